"""kvlab-tiny: the shipped checkpoint loads, is small, matches its record, and decodes the same
with and without a cache."""

import math

import pytest
import torch

from kvlab import pretrained
from kvlab.generate import decode_bytes, encode_bytes, generate
from kvlab.model import Transformer


@pytest.fixture(scope="module")
def model():
    return pretrained.load("kvlab-tiny")


def test_loads_in_eval_mode_as_a_byte_level_mha_model(model):
    assert isinstance(model, Transformer)
    assert not model.training
    cfg = model.config
    assert cfg.vocab_size == 256
    assert cfg.n_kv_heads == cfg.n_heads  # MHA, so chapter 04 can pool heads into GQA
    assert next(model.parameters()).dtype == torch.float32
    assert model.num_params() == pretrained.info()["n_params"]


def test_load_honours_dtype():
    half = pretrained.load("kvlab-tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_checkpoint_is_at_most_5_mb():
    size = (pretrained.DATA_DIR / "kvlab-tiny.pt").stat().st_size
    assert size <= 5 * 10**6, f"{size:,} bytes"


def test_unknown_name_lists_allowed_ones():
    with pytest.raises(ValueError, match="kvlab-huge.*allowed: 'kvlab-tiny'"):
        pretrained.load("kvlab-huge")
    with pytest.raises(ValueError, match="allowed"):
        pretrained.info("nope")


def test_corpus_splits_are_disjoint_and_both_languages():
    train, held = pretrained.corpus_text("train"), pretrained.corpus_text("held_out")
    train_paragraphs = set(train.split("\n\n"))
    held_paragraphs = held.strip().split("\n\n")
    assert len(held_paragraphs) >= 5
    assert not train_paragraphs & set(held_paragraphs)
    assert len(held.encode()) < 0.2 * len(train.encode())
    for text in (train, held):
        assert "cache" in text and "缓存" in text
    with pytest.raises(ValueError, match="allowed: 'train', 'held_out'"):
        pretrained.corpus_text("test")


def test_recorded_held_out_loss_matches_recomputed(model):
    record = pretrained.info()
    held = pretrained.loss(model, pretrained.corpus_text("held_out"), context=record["context"])
    assert held == pytest.approx(record["held_out_loss"], abs=2e-3)
    assert held < math.log(256) / 2  # far better than a uniform guess over 256 bytes


def test_loss_validates_and_counts_every_byte(model):
    with pytest.raises(ValueError, match="context=0"):
        pretrained.loss(model, "hello", context=0)
    with pytest.raises(ValueError, match="at least 2 bytes"):
        pretrained.loss(model, "a")
    # One window or many windows: the same bytes predicted, each from its own window only.
    text = "The KV cache stores keys and values."
    ids = torch.tensor([encode_bytes(text)])
    logits = model(ids[:, :-1])
    direct = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item()
    assert pretrained.loss(model, text, context=256) == pytest.approx(direct, rel=1e-5)
    assert pretrained.loss(model, text, context=4) > direct  # shorter windows see less context


def test_greedy_generation_is_deterministic_and_cache_independent(model):
    prompt = encode_bytes("The KV cache")
    runs = {kind: generate(model, prompt, 48, cache=kind).tokens for kind in (None, "dynamic", "static")}
    assert torch.equal(runs[None], runs["dynamic"])
    assert torch.equal(runs[None], runs["static"])
    again = generate(model, prompt, 48, cache="static").tokens
    assert torch.equal(again, runs["static"])
    text = decode_bytes(again[0])
    assert text.startswith("The KV cache") and len(text) > len("The KV cache")


def test_recorded_sample_decodes_to_text():
    record = pretrained.info()
    assert record["sample"] == decode_bytes(record["sample_tokens"])
    assert record["sample"].startswith(record["sample_prompt"])
    letters = sum(ch.isalpha() or ch.isspace() for ch in record["sample"])
    assert letters / len(record["sample"]) > 0.8  # words and spaces, not byte soup
