"""kvlab.trace: a recorded cached decode is the decode generate() does, and its counts are the theory's."""

import pytest
import torch

from kvlab import PRESETS, memory, pretrained, trace
from kvlab.attention import repeat_kv
from kvlab.cache import DynamicKVCache
from kvlab.generate import encode_bytes, generate
from kvlab.model import Transformer

PROMPT = encode_bytes("KV 缓存")  # 2 ASCII letters, a space, two 3-byte characters: 9 tokens
STEPS = 12


@pytest.fixture(scope="module")
def gqa_model():
    torch.manual_seed(0)
    return Transformer(PRESETS["tiny-gqa"]).eval()  # 4 query heads share 2 KV heads


@pytest.fixture(scope="module")
def recorded(gqa_model):
    return trace.record(gqa_model, PROMPT, STEPS)


def test_tokens_are_generates(gqa_model, recorded):
    for kind in (None, "static"):
        assert recorded.tokens == generate(gqa_model, PROMPT, STEPS, cache=kind).tokens[0].tolist()


def test_kvlab_tiny_tokens_are_generates():
    model = pretrained.load("kvlab-tiny")
    prompt = encode_bytes("The KV cache")
    assert trace.record(model, prompt, 24).tokens == generate(model, prompt, 24).tokens[0].tolist()


def test_one_row_per_step_and_rows_never_change(gqa_model, recorded):
    assert len(recorded) == STEPS
    for step in range(STEPS):
        frame = recorded[step]
        assert frame.positions == frame.keys.shape[2] == frame.values.shape[2] == len(PROMPT) + step
        assert frame.attention.shape == (2, 4, len(PROMPT) + step)
        assert frame.fed == (len(PROMPT) if step == 0 else 1)
        assert frame.next_token == recorded.tokens[len(PROMPT) + step]
    # The cache of the last step holds what one prefill of the same tokens computes.
    last = recorded[STEPS - 1]
    fresh = DynamicKVCache(gqa_model.config)
    with torch.inference_mode():
        gqa_model(torch.tensor([last.tokens]), cache=fresh)
    torch.testing.assert_close(last.keys, torch.stack([k[0] for k in fresh.keys]), rtol=0, atol=1e-5)
    torch.testing.assert_close(last.values, torch.stack([v[0] for v in fresh.values]), rtol=0, atol=1e-5)


def test_counts_match_theory_and_generate(gqa_model, recorded):
    naive = generate(gqa_model, PROMPT, STEPS, cache=None)
    cached = generate(gqa_model, PROMPT, STEPS, cache="static")
    p = len(PROMPT)
    for step in range(STEPS):
        frame = recorded[step]
        assert frame.naive_rows == sum(s.kv_rows for s in naive.steps[:step + 1])
        assert frame.naive_rows == sum(p + i for i in range(step + 1))
        assert frame.cached_rows == sum(s.kv_rows for s in cached.steps[:step + 1]) == p + step
        assert frame.cache_bytes == memory.kv_cache_bytes(gqa_model.config, p + step, dtype="fp32")
    assert recorded[STEPS - 1].naive_rows == naive.kv_rows


def test_attention_weights_sum_to_one_and_reproduce_the_layer_output(gqa_model, recorded):
    last = recorded[STEPS - 1]
    torch.testing.assert_close(last.attention.sum(-1), torch.ones(2, 4))
    assert (last.attention >= 0).all()
    outputs = {}
    hooks = [layer.attn.out.register_forward_pre_hook(
        lambda mod, args, i=i: outputs.__setitem__(i, args[0][0, -1])) for i, layer in
        enumerate(gqa_model.layers)]
    try:
        with torch.inference_mode():
            gqa_model(torch.tensor([last.tokens]))  # no cache: the newest token's attention output
    finally:
        for h in hooks:
            h.remove()
    for layer in range(2):
        values = repeat_kv(last.values[layer][None], 2)[0]             # (query heads, S, D)
        mixed = torch.einsum("hs,hsd->hd", last.attention[layer], values)
        torch.testing.assert_close(mixed.reshape(-1), outputs[layer], rtol=0, atol=1e-5)


def test_query_heads_map_to_their_kv_head(recorded):
    assert [recorded.kv_head(h) for h in range(4)] == [0, 0, 1, 1]


def test_bad_arguments_are_refused(gqa_model, recorded):
    with pytest.raises(ValueError, match="step=12 must be an integer in \\[0, 11\\]"):
        recorded[12]
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        trace.record(gqa_model, PROMPT, 0)
    with pytest.raises(ValueError, match="the prompt has batch 2"):
        trace.record(gqa_model, [PROMPT, PROMPT], 3)


def test_byte_labels_show_characters_and_partial_bytes():
    ids = encode_bytes("Hi 中\n")
    assert trace.byte_labels(ids) == ["H", "i", "␣", "中 1/3", "中 2/3", "中 3/3", "↵"]
    assert trace.byte_labels(encode_bytes("a文")[:3]) == ["a", "e6 1/3", "96 2/3"]
    assert trace.byte_labels([0xFF, 0x80, 7]) == ["xff", "x80", "x07"]


def test_readable_text_shows_an_unfinished_character_as_bytes():
    ids = encode_bytes("缓存")
    assert trace.readable_text(ids) == "缓存"
    assert trace.readable_text(ids[:5]) == "缓⟨e5 ad⟩"
    assert trace.readable_text(ids[:4]) == "缓⟨e5⟩"


def test_characters_group_the_bytes_of_each_character():
    ids = encode_bytes("a 缓存")
    assert trace.characters(ids) == [(0, 1, "a"), (1, 1, "␣"), (2, 3, "缓"), (5, 3, "存")]
    assert trace.characters(ids[:7]) == [(0, 1, "a"), (1, 1, "␣"), (2, 3, "缓"), (5, 2, "⟨e5 ad⟩")]
