"""The benchmark sweeps: naive vs cached decoding across lengths, the fixed-shape decode step eager vs
graphed / compiled, batch size, cache memory measured vs the formula, and the achieved share of the
bandwidth roofline. Each returns rows (dicts) that `kvlab.bench.report` writes out."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .. import memory, roofline
from ..config import PRESETS, ModelConfig
from ..fast import FastDecoder, fast_generate, make_step
from ..generate import generate
from ..model import Transformer
from .timing import median, time_interleaved

# A model small enough that per-step overhead (Python, dispatch, kernel launches) matters next to
# arithmetic: the size at which a framework's own cost shows.
# Byte-level vocabulary (256), as kvlab-tiny.
CPU_CONFIG = ModelConfig(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, vocab_size=256,
                         max_seq_len=1024, name="bench-small", source="kvlab benchmark config")
# About 28 M parameters (8 layers, d_model 512, vocabulary 4,096; GQA 8 query / 4 KV heads; d_ff 1408 =
# 8/3 · 512 rounded up to a multiple of 128, as Llama sizes its FFN): 111 MB of fp32 weights, far more
# than a CPU's caches, so a CPU decode step is bound by memory bandwidth, not by overhead.
CPU_CONFIG_25M = ModelConfig(n_layers=8, d_model=512, n_heads=8, n_kv_heads=4, d_ff=1408, vocab_size=4096,
                             max_seq_len=1024, name="bench-25m", source="kvlab benchmark config")
# The models `python -m kvlab.bench --compare-hf --hf-config NAME` compares on the CPU.
HF_CONFIGS = {"small": CPU_CONFIG, "25m": CPU_CONFIG_25M}
# About one billion parameters (TinyLlama-1.1B's shape): big enough that a GPU decode step is
# bound by memory bandwidth, as real LLM decoding is.
GPU_CONFIG = PRESETS["tinyllama-1.1b"]

TORCH_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def random_prompt(config: ModelConfig, batch: int, length: int, device, seed: int = 0) -> torch.Tensor:
    """Random token ids (batch, length), seeded: the same prompt for every method compared."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=g).to(device)


def random_model(config: ModelConfig, device, dtype, seed: int = 0) -> Transformer:
    """A kvlab model of this shape with seeded random weights (benchmarks need no training)."""
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: a 7B model takes minutes on the CPU
        return Transformer(config).to(dtype=dtype).eval()


def result_row(sweep: str, method: str, times: list[float], tokens: int, **extra) -> dict:
    """One result row: the timings' median, minimum and maximum (their spread), and tokens/s at the
    median."""
    m = median(times)
    return {"sweep": sweep, "method": method, **extra, "repeats": len(times), "median_s": m,
            "min_s": min(times), "max_s": max(times), "tokens_per_s": tokens / m}


# The three code paths of `sweep_lengths`, named by what runs.
NAIVE = "naive: generate(cache=None)"
CACHED = "cached: generate(cache='static')"
FAST = "fast: fast_generate (eager)"


def sweep_lengths(model: Transformer, lengths: Sequence[int], prompt_len: int = 8, repeats: int = 3,
                  progress: bool = False, clock: str = "wall") -> list[dict]:
    """Tokens/s per length of three code paths: naive (`generate`, no cache: every step a full
    forward pass), cached (`generate(cache="static")`: the model's own forward with a StaticKVCache,
    attention over the filled positions only) and fast (`kvlab.fast.fast_generate`, eager: the
    fixed-shape step, attention over all S_max slots of its buffer under a mask)."""
    device = next(model.parameters()).device
    ids = random_prompt(model.config, 1, prompt_len, device)
    rows = []
    for n in lengths:
        fns = {NAIVE: lambda n=n: generate(model, ids, n, cache=None),
               CACHED: lambda n=n: generate(model, ids, n, cache="static"),
               FAST: lambda n=n: fast_generate(model, ids, n)}
        times = time_interleaved(fns, repeats, 1, device, progress, f"length {n}", clock)
        rows += [result_row("lengths", k, v, n, new_tokens=n, batch=1, clock=clock) for k, v in times.items()]
    return rows


def sweep_modes(model: Transformer, new_tokens: int, modes: Sequence[str], prompt_len: int = 8,
                batch: int = 1, repeats: int = 3, progress: bool = False, clock: str = "wall") -> list[dict]:
    """The fixed-shape decoder eager vs CUDA-graphed vs compiled; setup (capture/compile) timed
    separately, since a server pays it once."""
    device = next(model.parameters()).device
    ids = random_prompt(model.config, batch, prompt_len, device)
    fns, setup = {}, {}
    for mode in modes:
        dec = FastDecoder(model, batch, prompt_len + new_tokens)
        t0 = time.perf_counter()
        with torch.inference_mode():
            step = make_step(dec, mode)
            fast_generate(model, ids, new_tokens, mode=mode, decoder=dec, step_fn=step)  # compile
        setup[mode] = time.perf_counter() - t0
        fns[mode] = lambda d=dec, s=step, m=mode: fast_generate(model, ids, new_tokens, mode=m,
                                                                 decoder=d, step_fn=s)
    times = time_interleaved(fns, repeats, 1, device, progress, "modes", clock)
    return [result_row("modes", k, v, batch * new_tokens, new_tokens=new_tokens, batch=batch, clock=clock,
                       setup_s=setup[k], slots_read=prompt_len + new_tokens) for k, v in times.items()]


def sweep_batch(model: Transformer, batch_sizes: Sequence[int], new_tokens: int, mode: str = "eager",
                prompt_len: int = 8, repeats: int = 3, progress: bool = False,
                clock: str = "wall") -> list[dict]:
    """Tokens/s of the whole batch: a decode step reads the weights once for all sequences."""
    device = next(model.parameters()).device
    rows = []
    for b in batch_sizes:
        ids = random_prompt(model.config, b, prompt_len, device)
        dec = FastDecoder(model, b, prompt_len + new_tokens)
        with torch.inference_mode():
            step = make_step(dec, mode)
        fns = {f"batch {b}": lambda ids=ids, dec=dec, step=step: fast_generate(
            model, ids, new_tokens, mode=mode, decoder=dec, step_fn=step)}
        times = time_interleaved(fns, repeats, 1, device, progress, f"batch {b}", clock)
        rows += [result_row("batch", f"fast {mode}", times[f"batch {b}"], b * new_tokens,
                            new_tokens=new_tokens, batch=b, clock=clock, slots_read=prompt_len + new_tokens)]
    return rows


def memory_check(model: Transformer, batch: int, seq_len: int, mode: str = "eager") -> dict:
    """The cache's bytes (and, on a GPU, the peak allocated memory of a run of seq_len positions,
    decoded with `kvlab.fast` mode `mode`) vs kvlab.memory's formulas."""
    device = next(model.parameters()).device
    dtype = TORCH_DTYPE_NAMES[next(model.parameters()).dtype]
    cfg = model.config
    predicted = memory.kv_cache_bytes(cfg, seq_len, batch, dtype)
    weights = sum(p.nbytes for p in model.parameters())
    row = {"sweep": "memory", "method": "static cache", "batch": batch, "seq_len": seq_len,
           "dtype": dtype, "predicted_cache_bytes": predicted,
           "predicted_weight_bytes": memory.weight_bytes(cfg, dtype), "weight_bytes": weights}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    dec = FastDecoder(model, batch, seq_len)
    row["cache_bytes"] = dec.nbytes
    if device.type == "cuda":
        row["cache_allocated_bytes"] = torch.cuda.memory_allocated(device) - before
        with torch.inference_mode():
            step = make_step(dec, mode)
        fast_generate(model, random_prompt(cfg, batch, 8, device), seq_len - 8, mode=mode, decoder=dec,
                      step_fn=step)
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_vs_predicted"] = row["peak_allocated_bytes"] / (predicted + row["predicted_weight_bytes"])
        row["mode"] = mode
    return row


def roofline_rows(model: Transformer, bandwidth: float, source: str, measured: Sequence[dict],
                  measured_bandwidth: float | None = None) -> list[dict]:
    """Achieved bandwidth of measured decode runs (rows with method, batch, new_tokens, tokens/s)
    against the device's bandwidth: bytes per step at the mean context × steps per second. With
    measured_bandwidth (a copy's, `kvlab.bench.machine.copy_bandwidth`), also the share of that."""
    cfg = model.config
    dtype = TORCH_DTYPE_NAMES[next(model.parameters()).dtype]
    rows = []
    for r in measured:
        # Cached positions a step reads: kvlab.fast's rows read every slot of their buffer, S_max =
        # prompt + new tokens (`slots_read`); otherwise the filled ones, a prompt of 8 and then one
        # more a step, on average.
        context = r.get("slots_read", 8 + r["new_tokens"] // 2)
        bound = roofline.roofline(cfg, bandwidth, context, r["batch"], dtype)
        achieved = bound.bytes_per_step * r["tokens_per_s"] / r["batch"]
        rows.append({"sweep": "roofline", "method": r["method"], "batch": r["batch"],
                     "new_tokens": r["new_tokens"], "tokens_per_s": r["tokens_per_s"],
                     "bytes_per_step": bound.bytes_per_step, "bound_tokens_per_s": bound.tokens_per_s,
                     "bandwidth_bytes_per_s": bandwidth, "bandwidth_source": source,
                     "achieved_bytes_per_s": achieved, "fraction_of_bandwidth": achieved / bandwidth})
        if measured_bandwidth is not None:
            rows[-1].update(measured_bandwidth_bytes_per_s=measured_bandwidth,
                            fraction_of_measured_bandwidth=achieved / measured_bandwidth)
    return rows
