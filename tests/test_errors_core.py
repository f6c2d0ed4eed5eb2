"""No silent wrong answers in the core: each case a learner can hit gets the right answer or a clear
error naming the value (issue 15). One test per case."""

import numpy as np
import pytest
import torch

from kvlab import PRESETS
from kvlab.cache import (
    CACHE_KINDS,
    BlockAllocator,
    DynamicKVCache,
    PagedKVCache,
    QuantizedKVCache,
    StaticKVCache,
    make_cache,
)
from kvlab.config import resolve
from kvlab.fragmentation import RequestMix, paged_waste, sample_requests, simulate
from kvlab.model import Transformer
from kvlab.quant import dequantize, quantize

CFG = PRESETS["tiny-gqa"]  # 2 layers, 4 heads, 2 KV heads, head_dim 16, vocabulary 256


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def kv(t, batch=1, scale=1.0):
    shape = (batch, CFG.n_kv_heads, t, CFG.head_dim)
    return torch.randn(shape) * scale, torch.randn(shape) * scale


# --- reusing a cache ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_every_cache_kind_says_how_many_positions_it_holds_and_resets(kind, model):
    cache = make_cache(kind, CFG, 1, 32)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        first = model(ids, cache=cache)
        assert cache.seq_len == 9 and cache.lengths == [9] * CFG.n_layers
        cache.reset()
        assert cache.seq_len == 0
        again = model(ids, cache=cache)  # a reset cache gives the same answer as a new one
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_dynamic_cache_takes_only_the_config():
    with pytest.raises(TypeError):
        DynamicKVCache(CFG, 2, 64)  # batch, length, dtype, device would be ignored: refused
    assert isinstance(make_cache("dynamic", CFG, 2, 64, dtype=torch.float16), DynamicKVCache)


def test_set_length_on_a_static_cache_declares_positions_filled():
    cache = StaticKVCache(CFG, 1, 16)
    cache.set_length(10)
    assert cache.seq_len == 10 and cache.lengths == [10, 10]
    cache.update(0, *kv(1))
    assert cache.lengths == [11, 10]
    with pytest.raises(ValueError, match=r"n=17 must be an integer in \[0, 16\]"):
        cache.set_length(17)
    with pytest.raises(ValueError, match=r"n=2\.5 must be an integer"):
        cache.set_length(2.5)


def test_crop_shortens_a_dynamic_cache_and_refuses_to_grow_it():
    cache = DynamicKVCache(CFG)
    k, v = kv(6)
    for layer in range(CFG.n_layers):
        cache.update(layer, k, v)
    cache.crop(4)
    assert cache.seq_len == 4 and torch.equal(cache.keys[0], k[:, :, :4])
    with pytest.raises(ValueError, match=r"n=5 must be an integer in \[0, 4\]"):
        cache.crop(5)


def test_set_length_on_a_paged_cache_takes_and_returns_blocks():
    cache = PagedKVCache(CFG, 2, 32, block_size=4)
    cache.set_length(9)
    assert cache.seq_len == 9 and cache.blocks_in_use == 2 * 3
    cache.set_length(4)
    assert cache.blocks_in_use == 2 * 1
    cache.reset()
    assert cache.blocks_in_use == 0 and cache.allocator.num_free == cache.num_blocks


def test_a_quantized_cache_crops_as_far_as_it_kept_exact_values():
    cache = QuantizedKVCache(CFG, 1, 16, key_granularity="token", residual=2, rollback=1)
    for layer in range(CFG.n_layers):
        cache.update(layer, *kv(5))  # per token: 3 quantized, the newest 2 exact, 1 more kept exact
    assert cache.crop_floor == 4
    with pytest.raises(ValueError, match=r"crop\(n=3\).*can crop to n >= 4 .*rollback=R"):
        cache.crop(3)
    cache.crop(4)
    assert cache.seq_len == 4
    cache.crop(0)
    assert cache.seq_len == 0


# --- a cache that does not match the model or the prompt -----------------------------------------

@pytest.mark.parametrize("cache, message", [
    (StaticKVCache(CFG, 2, 32), "the cache holds batch 2, the prompt has batch 1"),
    (StaticKVCache(CFG.with_(n_layers=1), 1, 32),
     "the cache was built for n_layers=1, the model has n_layers=2"),
    (StaticKVCache(PRESETS["tiny-mha"], 1, 32),
     "the cache was built for n_kv_heads=4, the model has n_kv_heads=2"),
    (StaticKVCache(CFG.with_(head_dim=32), 1, 32),
     "the cache was built for head_dim=32, the model has head_dim=16"),
    (StaticKVCache(CFG, 1, 32, dtype=torch.float16),
     "the cache hands back torch.float16 K/V, the model computes in torch.float32"),
    (StaticKVCache(CFG, 1, 32, device="meta"), "the cache is on meta, the model on cpu"),
    (QuantizedKVCache(CFG, 3, 32), "the cache holds batch 3, the prompt has batch 1"),
    (PagedKVCache(CFG, 2, 32), "the cache holds batch 2, the prompt has batch 1"),
])
def test_a_mismatched_cache_is_refused_up_front_naming_both_sides(cache, message, model):
    with pytest.raises(ValueError) as err, torch.no_grad():
        model(torch.randint(0, 256, (1, 5)), cache=cache)
    assert message in str(err.value)
    assert cache.seq_len == 0  # nothing was written


def test_a_dynamic_cache_remembers_its_batch(model):
    cache = DynamicKVCache(CFG)
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 5)), cache=cache)
        with pytest.raises(ValueError, match="the cache holds batch 2, the prompt has batch 1"):
            model(torch.randint(0, 256, (1, 1)), cache=cache)


def test_check_compatible_is_public():
    StaticKVCache(CFG, 1, 8).check_compatible(CFG, 1, torch.float32, "cpu")
    with pytest.raises(ValueError, match="the cache holds batch 1, the prompt has batch 4"):
        StaticKVCache(CFG, 1, 8).check_compatible(CFG, 4, torch.float32, "cpu")


# --- token ids ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ids, message", [
    (torch.tensor([1, 2, 3]), r"got shape \(3,\) \(add a batch dimension: ids\[None\]\)"),
    (torch.zeros(1, 0, dtype=torch.long), r"at least one of each; got shape \(1, 0\)"),
    (torch.zeros(0, 4, dtype=torch.long), r"at least one of each; got shape \(0, 4\)"),
    (torch.tensor([[1, 256]]), r"token id 256 is outside the vocabulary: allowed 0\.\.255"),
    (torch.tensor([[-1, 2]]), r"token id -1 is outside the vocabulary"),
    (torch.tensor([[72.9, 3.0]]), "must hold integer token ids; got dtype torch.float32"),
    ([[1, 2, 3]], "got a list .wrap a list: torch.tensor"),
])
def test_bad_token_ids_get_a_clear_error(ids, message, model):
    with pytest.raises(ValueError, match=message):
        model(ids)


def test_small_integer_id_dtypes_are_understood(model):
    ids = torch.tensor([[1, 2, 200]])
    with torch.no_grad():
        assert torch.equal(model(ids.to(torch.uint8)), model(ids))


# --- configs: MLA, preset names -----------------------------------------------------------------

def test_transformer_refuses_an_mla_config():
    with pytest.raises(ValueError) as err:
        Transformer(CFG.with_(kv_latent_dim=32))
    assert "kv_latent_dim=32" in str(err.value) and "kvlab.memory.kv_cache_bytes" in str(err.value)


def test_a_preset_name_builds_the_model_and_every_cache():
    assert Transformer("tiny-mha").config == PRESETS["tiny-mha"]
    for kind in CACHE_KINDS:
        assert make_cache(kind, "tiny-mha", 1, 8).config is PRESETS["tiny-mha"]
    assert resolve("TINY-GQA") is PRESETS["tiny-gqa"]
    with pytest.raises(ValueError, match="config='tiny' is not allowed; allowed:"):
        Transformer("tiny")
    with pytest.raises(ValueError, match="config=None is not a ModelConfig"):
        resolve(None)


# --- the quantized cache's scales --------------------------------------------------------------

def test_values_too_large_for_fp16_scales_are_refused_not_nan():
    x = torch.full((4, 8), 1.0e7)
    with pytest.raises(ValueError, match="does not fit in torch.float16.*scale_dtype=torch.float32"):
        quantize(x, "token", 8, torch.float16)
    back = dequantize(quantize(x, "token", 8, torch.float32))
    assert torch.isfinite(back).all() and (back - x).abs().max() <= 1.0e7 / 127 / 2
    cache = QuantizedKVCache(CFG, 1, 8, key_granularity="token")
    small_k, _ = kv(1)
    with pytest.raises(ValueError, match="scale_dtype=torch.float32"):
        cache.update(0, small_k, kv(1, scale=1e7)[1])  # K fits, V does not: neither is stored
    assert cache.seq_len == 0 and cache.sides["k"].quantized[0] == 0
    k, v = kv(1, scale=1e7)
    k_back, v_back = QuantizedKVCache(CFG, 1, 8, scale_dtype=torch.float32).update(0, k, v)
    assert torch.isfinite(k_back).all() and torch.isfinite(v_back).all()


@pytest.mark.parametrize("magnitude", [1e-3, 1e-5, 1e-7, 1e-9])
def test_tiny_values_stay_within_the_documented_bound(magnitude):
    x = torch.randn(16, 64) * magnitude
    for granularity in ("token", "channel", "tensor"):
        q = quantize(x, granularity, 8, torch.float16)
        err = (dequantize(q) - x).abs()
        assert torch.all(err <= q.scale.float() / 2 + 1e-12)  # within stored scale / 2
        amax = x.abs().amax().item()
        assert err.max().item() <= amax / 127 / 2 * 1.001 + 2.0**-25  # the bound quantize documents


def test_an_integer_scale_dtype_is_refused():
    with pytest.raises(ValueError, match="scale_dtype=torch.int8 cannot hold a scale"):
        QuantizedKVCache(CFG, 1, 8, scale_dtype=torch.int8)
    with pytest.raises(ValueError, match="scale_dtype=torch.int32 cannot hold a scale"):
        quantize(torch.randn(4, 4), "token", 8, torch.int32)


# --- paging ---------------------------------------------------------------------------------------

def test_simulate_refuses_fractional_lengths():
    with pytest.raises(ValueError, match="prompt_lens holds 10.5; every length must be a whole number"):
        simulate([10.5, 20], [5, 5], capacity=4096)
    with pytest.raises(ValueError, match="output_lens holds nan"):
        simulate([10, 20], [5, float("nan")], capacity=4096)
    with pytest.raises(ValueError, match="capacity=4096.5 must be an integer"):
        simulate([10], [5], capacity=4096.5)
    assert simulate([10.0, 20.0], [5, 5], capacity=4096).finished == 2  # whole floats are counts


def test_paged_waste_refuses_fractional_lengths():
    with pytest.raises(ValueError, match="seq_lens holds 3.5"):
        paged_waste([3.5, 16], 16)
    with pytest.raises(ValueError, match="block_size=16.0 must be an integer"):
        paged_waste([3, 16], 16.0)
    assert paged_waste([1, 16], 16) == 15 / 32


def test_sample_requests_with_an_absurd_median_stays_in_range():
    prompt, output = sample_requests(200, RequestMix(prompt_median=1e300, output_median=1e30))
    assert prompt.dtype == np.int64 and (prompt >= 1).all() and (output >= 1).all()
    assert (prompt + output <= 2048).all()
    with pytest.raises(ValueError, match="prompt_median=inf must be a finite number"):
        sample_requests(5, RequestMix(prompt_median=float("inf")))
    with pytest.raises(ValueError, match="n=2.0 must be an integer >= 0"):
        sample_requests(2.0)


def test_paged_cache_refuses_more_tokens_than_max_seq_len_while_blocks_remain():
    cache = PagedKVCache(CFG, 1, 10, block_size=4, num_blocks=100)
    cache.update(0, *kv(10))
    with pytest.raises(ValueError, match="cache is full: 10 of 10 positions used, 1 more requested"):
        cache.update(0, *kv(1))
    assert cache.lengths[0] == 10 and cache.blocks_in_use == 3


def test_freeing_a_block_twice_in_one_call_is_refused_and_changes_nothing():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(2)
    with pytest.raises(ValueError, match=f"block {blocks[0]} appears 2 times in one free"):
        alloc.free([blocks[0], blocks[0]])
    assert alloc.num_used == 2
    with pytest.raises(ValueError, match="block 3 is not in use"):
        alloc.free(3)


def test_numpy_block_ids_are_understood_and_floats_refused():
    alloc = BlockAllocator(4)
    blocks = np.array(alloc.allocate(3))
    alloc.free(blocks[0])               # a numpy integer
    alloc.free(blocks[1:])              # a numpy array
    assert alloc.num_used == 0 and alloc.allocate(np.int64(2)) == [2, 1]
    with pytest.raises(ValueError, match=r"block=1\.0 must be an integer >= 0"):
        alloc.free([1.0])
    with pytest.raises(ValueError, match=r"n=1\.5 must be an integer >= 0"):
        alloc.allocate(1.5)


# --- attention masks -----------------------------------------------------------------------------

def test_a_right_padded_mask_is_refused(model):
    ids = torch.randint(1, 256, (2, 5))
    right = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match=r"attention_mask row 1 has a 0 after a 1 \(right padding\); "
                                         "pad on the left"):
        model(ids, attention_mask=right)
    left = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with torch.no_grad():
        assert torch.isfinite(model(ids, attention_mask=left)).all()


def test_a_mask_that_is_not_zeros_and_ones_is_refused(model):
    with pytest.raises(ValueError, match="attention_mask must hold only 0"):
        model(torch.randint(1, 256, (1, 3)), attention_mask=torch.tensor([[0.5, 1.0, 1.0]]))
    with pytest.raises(ValueError, match="attention_mask must be a tensor; got a list"):
        model(torch.randint(1, 256, (1, 3)), attention_mask=[[1, 1, 1]])
