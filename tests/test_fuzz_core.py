"""Issue 24, item 3: property tests over the public API of the core, fed good and bad arguments alike.

Every call either returns the right answer (checked against a formula or an independent path: the
uncached model, the definition of a metric, a record of what was fed) or raises a clear error, a
ValueError, TypeError, IndexError, MemoryError or OutOfBlocksError whose message names the argument;
never another exception (the test fails on it), never a silent wrong answer. Each example spoils at
most one argument with an odd value (a huge int, NaN, text, None, a NumPy scalar, a list...), so
about half the calls are valid and are checked for the right answer. `pytest --hypothesis-show-statistics`
shows how many were answered and how many refused. tools/fuzz_report.py keeps a fixed list of such
cases as a table; tests/test_refusals_core.py has one test per finding.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvlab import eviction, memory, oracle, prefix, quant, roofline, validate
from kvlab.cache import (
    BlockAllocator,
    DynamicKVCache,
    OutOfBlocksError,
    PagedKVCache,
    PrefixKVStore,
    QuantizedKVCache,
    SlidingWindowKVCache,
    StaticKVCache,
)
from kvlab.cache.prefix import PrefixBlockManager
from kvlab.config import PRESETS, ModelConfig
from kvlab.fast import fast_generate
from kvlab.generate import generate
from kvlab.model import Transformer
from kvlab.offload import offload_seconds, recompute_seconds

CLEAR = (ValueError, TypeError, IndexError, MemoryError, OutOfBlocksError)
# derandomize: the same examples every run, so a failure here is reproducible and the run time fixed
FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
SLOW = settings(FUZZ, max_examples=30)

# A small model (vocabulary 64, 32 positions), in float64 so that the cached and uncached paths
# cannot round a near-tie into different greedy tokens.
CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, vocab_size=64, max_seq_len=32)
_MODEL: list = []


def model() -> Transformer:
    if not _MODEL:
        torch.manual_seed(0)
        _MODEL.append(Transformer(CFG).double().eval())
    return _MODEL[0]


def outcome(call, *names):
    """(True, result), or (False, error) for a clear error whose message names one of `names`; any
    other exception propagates and fails the test."""
    try:
        result = call()
    except CLEAR as err:
        text = str(err)
        assert any(n.lower() in text.lower() for n in names), (
            f"{type(err).__name__} names none of {names}: {text}"
        )
        event(f"refused: {text[:40]}")
        return False, err
    event("answered")
    return True, result


# What a learner might pass anywhere: numbers of every kind, huge ints, text, None, containers.
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.sampled_from(
        [
            2**63,
            10**400,
            -(10**400),
            np.int64(4),
            np.float32(0.5),
            np.bool_(True),
            np.uint8(3),
            [2],
            (),
            object(),
        ]
    ),
)
COUNT = st.one_of(st.integers(-2, 12), st.sampled_from([np.int64(3), 2.0, 2.5, "3", None, True]))


@st.composite
def arguments(draw, odd=None, **valid):
    """A dict of valid values, one of them replaced by an odd one in half the draws (`odd` gives
    some arguments odd values of their own, e.g. malformed token ids)."""
    values = {name: draw(strategy) for name, strategy in valid.items()}
    spoiled = draw(st.sampled_from([None] * len(valid) + list(valid)))
    if spoiled is not None:
        values[spoiled] = draw(st.one_of((odd or {}).get(spoiled, ODD), ODD))
    return values


# --- config and memory --------------------------------------------------------------------------

BASE = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=172, vocab_size=256, max_seq_len=512)
FIELDS = dict(
    BASE,
    head_dim=None,
    rope_theta=10000.0,
    norm_eps=1e-5,
    tie_embeddings=False,
    qkv_bias=False,
    n_params=None,
    kv_latent_dim=None,
)
VALID_FIELDS = {k: st.just(v) for k, v in FIELDS.items()} | {
    "n_kv_heads": st.sampled_from([1, 2, 4]),
    "head_dim": st.sampled_from([None, 8, 32]),
    "tie_embeddings": st.booleans(),
    "qkv_bias": st.booleans(),
    "rope_theta": st.floats(1, 1e6),
    "kv_latent_dim": st.sampled_from([None, 64]),
}


@FUZZ
@given(fields=arguments(**VALID_FIELDS))
def test_a_model_config_is_valid_or_refused_naming_a_field(fields):
    ok, c = outcome(lambda: ModelConfig(**fields), *FIELDS)
    if not ok:
        return
    for key in BASE:
        assert type(getattr(c, key)) is int and getattr(c, key) >= 1
    assert type(c.tie_embeddings) is bool and type(c.qkv_bias) is bool
    assert math.isfinite(c.rope_theta) and c.rope_theta > 0 and c.norm_eps > 0
    assert c.head_dim % 2 == 0 and c.n_heads % c.n_kv_heads == 0
    if c.kv_latent_dim is None:
        assert memory.kv_bytes_per_token(c) == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2


BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}


@FUZZ
@given(
    a=arguments(
        config=st.sampled_from(["llama-7b", "llama-2-70b", "deepseek-v2", "tiny-gqa"]),
        seq_len=st.integers(0, 10**6),
        batch_size=st.integers(1, 64),
        dtype=st.sampled_from(list(BITS)),
    )
)
def test_kv_cache_bytes_is_the_formula_or_refused(a):
    ok, n = outcome(lambda: memory.kv_cache_bytes(**a), "config", "seq_len", "batch_size", "dtype")
    if ok:
        c = PRESETS[a["config"]]
        per_token = c.n_layers * (c.kv_latent_dim or 2 * c.n_kv_heads * c.head_dim)
        assert n == -(
            -per_token * int(a["seq_len"]) * int(a["batch_size"]) * BITS[a["dtype"]] // 8
        )  # whole bytes


@FUZZ
@given(
    a=arguments(
        reserve_fraction=st.floats(0, 0.99),
        context_bytes=st.integers(0, 2**31),
        seq_len=st.integers(1, 10**5),
        batch_size=st.integers(1, 8),
    )
)
def test_a_plan_adds_up_or_is_refused(a):
    ok, p = outcome(lambda: memory.plan("llama-7b", "A100 80GB", **a), *a)
    if ok:
        assert p.reserve_bytes == int(p.gpu.memory_bytes * float(a["reserve_fraction"]))
        assert (
            p.free_for_cache
            == p.gpu.memory_bytes - int(a["context_bytes"]) - p.weight_bytes - p.reserve_bytes
        )
        assert p.fits == (p.cache_bytes <= p.free_for_cache)
        assert memory.kv_cache_bytes("llama-7b", p.max_context, int(a["batch_size"])) <= max(
            p.free_for_cache, 0
        )


@FUZZ
@given(n=st.one_of(ODD, st.integers(-(2**70), 2**70), st.floats(-1e20, 1e20)))
def test_format_bytes_reads_back_the_number_or_refuses(n):
    ok, text = outcome(lambda: memory.format_bytes(n), "n=")
    if ok:
        number, unit = text.split()
        scale = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}[unit]
        assert abs(abs(float(number)) * scale - abs(float(n))) <= 0.005 * scale + 0.5


# --- quantization --------------------------------------------------------------------------------


@st.composite
def tensors(draw):
    """Mostly finite float tensors of 2-3 dims; now and then 1-D, empty, of an integer dtype, or with
    one special value (tiny, beyond fp16, NaN, infinity)."""
    rarely = st.sampled_from([False] * 7 + [True])
    shape = draw(st.lists(st.integers(1, 4), min_size=2, max_size=3))
    if draw(rarely):
        shape = shape[:1]
    if draw(rarely):
        shape[draw(st.integers(0, len(shape) - 1))] = 0
    values = draw(
        st.lists(st.floats(-1e4, 1e4, width=32), min_size=math.prod(shape), max_size=math.prod(shape))
    )
    if values and draw(rarely):
        values[draw(st.integers(0, len(values) - 1))] = draw(
            st.sampled_from([1e-30, -3e38, math.nan, math.inf])
        )
    dtype = (
        torch.int32 if draw(rarely) else draw(st.sampled_from([torch.float32, torch.float16, torch.float64]))
    )
    return torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)


@FUZZ
@given(
    x=tensors(),
    a=arguments(
        granularity=st.sampled_from(["tensor", "token", "channel"]),
        bits=st.sampled_from([8, 4]),
        scale_dtype=st.sampled_from([None, torch.float16, torch.float32]),
    ),
)
def test_quantize_round_trips_within_half_a_scale_or_refuses(x, a):
    ok, q = outcome(lambda: quant.quantize(x, **a), "x", "granularity", "bits", "scale_dtype")
    if not ok:
        return
    assert q.data.dtype == torch.int8 and int(q.data.abs().max()) <= quant.qmax(a["bits"])
    err = (q.dequantize(torch.float64) - x.double()).abs()
    assert bool((err <= q.scale.double() / 2 * 1.001 + 1e-7).all())


@FUZZ
@given(
    a=st.lists(st.integers(0, 3), max_size=3),
    other=st.one_of(st.none(), st.none(), st.lists(st.integers(0, 3), max_size=3)),
    as_list=st.integers(0, 5),
    metric=st.sampled_from(["max_abs_error", "relative_rms_error", "snr_db", "cosine_similarity"]),
)
def test_error_metrics_are_their_definition_or_refuse(a, other, as_list, metric):
    b = a if other is None else other
    x = torch.arange(math.prod(a), dtype=torch.float32).reshape(a) + 1
    y = torch.flip(x, list(range(x.dim()))) - 0.5 if a == b else torch.zeros(b)
    ok, value = outcome(
        lambda: getattr(quant, metric)(x.tolist() if as_list == 0 else x, y), "x", "y", "shape"
    )
    if not ok:
        assert as_list == 0 or a != b or x.numel() == 0  # refused only what is not a pair of equal shapes
        return
    x64, y64 = x.double().flatten(), y.double().flatten()
    d = x64 - y64
    noise = float(d.pow(2).sum())
    expected = {
        "max_abs_error": float(d.abs().max()),
        "relative_rms_error": float(d.norm() / x64.norm()),
        "snr_db": math.inf if noise == 0 else 10 * math.log10(float(x64.pow(2).sum()) / noise),
        "cosine_similarity": float(torch.dot(x64, y64) / (x64.norm() * y64.norm())),
    }[metric]
    assert value == pytest.approx(expected, rel=1e-5, abs=1e-6)


# --- caches: constructors, then updates and crops against a record of what was fed ----------------

BUILDERS = {
    "static": lambda a: StaticKVCache(CFG, a["batch_size"], a["size"], a["dtype"], a["device"]),
    "dynamic": lambda a: DynamicKVCache(CFG),
    "int8": lambda a: QuantizedKVCache(CFG, a["batch_size"], a["size"], a["dtype"], a["device"], residual=4),
    "paged": lambda a: PagedKVCache(CFG, a["batch_size"], a["size"], a["dtype"], a["device"], block_size=4),
    "window": lambda a: SlidingWindowKVCache(
        CFG, a["batch_size"], a["size"], 1, a["dtype"], a["device"], rollback=2
    ),
    "prefix": lambda a: PrefixKVStore(CFG, a["size"], 4, a["dtype"], a["device"]).cache_for([1, 2, 3]),
}
CACHE_ARGS = arguments(
    batch_size=st.sampled_from([1, 1, 2]),
    size=st.sampled_from([16, 12]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    device=st.sampled_from(["cpu", torch.device("cpu")]),
)
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("pass"),
            st.integers(1, 4),
            st.sampled_from(["ok"] * 4 + ["dim", "heads", "int", "v longer"]),
        ),
        st.tuples(st.just("pass"), st.integers(1, 4), st.just("ok")),
        st.tuples(st.just("crop"), COUNT, st.just("")),
        st.tuples(st.just("layer"), st.sampled_from([-1, 2, 1.0, True, None]), st.just("")),
    ),
    max_size=8,
)


@FUZZ
@given(kind=st.sampled_from(list(BUILDERS)), a=CACHE_ARGS, ops=OPS)
def test_a_cache_holds_what_it_was_fed_or_refuses_and_changes_nothing(kind, a, ops):
    ok, cache = outcome(
        lambda: BUILDERS[kind](a),
        "batch_size",
        "max_seq_len",
        "window",
        "num_blocks",
        "dtype",
        "device",
        "bytes",
    )
    if not ok:
        return
    b = 1 if kind in ("dynamic", "prefix") else a["batch_size"]
    fed = [([], []) for _ in range(CFG.n_layers)]  # per layer: the K rows and V rows fed, in order
    gen = torch.Generator().manual_seed(len(ops))
    for op, arg, how in ops:
        before = list(cache.lengths)
        if op == "layer":
            good, _ = outcome(
                lambda a=arg: cache.update(a, *(torch.zeros(b, 2, 1, 8, dtype=torch.float64),) * 2), "layer"
            )
            assert not good and cache.lengths == before
        elif op == "crop":
            good, _ = outcome(lambda a=arg: cache.crop(a), "n=", "crop")
            if good:
                fed = [(k[: int(arg)], v[: int(arg)]) for k, v in fed]
            else:
                assert cache.lengths == before
        elif not _feed_a_pass(cache, kind, b, arg, how, fed, gen, before):
            return  # refused: this life ends (what a model would see next is undefined)


def _feed_a_pass(cache, kind, b, t, how, fed, gen, before) -> bool:
    """One forward pass's worth of updates, layer by layer; False when refused."""
    for layer in range(CFG.n_layers):
        k, v = (torch.randn(b, 2, t, 8, generator=gen, dtype=torch.float64) for _ in range(2))
        if how == "dim":
            k = v = torch.zeros(b, 2, t, 4, dtype=torch.float64)
        elif how == "heads":
            k = v = torch.zeros(b, 4, t, 8, dtype=torch.float64)
        elif how == "int":
            k = v = torch.zeros(b, 2, t, 8, dtype=torch.int64)
        elif how == "v longer":
            v = torch.zeros(b, 2, t + 1, 8, dtype=torch.float64)
        good, got = outcome(
            lambda k=k, v=v, layer=layer: cache.update(layer, k, v),
            "k ",
            "v ",
            "k has",
            "v has",
            "cache is full",
            "positions",
            "blocks",
        )
        if not good:
            assert list(cache.lengths)[layer:] == before[layer:]  # this layer and the later ones: unchanged
            return False
        fed[layer][0].extend(k.unbind(2))
        fed[layer][1].extend(v.unbind(2))
        positions = cache.key_positions(layer)
        positions = range(len(fed[layer][0])) if positions is None else positions.tolist()
        for returned, rows in zip(got, fed[layer], strict=True):
            want = torch.stack([rows[p] for p in positions], dim=2).to(returned.dtype)
            top = want.abs().max().item()
            bound = top / 127 if kind == "int8" else 1e-6 * top  # int8: within scale / 2; others: exact
            assert (returned - want).abs().max().item() <= bound, f"{kind} layer {layer} returned other K/V"
    return True


# --- the allocator and the prefix index ------------------------------------------------------------


@FUZZ
@given(
    a=arguments(num_blocks=st.integers(1, 10)),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["allocate", "free"]), st.one_of(st.integers(0, 6), st.integers(0, 6), ODD)
        ),
        max_size=12,
    ),
)
def test_the_allocator_refuses_odd_arguments_and_changes_nothing(a, ops):
    ok, alloc = outcome(lambda: BlockAllocator(**a), "num_blocks")
    if not ok:
        return
    if alloc.num_blocks > 64:  # a huge pool: counted, never listed
        assert alloc.allocate(3) == [0, 1, 2] and alloc.num_free == alloc.num_blocks - 3
        return
    held: list[int] = []
    for op, arg in ops:
        before = (alloc.num_used, alloc.free_blocks)
        if op == "allocate":
            good, got = outcome(lambda a=arg: alloc.allocate(a), "n=", "blocks")
            held += got if good else []
        else:
            arg = held[arg % len(held)] if held and type(arg) is int else arg  # mostly a block in use
            good, _ = outcome(lambda a=arg: alloc.free(a), "block")
            if good:
                gone = [int(arg)] if np.ndim(arg) == 0 else [int(x) for x in arg]
                held = [h for h in held if h not in gone]
        if not good:
            assert (alloc.num_used, alloc.free_blocks) == before
        assert sorted(alloc.free_blocks + held) == list(range(alloc.num_blocks))


TOKENS = st.sampled_from([1, 2, 2**61, 2**61 + 1, 7])  # 1 and 2**61 (2 and 2**61 + 1) share a hash


@FUZZ
@given(
    prompts=st.lists(st.lists(TOKENS, min_size=1, max_size=9), min_size=1, max_size=6),
    spoil=st.lists(st.tuples(st.integers(0, 8), st.sampled_from([-1, -2, 1.5, True])), max_size=1),
)
def test_the_prefix_index_shares_only_equal_prefixes(prompts, spoil):
    m = PrefixBlockManager(64, 2)
    for i, (at, bad) in enumerate(spoil):
        prompts[i][at % len(prompts[i])] = bad
    for p in prompts:
        ok, seq = outcome(lambda p=p: m.new_sequence(p), "prompt", "token ids")
        if not ok:
            assert any(isinstance(t, (bool, float)) or t < 0 for t in p)
            continue
        for i, block in enumerate(seq.table[: seq.cached_tokens // 2]):
            assert m.content[block][1] == tuple(
                p[2 * i : 2 * i + 2]
            )  # a shared block holds these very tokens
        m.register(seq)


IDS = st.lists(st.integers(0, 63), min_size=1, max_size=8)
BAD_IDS = st.sampled_from(["abc", [1.5, 2.0], [-1, 3], [64], [], [[1, 2], [3]], None, [True]])


@SLOW
@given(
    prompts=st.lists(st.one_of(IDS, IDS, IDS, IDS, IDS, BAD_IDS), min_size=1, max_size=4),
    a=arguments(max_new_tokens=st.integers(1, 3), reuse=st.booleans()),
)
def test_run_request_is_the_greedy_decode_and_leaves_the_pool_whole(prompts, a):
    store = PrefixKVStore(CFG, 24, 4, dtype=torch.float64)
    for p in prompts:
        ok, r = outcome(
            lambda p=p: prefix.run_request(model(), store, p, **a), "prompt", "id", "max_new_tokens", "reuse"
        )
        assert store.manager.num_in_use == 0  # released on success and on refusal alike
        if ok:
            assert (
                r.new_tokens
                == generate(model(), p, int(a["max_new_tokens"]), cache=None).new_tokens[0].tolist()
            )


@FUZZ
@given(
    requests=st.one_of(st.lists(IDS, max_size=5), st.lists(IDS, max_size=5), BAD_IDS),
    a=arguments(
        num_blocks=st.integers(1, 16),
        block_size=st.integers(1, 4),
        output_len=st.integers(0, 3),
        concurrent=st.integers(1, 3),
    ),
)
def test_a_request_stream_is_counted_or_refused(requests, a):
    if isinstance(a["output_len"], int) and a["output_len"] > 100:
        a["output_len"] = 100  # 2**63 generated tokens would take forever, rightly
    ok, r = outcome(
        lambda: prefix.simulate_stream(requests, **a), "requests", "prompt", "token ids", *a, "blocks"
    )
    if ok:
        total = sum(len(x) for x in requests)
        assert r.prompt_tokens == total and 0 <= r.computed_tokens <= total
        assert r.hit_rate == pytest.approx((total - r.computed_tokens) / total if total else 0.0)


# --- generate, the fast path, eviction and the oracle -----------------------------------------------

GENERATE_ARGS = arguments(
    odd={"input_ids": BAD_IDS},
    input_ids=IDS,
    max_new_tokens=st.integers(1, 4),
    cache=st.sampled_from([None, "dynamic", "static", "paged", "int8"]),
    temperature=st.one_of(st.just(0.0), st.just(0.0), st.floats(0.5, 2)),
    top_k=st.one_of(st.none(), st.integers(1, 5)),
    seed=st.one_of(st.none(), st.integers(0, 9)),
    eos_token_id=st.one_of(st.none(), st.none(), st.integers(0, 63)),
    count_flops=st.booleans(),
)


@SLOW
@given(a=GENERATE_ARGS)
def test_generate_is_the_naive_decode_or_refuses(a):
    ok, out = outcome(lambda: generate(model(), **a), *a, "id", "max_seq_len")
    if not ok:
        return
    prompt = torch.as_tensor(a["input_ids"]).reshape(1, -1)
    assert out.tokens.shape[1] <= prompt.shape[1] + int(a["max_new_tokens"])
    assert torch.equal(out.tokens[:, : prompt.shape[1]], prompt)
    assert int(out.tokens.min()) >= 0 and int(out.tokens.max()) < CFG.vocab_size
    assert (out.flops is not None) == bool(a["count_flops"])
    if float(a["temperature"]) == 0 and a["cache"] != "int8" and a["eos_token_id"] is None:
        assert torch.equal(
            out.tokens, generate(model(), a["input_ids"], int(a["max_new_tokens"]), cache=None).tokens
        )


@SLOW
@given(
    a=arguments(
        odd={"input_ids": BAD_IDS},
        input_ids=IDS,
        max_new_tokens=st.integers(1, 4),
        mode=st.sampled_from(["eager", "eager", "eager", "graph", "fast"]),
    )
)
def test_fast_generate_gives_the_tokens_of_generate_or_refuses(a):
    ok, out = outcome(lambda: fast_generate(model(), **a), *a, "id", "max_seq_len")
    if ok:
        assert torch.equal(
            out.tokens, generate(model(), a["input_ids"], int(a["max_new_tokens"]), cache="static").tokens
        )


@SLOW
@given(
    a=arguments(
        odd={"ids": BAD_IDS},
        ids=st.lists(st.integers(0, 63), min_size=2, max_size=10),
        policy=st.sampled_from(["window", "sinks + window", "heavy hitters", "full"]),
        budget=st.integers(2, 12),
        sinks=st.integers(1, 1),
    )
)
def test_token_losses_under_a_budget_are_the_full_losses_when_all_fits_or_refuse(a):
    ids = a.pop("ids")
    ok, cache = outcome(
        lambda: eviction.bounded_cache(config=CFG, batch_size=1, dtype=torch.float64, **a), *a, "bytes"
    )
    if not ok:
        return
    ok, losses = outcome(lambda: eviction.token_losses(model(), ids, cache), "input_ids", "id")
    if ok:
        assert isinstance(ids, list) and all(type(i) is int and 0 <= i < CFG.vocab_size for i in ids)
    if not ok:
        return
    assert losses.shape == (1, len(ids) - 1) and bool(torch.isfinite(losses).all())
    if cache is None or int(a["budget"]) >= len(ids):
        torch.testing.assert_close(losses, eviction.token_losses(model(), ids))


@SLOW
@given(
    kind=st.sampled_from(["static", "dynamic", "paged", "window"]),
    a=arguments(
        odd={"ids": BAD_IDS},
        ids=st.lists(st.integers(0, 63), min_size=1, max_size=8),
        prompt_len=st.one_of(st.none(), st.integers(1, 3)),
        atol=st.floats(0, 1e-3),
    ),
)
def test_the_oracle_passes_every_exact_kind_or_refuses(kind, a):
    cache = BUILDERS[kind](dict(batch_size=1, size=16, dtype=torch.float64, device="cpu"))
    ok, report = outcome(lambda: oracle.check(model(), cache, **a), *a, "input_ids", "id")
    if ok:
        assert report.ok, str(report)


# --- arithmetic: roofline, offloading, devices ----------------------------------------------------


@FUZZ
@given(
    a=arguments(
        config=st.sampled_from(["llama-7b", "llama-3-8b", "smollm2-135m"]),
        context=st.integers(0, 10**6),
        batch_size=st.integers(1, 256),
        bandwidth_bytes_per_s=st.floats(1e9, 1e13),
        peak_flops_per_s=st.one_of(st.none(), st.floats(1e12, 1e15)),
    )
)
def test_the_roofline_is_positive_and_consistent_or_refused(a):
    ok, r = outcome(lambda: roofline.roofline(**a), *a)
    if ok:
        assert r.memory_seconds == r.bytes_per_step / float(a["bandwidth_bytes_per_s"]) > 0
        assert r.tokens_per_s == pytest.approx(
            int(a["batch_size"]) / max(r.memory_seconds, r.compute_seconds)
        )
        assert r.bytes_per_step >= memory.kv_cache_bytes(a["config"], int(a["context"]), int(a["batch_size"]))


@FUZZ
@given(
    a=arguments(
        config=st.sampled_from(["llama-7b", "tiny-gqa"]),
        n_tokens=st.integers(0, 10**5),
        rate=st.floats(1e6, 1e15),
    )
)
def test_offloading_times_are_bytes_or_flops_over_a_rate_or_refused(a):
    config, n, rate = a["config"], a["n_tokens"], a["rate"]
    ok, t = outcome(lambda: offload_seconds(config, n, rate), "config", "n_tokens", "bandwidth")
    if ok:
        assert t == pytest.approx(memory.kv_bytes_per_token(config) * int(n) / float(rate))
    ok, t = outcome(lambda: recompute_seconds(config, n, rate), "config", "n_tokens", "flops_per_s")
    if ok:
        assert t == pytest.approx(prefix.prefill_flops(config, int(n)) / float(rate))


@FUZZ
@given(
    value=st.one_of(
        ODD,
        st.sampled_from(
            [
                "cpu",
                "cuda",
                "cuda:0",
                "gpu",
                "meta",
                "mps",
                "cpu:0",
                "xla",
                torch.device("cpu"),
                torch.device("meta"),
                "CPU",
            ]
        ),
    )
)
def test_a_device_is_one_this_machine_has_or_refused_naming_the_allowed(value):
    ok, dev = outcome(lambda: validate.device("device", value), "allowed: 'cpu', 'meta'")
    if ok and value is not None:
        assert dev.type in ("cpu", "meta") or (dev.type == "cuda" and torch.cuda.is_available())
