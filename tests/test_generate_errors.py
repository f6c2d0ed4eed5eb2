"""generate() and fast_generate() refuse what they cannot do right, with a ValueError that names the
value and says what to do instead (issue 15: no silent wrong answers, no internal errors)."""

import pytest
import torch

from kvlab import PRESETS
from kvlab.cache import DynamicKVCache, StaticKVCache
from kvlab.fast import fast_generate
from kvlab.generate import generate
from kvlab.model import Transformer

CFG = PRESETS["tiny-mha"]  # vocabulary 256, max_seq_len 512


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def refused(call, *fragments):
    """call() raises a ValueError whose message contains every fragment."""
    with pytest.raises(ValueError) as err:
        call()
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in {str(err.value)!r}"
    return str(err.value)


# --- the prompt -----------------------------------------------------------------------------------

def test_a_string_prompt_says_to_encode_it(model):
    refused(lambda: generate(model, "Hello", 3), "'Hello'", "encode_bytes")


def test_a_ragged_batch_says_to_pad_on_the_left(model):
    refused(lambda: generate(model, [[1, 2, 3], [4, 5]], 3), "[3, 2]", "pad them on the left",
            "attention_mask")


def test_float_token_ids_are_not_truncated(model):
    refused(lambda: generate(model, [72.9, 101.0], 3), "must be integers", "72.9")


def test_a_float_tensor_of_whole_numbers_is_refused_too(model):
    refused(lambda: generate(model, torch.tensor([[72.0, 101.0]]), 3), "torch.float32", "long tensor")


def test_a_batch_of_zero_sequences(model):
    refused(lambda: generate(model, torch.zeros(0, 4, dtype=torch.long), 3), "(0, 4)", "batch of 0")


def test_an_empty_prompt(model):
    refused(lambda: generate(model, [], 3), "empty prompt")
    refused(lambda: generate(model, [[]], 3), "empty prompt")


def test_three_dimensional_ids(model):
    refused(lambda: generate(model, torch.zeros(1, 2, 3, dtype=torch.long), 3), "(1, 2, 3)", "(B, T)")


def test_a_single_number_is_not_a_prompt(model):
    refused(lambda: generate(model, 5, 3), "shape ()")


def test_one_dimensional_ids_are_one_sequence(model):
    out = generate(model, [1, 2, 3], 4)
    assert out.tokens.shape == (1, 7)
    assert torch.equal(out.tokens, generate(model, [[1, 2, 3]], 4).tokens)


@pytest.mark.parametrize("ids, shown", [([0, 256], "max 256"), ([-1, 3], "min -1")])
def test_ids_outside_the_vocabulary(model, ids, shown):
    refused(lambda: generate(model, ids, 3), "0..255", shown)


# --- the padding mask -----------------------------------------------------------------------------

def test_a_right_padded_mask_says_to_pad_on_the_left(model):
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    refused(lambda: generate(model, ids, 3, attention_mask=mask), "row 1", "[1, 1, 0]", "pad on the left")


def test_a_mask_of_another_shape(model):
    refused(lambda: generate(model, [[1, 2, 3]], 3, attention_mask=[[1, 1]]), "(1, 2)", "(1, 3)")


def test_a_mask_with_values_other_than_0_and_1(model):
    refused(lambda: generate(model, [[1, 2]], 3, attention_mask=[[2, 1]]), "only 1", "[1, 2]")


def test_a_row_that_is_all_padding(model):
    refused(lambda: generate(model, [[1, 2], [3, 4]], 3, attention_mask=[[1, 1], [0, 0]]),
            "row 1 is all 0")


def test_a_left_padded_mask_is_accepted(model):
    out = generate(model, [[0, 2, 3], [1, 2, 3]], 4, attention_mask=[[0, 1, 1], [1, 1, 1]])
    alone = generate(model, [[2, 3]], 4)
    assert torch.equal(out.new_tokens[0], alone.new_tokens[0])


def test_a_one_dimensional_mask_goes_with_a_one_dimensional_prompt(model):
    out = generate(model, [0, 5, 6], 4, attention_mask=[0, 1, 1])
    assert torch.equal(out.new_tokens, generate(model, [5, 6], 4).new_tokens)


# --- sampling arguments ---------------------------------------------------------------------------

@pytest.mark.parametrize("temperature, shown", [
    ("hot", "temperature='hot'"), (float("nan"), "temperature=nan"), (float("inf"), "temperature=inf"),
    (-1.0, "temperature=-1.0"), (None, "temperature=None")])
def test_temperature_must_be_a_finite_number_at_least_0(model, temperature, shown):
    refused(lambda: generate(model, [1, 2], 3, temperature=temperature), shown, "must be")


def test_a_tiny_temperature_is_refused_with_the_minimum(model):
    refused(lambda: generate(model, [1, 2], 3, temperature=1e-30), "temperature=1e-30", "0 for greedy",
            "0.0001")


def test_the_minimum_temperature_samples(model):
    out = generate(model, [1, 2], 3, temperature=1e-4, seed=0)
    assert out.new_tokens.shape == (1, 3)


@pytest.mark.parametrize("top_k", [True, 2.5, 0, -3])
def test_top_k_must_be_a_positive_integer(model, top_k):
    refused(lambda: generate(model, [1, 2], 3, temperature=1.0, top_k=top_k), f"top_k={top_k!r}")


@pytest.mark.parametrize("seed", [2**63, -1, 1.5, "7"])
def test_seed_must_be_a_64_bit_non_negative_integer(model, seed):
    refused(lambda: generate(model, [1, 2], 3, temperature=1.0, seed=seed), f"seed={seed!r}")


def test_the_largest_seed_is_accepted(model):
    a = generate(model, [1, 2], 5, temperature=1.0, seed=2**63 - 1)
    b = generate(model, [1, 2], 5, temperature=1.0, seed=2**63 - 1)
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("eos", [2.5, 256, -1, True])
def test_eos_id_must_be_an_integer_in_the_vocabulary(model, eos):
    refused(lambda: generate(model, [1, 2], 3, eos_token_id=eos), f"eos_token_id={eos!r}", "[0, 255]")


@pytest.mark.parametrize("n", [0, 2.0, True])
def test_max_new_tokens_must_be_a_positive_integer(model, n):
    refused(lambda: generate(model, [1, 2], n), f"max_new_tokens={n!r}")


# --- the cache ------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: StaticKVCache(CFG, 1, 32), lambda: DynamicKVCache(CFG)],
                         ids=["static", "dynamic"])
def test_a_cache_that_already_holds_positions(model, make):
    cache = make()
    generate(model, [1, 2, 3], 5, cache=cache)
    refused(lambda: generate(model, [1, 2, 3], 5, cache=cache), "already holds 7 positions",
            "cache.reset()")


def test_a_reset_cache_gives_the_same_answer_again(model):
    cache = StaticKVCache(CFG, 1, 32)
    first = generate(model, [1, 2, 3], 5, cache=cache).tokens
    cache.reset()
    assert torch.equal(generate(model, [1, 2, 3], 5, cache=cache).tokens, first)


@pytest.mark.parametrize("cache, fragments", [
    (lambda: StaticKVCache(CFG, 2, 32), ["batch 2", "batch 1"]),
    (lambda: StaticKVCache(CFG.with_(n_layers=CFG.n_layers + 1), 1, 32),
     [f"n_layers={CFG.n_layers + 1}", f"n_layers={CFG.n_layers}"]),
    (lambda: StaticKVCache(CFG.with_(n_kv_heads=1), 1, 32), ["n_kv_heads=1", f"n_kv_heads={CFG.n_kv_heads}"]),
    (lambda: StaticKVCache(CFG, 1, 32, dtype=torch.float64), ["torch.float64", "torch.float32"]),
    (lambda: StaticKVCache(CFG, 1, 32, device="meta"), ["meta", "cpu"]),
], ids=["batch", "layers", "kv-heads", "dtype", "device"])
def test_a_cache_that_does_not_fit_the_model_or_prompt(model, cache, fragments):
    refused(lambda: generate(model, [1, 2, 3], 5, cache=cache()), *fragments)


def test_a_cache_with_another_head_size(model):
    other = CFG.with_(head_dim=CFG.head_dim // 2)
    refused(lambda: generate(model, [1, 2, 3], 5, cache=StaticKVCache(other, 1, 32)),
            f"head_dim={CFG.head_dim // 2}", f"head_dim={CFG.head_dim}")


def test_a_cache_too_short_for_the_request(model):
    refused(lambda: generate(model, [1, 2, 3], 10, cache=StaticKVCache(CFG, 1, 8)),
            "room for 8 positions", "need 13")


def test_something_that_is_not_a_cache(model):
    refused(lambda: generate(model, [1, 2], 3, cache=True), "cache=True is not a cache")


# --- fast_generate shares the checks --------------------------------------------------------------

@pytest.mark.parametrize("kwargs, fragments", [
    (dict(input_ids="Hi"), ["'Hi'", "encode_bytes"]),
    (dict(input_ids=[72.9]), ["72.9"]),
    (dict(input_ids=[[1, 2], [3]]), ["pad them on the left"]),
    (dict(temperature=1e-30), ["temperature=1e-30"]),
    (dict(temperature=1.0, top_k=True), ["top_k=True"]),
    (dict(temperature=1.0, seed=2**64), [f"seed={2**64}"]),
    (dict(eos_token_id=3.5), ["eos_token_id=3.5"]),
    (dict(mode="turbo"), ["mode='turbo'", "'eager'"]),
], ids=["string", "float-id", "ragged", "tiny-temperature", "bool-top-k", "huge-seed", "float-eos", "mode"])
def test_fast_generate_refuses_the_same_inputs(model, kwargs, fragments):
    args = {"input_ids": [1, 2, 3], **kwargs}
    refused(lambda: fast_generate(model, args.pop("input_ids"), 4, **args), *fragments)

