"""Issue 24, item 2: each finding of the fuzzing pass over the core, one test named after the
behaviour. A bad argument gets a ValueError (or IndexError / MemoryError / OutOfBlocksError) that
names it; a valid one, including NumPy scalars and preset names, gets the right answer.
(tools/fuzz_report.py runs the same cases as a table; tests/test_fuzz_core.py generates more.)"""

import math

import numpy as np
import pytest
import torch

import kvlab
from kvlab import eviction, fragmentation, gqa, memory, oracle, prefix, quant, roofline, validate
from kvlab.attention import attention, causal_mask, repeat_kv
from kvlab.cache import (
    BlockAllocator,
    DynamicKVCache,
    HeavyHitterKVCache,
    PagedKVCache,
    PrefixKVStore,
    QuantizedKVCache,
    SlidingWindowKVCache,
    StaticKVCache,
)
from kvlab.cache.prefix import PrefixBlockManager
from kvlab.config import PRESETS, ModelConfig
from kvlab.fast import FastDecoder, fast_generate
from kvlab.generate import generate
from kvlab.model import Transformer, attend_with
from kvlab.offload import offload_seconds, recompute_seconds
from kvlab.trace import record

CFG = PRESETS["tiny-gqa"]  # 2 layers, 4 heads, 2 KV heads, head_dim 16, vocabulary 256
SHAPE = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=172, vocab_size=256, max_seq_len=512)

KINDS = {  # every cache kind, built small (window / budget / pool of 8)
    "static": lambda **kw: StaticKVCache(CFG, 1, 16, **kw),
    "int8": lambda **kw: QuantizedKVCache(CFG, 1, 16, **kw),
    "paged": lambda **kw: PagedKVCache(CFG, 1, 16, **kw),
    "window": lambda **kw: SlidingWindowKVCache(CFG, 1, 8, **kw),
    "heavy hitters": lambda **kw: HeavyHitterKVCache(CFG, 1, 8, **kw),
    "prefix store": lambda **kw: PrefixKVStore(CFG, 8, 4, **kw),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def kv(t=3, batch=1, heads=2, dim=16, dtype=torch.float32):
    return torch.randn(batch, heads, t, dim).to(dtype), torch.randn(batch, heads, t, dim).to(dtype)


def message(call, error=ValueError) -> str:
    with pytest.raises(error) as err:
        call()
    return str(err.value)


# --- prefix caching: the pool, the index, a released cache ------------------------------------------


def test_refused_prompts_take_no_blocks_from_the_pool(model):
    store = PrefixKVStore(CFG, 8, 4)
    for bad in ([72.9] * 9, "123456789", [-1] * 9, [300] * 9):  # floats, text, negative, outside vocab
        with pytest.raises(ValueError):
            prefix.run_request(model, store, bad, 2)
    assert store.manager.num_in_use == 0 and store.manager.allocator.num_free == 8
    ok = prefix.run_request(model, store, list(range(1, 25)), 2)  # 7 blocks of the 8: still fits
    assert ok.new_tokens == generate(model, list(range(1, 25)), 2, cache=None).new_tokens[0].tolist()


def test_a_request_that_fails_mid_forward_gives_its_blocks_back(model):
    store = PrefixKVStore(CFG, 8, 4)

    def broken(layer, q, k, v, mask):
        raise RuntimeError("a bug inside the model")

    with attend_with(model, broken), pytest.raises(RuntimeError, match="a bug inside the model"):
        prefix.run_request(model, store, [1, 2, 3, 4, 5], 2)
    assert store.manager.num_in_use == 0 and store.manager.allocator.num_free == 8


@pytest.mark.parametrize("use", ["update", "crop", "fork", "release", "finish", "forward"])
def test_a_released_shared_cache_refuses_every_use(use, model):
    store = PrefixKVStore(CFG, 8, 4)
    cache = store.cache_for([1, 2, 3])
    cache.release()
    calls = {
        "update": lambda: cache.update(0, *kv(1)),
        "crop": lambda: cache.crop(0),
        "fork": cache.fork,
        "release": cache.release,
        "finish": lambda: cache.finish([1, 2, 3]),
        "forward": lambda: model(torch.tensor([[4]]), cache=cache),
    }
    with torch.inference_mode():
        assert "was released" in message(calls[use])
    assert store.manager.num_in_use == 0  # it took nothing back from the pool


def test_the_prefix_index_compares_tokens_not_only_their_hash():
    assert hash(2**61) == hash(1)  # CPython hashes ints modulo 2**61 - 1: a collision
    m = PrefixBlockManager(8, 2)
    m.register(m.new_sequence([1, 1, 5]))
    assert m.match([1, 1, 5]) != [] and m.match([2**61, 2**61, 5]) == []


def test_negative_token_ids_are_refused_by_the_prefix_index():
    assert hash(-1) == hash(-2)  # CPython: -1 is reserved, so hash(-1) is -2
    m = PrefixBlockManager(8, 2)
    for call in (
        lambda: m.new_sequence([-1, -1, 5]),
        lambda: m.match([-2, 3]),
        lambda: prefix.simulate_stream([[-1, 2]], 8),
    ):
        assert "token ids must be integers >= 0" in message(call)


def test_run_request_flags_and_store_are_checked(model):
    store = PrefixKVStore(CFG, 8, 4)
    assert (
        message(lambda: prefix.run_request(model, store, [1, 2], 2, reuse="no"))
        == "reuse='no' must be True or False"
    )
    assert "keep=1 must be True or False" in message(
        lambda: prefix.run_request(model, store, [1, 2], 2, keep=1)
    )
    assert "store=None is not a PrefixKVStore" in message(lambda: prefix.run_request(model, None, [1, 2], 2))
    assert store.manager.num_in_use == 0


def test_simulate_stream_refuses_one_list_of_ids_as_the_requests():
    for requests in ([1, 2, 3], "abc", None, 5):
        assert "must be a list of requests, each a list of token ids" in message(
            lambda r=requests: prefix.simulate_stream(r, 8)
        )
    stream = (list(range(33)) for _ in range(2))  # a generator of requests is read once, whole
    assert prefix.simulate_stream(stream, 8).prompt_tokens == 66


def test_sample_stream_checks_its_vocabulary_and_seed():
    assert "vocab=0 must be an integer >= 1" in message(lambda: prefix.sample_stream(2, vocab=0))
    assert "vocab=1.5" in message(lambda: prefix.sample_stream(2, vocab=1.5))
    assert "seed=-1 must be an integer >= 0" in message(lambda: prefix.sample_stream(2, seed=-1))
    assert prefix.sample_stream(2, seed=np.int64(3)) == prefix.sample_stream(2, seed=3)


def test_prefill_flops_and_offloading_take_a_preset_name():
    l7 = PRESETS["llama-7b"]
    assert prefix.prefill_flops("llama-7b", 10) == prefix.prefill_flops(l7, 10) > 0
    assert recompute_seconds("llama-7b", 10, 1e12) == recompute_seconds(l7, 10, 1e12)
    assert offload_seconds("llama-7b", 10, 32e9) == 524288 * 10 / 32e9


# --- caches: dtypes, shapes, sizes, devices, names ---------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, "fp16"])
def test_caches_refuse_dtypes_that_cannot_hold_keys(kind, dtype):
    assert "cannot hold keys and values" in message(lambda: KINDS[kind](dtype=dtype))


def test_a_quantized_cache_refuses_k_and_v_of_different_lengths():
    cache = QuantizedKVCache(CFG, 1, 16)
    k, _ = kv(3)
    _, v = kv(4)
    assert "but v (1, 2, 4, 16): they must match" in message(lambda: cache.update(0, k, v))
    assert cache.seq_len == 0 and cache.read(0)[0].shape[2] == 0  # nothing stored


WRONG_SHAPES = [
    (dict(dim=8), "(1, 2, 3, 8)"),
    (dict(heads=4), "(1, 4, 3, 16)"),
    (dict(t=0), "tokens >= 1"),
    (dict(batch=2), "batch"),
]


@pytest.mark.parametrize(
    "kind, wrong, shown",
    [
        (kind, wrong, shown)
        for kind in ["static", "dynamic", "int8", "paged", "window", "prefix"]
        for wrong, shown in WRONG_SHAPES
        if not (kind == "dynamic" and "batch" in wrong)
    ],  # a DynamicKVCache takes the batch it is first given
)
def test_update_with_a_wrong_shape_says_which(kind, wrong, shown):
    cache = {
        "dynamic": lambda: DynamicKVCache(CFG),
        "prefix": lambda: PrefixKVStore(CFG, 8, 4).cache_for([1, 2, 3]),
    }.get(kind, KINDS.get(kind))()
    assert shown in message(lambda: cache.update(0, *kv(**{"t": 3, **wrong})))
    assert "layer=2 out of range" in message(lambda: cache.update(2, *kv()), IndexError)
    assert cache.seq_len == 0


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("size", [10**12, 10**30])
def test_a_huge_cache_is_refused_with_its_byte_count_before_any_allocation(kind, size):
    build = {
        "static": lambda: StaticKVCache(CFG, 1, size),
        "int8": lambda: QuantizedKVCache(CFG, 1, size),
        "paged": lambda: PagedKVCache(CFG, 1, size),
        "window": lambda: SlidingWindowKVCache(CFG, 1, size),
        "heavy hitters": lambda: HeavyHitterKVCache(CFG, 1, size),
        "prefix store": lambda: PrefixKVStore(CFG, size, 4),
    }[kind]
    text = message(build, MemoryError)
    assert " bytes" in text and "kv_cache_bytes" in text


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("to_int", [np.int32, np.int64], ids=["int32", "int64"])
def test_a_huge_cache_sized_by_numpy_ints_is_refused_like_python_ints(kind, to_int):
    batch, length = to_int(4096), to_int(2**17)  # their product overflows int32 (0 bytes there)
    build = {
        "static": lambda: StaticKVCache(CFG, batch, length),
        "int8": lambda: QuantizedKVCache(CFG, batch, length),
        "paged": lambda: PagedKVCache(CFG, batch, length),
        "window": lambda: SlidingWindowKVCache(CFG, batch, length),
        "heavy hitters": lambda: HeavyHitterKVCache(CFG, batch, length),
        "prefix store": lambda: PrefixKVStore(CFG, batch * length, 4),
    }[kind]
    assert " bytes" in message(build, MemoryError)


def test_a_huge_cache_on_the_meta_device_is_refused_too():
    assert StaticKVCache(CFG, 1, 10**6, device="meta").k.is_meta  # 8 GiB on meta: allowed, nothing held
    assert "cannot tell how much is free" in message(
        lambda: StaticKVCache(CFG, 1, 10**30, device="meta"), MemoryError
    )


def test_a_block_pool_of_a_trillion_blocks_costs_nothing_until_used():
    pool = BlockAllocator(10**12)  # the free list is counted, not listed
    assert pool.allocate(3) == [0, 1, 2] and pool.num_free == 10**12 - 3
    pool.free([1])
    assert pool.allocate(2) == [1, 3]  # a freed block first, then the next never used
    big = fragmentation.simulate([10, 20], [5, 5], "paged", capacity=10**12)
    assert big.finished == 2


def test_block_allocator_free_refuses_none_and_other_non_ids():
    pool = BlockAllocator(8)
    pool.allocate(2)
    for bad in (None, "0", 1.5, object()):
        assert "must be a block id or a list of block ids" in message(lambda b=bad: pool.free(b))
    assert pool.num_used == 2


@pytest.mark.parametrize("kind", ["window", "heavy hitters", "prefix store"])
def test_bounded_and_prefix_caches_take_a_preset_name(kind):
    build = {
        "window": lambda c: SlidingWindowKVCache(c, 1, 8),
        "heavy hitters": lambda c: HeavyHitterKVCache(c, 1, 8),
        "prefix store": lambda c: PrefixKVStore(c, 8, 4),
    }[kind]
    assert build("tiny-gqa").config == CFG and build("TINY-GQA").config == CFG
    assert "config='nope' is not allowed" in message(lambda: build("nope"))


@pytest.mark.parametrize("device", ["gpu", "cuda:x", 5, True])
def test_an_unknown_device_is_refused_naming_the_allowed_ones(device):
    for call in (
        lambda: StaticKVCache(CFG, 1, 8, device=device),
        lambda: PrefixKVStore(CFG, 8, device=device),
        lambda: kvlab.pretrained.load(device=device),
        lambda: kvlab.env.available_memory(device),
    ):
        text = message(call)
        assert "allowed: 'cpu', 'meta'" in text and str(device) in text


def test_cuda_is_refused_clearly_where_it_is_not_available_and_used_where_it_is():
    if torch.cuda.is_available():
        assert StaticKVCache(CFG, 1, 8, device="cuda").device.type == "cuda"
        return
    for call in (
        lambda: StaticKVCache(CFG, 1, 8, device="cuda"),
        lambda: kvlab.pretrained.load(device="cuda"),
    ):
        text = message(call)
        assert text.startswith("device='cuda' needs CUDA, which is not available") and "'cpu'" in text
    assert validate.device("device", "meta") == torch.device("meta") and validate.device("d", None) is None


# --- the model, generate and the fast path --------------------------------------------------------


@pytest.mark.parametrize("bad", ["kvlab-tiny", None, CFG])
def test_everything_that_takes_a_model_refuses_what_is_not_one(bad, model):
    calls = [
        lambda: generate(bad, [1, 2, 3], 4),
        lambda: fast_generate(bad, [1, 2, 3], 4),
        lambda: FastDecoder(bad, 1, 8),
        lambda: prefix.run_request(bad, PrefixKVStore(CFG, 8), [1], 1),
        lambda: eviction.token_losses(bad, [1, 2]),
        lambda: eviction.attention_maps(bad, [1, 2]),
        lambda: oracle.check(bad, StaticKVCache(CFG, 1, 8), [1, 2]),
        lambda: record(bad, [1, 2], 1),
        lambda: gqa.mha_to_gqa(bad, 1),
        lambda: gqa.gqa_to_mha(bad),
    ]
    for call in calls:
        assert message(call).endswith(
            "must be a kvlab Transformer (e.g. kvlab.pretrained.load('kvlab-tiny'))"
        )
    assert (
        message(lambda: generate("kvlab-tiny", [1], 1))
        == "model='kvlab-tiny' must be a kvlab Transformer (e.g. kvlab.pretrained.load('kvlab-tiny'))"
    )


def test_on_token_that_is_not_a_function_is_refused_before_the_first_forward_pass(model):
    passes = []

    def counting(layer, q, k, v, mask):
        passes.append(layer)
        return attention(q, k, v, mask)

    with attend_with(model, counting):
        assert "on_token=5 must be a function" in message(lambda: generate(model, [1, 2, 3], 4, on_token=5))
    assert passes == []


def test_count_flops_must_be_a_bool(model):
    for bad in ("no", 2, None):
        assert "must be True or False" in message(lambda b=bad: generate(model, [1, 2], 2, count_flops=b))
    assert generate(model, [1, 2], 2, count_flops=np.bool_(True)).flops > 0


def test_forward_refuses_a_row_that_is_all_padding(model):
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert (
        message(lambda: model(ids, attention_mask=mask))
        == "attention_mask row 1 is all padding: every sequence needs at least one real token"
    )


def test_forward_refuses_a_cache_that_is_not_a_cache(model):
    for bad in ("static", 5):
        assert "is not a kvlab cache" in message(lambda b=bad: model(torch.tensor([[1, 2]]), cache=b))


def test_an_attention_mask_that_is_not_numbers_is_refused(model):
    assert "attention_mask='abc' is not a list or tensor" in message(
        lambda: generate(model, [[1, 2, 3]], 2, attention_mask="abc")
    )


def test_fast_generate_refuses_a_decoder_or_step_that_is_not_one(model):
    assert "decoder=5 must be a FastDecoder of this model" in message(
        lambda: fast_generate(model, [1, 2], 2, decoder=5)
    )
    other = Transformer(CFG).eval()
    assert "must be a FastDecoder of this model" in message(
        lambda: fast_generate(model, [1, 2], 2, decoder=FastDecoder(other, 1, 8))
    )
    assert "step_fn=5 must be the function make_step" in message(
        lambda: fast_generate(model, [1, 2], 2, step_fn=5)
    )


@pytest.mark.parametrize("ids", [[72.9, 105.5], "hi", [[1, 2], [3]], [300, 1]])
def test_eviction_refuses_float_text_ragged_and_out_of_vocabulary_ids(ids, model):
    for call in (
        lambda: eviction.token_losses(model, ids),
        lambda: eviction.attention_maps(model, ids),
        lambda: eviction.loss_vs_budget(model, ids, [4]),
    ):
        text = message(call)
        assert "id" in text and "Error" not in text


def test_loss_vs_budget_refuses_one_number_for_its_lists(model):
    assert "budgets=5 must be a list, e.g. budgets=[16, 64]" in message(
        lambda: eviction.loss_vs_budget(model, [1, 2, 3], 5)
    )
    assert "budget=1 must be an integer >= 2" in message(
        lambda: eviction.loss_vs_budget(model, [1, 2, 3], [1])
    )
    assert "policy='lru' is not allowed" in message(
        lambda: eviction.loss_vs_budget(model, [1, 2, 3], [4], policies=["lru"])
    )


def test_oracle_check_refuses_bad_ids_and_a_mask_of_another_shape(model):
    cache = StaticKVCache(CFG, 1, 16)
    assert "is not a list or tensor of token ids" in message(lambda: oracle.check(model, cache, None))
    assert "token ids must lie in 0..255" in message(lambda: oracle.check(model, cache, [300, 1]))
    assert "attention_mask has shape (1, 2); expected one 0 or 1 per token, shape (1, 6)" in message(
        lambda: oracle.check(model, cache, [1, 2, 3, 4, 5, 6], attention_mask=[[1, 1]])
    )
    assert "atol=" in message(lambda: oracle.check(model, cache, [1, 2], atol=10**400))
    assert oracle.check(model, StaticKVCache(CFG, 1, 16), [1, 2, 3, 4, 5, 6]).ok


# --- config, numbers, flags -----------------------------------------------------------------------


@pytest.mark.parametrize("key", ["tie_embeddings", "qkv_bias"])
@pytest.mark.parametrize("bad", ["no", 2, 0, 1, None, "True"])
def test_model_config_flags_must_be_bools(key, bad):
    assert message(lambda: ModelConfig(**SHAPE, **{key: bad})) == f"{key}={bad!r} must be True or False"


def test_model_config_keeps_flags_and_floats_as_python_types():
    c = ModelConfig(**SHAPE, tie_embeddings=np.bool_(True), rope_theta=np.float32(0.5))
    assert c.tie_embeddings is True and type(c.rope_theta) is float and c.rope_theta == 0.5
    tied, untied = Transformer(c), Transformer(ModelConfig(**SHAPE, tie_embeddings=False))
    assert tied.lm_head.weight is tied.embed.weight and untied.lm_head.weight is not untied.embed.weight


@pytest.mark.parametrize(
    "call",
    [
        lambda: validate.number("x", 10**400),
        lambda: ModelConfig(**SHAPE, rope_theta=10**400),
        lambda: ModelConfig(**SHAPE, norm_eps=-(10**400)),
        lambda: roofline.roofline("llama-7b", 10**400),
        lambda: offload_seconds("llama-7b", 10, 10**400),
        lambda: memory.format_bytes(10**400),
    ],
    ids=["number", "rope_theta", "norm_eps", "bandwidth", "offload bandwidth", "format_bytes"],
)
def test_numbers_beyond_a_floats_range_are_refused_not_overflowing(call):
    assert "(an integer of 401 digits) must be a finite number" in message(call)


def test_a_temperature_beyond_a_floats_range_is_refused(model):
    for call in (
        lambda: generate(model, [1], 2, temperature=10**400),
        lambda: fast_generate(model, [1], 2, temperature=10**400),
    ):
        assert "temperature=100000... (an integer of 401 digits) must be a finite number" in message(call)


def test_format_bytes_takes_numpy_scalars_and_refuses_infinity():
    assert (
        memory.format_bytes(np.int64(2048)) == "2.00 KiB" and memory.format_bytes(np.float32(1.5)) == "1.50 B"
    )
    assert memory.format_bytes(np.uint8(5)) == "5 B"
    for bad in (math.inf, math.nan, "2048", None, True):
        assert message(lambda b=bad: memory.format_bytes(b)).startswith(f"n={bad!r} must be a finite number")


def test_plan_reserve_fraction_is_checked_as_a_number():
    for bad in ("0.1", None, [0.1]):
        assert (
            message(lambda b=bad: memory.plan("llama-7b", "A100 80GB", 2048, reserve_fraction=b))
            == f"reserve_fraction={bad!r} must be a finite number in [0, 1)"
        )
    p = memory.plan("llama-7b", "A100 80GB", 2048, reserve_fraction=np.float64(0.1))
    assert p == memory.plan("llama-7b", "A100 80GB", 2048, reserve_fraction=0.1)


def test_roofline_takes_preset_names_and_names_the_context():
    l7 = PRESETS["llama-7b"]
    assert roofline.decode_step_bytes("llama-7b", 16) == roofline.decode_step_bytes(l7, 16)
    assert roofline.memory_bound_batch("llama-7b", 312e12, 2e12) == roofline.memory_bound_batch(
        l7, 312e12, 2e12
    )
    assert roofline.forward_flops("llama-7b", 4) == roofline.forward_flops(l7, 4)
    assert "context=-1 must be an integer in [0, 1099511627776]" in message(
        lambda: roofline.decode_step_bytes(l7, -1)
    )


def test_gqa_helpers_take_preset_names_and_numpy_counts():
    assert gqa.mha_ratio("llama-2-70b") == 8 and len(gqa.variants("llama-2-70b")) == 3
    assert gqa.kv_head_of(np.int64(5), 8, np.int64(2)) == 1
    assert "query_head=1.0 must be an integer" in message(lambda: gqa.kv_head_of(1.0, 8, 2))
    assert "n_kv_heads=0 must be an integer >= 1; allowed: [1, 2, 4, 8]" in message(
        lambda: gqa.kv_groups(8, 0)
    )


def test_attention_helpers_refuse_what_they_cannot_compute():
    assert "q_len=2.5 must be an integer" in message(lambda: causal_mask(2.5, 4))
    assert "n_rep=0 must be an integer >= 1" in message(lambda: repeat_kv(torch.ones(1, 2, 3, 4), 0))
    q, k = torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 8)
    assert "cannot attend over k (1, 2, 3, 8)" in message(lambda: attention(q, k, k))
    assert causal_mask(0, 4).shape == (0, 4)  # no query rows: an empty mask, not an error


# --- quantization ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, text",
    [
        ([[1.0, 2.0]], "x must be a torch.Tensor; got list"),
        (np.ones((2, 2)), "x must be a torch.Tensor; got ndarray"),
        (torch.empty(0, 8), "x has shape (0, 8): no elements"),
        (torch.ones(2, 2, dtype=torch.int64), "x must be a floating-point tensor"),
    ],
)
def test_quantize_refuses_a_list_an_array_an_empty_or_an_integer_tensor(x, text):
    for granularity in ("tensor", "token", "channel"):
        assert text in message(lambda g=granularity: quant.quantize(x, g))


@pytest.mark.parametrize(
    "metric", ["max_abs_error", "relative_rms_error", "snr_db", "cosine_similarity", "error_report"]
)
def test_error_metrics_refuse_mismatched_shapes_instead_of_broadcasting(metric):
    a = torch.tensor([1.0, 2.0, 3.0])
    fn = getattr(quant, metric)
    assert "x has shape (3, 1) but y (3,)" in message(lambda: fn(a[:, None], a))
    assert "x has shape (2, 3) but y (3, 2)" in message(lambda: fn(torch.ones(2, 3), torch.ones(3, 2)))
    assert "x must be a torch.Tensor" in message(lambda: fn([1.0], [1.0]))
    assert "x has shape (0,): no elements" in message(lambda: fn(torch.empty(0), torch.empty(0)))
    assert quant.max_abs_error(a[:, None], a[:, None]) == 0.0


def test_dequantize_refuses_an_integer_dtype():
    q = quant.quantize(torch.randn(4, 8))
    assert "dtype=torch.int8 cannot hold dequantized values" in message(lambda: q.dequantize(torch.int8))


def test_int4_packing_refuses_what_is_not_int8_codes():
    assert "codes must be a torch.Tensor" in message(lambda: quant.pack_int4([[1, 2]]))
    assert "packed must be int8" in message(lambda: quant.unpack_int4(torch.tensor([1.0])))
    assert "packed must be a torch.Tensor" in message(lambda: quant.unpack_int4([1, 2]))


def test_bit_widths_are_whole_numbers():
    assert quant.qmax(np.int64(8)) == 127 and type(quant.qmax(np.int64(4))) is int
    for bad in (8.0, "8", True):
        assert "is not supported; allowed: 8, 4" in message(lambda b=bad: quant.qmax(b))
