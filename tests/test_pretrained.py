"""kvlab-tiny, kvlab-tiny-gqa and kvlab-tiny-draft: the shipped checkpoints load, are small, match
their records, decode the same with and without a cache; the corpus is split by document; bad input
and damaged files get clear errors."""

import json
import math
import re
import shutil

import pytest
import torch

from kvlab import pretrained
from kvlab.generate import decode_bytes, encode_bytes, generate
from kvlab.model import Transformer

NAMES = pretrained.MODELS


@pytest.fixture(scope="module")
def models():
    return {name: pretrained.load(name) for name in NAMES}


def test_all_load_in_eval_mode_with_the_recorded_shapes(models):
    mha, gqa = models["kvlab-tiny"], models["kvlab-tiny-gqa"]
    for name, model in models.items():
        assert isinstance(model, Transformer) and not model.training
        assert model.config.vocab_size == 256  # byte-level
        assert next(model.parameters()).dtype == torch.float32
        assert model.num_params() == pretrained.info(name)["n_params"]
    assert mha.config.n_kv_heads == mha.config.n_heads  # MHA, so chapter 04 can pool its heads
    assert gqa.config.n_kv_heads < gqa.config.n_heads == mha.config.n_heads
    # The same parameter budget: within 0.1 %.
    assert abs(gqa.num_params() - mha.num_params()) <= 1e-3 * mha.num_params()


@pytest.mark.parametrize("dtype, expected", [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                             ("fp32", torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_load_understands_dtype_names_and_torch_dtypes(dtype, expected):
    model = pretrained.load("kvlab-tiny", dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}


@pytest.mark.parametrize("dtype", ["int8", "float64", torch.float64, 16])
def test_load_refuses_other_dtypes(dtype):
    with pytest.raises(ValueError, match=r"dtype=.*allowed: 'fp32', 'fp16', 'bf16'"):
        pretrained.load("kvlab-tiny", dtype=dtype)


def test_checkpoints_are_safetensors_of_at_most_5_mb():
    for name in NAMES:
        size = (pretrained.DATA_DIR / f"{name}.safetensors").stat().st_size
        assert size <= 5 * 10**6, f"{name}: {size:,} bytes"


def test_unknown_name_lists_allowed_ones():
    with pytest.raises(ValueError, match="kvlab-huge.*allowed: 'kvlab-tiny', 'kvlab-tiny-gqa'"):
        pretrained.load("kvlab-huge")
    with pytest.raises(ValueError, match="allowed"):
        pretrained.info("nope")


def test_corpus_is_large_bilingual_and_split_by_whole_documents():
    docs = pretrained.documents()
    size = lambda ds: sum(len(d.text.encode("utf-8")) for d in ds)  # noqa: E731
    assert size(docs) >= 300_000
    assert size([d for d in docs if d.source == "handwritten"]) >= 100_000
    assert len({d.name for d in docs}) == len(docs)
    by_split = {s: [d for d in docs if d.split == s] for s in pretrained.SPLITS}
    assert size(by_split["held_out"]) >= 30_000
    assert all(by_split.values())
    for split in pretrained.SPLITS:
        text = pretrained.corpus_text(split)
        assert text == "\n\n".join(d.text for d in by_split[split]) + "\n"
        assert "cache" in text and "缓存" in text, split
    # The rule depends on the name only, so it is the same every time.
    assert [pretrained.split_of(d.name) for d in docs] == [d.split for d in docs]
    held = pretrained.corpus_text("held_out", "handwritten")
    assert held and all(d.text in held for d in by_split["held_out"] if d.source == "handwritten")
    with pytest.raises(ValueError, match="allowed: 'train', 'validation', 'held_out'"):
        pretrained.corpus_text("test")
    with pytest.raises(ValueError, match="source='web'"):
        pretrained.corpus_text("train", "web")


@pytest.mark.parametrize("name", NAMES)
def test_record_describes_this_corpus_and_recomputes(models, name):
    record = pretrained.info(name)
    assert record["corpus"]["sha256"] == pretrained.corpus_sha256()
    for split in pretrained.SPLITS:
        assert record["corpus"]["bytes"][split] == len(pretrained.corpus_text(split).encode("utf-8"))
    held, se = pretrained.loss_and_error(models[name], pretrained.corpus_text("held_out"),
                                         context=record["context"])
    assert held == pytest.approx(record["losses"]["held_out"]["loss"], abs=0.01)
    assert se == pytest.approx(record["losses"]["held_out"]["standard_error"], abs=0.01)
    assert record["held_out_loss"] == record["losses"]["held_out"]["loss"]
    assert held < math.log(256) / 2  # far better than a uniform guess over 256 bytes


@pytest.mark.parametrize("name", NAMES)
def test_recorded_model_does_not_memorise(name):
    losses = pretrained.info(name)["losses"]
    gap = losses["held_out"]["loss"] - losses["train"]["loss"]
    assert gap <= 0.25, f"{name}: held-out minus train = {gap:.3f} nats/byte"


def test_loss_is_the_mean_over_every_byte_whatever_the_batch_size(models):
    model = models["kvlab-tiny"]
    # One training-length window (256 bytes: positions beyond it were never trained).
    text = pretrained.corpus_text("validation").encode()[:250].decode("utf-8", "ignore")
    ids = torch.tensor([encode_bytes(text)])
    logits = model(ids[:, :-1])
    direct = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item()
    assert pretrained.loss(model, text, context=256) == pytest.approx(direct, rel=1e-5)
    windows = [pretrained.loss(model, text, context=40, batch_size=b) for b in (1, 3, 64)]
    assert windows[1] == pytest.approx(windows[0], rel=1e-6)
    assert windows[2] == pytest.approx(windows[0], rel=1e-6)
    assert windows[0] > direct  # shorter windows see less context


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": -1}, "batch_size=-1 must be an integer >= 1"),
    ({"batch_size": 0}, "batch_size=0"), ({"batch_size": 2.0}, "batch_size=2.0"),
    ({"context": 0}, "context=0"), ({"context": True}, "context=True"),
    ({"context": 4096}, r"context=4096 must be an integer in \[1, 1024\]"),
])
def test_loss_refuses_bad_arguments(models, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pretrained.loss(models["kvlab-tiny"], "hello, cache", **kwargs)


def test_loss_and_error_is_the_spread_of_window_means(models):
    model, text = models["kvlab-tiny"], pretrained.corpus_text("validation")[:2000]
    mean, se = pretrained.loss_and_error(model, text, context=200)
    rows = pretrained.window_losses(model, text, context=200)
    per_window = rows[:, 0] / rows[:, 1]
    assert len(rows) >= 9 and se > 0
    assert se == pytest.approx(per_window.std().item() / math.sqrt(len(rows)), rel=1e-9)
    assert mean == pytest.approx(pretrained.loss(model, text, context=200), rel=1e-9)
    with pytest.raises(ValueError, match="at least 2 bytes"):
        pretrained.loss(model, "a")
    with pytest.raises(ValueError, match="at least 2 windows"):
        pretrained.loss_and_error(model, "short text", context=256)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_is_deterministic_and_cache_independent(models, name):
    model = models[name]
    prompt = encode_bytes("The KV cache")
    runs = {kind: generate(model, prompt, 48, cache=kind).tokens for kind in (None, "dynamic", "static")}
    assert torch.equal(runs[None], runs["dynamic"])
    assert torch.equal(runs[None], runs["static"])
    assert torch.equal(generate(model, prompt, 48, cache="static").tokens, runs["static"])
    text = decode_bytes(runs["static"][0])
    assert text.startswith("The KV cache") and len(text) > len("The KV cache")


@pytest.mark.parametrize("name", NAMES)
def test_recorded_samples_are_what_the_model_writes(models, name):
    record = pretrained.info(name)
    first = record["samples"][0]
    assert (record["sample"], record["sample_tokens"]) == (first["text"], first["tokens"])
    prompt = encode_bytes(first["prompt"])
    tokens = generate(models[name], prompt, len(first["tokens"]) - len(prompt), cache="static").tokens
    assert tokens[0].tolist() == first["tokens"]
    assert record["sample"] == decode_bytes(record["sample_tokens"])
    # Valid UTF-8 (the last character may be cut) and words, not byte soup.
    assert "\ufffd" not in record["sample"][:-1]
    assert len(re.findall(r"[A-Za-z]{3,}", record["sample"])) >= 10
    chinese = record["samples"][1]["text"]
    assert "\ufffd" not in chinese[:-1]
    if name != "kvlab-tiny-draft":  # the course's models write Chinese; the one-layer draft model
        # (kvlab.speculative) soon falls back to English, the larger part of the corpus
        assert len(re.findall(r"[\u4e00-\u9fff]", chinese)) >= 10


# ------------------------------------------------------------------ damaged files
@pytest.fixture
def copy_dir(tmp_path):
    for name in NAMES:
        for ext in (".json", ".safetensors"):
            shutil.copy(pretrained.DATA_DIR / f"{name}{ext}", tmp_path / f"{name}{ext}")
    return tmp_path


def test_loads_from_another_folder(copy_dir, models):
    model = pretrained.load("kvlab-tiny", directory=copy_dir)
    pairs = zip(model.parameters(), models["kvlab-tiny"].parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[: len(b) // 2], "not a readable safetensors checkpoint"),
    (lambda b: b"", "is empty"),
    (lambda b: b"PK\x03\x04 a zip file, not safetensors" * 10, "not a readable safetensors checkpoint"),
])
def test_damaged_weights_name_the_file_and_the_problem(copy_dir, damage, message):
    path = copy_dir / "kvlab-tiny.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + message):
        pretrained.load("kvlab-tiny", directory=copy_dir)


def test_weights_of_another_shape_are_refused(copy_dir):
    shutil.copy(copy_dir / "kvlab-tiny-gqa.safetensors", copy_dir / "kvlab-tiny.safetensors")
    with pytest.raises(ValueError, match=r"kvlab-tiny.safetensors: \S+ has shape .* in kvlab-tiny.json"):
        pretrained.load("kvlab-tiny", directory=copy_dir)


def test_missing_files_are_named(copy_dir):
    (copy_dir / "kvlab-tiny.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="kvlab-tiny.safetensors is missing"):
        pretrained.load("kvlab-tiny", directory=copy_dir)
    (copy_dir / "kvlab-tiny-gqa.json").unlink()
    with pytest.raises(FileNotFoundError, match="kvlab-tiny-gqa.json is missing"):
        pretrained.load("kvlab-tiny-gqa", directory=copy_dir)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not a valid JSON training record"),
    ("[1, 2]", "holds a list, not a JSON object"),
    (json.dumps({"name": "kvlab-tiny"}), r"lacks the keys \['config', 'n_params', 'context'\]"),
    (json.dumps({"config": {"n_layers": 2}, "n_params": 1, "context": 8}),
     "'config' is not a valid ModelConfig"),
])
def test_bad_records_name_the_file_and_the_problem(copy_dir, text, message):
    path = copy_dir / "kvlab-tiny.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + message):
        pretrained.load("kvlab-tiny", directory=copy_dir)


def test_loss_comparison_pairs_windows_against_the_reference():
    from kvlab import PRESETS, gqa
    from kvlab.model import Transformer

    torch.manual_seed(0)
    a = Transformer(PRESETS["tiny-mha"]).eval()
    b = gqa.mha_to_gqa(a, 1)
    text = "The KV cache holds keys and values. " * 20
    table = pretrained.loss_comparison({"a": a, "a again": a, "b": b}, text, reference="a", context=64)
    assert table.loc["a again", "Δ vs a"] == 0 and table.loc["a again", "paired SE"] == 0
    assert table.loc["a", "SE"] > 0 and table.loc["b", "paired SE"] > 0
    assert table.loc["b", "Δ vs a"] == pytest.approx(table.loc["b", "loss"] - table.loc["a", "loss"])
    with pytest.raises(ValueError, match="reference='c'"):
        pretrained.loss_comparison({"a": a}, text, reference="c")


def test_paired_difference_says_whether_a_change_is_significant():
    from kvlab import PRESETS, gqa
    from kvlab.model import Transformer

    torch.manual_seed(0)
    a = Transformer(PRESETS["tiny-mha"]).eval()
    text = "Keys and values, cached once, read at every step. " * 20
    table = pretrained.loss_comparison({"a": a, "pooled": gqa.mha_to_gqa(a, 1)}, text, "a", context=64)
    line = pretrained.paired_difference(table, "pooled", "a")
    assert line.startswith("pooled vs a: ") and "SE)" in line and "significant" in line
    with pytest.raises(ValueError, match="'b' is not in the table"):
        pretrained.paired_difference(table, "b", "a")
