"""A fixed list of calls into kvlab's core, each classified: right, clear error, silent wrong, obscure.

Issue 24 asks that every public call either gives the right answer or refuses with a clear error:
a ValueError, TypeError, IndexError, MemoryError or OutOfBlocksError whose message names the
argument. This script runs the same cases every time (no randomness), so the table it prints can be
compared before and after a change, even on an older checkout of the package:

    PYTHONPATH=. python tools/fuzz_report.py                 # the table
    PYTHONPATH=. python tools/fuzz_report.py --show wrong    # the cases that are not right / clear
    PYTHONPATH=. python tools/fuzz_report.py --json out.json # every verdict, to compare two runs

Each case says what a correct package does: *answer* (and a check of the answer), or *refuse*
(and the words its message must contain, usually the argument's name). Verdicts:

- right:        a valid call answered, and the answer passes its check;
- clear error:  an invalid call refused with one of the errors above, naming what it must;
- silent wrong: an invalid call answered, or a valid one answered wrongly;
- obscure:      any other exception (AttributeError, OverflowError, torch's RuntimeError, ...), a
                message that does not name the argument, or a valid call refused;
- n/a:          the API does not exist in the checkout under test (not counted).

The property tests in tests/test_fuzz_core.py cover the same ground with generated inputs; this
list is the reproducible record.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# --- what a case expects ----------------------------------------------------------------------------


@dataclass
class Answer:
    """A valid call: it must return, and `check(result)` must be true."""

    check: Callable = lambda result: True


@dataclass
class Refuse:
    """An invalid call: it must raise a clear error whose message holds every word (any case)."""

    words: tuple[str, ...] = ()


@dataclass
class Either:
    """Answering right (check) and refusing clearly (words) are both correct."""

    check: Callable
    words: tuple[str, ...] = ()


@dataclass
class Case:
    area: str
    name: str
    call: Callable
    expect: Answer | Refuse | Either


class Missing(Exception):
    """The checkout under test has no such API."""


CASES: list[Case] = []


def case(area: str, name: str, call: Callable, expect) -> None:
    CASES.append(Case(area, name, call, expect))


def refuse(*words: str) -> Refuse:
    return Refuse(words)


# --- where the API lives (the cache package moved in this wave: look in both places) ----------------

HOMES = {
    "StaticKVCache": ["kvlab.cache"],
    "DynamicKVCache": ["kvlab.cache"],
    "QuantizedKVCache": ["kvlab.cache"],
    "make_cache": ["kvlab.cache"],
    "PagedKVCache": ["kvlab.cache", "kvlab.paging"],
    "BlockAllocator": ["kvlab.cache", "kvlab.paging"],
    "OutOfBlocksError": ["kvlab.cache", "kvlab.paging"],
    "blocks_needed": ["kvlab.cache", "kvlab.paging"],
    "wasted_slots": ["kvlab.cache.paged", "kvlab.paging"],
    "SlidingWindowKVCache": ["kvlab.cache", "kvlab.window"],
    "HeavyHitterKVCache": ["kvlab.cache", "kvlab.window"],
    "PrefixKVStore": ["kvlab.cache", "kvlab.prefix"],
    "PrefixBlockManager": ["kvlab.cache.prefix", "kvlab.prefix"],
    "prefix_hashes": ["kvlab.cache.prefix", "kvlab.prefix"],
    "paged_waste": ["kvlab.fragmentation", "kvlab.paging"],
    "token_losses": ["kvlab.eviction", "kvlab.window"],
    "attention_maps": ["kvlab.eviction", "kvlab.window"],
    "bounded_cache": ["kvlab.eviction", "kvlab.window"],
    "loss_vs_budget": ["kvlab.eviction", "kvlab.window"],
}


def api(dotted: str):
    """`module:name`, or a bare name looked up in HOMES; Missing when the checkout lacks it."""
    if ":" in dotted:
        module, name = dotted.split(":")
        homes = [module]
    else:
        name, homes = dotted, HOMES[dotted]
    for module in homes:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise Missing(dotted)


def clear_errors() -> tuple[type, ...]:
    try:
        out_of_blocks = (api("OutOfBlocksError"),)
    except Missing:
        out_of_blocks = ()
    return (ValueError, TypeError, IndexError, MemoryError, *out_of_blocks)


# --- shared objects, built once -------------------------------------------------------------------

_SHARED: dict = {}


def cfg():
    return api("kvlab.config:PRESETS")["tiny-gqa"]  # 2 layers, 4 heads, 2 KV heads, head_dim 16, vocab 256


def model():
    if "model" not in _SHARED:
        torch.manual_seed(0)
        _SHARED["model"] = api("kvlab.model:Transformer")(cfg()).eval()
    return _SHARED["model"]


def generate(*args, **kw):
    return api("kvlab.generate:generate")(*args, **kw)


def reference(prompt=(1, 2, 3), n=4):
    """The naive (no cache) greedy tokens: what every exact path must give."""
    key = ("ref", tuple(prompt), n)
    if key not in _SHARED:
        _SHARED[key] = generate(model(), list(prompt), n, cache=None).tokens
    return _SHARED[key]


def same_tokens(result, prompt=(1, 2, 3), n=4) -> bool:
    return torch.equal(result.tokens, reference(prompt, n))


def kv(t=3, batch=1, heads=2, dim=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(t * 100 + heads * 10 + dim)
    return (
        torch.randn(batch, heads, t, dim, generator=g).to(dtype),
        torch.randn(batch, heads, t, dim, generator=g).to(dtype),
    )


CACHE_BUILDERS = {
    "static": lambda: api("StaticKVCache")(cfg(), 1, 16),
    "dynamic": lambda: api("DynamicKVCache")(cfg()),
    "int8": lambda: api("QuantizedKVCache")(cfg(), 1, 16),
    "paged": lambda: api("PagedKVCache")(cfg(), 1, 16),
    "window": lambda: api("SlidingWindowKVCache")(cfg(), 1, 8),
    "prefix": lambda: api("PrefixKVStore")(cfg(), 8, 4).cache_for([1, 2, 3]),
}


def _no_grad(m, *args, **kw):
    with torch.inference_mode():
        return m(*args, **kw)


def released_cache():
    cache = CACHE_BUILDERS["prefix"]()
    cache.release()
    return cache


# --- the cases ------------------------------------------------------------------------------------

BAD_COUNTS = [(0, "0"), (-1, "-1"), (2.5, "2.5"), (True, "True"), ("4", "'4'"), (None, "None")]
BAD_NUMBERS = [
    (math.nan, "nan"),
    (math.inf, "inf"),
    ("0.5", "'0.5'"),
    (True, "True"),
    (None, "None"),
    (10**400, "10**400"),
]


def counts(area, label, make, name, low=1, extra=(), none_ok=False):
    """make(value) for the usual bad counts (those below `low`; None unless none_ok) and `extra`,
    each refused naming `name`."""
    for value, shown in BAD_COUNTS:
        if (type(value) is int and value >= low) or (value is None and none_ok):
            continue  # a valid count for this argument
        case(area, f"{label}({name}={shown})", lambda v=value: make(v), refuse(name))
    for value, shown in extra:
        case(area, f"{label}({name}={shown})", lambda v=value: make(v), refuse(name))


def numbers(area, label, make, name, extra=(), none_ok=False):
    """make(value) for the usual bad numbers (None unless none_ok) and `extra`, each refused naming
    `name`."""
    for value, shown in BAD_NUMBERS + list(extra):
        if value is None and none_ok:
            continue
        case(area, f"{label}({name}={shown})", lambda v=value: make(v), refuse(name))


def config_cases():
    ModelConfig = lambda **kw: api("kvlab.config:ModelConfig")(**{**BASE, **kw})  # noqa: E731
    for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "max_seq_len"):
        counts("config", "ModelConfig", lambda v, k=key: ModelConfig(**{k: v}), key)
        case(
            "config",
            f"ModelConfig({key}=np.int64)",
            lambda k=key: ModelConfig(**{k: np.int64(BASE[k])}),
            Answer(lambda c, k=key: type(getattr(c, k)) is int and getattr(c, k) == BASE[k]),
        )
    counts(
        "config",
        "ModelConfig",
        lambda v: ModelConfig(head_dim=v),
        "head_dim",
        extra=[(3, "3 (odd)")],
        none_ok=True,
    )
    for key in ("rope_theta", "norm_eps"):
        numbers(
            "config",
            "ModelConfig",
            lambda v, k=key: ModelConfig(**{k: v}),
            key,
            extra=[(0, "0"), (-1.0, "-1.0")],
        )
        case(
            "config",
            f"ModelConfig({key}=np.float32)",
            lambda k=key: ModelConfig(**{k: np.float32(0.5)}),
            Answer(lambda c, k=key: getattr(c, k) == 0.5),
        )
    for key in ("tie_embeddings", "qkv_bias"):
        for value in ("no", 2, 0, 1, None, "True"):
            case(
                "config",
                f"ModelConfig({key}={value!r})",
                lambda v=value, k=key: ModelConfig(**{k: v}),
                refuse(key),
            )
        for value in (True, False, np.bool_(True)):
            case(
                "config",
                f"ModelConfig({key}={value!r})",
                lambda v=value, k=key: ModelConfig(**{k: v}),
                Answer(lambda c, v=value, k=key: getattr(c, k) is bool(v)),
            )
    for key in ("n_params", "kv_latent_dim"):
        counts("config", "ModelConfig", lambda v, k=key: ModelConfig(**{k: v}), key, none_ok=True)
    case(
        "config",
        "ModelConfig(n_heads=3) (kv heads 2)",
        lambda: ModelConfig(n_heads=3, head_dim=16),
        refuse("n_heads"),
    )
    case("config", "ModelConfig(d_model=65)", lambda: ModelConfig(d_model=65), refuse("d_model"))
    resolve = lambda v: api("kvlab.config:resolve")(v)  # noqa: E731
    for value in ("nope", 5, None, {"n_layers": 2}):
        case("config", f"resolve({value!r})", lambda v=value: resolve(v), refuse("config"))
    case(
        "config",
        "resolve('LLAMA-2-7B')",
        lambda: resolve("LLAMA-2-7B"),
        Answer(lambda c: c.name == "llama-2-7b"),
    )
    case("config", "with_(n_heads=3)", lambda: cfg().with_(n_heads=3), refuse("n_heads"))


BASE = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=172, vocab_size=256, max_seq_len=512)


def validate_cases():
    number = lambda v, **kw: api("kvlab.validate:number")("x", v, **kw)  # noqa: E731
    integer = lambda v, **kw: api("kvlab.validate:integer")("x", v, **kw)  # noqa: E731
    for value, shown in BAD_NUMBERS + [(-(10**400), "-10**400"), (np.float64("nan"), "np.nan")]:
        case("validate", f"number({shown})", lambda v=value: number(v), refuse("x"))
    case("validate", "number(np.float32(0.5))", lambda: number(np.float32(0.5)), Answer(lambda r: r == 0.5))
    case("validate", "number(np.int64(3))", lambda: number(np.int64(3)), Answer(lambda r: r == 3.0))
    case("validate", "integer(10**400)", lambda: integer(10**400), Answer(lambda r: r == 10**400))
    case(
        "validate",
        "integer(np.int64(3))",
        lambda: integer(np.int64(3)),
        Answer(lambda r: r == 3 and type(r) is int),
    )
    for value, shown in BAD_COUNTS[2:]:
        case("validate", f"integer({shown})", lambda v=value: integer(v), refuse("x"))


def memory_cases():
    m = lambda name: api(f"kvlab.memory:{name}")  # noqa: E731
    L7 = "llama-7b"
    case(
        "memory",
        "kv_cache_bytes(llama-7b, 2048)",
        lambda: m("kv_cache_bytes")(L7, 2048),
        Answer(lambda r: r == 2**30),
    )
    case(
        "memory",
        "kv_cache_bytes(seq_len=np.int64(2048))",
        lambda: m("kv_cache_bytes")(L7, np.int64(2048)),
        Answer(lambda r: r == 2**30),
    )
    case(
        "memory",
        "kv_cache_bytes(seq_len=10**30)",
        lambda: m("kv_cache_bytes")(L7, 10**30),
        Answer(lambda r: r == 2**19 * 10**30),
    )
    counts("memory", "kv_cache_bytes", lambda v: m("kv_cache_bytes")(L7, v), "seq_len", low=0)
    counts("memory", "kv_cache_bytes", lambda v: m("kv_cache_bytes")(L7, 16, v), "batch_size")
    for value in ("fp64", None, 16, ["fp16"]):
        case(
            "memory",
            f"kv_cache_bytes(dtype={value!r})",
            lambda v=value: m("kv_cache_bytes")(L7, 16, 1, v),
            refuse("dtype"),
        )
    for value in ("nope", None, 5):
        case(
            "memory",
            f"kv_cache_bytes(config={value!r})",
            lambda v=value: m("kv_cache_bytes")(v, 16),
            refuse("config"),
        )
    case(
        "memory",
        "kv_bytes_per_token(llama-7b)",
        lambda: m("kv_bytes_per_token")(L7),
        Answer(lambda r: r == 524288),
    )
    case("memory", "param_count('nope')", lambda: m("param_count")("nope"), refuse("config"))
    case("memory", "weight_bytes(dtype='int3')", lambda: m("weight_bytes")(L7, "int3"), refuse("dtype"))
    case("memory", "gpu('V100')", lambda: m("gpu")("V100"), refuse("gpu"))
    case("memory", "gpu(None)", lambda: m("gpu")(None), refuse("gpu"))
    plan = lambda **kw: m("plan")(L7, "A100 80GB", **{"seq_len": 2048, **kw})  # noqa: E731
    for value, shown in [
        ("0.1", "'0.1'"),
        (1, "1"),
        (1.0, "1.0"),
        (-0.1, "-0.1"),
        (math.nan, "nan"),
        (None, "None"),
        (True, "True"),
        (10**400, "10**400"),
    ]:
        case(
            "memory",
            f"plan(reserve_fraction={shown})",
            lambda v=value: plan(reserve_fraction=v),
            refuse("reserve_fraction"),
        )
    case(
        "memory",
        "plan(reserve_fraction=np.float64(0.1))",
        lambda: plan(reserve_fraction=np.float64(0.1)),
        Answer(lambda p: p == plan(reserve_fraction=0.1)),
    )
    counts("memory", "plan", lambda v: plan(seq_len=v), "seq_len")
    counts("memory", "plan", lambda v: plan(batch_size=v), "batch_size")
    counts("memory", "plan", lambda v: plan(context_bytes=v), "context_bytes", low=0)
    case("memory", "plan(weight_dtype='int2')", lambda: plan(weight_dtype="int2"), refuse("dtype"))
    case(
        "memory",
        "require_fit(seq_len=10**9) does not fit",
        lambda: m("require_fit")(L7, "T4 16GB", 10**9),
        refuse("seq_len"),
    )
    case(
        "memory",
        "require_fit fits",
        lambda: m("require_fit")(L7, "A100 80GB", 2048),
        Answer(lambda p: p.fits),
    )
    fb = m_lazy("format_bytes")
    for value, text in [
        (2048, "2.00 KiB"),
        (np.int64(2048), "2.00 KiB"),
        (np.float32(1.5), "1.50 B"),
        (-2048, "-2.00 KiB"),
        (np.uint8(5), "5 B"),
        (0, "0 B"),
    ]:
        case("memory", f"format_bytes({value!r})", lambda v=value: fb()(v), Answer(lambda r, t=text: r == t))
    for value in ("2048", None, math.nan, math.inf, True, [2048]):
        case("memory", f"format_bytes({value!r})", lambda v=value: fb()(v), refuse("n"))
    case("memory", "format_bytes(10**400)", lambda: fb()(10**400), Either(lambda r: "TiB" in r, ("n",)))
    if not torch.cuda.is_available():
        case("memory", "current_gpu() without CUDA", lambda: m("current_gpu")(), refuse("GPU"))


def m_lazy(name):
    return lambda: api(f"kvlab.memory:{name}")


def quant_cases():
    q = lambda name: api(f"kvlab.quant:{name}")  # noqa: E731
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for value, shown in [(3, "3"), (8.5, "8.5"), ("8", "'8'"), (True, "True"), (None, "None"), (16, "16")]:
        case("quant", f"qmax(bits={shown})", lambda v=value: q("qmax")(v), refuse("bits"))
        case(
            "quant", f"quantize(bits={shown})", lambda v=value: q("quantize")(x, "tensor", v), refuse("bits")
        )
    case("quant", "qmax(np.int64(8))", lambda: q("qmax")(np.int64(8)), Answer(lambda r: r == 127))
    for gran in ("tensor", "token", "channel"):
        for bits in (8, 4):
            case(
                "quant",
                f"quantize({gran}, {bits}) round trip",
                lambda g=gran, b=bits: q("quantize")(x, g, b),
                Answer(
                    lambda r: bool(((r.dequantize() - x).abs() <= r.scale.float() / 2 * 1.001 + 1e-8).all())
                ),
            )
    for value, shown, word in [
        ([[1.0, 2.0]], "[[1.0, 2.0]]", "x"),
        (np.ones((2, 2)), "np.ones((2, 2))", "x"),
        (torch.ones(2, 2, dtype=torch.int64), "int64 tensor", "x"),
        (torch.ones(2, 2, dtype=torch.complex64), "complex tensor", "x"),
        (torch.tensor([[1.0, math.nan]]), "NaN", "finite"),
        (torch.tensor([[1.0, math.inf]]), "inf", "finite"),
        (None, "None", "x"),
        ("abc", "'abc'", "x"),
    ]:
        case("quant", f"quantize({shown})", lambda v=value: q("quantize")(v), refuse(word))
    for gran in ("tensor", "token", "channel"):
        case(
            "quant",
            f"quantize(torch.empty(0, 8), {gran})",
            lambda g=gran: q("quantize")(torch.empty(0, 8), g),
            Either(lambda r: r.dequantize().shape == (0, 8), ("x",)),
        )
    case("quant", "quantize(granularity='row')", lambda: q("quantize")(x, "row"), refuse("granularity"))
    case(
        "quant",
        "quantize(1-D, 'token')",
        lambda: q("quantize")(torch.ones(4), "token"),
        refuse("granularity"),
    )
    case(
        "quant", "quantize(granularity=['token'])", lambda: q("quantize")(x, ["token"]), refuse("granularity")
    )
    for value in (torch.int8, "fp16", torch.bool, 5):
        case(
            "quant",
            f"quantize(scale_dtype={value!r})",
            lambda v=value: q("quantize")(x, scale_dtype=v),
            refuse("scale_dtype"),
        )
    case(
        "quant",
        "quantize(scale_dtype=torch.float16)",
        lambda: q("quantize")(x, scale_dtype=torch.float16),
        Answer(lambda r: r.scale.dtype == torch.float16),
    )
    case(
        "quant",
        "dequantize(dtype=torch.int8)",
        lambda: q("quantize")(x).dequantize(torch.int8),
        refuse("dtype"),
    )
    case(
        "quant",
        "fake_quantize(fp16 x)",
        lambda: q("fake_quantize")(x.half()),
        Answer(lambda r: r.dtype == torch.float16 and (r.float() - x).abs().max() < 0.05),
    )
    codes = torch.tensor([[-8, 7, 0, 3]], dtype=torch.int8)
    case(
        "quant",
        "pack_int4 round trip",
        lambda: q("unpack_int4")(q("pack_int4")(codes)),
        Answer(lambda r: torch.equal(r, codes)),
    )
    for value, shown in [
        (torch.tensor([[1, 2, 3]], dtype=torch.int8), "odd last dim"),
        (torch.tensor([[9, 0]], dtype=torch.int8), "code 9"),
        (torch.tensor([[1.0, 2.0]]), "float codes"),
        ([[1, 2]], "a list"),
    ]:
        case("quant", f"pack_int4({shown})", lambda v=value: q("pack_int4")(v), refuse("codes"))
    for value, shown in [(torch.tensor([1.0]), "float"), ([1, 2], "a list")]:
        case("quant", f"unpack_int4({shown})", lambda v=value: q("unpack_int4")(v), refuse("packed"))
    a = torch.tensor([1.0, 2.0, 3.0])
    for metric in ("max_abs_error", "relative_rms_error", "snr_db", "cosine_similarity", "error_report"):
        case("quant", f"{metric}((3, 1) vs (3,))", lambda f=metric: q(f)(a[:, None], a), refuse("shape"))
        case(
            "quant",
            f"{metric}((2, 3) vs (3, 2))",
            lambda f=metric: q(f)(torch.arange(6.0).view(2, 3), torch.arange(6.0).view(3, 2)),
            refuse("shape"),
        )
        case("quant", f"{metric}(list, list)", lambda f=metric: q(f)([1.0, 2.0], [1.0, 2.0]), refuse("x"))
        case(
            "quant",
            f"{metric}(empty, empty)",
            lambda f=metric: q(f)(torch.empty(0), torch.empty(0)),
            refuse("x"),
        )
    case(
        "quant",
        "max_abs_error(a, a + 0.5)",
        lambda: q("max_abs_error")(a, a + 0.5),
        Answer(lambda r: r == 0.5),
    )
    case(
        "quant",
        "relative_rms_error(0, 0)",
        lambda: q("relative_rms_error")(a * 0, a * 0),
        Answer(lambda r: r == 0.0),
    )
    case("quant", "snr_db(a, a)", lambda: q("snr_db")(a, a), Answer(lambda r: r == math.inf))
    case(
        "quant",
        "cosine_similarity(a, 2a)",
        lambda: q("cosine_similarity")(a, 2 * a),
        Answer(lambda r: abs(r - 1) < 1e-6),
    )
    case("quant", "absmax_scale(bits=5)", lambda: q("absmax_scale")(x, "tensor", 5), refuse("bits"))


CACHE_SIZES = {  # constructor, name of its size argument
    "StaticKVCache": ("max_seq_len", lambda size, **kw: api("StaticKVCache")(cfg(), 1, size, **kw)),
    "QuantizedKVCache": ("max_seq_len", lambda size, **kw: api("QuantizedKVCache")(cfg(), 1, size, **kw)),
    "PagedKVCache": ("max_seq_len", lambda size, **kw: api("PagedKVCache")(cfg(), 1, size, **kw)),
    "SlidingWindowKVCache": ("window", lambda size, **kw: api("SlidingWindowKVCache")(cfg(), 1, size, **kw)),
    "HeavyHitterKVCache": ("budget", lambda size, **kw: api("HeavyHitterKVCache")(cfg(), 1, size, **kw)),
    "PrefixKVStore": ("num_blocks", lambda size, **kw: api("PrefixKVStore")(cfg(), size, **kw)),
}


def cache_cases():
    for kind, (size_name, make) in CACHE_SIZES.items():
        counts("cache", kind, lambda v, f=make: f(v), size_name, low=2)
        case("cache", f"{kind}({size_name}=10**12)", lambda f=make: f(10**12), refuse("bytes"))
        case("cache", f"{kind}({size_name}=10**30)", lambda f=make: f(10**30), refuse("bytes"))
        case(
            "cache",
            f"{kind}({size_name}=np.int64(8))",
            lambda f=make: f(np.int64(8)),
            Answer(lambda c: c.config.n_layers == 2),
        )
        for dtype in (torch.int64, torch.bool, "fp16", None):
            case("cache", f"{kind}(dtype={dtype!r})", lambda f=make, d=dtype: f(8, dtype=d), refuse("dtype"))
        case(
            "cache",
            f"{kind}(dtype=torch.float16)",
            lambda f=make: f(8, dtype=torch.float16),
            Answer(lambda c: (c.k.dtype if hasattr(c, "k") else c.dtype) == torch.float16),
        )
        for device, word in (("gpu", "device"), (5, "device"), ("cuda:x", "device")):
            case("cache", f"{kind}(device={device!r})", lambda f=make, d=device: f(8, device=d), refuse(word))
        if not torch.cuda.is_available():
            case(
                "cache",
                f"{kind}(device='cuda') without CUDA",
                lambda f=make: f(8, device="cuda"),
                refuse("device", "cuda"),
            )
        case(
            "cache",
            f"{kind}(device=torch.device('cpu'))",
            lambda f=make: f(8, device=torch.device("cpu")),
            Answer(),
        )
        case("cache", f"{kind}(device='meta')", lambda f=make: f(8, device="meta"), Answer())
    for kind in (
        "StaticKVCache",
        "QuantizedKVCache",
        "PagedKVCache",
        "SlidingWindowKVCache",
        "HeavyHitterKVCache",
    ):
        for value in ("tiny-gqa", "TINY-GQA"):
            case(
                "cache",
                f"{kind}(config={value!r})",
                lambda k=kind, v=value: api(k)(v, 1, 8),
                Answer(lambda c: c.config.n_kv_heads == 2),
            )
        for value in ("nope", None, 5):
            case(
                "cache",
                f"{kind}(config={value!r})",
                lambda k=kind, v=value: api(k)(v, 1, 8),
                refuse("config"),
            )
        counts("cache", kind, lambda v, k=kind: api(k)(cfg(), v, 8), "batch_size")
    case(
        "cache",
        "PrefixKVStore(config='tiny-gqa')",
        lambda: api("PrefixKVStore")("tiny-gqa", 8),
        Answer(lambda s: s.config.n_kv_heads == 2),
    )
    case("cache", "DynamicKVCache(config='nope')", lambda: api("DynamicKVCache")("nope"), refuse("config"))
    quantized = lambda **kw: api("QuantizedKVCache")(cfg(), 1, 16, **kw)  # noqa: E731
    for key, value in [
        ("bits", 3),
        ("bits", "8"),
        ("key_granularity", "row"),
        ("value_granularity", None),
        ("group_size", 0),
        ("group_size", 2.5),
        ("residual", -1),
        ("scale_dtype", torch.int8),
    ]:
        case(
            "cache",
            f"QuantizedKVCache({key}={value!r})",
            lambda k=key, v=value: quantized(**{k: v}),
            refuse(key.replace("key_", "").replace("value_", "")),
        )
    paged = lambda **kw: api("PagedKVCache")(cfg(), 1, 16, **kw)  # noqa: E731
    for key, value in [("block_size", 0), ("block_size", 1.5), ("num_blocks", 0), ("num_blocks", "4")]:
        case("cache", f"PagedKVCache({key}={value!r})", lambda k=key, v=value: paged(**{k: v}), refuse(key))
    window = lambda **kw: api("SlidingWindowKVCache")(cfg(), 1, 8, **kw)  # noqa: E731
    for key, value in [("sinks", -1), ("sinks", 1.5), ("positions", "abs"), ("rollback", -1)]:
        case(
            "cache",
            f"SlidingWindowKVCache({key}={value!r})",
            lambda k=key, v=value: window(**{k: v}),
            refuse(key),
        )
    heavy = lambda **kw: api("HeavyHitterKVCache")(cfg(), 1, 8, **kw)  # noqa: E731
    for key, value in [("recent", 0), ("recent", 8), ("sinks", 7), ("sinks", -1)]:
        case(
            "cache",
            f"HeavyHitterKVCache({key}={value!r})",
            lambda k=key, v=value: heavy(**{k: v}),
            refuse(key),
        )
    make_cache = lambda kind: api("make_cache")(kind, cfg(), 1, 16)  # noqa: E731
    for value in ("int16", 5, None, "Static"):
        case("cache", f"make_cache({value!r})", lambda v=value: make_cache(v), refuse("cache"))
    update_cases()


def stored_as_given(keys, values, positions, k, v, bound) -> bool:
    """Every row update handed back for a new position holds that position's K and V (within bound).
    A cache may hand back more rows than positions (the int8 cache's per-query views): the rows are
    read by their positions (`key_positions`; None: rows 0..S-1 in order), as the model's mask reads them."""
    t = k.shape[2]
    if positions is None:
        positions = torch.arange(keys.shape[2])
    rows = [(i, int(p)) for i, p in enumerate(positions.reshape(-1).tolist()) if p >= 0]
    seen = {p for _, p in rows}
    def close(i: int, p: int) -> bool:
        return bool((keys[:, :, i] - k[:, :, p]).abs().max() <= bound
                    and (values[:, :, i] - v[:, :, p]).abs().max() <= bound)

    return seen >= set(range(t)) and all(close(i, p) for i, p in rows if p < t)


def update_cases():
    for kind, build in CACHE_BUILDERS.items():

        def upd(layer=0, k=None, v=None, b=build):
            cache = b()
            kk, vv = kv()
            return cache.update(layer, kk if k is None else k, vv if v is None else v)

        k3, v3 = kv(3)
        # int8 reads back within scale / 2 (scale: max |x| / 127), every other kind exactly.
        bound = 0.0 if kind != "int8" else max(k3.abs().max(), v3.abs().max()).item() / 127

        def valid(b=build, k=k3, v=v3):
            cache = b()
            keys, values = cache.update(0, k, v)
            return keys, values, cache.key_positions(0)

        case("update", f"{kind}.update valid", valid,
             Answer(lambda r, k=k3, v=v3, b=bound: stored_as_given(*r, k, v, b)))
        for layer in (-1, 2, 1.0, True, "0", None):
            case("update", f"{kind}.update(layer={layer!r})", lambda u=upd, x=layer: u(x), refuse("layer"))
        bad_shapes = {
            "head_dim 8": kv(3, dim=8),
            "heads 4": kv(3, heads=4),
            "batch 2": kv(3, batch=2),
            "no tokens": kv(0),
            "int64": kv(3, dtype=torch.int64),
        }
        for label, (k, v) in bad_shapes.items():
            if kind == "dynamic" and label == "batch 2":
                continue  # a DynamicKVCache takes the batch it is first given
            case("update", f"{kind}.update(k, v: {label})", lambda u=upd, k=k, v=v: u(0, k, v), refuse("k"))
        case(
            "update",
            f"{kind}.update(k of 3, v of 4 tokens)",
            lambda u=upd: u(0, kv(3)[0], kv(4)[1]),
            refuse("v"),
        )
        case(
            "update",
            f"{kind}.update(k as a list)",
            lambda u=upd: u(0, kv(3)[0].tolist(), kv(3)[1]),
            refuse("k"),
        )
        case("update", f"{kind}.update(3-D k)", lambda u=upd: u(0, kv(3)[0][0], kv(3)[1][0]), refuse("k"))

        def crop(n, b=build):
            cache = b()
            with torch.inference_mode():
                model()(torch.tensor([[1, 2, 3, 4]]), cache=cache)
            cache.crop(n)
            return cache

        for n in (-1, 1.5, True, "1", None, 5):
            case("update", f"{kind}.crop({n!r}) of 4", lambda c=crop, n=n: c(n), refuse("n"))
        case(
            "update",
            f"{kind}.crop(np.int64(4)) of 4",
            lambda c=crop: c(np.int64(4)),
            Answer(lambda c: c.seq_len == 4),
        )
    case(
        "update",
        "static.update past max_seq_len",
        lambda: api("StaticKVCache")(cfg(), 1, 2).update(0, *kv(3)),
        refuse("positions"),
    )
    case(
        "update",
        "heavy hitters update without queries",
        lambda: api("HeavyHitterKVCache")(cfg(), 1, 8).update(0, *kv(3)),
        refuse("queries"),
    )
    for label, use in [
        ("update", lambda c: c.update(0, *kv(3))),
        ("crop", lambda c: c.crop(0)),
        ("fork", lambda c: c.fork()),
        ("release", lambda c: c.release()),
        ("finish", lambda c: c.finish([1, 2, 3])),
        ("forward pass", lambda c: _no_grad(model(), torch.tensor([[4]]), cache=c)),
    ]:
        case(
            "update", f"released prefix cache: {label}", lambda u=use: u(released_cache()), refuse("released")
        )


def paging_cases():
    alloc = lambda n=8: api("BlockAllocator")(n)  # noqa: E731
    counts("paging", "BlockAllocator", lambda v: alloc(v), "num_blocks")
    counts("paging", "allocate", lambda v: alloc().allocate(v), "n", low=0)
    case("paging", "allocate(100) of 8", lambda: alloc().allocate(100), refuse("blocks"))
    case(
        "paging",
        "allocate(np.int64(3))",
        lambda: alloc().allocate(np.int64(3)),
        Answer(lambda r: sorted(r) == [0, 1, 2]),
    )

    def free(blocks, take=2):
        a = alloc()
        a.allocate(take)
        a.free(blocks)
        return a

    for value, shown in [
        (None, "None"),
        ("0", "'0'"),
        ([0.0], "[0.0]"),
        (5, "5 (not in use)"),
        ([0, 0], "[0, 0]"),
        (-1, "-1"),
        (1.5, "1.5"),
        (object(), "object()"),
    ]:
        case("paging", f"free({shown})", lambda v=value: free(v), refuse("block"))
    case("paging", "free(np.int64(0))", lambda: free(np.int64(0)), Answer(lambda a: a.num_used == 1))
    case("paging", "free([])", lambda: free([]), Answer(lambda a: a.num_used == 2))
    counts("paging", "blocks_needed", lambda v: api("blocks_needed")(v, 16), "n_tokens", low=0)
    counts("paging", "blocks_needed", lambda v: api("blocks_needed")(10, v), "block_size")
    case("paging", "blocks_needed(33, 16)", lambda: api("blocks_needed")(33, 16), Answer(lambda r: r == 3))
    case("paging", "wasted_slots(33, 16)", lambda: api("wasted_slots")(33, 16), Answer(lambda r: r == 15))
    waste = lambda v, bs=16: api("paged_waste")(v, bs)  # noqa: E731
    for value, shown in [
        ([], "[]"),
        ([1.5], "[1.5]"),
        (["a"], "['a']"),
        ([0], "[0]"),
        ([math.nan], "[nan]"),
        (None, "None"),
        ([True], "[True]"),
    ]:
        case("paging", f"paged_waste({shown})", lambda v=value: waste(v), refuse("seq_lens"))
    case("paging", "paged_waste([16, 8], 16)", lambda: waste([16, 8]), Answer(lambda r: r == 0.25))
    case("paging", "paged_waste(block_size=0)", lambda: waste([16], 0), refuse("block_size"))


def fragmentation_cases():
    f = lambda name: api(f"kvlab.fragmentation:{name}")  # noqa: E731
    counts("fragmentation", "sample_requests", lambda v: f("sample_requests")(v), "n", low=0)
    mix = lambda **kw: f("sample_requests")(10, f("RequestMix")(**kw))  # noqa: E731
    for key, value in [
        ("prompt_median", math.nan),
        ("prompt_median", 0),
        ("output_sigma", -1),
        ("max_len", 1),
        ("max_len", 2.5),
        ("prompt_median", "200"),
    ]:
        case(
            "fragmentation", f"RequestMix({key}={value!r})", lambda k=key, v=value: mix(**{k: v}), refuse(key)
        )
    case(
        "fragmentation",
        "sample_requests(10) sums <= max_len",
        lambda: f("sample_requests")(10),
        Answer(lambda r: bool(((r[0] + r[1]) <= 2048).all() and (r[0] >= 1).all())),
    )
    sim = lambda **kw: f("simulate")(**{"prompt_lens": [10, 20], "output_lens": [5, 5], **kw})  # noqa: E731
    for key, value, word in [
        ("policy", "lru", "policy"),
        ("capacity", 0, "capacity"),
        ("capacity", 10, "capacity"),
        ("max_len", 20, "max_len"),
        ("headroom", -1, "headroom"),
        ("headroom", math.nan, "headroom"),
        ("layout_step", -1, "layout_step"),
        ("output_lens", [5], "output_lens"),
        ("prompt_lens", [1.5, 2], "prompt_lens"),
        ("block_size", 0, "block_size"),
    ]:
        case(
            "fragmentation", f"simulate({key}={value!r})", lambda k=key, v=value: sim(**{k: v}), refuse(word)
        )
    for policy in ("max", "pow2", "exact", "paged"):
        case(
            "fragmentation",
            f"simulate(policy={policy!r}) finishes",
            lambda p=policy: sim(policy=p),
            Answer(
                lambda r: (
                    r.finished == 2
                    and abs(sum(r.fractions().values()) - 1) < 1e-9
                    or r.finished == 2
                    and sum(r.fractions().values()) == 0
                )
            ),
        )


def generate_cases():
    M = model
    for value in ("kvlab-tiny", None, "cfg", 5):
        case(
            "generate",
            f"generate(model={value!r})",
            lambda v=value: generate(cfg() if v == "cfg" else v, [1, 2, 3], 4),
            refuse("model"),
        )
    for ids, shown in [
        ("abc", "'abc'"),
        ([1.5], "[1.5]"),
        ([[1, 2], [3]], "ragged"),
        ([], "[]"),
        ([-1], "[-1]"),
        ([256], "[256]"),
        ([True, False], "[True, False]"),
        (None, "None"),
        (torch.ones(1, 2, 3, dtype=torch.long), "3-D"),
        (5, "5"),
        ([[]], "[[]]"),
    ]:
        case("generate", f"generate(input_ids={shown})", lambda v=ids: generate(M(), v, 4), refuse("id"))
    for ids, shown in [
        (np.array([1, 2, 3]), "np.array"),
        (torch.tensor([1, 2, 3], dtype=torch.int32), "int32"),
        ((1, 2, 3), "a tuple"),
        (torch.tensor([[1, 2, 3]]), "(1, 3) tensor"),
    ]:
        case(
            "generate", f"generate(input_ids={shown})", lambda v=ids: generate(M(), v, 4), Answer(same_tokens)
        )
    counts(
        "generate",
        "generate",
        lambda v: generate(M(), [1, 2, 3], v),
        "max_new_tokens",
        extra=[(10**400, "10**400"), (600, "600 (past max_seq_len)")],
    )
    case(
        "generate",
        "generate(max_new_tokens=np.int64(4))",
        lambda: generate(M(), [1, 2, 3], np.int64(4)),
        Answer(same_tokens),
    )
    for kind in ("dynamic", "static", "paged"):
        case(
            "generate",
            f"generate(cache={kind!r})",
            lambda k=kind: generate(M(), [1, 2, 3], 4, cache=k),
            Answer(same_tokens),
        )
    for kind in ("int8", "int4"):
        case(
            "generate",
            f"generate(cache={kind!r})",
            lambda k=kind: generate(M(), [1, 2, 3], 4, cache=k),
            Answer(lambda r: r.tokens.shape == (1, 7)),
        )
    for value, shown, word in [
        ("int16", "'int16'", "cache"),
        (5, "5", "cache"),
        ("batch2", "a cache of batch 2", "batch"),
        ("short", "a cache too short", "room"),
    ]:

        def with_cache(v=value):
            c = {
                "batch2": lambda: api("StaticKVCache")(cfg(), 2, 32),
                "short": lambda: api("StaticKVCache")(cfg(), 1, 4),
            }.get(v, lambda: v)()
            return generate(M(), [1, 2, 3], 4, cache=c)

        case("generate", f"generate(cache={shown})", with_cache, refuse(word))
    numbers(
        "generate",
        "generate",
        lambda v: generate(M(), [1, 2, 3], 4, temperature=v),
        "temperature",
        extra=[(-1, "-1"), (1e-9, "1e-9")],
    )
    case(
        "generate",
        "generate(temperature=np.float32(0.7), seed=1)",
        lambda: generate(M(), [1, 2, 3], 4, temperature=np.float32(0.7), seed=1),
        Answer(lambda r: torch.equal(r.tokens, generate(M(), [1, 2, 3], 4, temperature=0.7, seed=1).tokens)),
    )
    counts(
        "generate",
        "generate",
        lambda v: generate(M(), [1, 2, 3], 4, temperature=1.0, top_k=v),
        "top_k",
        none_ok=True,
    )
    for value in (-1, 2**63, 1.5, "1", True):
        case(
            "generate",
            f"generate(seed={value!r})",
            lambda v=value: generate(M(), [1, 2, 3], 4, temperature=1.0, seed=v),
            refuse("seed"),
        )
    case(
        "generate",
        "generate(seed=np.int64(7)) twice",
        lambda: generate(M(), [1, 2, 3], 4, temperature=1.0, seed=np.int64(7)),
        Answer(lambda r: torch.equal(r.tokens, generate(M(), [1, 2, 3], 4, temperature=1.0, seed=7).tokens)),
    )
    for value in (256, -1, 1.5, "2"):
        case(
            "generate",
            f"generate(eos_token_id={value!r})",
            lambda v=value: generate(M(), [1, 2, 3], 4, eos_token_id=v),
            refuse("eos_token_id"),
        )
    for mask, shown in [
        ([[1, 1]], "wrong shape"),
        ([[2, 1, 1]], "a 2"),
        ([[1, 1, 0]], "right padding"),
        ([[0, 0, 0]], "all padding"),
        ("abc", "text"),
    ]:
        case(
            "generate",
            f"generate(attention_mask={shown})",
            lambda m=mask: generate(M(), [[1, 2, 3]], 4, attention_mask=m),
            refuse("attention_mask"),
        )
    case(
        "generate",
        "generate(attention_mask=[[0, 1, 1]])",
        lambda: generate(M(), [[9, 2, 3]], 4, attention_mask=[[0, 1, 1]]),
        Answer(lambda r: torch.equal(r.tokens[:, 1:], generate(M(), [2, 3], 4).tokens)),
    )
    for value in ("no", 2, None):
        case(
            "generate",
            f"generate(count_flops={value!r})",
            lambda v=value: generate(M(), [1, 2, 3], 4, count_flops=v),
            refuse("count_flops"),
        )
    case(
        "generate",
        "generate(count_flops=True)",
        lambda: generate(M(), [1, 2, 3], 4, count_flops=True),
        Answer(lambda r: r.flops > 0 and same_tokens(r)),
    )
    for value in (5, "print"):
        case(
            "generate",
            f"generate(on_token={value!r})",
            lambda v=value: generate(M(), [1, 2, 3], 4, on_token=v),
            refuse("on_token"),
        )


def fast_cases():
    fg = lambda *a, **kw: api("kvlab.fast:fast_generate")(*a, **kw)  # noqa: E731
    FastDecoder = lambda *a: api("kvlab.fast:FastDecoder")(*a)  # noqa: E731
    M = model
    case("fast", "fast_generate valid", lambda: fg(M(), [1, 2, 3], 4), Answer(same_tokens))
    for value in ("kvlab-tiny", None):
        case("fast", f"fast_generate(model={value!r})", lambda v=value: fg(v, [1, 2, 3], 4), refuse("model"))
    for value in ("cuda-graph", None, 5):
        case(
            "fast",
            f"fast_generate(mode={value!r})",
            lambda v=value: fg(M(), [1, 2, 3], 4, mode=v),
            refuse("mode"),
        )
    if not torch.cuda.is_available():
        case(
            "fast",
            "fast_generate(mode='graph') on the CPU",
            lambda: fg(M(), [1, 2, 3], 4, mode="graph"),
            refuse("graph"),
        )
    numbers("fast", "fast_generate", lambda v: fg(M(), [1, 2, 3], 4, temperature=v), "temperature")
    case("fast", "fast_generate(ids=[1.5])", lambda: fg(M(), [1.5], 4), refuse("id"))
    case("fast", "fast_generate(max_new_tokens=0)", lambda: fg(M(), [1, 2, 3], 0), refuse("max_new_tokens"))
    case(
        "fast",
        "fast_generate(decoder of batch 2)",
        lambda: fg(M(), [1, 2, 3], 4, decoder=FastDecoder(M(), 2, 8)),
        refuse("decoder"),
    )
    case("fast", "fast_generate(decoder=5)", lambda: fg(M(), [1, 2, 3], 4, decoder=5), refuse("decoder"))
    case("fast", "fast_generate(step_fn=5)", lambda: fg(M(), [1, 2, 3], 4, step_fn=5), refuse("step_fn"))
    case(
        "fast",
        "fast_generate(reused decoder)",
        lambda: fg(M(), [1, 2, 3], 4, decoder=FastDecoder(M(), 1, 16)),
        Answer(same_tokens),
    )
    counts("fast", "FastDecoder", lambda v: FastDecoder(M(), v, 8), "batch_size")
    counts(
        "fast",
        "FastDecoder",
        lambda v: FastDecoder(M(), 1, v),
        "max_seq_len",
        extra=[(10**6, "10**6 (past the model's)")],
    )
    case("fast", "FastDecoder(model='kvlab-tiny')", lambda: FastDecoder("kvlab-tiny", 1, 8), refuse("model"))
    case(
        "fast",
        "make_step(mode='fast')",
        lambda: api("kvlab.fast:make_step")(FastDecoder(M(), 1, 8), "fast"),
        refuse("mode"),
    )


def prefix_cases():
    p = lambda name: api(f"kvlab.prefix:{name}")  # noqa: E731
    store = lambda n=8: api("PrefixKVStore")(cfg(), n, 4)  # noqa: E731
    run = lambda prompt, n=2, **kw: p("run_request")(model(), store(), prompt, n, **kw)  # noqa: E731
    for prompt, shown, word in [
        ("123", "'123'", "prompt"),
        ([72.9, 105.5], "[72.9, 105.5]", "prompt"),
        ([-1, 2], "[-1, 2]", "prompt"),
        ([300], "[300]", "id"),
        ([], "[]", "prompt"),
        (torch.tensor([1.0, 2.0]), "a float tensor", "prompt"),
        (None, "None", "prompt"),
        ([True, 2], "[True, 2]", "prompt"),
    ]:
        case("prefix", f"run_request(prompt={shown})", lambda v=prompt: run(v), refuse(word))
    counts("prefix", "run_request", lambda v: run([1, 2, 3], v), "max_new_tokens")
    for key, value in [("reuse", "no"), ("keep", "yes"), ("reuse", None)]:
        case(
            "prefix",
            f"run_request({key}={value!r})",
            lambda k=key, v=value: run([1, 2, 3], **{k: v}),
            refuse(key),
        )
    case(
        "prefix",
        "run_request(model='kvlab-tiny')",
        lambda: p("run_request")("kvlab-tiny", store(), [1, 2, 3], 2),
        refuse("model"),
    )
    case(
        "prefix",
        "run_request(store=None)",
        lambda: p("run_request")(model(), None, [1, 2, 3], 2),
        refuse("store"),
    )

    def after_refusals():
        s = store(8)
        for bad in ([72.9] * 9, [300] * 9, [-1] * 9, [1] * 9 + [999]):
            try:
                p("run_request")(model(), s, bad, 2)
            except Exception:  # noqa: BLE001 - each is refused; the pool must be whole afterwards
                pass
        return p("run_request")(model(), s, list(range(1, 25)), 2)

    case(
        "prefix",
        "a valid request after four refused ones",
        after_refusals,
        Answer(
            lambda r: (
                r.new_tokens == generate(model(), list(range(1, 25)), 2, cache=None).tokens[0, 24:].tolist()
            )
        ),
    )

    def twice():
        s = store(16)
        first = p("run_request")(model(), s, list(range(1, 14)), 3)
        second = p("run_request")(model(), s, list(range(1, 14)), 3)
        return first, second

    case(
        "prefix",
        "the same request twice reuses the prefix",
        twice,
        Answer(lambda r: r[0].new_tokens == r[1].new_tokens and r[1].cached_tokens == 12),
    )

    def collide():
        m = api("PrefixBlockManager")(8, 2)
        seq = m.new_sequence([1, 1, 5])
        m.register(seq)
        return m.match([2**61, 2**61, 5])  # hash(2**61) == hash(1): a different prompt

    case("prefix", "match([2**61, 2**61]) after [1, 1]", collide, Answer(lambda r: r == []))
    case(
        "prefix",
        "new_sequence([-1, -1, 5])",
        lambda: api("PrefixBlockManager")(8, 2).new_sequence([-1, -1, 5]),
        refuse("prompt"),
    )
    case(
        "prefix", "prefix_hashes(block_size=0)", lambda: api("prefix_hashes")([1, 2], 0), refuse("block_size")
    )
    counts("prefix", "sharing", lambda v: p("sharing")(v, 32, 8), "users")
    counts("prefix", "sharing", lambda v: p("sharing")(2, 32, 8, v), "block_size")
    case(
        "prefix",
        "sharing(config='llama-7b')",
        lambda: p("sharing")(2, 32, 8, 16, "llama-7b"),
        Answer(lambda r: r.bytes_shared == r.blocks_shared * 16 * 524288),
    )
    case("prefix", "sharing(config='nope')", lambda: p("sharing")(2, 32, 8, 16, "nope"), refuse("config"))
    case(
        "prefix",
        "prefill_flops('llama-7b', 10)",
        lambda: p("prefill_flops")("llama-7b", 10),
        Answer(lambda r: r == p("prefill_flops")(api("kvlab.config:PRESETS")["llama-7b"], 10)),
    )
    counts("prefix", "prefill_flops", lambda v: p("prefill_flops")(cfg(), v), "n_tokens", low=0)
    counts("prefix", "sample_stream", lambda v: p("sample_stream")(v), "n_requests")
    counts("prefix", "sample_stream", lambda v: p("sample_stream")(2, v), "n_prefixes")
    for key, value in [
        ("skew", math.nan),
        ("skew", -1),
        ("seed", -1),
        ("seed", "a"),
        ("vocab", 0),
        ("vocab", 1.5),
        ("prefix_len", -1),
        ("suffix_len", 0),
    ]:
        case(
            "prefix",
            f"sample_stream({key}={value!r})",
            lambda k=key, v=value: p("sample_stream")(2, **{k: v}),
            refuse(key),
        )
    case(
        "prefix",
        "sample_stream(3) lengths",
        lambda: p("sample_stream")(3, prefix_len=8, suffix_len=2),
        Answer(lambda r: len(r) == 3 and all(len(x) == 10 for x in r)),
    )
    ss = lambda *a, **kw: p("simulate_stream")(*a, **kw)  # noqa: E731
    for value, shown, word in [
        ([1, 2, 3], "[1, 2, 3]", "requests"),
        ("abc", "'abc'", "requests"),
        ([[1.5]], "[[1.5]]", "prompt"),
        ([[]], "[[]]", "prompt"),
        ([[-1, 2]], "[[-1, 2]]", "prompt"),
        (None, "None", "requests"),
        (5, "5", "requests"),
    ]:
        case("prefix", f"simulate_stream({shown}, 8)", lambda v=value: ss(v, 8), refuse(word))
    for key, value in [("num_blocks", 0), ("block_size", 0), ("concurrent", 0), ("output_len", -1)]:
        kw = {"num_blocks": 8, key: value}
        case("prefix", f"simulate_stream({key}={value!r})", lambda kw=kw: ss([[1, 2]], **kw), refuse(key))
    case(
        "prefix",
        "simulate_stream(a request larger than the pool)",
        lambda: ss([[1] * 40], 1),
        refuse("blocks"),
    )
    case(
        "prefix",
        "simulate_stream(two equal requests)",
        lambda: ss([list(range(33))] * 2, 8),
        Answer(lambda r: r.hit_rate == 32 / 66 and r.prompt_tokens == 66),
    )


def eviction_cases():
    M = model
    tl = lambda *a, **kw: api("token_losses")(*a, **kw)  # noqa: E731
    for ids, shown in [
        ([72.9, 105.5], "[72.9, 105.5]"),
        ("ab", "'ab'"),
        ([300, 1], "[300, 1]"),
        ([-1, 1], "[-1, 1]"),
        ([[1, 2], [3]], "ragged"),
    ]:
        case("eviction", f"token_losses({shown})", lambda v=ids: tl(M(), v), refuse("id"))
        case(
            "eviction", f"attention_maps({shown})", lambda v=ids: api("attention_maps")(M(), v), refuse("id")
        )
    case(
        "eviction",
        "token_losses([1, 2, 3])",
        lambda: tl(M(), [1, 2, 3]),
        Answer(lambda r: r.shape == (1, 2) and bool(torch.isfinite(r).all())),
    )
    case("eviction", "token_losses(model='kvlab-tiny')", lambda: tl("kvlab-tiny", [1, 2, 3]), refuse("model"))
    for value in (5, "static"):
        case(
            "eviction",
            f"token_losses(cache={value!r})",
            lambda v=value: tl(M(), [1, 2, 3], cache=v),
            refuse("cache"),
        )
    case(
        "eviction",
        "token_losses(a full window = the plain model)",
        lambda: tl(M(), [1, 2, 3, 4], cache=api("SlidingWindowKVCache")(cfg(), 1, 8)),
        Answer(lambda r: torch.allclose(r, tl(M(), [1, 2, 3, 4]), atol=1e-5)),
    )
    case(
        "eviction",
        "attention_maps([1, 2, 3]) rows sum to 1",
        lambda: api("attention_maps")(M(), [1, 2, 3]),
        Answer(lambda maps: len(maps) == 2 and all(torch.allclose(m.sum(-1), torch.ones(1)) for m in maps)),
    )
    bc = lambda *a, **kw: api("bounded_cache")(*a, **kw)  # noqa: E731
    case("eviction", "bounded_cache('lru')", lambda: bc("lru", cfg(), 1, 8), refuse("policy"))
    for policy in ("window", "sinks + window", "heavy hitters"):
        case(
            "eviction",
            f"bounded_cache({policy!r}, 'tiny-gqa')",
            lambda pol=policy: bc(pol, "tiny-gqa", 1, 8),
            Answer(lambda c: c.config.n_kv_heads == 2),
        )
    case("eviction", "bounded_cache('full')", lambda: bc("full", cfg(), 1, 8), Answer(lambda c: c is None))
    counts("eviction", "bounded_cache", lambda v: bc("window", cfg(), 1, v), "budget", low=2)
    case(
        "eviction",
        "bounded_cache(sinks=budget)",
        lambda: bc("sinks + window", cfg(), 1, 8, sinks=8),
        refuse("sinks"),
    )
    lvb = lambda *a, **kw: api("loss_vs_budget")(M(), [[1, 2, 3, 4, 5, 6]], *a, **kw)  # noqa: E731
    case("eviction", "loss_vs_budget(budgets=[1])", lambda: lvb([1]), refuse("budget"))
    case("eviction", "loss_vs_budget(budgets=5)", lambda: lvb(5), refuse("budgets"))
    case("eviction", "loss_vs_budget(policies=['lru'])", lambda: lvb([4], policies=["lru"]), refuse("policy"))
    case(
        "eviction",
        "loss_vs_budget(budgets=[8]) = full",
        lambda: lvb([8], policies=("full", "window")),
        Answer(lambda r: torch.allclose(r["full"][0], r["window"][0], atol=1e-5)),
    )


def model_cases():
    M = model
    T = lambda c: api("kvlab.model:Transformer")(c)  # noqa: E731
    for value in ("nope", None, 5):
        case("model", f"Transformer({value!r})", lambda v=value: T(v), refuse("config"))
    case("model", "Transformer('tiny-mha')", lambda: T("tiny-mha"), Answer(lambda m: m.config.n_heads == 4))
    case("model", "Transformer(deepseek-v2: MLA)", lambda: T("deepseek-v2"), refuse("kv_latent_dim"))
    for ids, shown in [
        (torch.tensor([[1.0]]), "float"),
        ([[1, 2]], "a list"),
        (torch.tensor([1, 2]), "1-D"),
        (torch.tensor([[256]]), "256"),
        (torch.zeros(1, 0, dtype=torch.long), "empty"),
    ]:
        case("model", f"forward({shown})", lambda v=ids: M()(v), refuse("id"))
    for mask, shown in [
        (torch.zeros(1, 3), "all padding"),
        (torch.tensor([[1, 1, 0]]), "right padding"),
        (torch.ones(1, 2), "wrong shape"),
        ([[1, 1, 1]], "a list"),
        (torch.tensor([[0, 2, 1]]), "a 2"),
    ]:
        case(
            "model",
            f"forward(attention_mask={shown})",
            lambda m=mask: M()(torch.tensor([[1, 2, 3]]), attention_mask=m),
            refuse("attention_mask"),
        )
    for value in (5, "static"):
        case(
            "model",
            f"forward(cache={value!r})",
            lambda v=value: M()(torch.tensor([[1, 2, 3]]), cache=v),
            refuse("cache"),
        )
    case(
        "model",
        "forward(513 tokens)",
        lambda: M()(torch.ones(1, 513, dtype=torch.long)),
        refuse("max_seq_len"),
    )


def oracle_cases():
    check = lambda *a, **kw: api("kvlab.oracle:check")(*a, **kw)  # noqa: E731
    static = lambda: api("StaticKVCache")(cfg(), 1, 16)  # noqa: E731
    ids = [1, 2, 3, 4, 5, 6]
    M = model
    case("oracle", "check(static) passes", lambda: check(M(), static(), ids), Answer(lambda r: r.ok))
    case(
        "oracle",
        "check(int8, exact tolerances) fails",
        lambda: check(M(), api("QuantizedKVCache")(cfg(), 1, 16), ids),
        Answer(lambda r: not r.ok),
    )
    for kind in ("window", "paged", "dynamic"):
        case(
            "oracle",
            f"check({kind}) passes",
            lambda k=kind: check(M(), CACHE_BUILDERS[k](), ids),
            Answer(lambda r: r.ok),
        )
    case("oracle", "check(cache=5)", lambda: check(M(), 5, ids), refuse("cache"))
    case("oracle", "check(model='kvlab-tiny')", lambda: check("kvlab-tiny", static(), ids), refuse("model"))
    for value, shown in [
        ([1.5, 2.5], "[1.5, 2.5]"),
        ("abc", "'abc'"),
        ([300, 1], "[300, 1]"),
        ([], "[]"),
        ([[1, 2], [3]], "ragged"),
        (None, "None"),
    ]:
        case("oracle", f"check(ids={shown})", lambda v=value: check(M(), static(), v), refuse("id"))
    for value in (0, 100, 1.5, "2", True):
        case(
            "oracle",
            f"check(prompt_len={value!r})",
            lambda v=value: check(M(), static(), ids, v),
            refuse("prompt_len"),
        )
    for key in ("atol", "rtol"):
        for value in (math.nan, -1, "0", 10**400):
            case(
                "oracle",
                f"check({key}={value!r})",
                lambda k=key, v=value: check(M(), static(), ids, **{k: v}),
                refuse(key),
            )
    case(
        "oracle",
        "check(attention_mask of another shape)",
        lambda: check(M(), static(), ids, attention_mask=[[1, 1]]),
        refuse("attention_mask"),
    )
    case(
        "oracle",
        "check(more tokens than the cache holds)",
        lambda: check(M(), api("StaticKVCache")(cfg(), 1, 4), ids),
        refuse("positions"),
    )
    case(
        "oracle",
        "check(a cache of batch 2)",
        lambda: check(M(), api("StaticKVCache")(cfg(), 2, 16), ids),
        refuse("batch"),
    )
    case("oracle", "Oracle.crop(-1)", lambda: api("kvlab.oracle:Oracle")(M(), static()).crop(-1), refuse("n"))


def roofline_cases():
    r = lambda name: api(f"kvlab.roofline:{name}")  # noqa: E731
    L7 = lambda: api("kvlab.config:PRESETS")["llama-7b"]  # noqa: E731
    for fn in ("decode_step_bytes", "decode_step_flops"):
        case(
            "roofline",
            f"{fn}('llama-7b', 16)",
            lambda f=fn: r(f)("llama-7b", 16),
            Answer(lambda v, f=fn: v == r(f)(L7(), 16)),
        )
        counts("roofline", fn, lambda v, f=fn: r(f)(L7(), v), "context", low=0)
        counts("roofline", fn, lambda v, f=fn: r(f)(L7(), 16, v), "batch_size")
        case("roofline", f"{fn}(config='nope')", lambda f=fn: r(f)("nope", 16), refuse("config"))
    case(
        "roofline",
        "decode_step_bytes(dtype='fp64')",
        lambda: r("decode_step_bytes")(L7(), 16, 1, "fp64"),
        refuse("dtype"),
    )
    case(
        "roofline",
        "forward_flops('llama-7b', 4)",
        lambda: r("forward_flops")("llama-7b", 4),
        Answer(lambda v: v == r("forward_flops")(L7(), 4)),
    )
    counts("roofline", "forward_flops", lambda v: r("forward_flops")(L7(), v), "fed")
    case(
        "roofline",
        "forward_flops(fed=4, context=2)",
        lambda: r("forward_flops")(L7(), 4, 2),
        refuse("context"),
    )
    roof = lambda *a, **kw: r("roofline")(L7(), *a, **kw)  # noqa: E731
    numbers("roofline", "roofline", lambda v: roof(v), "bandwidth", extra=[(0, "0"), (-1.0, "-1.0")])
    numbers(
        "roofline",
        "roofline",
        lambda v: roof(2e12, peak_flops_per_s=v),
        "peak_flops_per_s",
        extra=[(0, "0")],
        none_ok=True,
    )
    case(
        "roofline",
        "roofline(llama-7b, 2e12)",
        lambda: roof(2e12),
        Answer(lambda v: v.bound == "memory" and 0 < v.tokens_per_s < 1e4),
    )
    case(
        "roofline",
        "roofline(bandwidth=np.float64)",
        lambda: roof(np.float64(2e12)),
        Answer(lambda v: v == roof(2e12)),
    )
    case("roofline", "ridge_point(0, 1)", lambda: r("ridge_point")(0, 1), refuse("peak_flops_per_s"))
    case(
        "roofline",
        "ridge_point(312e12, 2e12)",
        lambda: r("ridge_point")(312e12, 2e12),
        Answer(lambda v: v == 156.0),
    )
    case(
        "roofline",
        "memory_bound_batch(context=-1)",
        lambda: r("memory_bound_batch")(L7(), 1e12, 1e12, -1),
        refuse("context"),
    )
    case(
        "roofline",
        "memory_bound_batch('llama-7b')",
        lambda: r("memory_bound_batch")("llama-7b", 312e12, 2e12),
        Answer(lambda v: v == r("memory_bound_batch")(L7(), 312e12, 2e12)),
    )
    for value in (-1, "1", math.nan):
        case(
            "roofline",
            f"achieved_fraction(tokens_per_s={value!r})",
            lambda v=value: r("achieved_fraction")(L7(), v, 2e12, 16),
            refuse("tokens_per_s"),
        )


def offload_cases():
    o = lambda name: api(f"kvlab.offload:{name}")  # noqa: E731
    case(
        "offload",
        "offload_seconds('llama-7b', 10, 32e9)",
        lambda: o("offload_seconds")("llama-7b", 10, 32e9),
        Answer(lambda v: v == 524288 * 10 / 32e9),
    )
    case(
        "offload",
        "recompute_seconds('llama-7b', 10, 1e12)",
        lambda: o("recompute_seconds")("llama-7b", 10, 1e12),
        Answer(lambda v: v > 0),
    )
    counts("offload", "offload_seconds", lambda v: o("offload_seconds")(cfg(), v, 32e9), "n_tokens", low=0)
    numbers(
        "offload",
        "offload_seconds",
        lambda v: o("offload_seconds")(cfg(), 10, v),
        "bandwidth",
        extra=[(0, "0")],
    )
    numbers(
        "offload",
        "recompute_seconds",
        lambda v: o("recompute_seconds")(cfg(), 10, v),
        "flops_per_s",
        extra=[(0, "0")],
    )
    counts(
        "offload", "recompute_seconds", lambda v: o("recompute_seconds")(cfg(), v, 1e12), "n_tokens", low=0
    )


def env_cases():
    e = lambda name: api(f"kvlab.env:{name}")  # noqa: E731
    for value in (0, "2", 1.5, True):
        case("env", f"setup(threads={value!r})", lambda v=value: e("setup")(v), refuse("threads"))
    for value in ("gpu", 5, "cuda:x"):
        case(
            "env", f"available_memory({value!r})", lambda v=value: e("available_memory")(v), refuse("device")
        )
    case(
        "env",
        "available_memory('cpu')",
        lambda: e("available_memory")("cpu"),
        Answer(lambda v: v is None or v > 0),
    )
    load = lambda **kw: api("kvlab.pretrained:load")(**kw)  # noqa: E731
    for value in ("gpu", 5):
        case("env", f"pretrained.load(device={value!r})", lambda v=value: load(device=v), refuse("device"))
    if not torch.cuda.is_available():
        case(
            "env",
            "pretrained.load(device='cuda') without CUDA",
            lambda: load(device="cuda"),
            refuse("device", "cuda"),
        )
    case("env", "pretrained.load('kvlab-huge')", lambda: load(name="kvlab-huge"), refuse("name"))
    case("env", "pretrained.load(dtype='fp64')", lambda: load(dtype="fp64"), refuse("dtype"))


def gqa_attention_cases():
    g = lambda name: api(f"kvlab.gqa:{name}")  # noqa: E731
    a = lambda name: api(f"kvlab.attention:{name}")  # noqa: E731
    case("gqa", "kv_head_of(5, 8, 2)", lambda: g("kv_head_of")(5, 8, 2), Answer(lambda r: r == 1))
    for args, word in [
        ((8, 8, 2), "query_head"),
        ((-1, 8, 2), "query_head"),
        ((0, 8, 3), "n_kv_heads"),
        ((1.0, 8, 2), "query_head"),
        ((0, 8, 0), "n_kv_heads"),
    ]:
        case("gqa", f"kv_head_of{args}", lambda x=args: g("kv_head_of")(*x), refuse(word))
    case("gqa", "kv_groups(4, 2)", lambda: g("kv_groups")(4, 2), Answer(lambda r: r == [[0, 1], [2, 3]]))
    case("gqa", "kv_groups(4, 3)", lambda: g("kv_groups")(4, 3), refuse("n_kv_heads"))
    case(
        "gqa",
        "variants('llama-2-7b')",
        lambda: g("variants")("llama-2-7b"),
        Answer(lambda r: all(c.n_heads == 32 for c in r.values())),
    )
    case("gqa", "mha_ratio('llama-2-70b')", lambda: g("mha_ratio")("llama-2-70b"), Answer(lambda r: r == 8))
    case(
        "gqa",
        "mha_to_gqa(tiny-mha, 2)",
        lambda: g("mha_to_gqa")(api("kvlab.model:Transformer")("tiny-mha"), 2),
        Answer(lambda m: m.config.n_kv_heads == 2),
    )
    for value in (3, 0, 2.0, "2"):
        case(
            "gqa",
            f"mha_to_gqa(n_kv_heads={value!r})",
            lambda v=value: g("mha_to_gqa")(api("kvlab.model:Transformer")("tiny-mha"), v),
            refuse("n_kv_heads"),
        )
    case("gqa", "mha_to_gqa(model='tiny-mha')", lambda: g("mha_to_gqa")("tiny-mha", 2), refuse("model"))
    case(
        "gqa",
        "pool_kv_heads(weight of 3 heads, 2)",
        lambda: g("pool_kv_heads")(torch.ones(3 * 16, 8), 2, 16),
        refuse("n_kv_heads"),
    )
    for args, word in [((4, 2), "k_len"), ((2.5, 4), "q_len"), ((-1, 4), "q_len"), ((1, "4"), "k_len")]:
        case("attention", f"causal_mask{args}", lambda x=args: a("causal_mask")(*x), refuse(word))
    case(
        "attention",
        "causal_mask(0, 4)",
        lambda: a("causal_mask")(0, 4),
        Either(lambda m: m.shape == (0, 4), ("q_len",)),
    )
    case(
        "attention",
        "causal_mask(2, 4)",
        lambda: a("causal_mask")(2, 4),
        Answer(lambda m: m.tolist() == [[True, True, True, False], [True, True, True, True]]),
    )
    case(
        "attention", "repeat_kv(n_rep=0)", lambda: a("repeat_kv")(torch.ones(1, 2, 3, 4), 0), refuse("n_rep")
    )
    case(
        "attention",
        "attention(q, k of another head_dim)",
        lambda: a("attention")(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8)),
        refuse("head_dim"),
    )
    t = api_lazy("kvlab.trace:record")
    case(
        "trace",
        "record(tiny, [1, 2, 3], 2)",
        lambda: t()(model(), [1, 2, 3], 2),
        Answer(lambda r: len(r) == 2),
    )
    for prompt, shown in [("abc", "'abc'"), ([1.5], "[1.5]"), ([300], "[300]")]:
        case("trace", f"record(prompt={shown})", lambda v=prompt: t()(model(), v, 2), refuse("id"))
    case("trace", "record(max_new_tokens=0)", lambda: t()(model(), [1, 2], 0), refuse("max_new_tokens"))
    case("trace", "record(model='kvlab-tiny')", lambda: t()("kvlab-tiny", [1, 2], 2), refuse("model"))


def api_lazy(dotted):
    return lambda: api(dotted)


def numpy_scalar_cases():
    """Small NumPy integers are valid counts, but arithmetic in their own dtype wraps around:
    np.uint8(200) * 2 is 144. The validated Python int must be the one computed with."""
    u8 = np.uint8(200)
    L7 = lambda: api("kvlab.config:PRESETS")["llama-7b"]  # noqa: E731
    sharing, flops = api_lazy("kvlab.prefix:sharing"), api_lazy("kvlab.roofline:decode_step_flops")
    roof = api_lazy("kvlab.roofline:roofline")
    case(
        "numpy",
        "sharing(users=np.uint8(200))",
        lambda: sharing()(u8, 32, 8),
        Answer(lambda r: r == sharing()(200, 32, 8)),
    )
    case(
        "numpy",
        "offload_seconds(n_tokens=np.uint8(200))",
        lambda: api("kvlab.offload:offload_seconds")("llama-7b", u8, 32e9),
        Answer(lambda r: r == 524288 * 200 / 32e9),
    )
    case(
        "numpy",
        "decode_step_flops(context=np.uint8(200), batch_size=np.uint8(200))",
        lambda: flops()(L7(), u8, u8),
        Answer(lambda r: r == flops()(L7(), 200, 200)),
    )
    case(
        "numpy",
        "roofline(batch_size=np.uint8(200))",
        lambda: roof()(L7(), 2e12, 16, u8),
        Answer(lambda r: r == roof()(L7(), 2e12, 16, 200)),
    )
    case(
        "numpy",
        "kv_cache_bytes(seq_len=np.uint8(200), batch_size=np.uint8(200))",
        lambda: api("kvlab.memory:kv_cache_bytes")("llama-7b", u8, u8),
        Answer(lambda r: r == 524288 * 200 * 200),
    )
    case(
        "numpy",
        "prefix.sample_stream(prefix_len=np.uint8(200))",
        lambda: api("kvlab.prefix:sample_stream")(2, prefix_len=u8, suffix_len=np.uint8(100)),
        Answer(lambda r: [len(x) for x in r] == [300, 300]),
    )
    case(
        "numpy",
        "blocks_needed(np.uint8(200), np.uint8(16))",
        lambda: api("blocks_needed")(u8, np.uint8(16)),
        Answer(lambda r: r == 13),
    )
    case(
        "numpy",
        "StaticKVCache(batch_size=np.uint8(2), max_seq_len=np.uint8(200))",
        lambda: api("StaticKVCache")(cfg(), np.uint8(2), u8),
        Answer(lambda c: c.k.shape == (2, 2, 2, 200, 16)),
    )


def all_cases() -> list[Case]:
    if not CASES:
        for build in (
            validate_cases,
            config_cases,
            memory_cases,
            quant_cases,
            cache_cases,
            paging_cases,
            fragmentation_cases,
            generate_cases,
            fast_cases,
            prefix_cases,
            eviction_cases,
            model_cases,
            oracle_cases,
            roofline_cases,
            offload_cases,
            env_cases,
            gqa_attention_cases,
            numpy_scalar_cases,
        ):
            build()
    return CASES


# --- running and classifying ------------------------------------------------------------------------

VERDICTS = ("right", "clear error", "silent wrong", "obscure")


def classify(c: Case, clear: tuple[type, ...]) -> tuple[str, str]:
    """(verdict, what happened)."""
    threads = torch.get_num_threads()
    try:
        result = c.call()
    except Missing as missing:
        return "n/a", f"no {missing}"
    except Exception as err:  # noqa: BLE001 - classifying every exception is the point
        text = f"{type(err).__name__}: {str(err)[:160]}"
        if isinstance(c.expect, Answer):
            return "obscure", "refused a valid call: " + text
        named = all(w.lower() in str(err).lower() for w in c.expect.words)
        return ("clear error" if isinstance(err, clear) and named else "obscure"), text
    finally:
        torch.set_num_threads(threads)
    if isinstance(c.expect, Refuse):
        return "silent wrong", f"answered {_short(result)}"
    try:
        ok = bool(c.expect.check(result))
    except Exception as err:  # noqa: BLE001 - an answer the check cannot read is a wrong answer
        ok, result = False, f"{_short(result)} ({type(err).__name__}: {err})"
    return ("right" if ok else "silent wrong"), f"answered {_short(result)}"


def _short(value) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 100 else text[:97] + "..."


def run(cases: list[Case]) -> list[dict]:
    clear = clear_errors()
    try:
        model()  # built here, outside any case's inference mode (its weights stay normal tensors)
    except Missing:
        pass
    rows = []
    for c in cases:
        verdict, detail = classify(c, clear)
        rows.append({"area": c.area, "case": c.name, "verdict": verdict, "detail": detail})
    return rows


def table(rows: list[dict]) -> str:
    areas = sorted({r["area"] for r in rows}, key=[r["area"] for r in rows].index)
    lines = [f"{'area':<14}{'tried':>6}" + "".join(f"{v:>14}" for v in VERDICTS)]
    for area in areas + ["all"]:
        mine = [r for r in rows if (area == "all" or r["area"] == area) and r["verdict"] != "n/a"]
        n = Counter(r["verdict"] for r in mine)
        lines.append(f"{area:<14}{len(mine):>6}" + "".join(f"{n[v]:>14}" for v in VERDICTS))
    missing = sum(r["verdict"] == "n/a" for r in rows)
    if missing:
        lines.append(f"({missing} cases not applicable: their API does not exist in this checkout)")
    return "\n".join(lines)


def _limit_memory(gib: float) -> None:
    try:
        import resource
    except ImportError:  # not on Linux / macOS: run without a limit
        return
    limit = int(gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--show", choices=["all", "wrong"], help="list the cases (all, or those not right / clear error)"
    )
    parser.add_argument("--json", help="write every verdict to this file")
    parser.add_argument(
        "--memory-limit-gib",
        type=float,
        default=4.0,
        help="address-space limit of this process (Linux), so that a case which "
        "allocates without checking fails with MemoryError instead of taking the "
        "machine's memory (default 4)",
    )
    args = parser.parse_args(argv)
    _limit_memory(args.memory_limit_gib)
    torch.set_num_threads(1)
    import kvlab

    rows = run(all_cases())
    print(f"kvlab from {kvlab.__file__}")
    print(table(rows))
    if args.show:
        for r in rows:
            if args.show == "all" or r["verdict"] in ("silent wrong", "obscure"):
                print(f"[{r['verdict']}] {r['area']}: {r['case']}: {r['detail']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
