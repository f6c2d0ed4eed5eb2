"""Benchmarks done right: `python -m kvlab.bench [--compare-hf]`.

Timing rules: run each thing once to warm up (lazy initialisation, caches, CUDA graph capture),
then several times, and quote the **median**. On a GPU, work is queued asynchronously: a timer
read right after a call measures how fast Python *queued* the kernels, not how fast the GPU ran
them, so every timed call is bracketed by CUDA events and synchronized. When two things are
compared (kvlab against `transformers`), their runs are interleaved in one process, so a busy
machine slows both alike.

Sweeps: naive vs cached decoding across generated lengths; the fixed-shape decode step eager vs
CUDA-graphed / compiled; batch size; cache memory measured vs `kvlab.memory`'s formula; the
bandwidth roofline (bytes read per decode step ÷ bandwidth = the fastest a token can come);
and `--compare-hf`: the same random weights in `transformers` and in kvlab, tokens/s side by side.
Results go to `benchmarks/<device>-<date>.json|.csv|.md`, and `benchmarks/README.md` indexes them.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import env, memory
from .config import PRESETS, ModelConfig
from .env import half_dtype
from .fast import FastDecoder, fast_generate, make_step
from .generate import generate
from .model import Transformer

# A model small enough that per-step overhead (Python, dispatch, kernel launches) matters next to
# arithmetic: the size at which a framework's own cost shows.
# Byte-level vocabulary (256), as kvlab-tiny.
CPU_CONFIG = ModelConfig(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, vocab_size=256,
                         max_seq_len=1024, name="bench-small", source="kvlab benchmark config")
# About one billion parameters (TinyLlama-1.1B's shape): big enough that a GPU decode step is
# bound by memory bandwidth, as real LLM decoding is.
GPU_CONFIG = PRESETS["tinyllama-1.1b"]

TORCH_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ----------------------------------------------------------------------------- timing

def median(values: Sequence[float]) -> float:
    """The middle value (mean of the two middle ones for an even count): robust to outliers."""
    if len(values) == 0:
        raise ValueError("median of no values: time at least one repeat")
    return float(statistics.median(values))


CLOCKS = ("wall", "cpu")


def time_call(fn: Callable[[], object], device: torch.device | str = "cpu", clock: str = "wall") -> float:
    """Seconds one call of fn takes, the GPU's work included (CUDA events + synchronize).

    clock="cpu" (CPU only) counts the CPU time this process used instead of wall time: on a machine
    shared with other busy programs, wall time also counts the time the others held the cores."""
    device = torch.device(device)
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r} is not known; allowed: {', '.join(CLOCKS)}")
    if clock == "cpu":
        if device.type == "cuda":
            raise ValueError("clock='cpu' measures CPU work; GPU timing needs clock='wall'")
        t0 = time.process_time()
        fn()
        return time.process_time() - t0
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                     device: torch.device | str = "cpu", progress: bool = False,
                     desc: str = "", clock: str = "wall") -> dict[str, list[float]]:
    """Time several functions round-robin (A B C, B C A, …): warm-up rounds first, then `repeats`
    timed rounds. Returns every timing, so a caller can take medians and ratios."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    rounds = range(warmup + repeats)
    if progress:
        from tqdm.auto import tqdm
        rounds = tqdm(rounds, desc=desc or "timing", leave=False)
    for r in rounds:
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: nobody always goes first
        for name in order:
            seconds = time_call(fns[name], device, clock)
            if r >= warmup:
                times[name].append(seconds)
    return times


# ----------------------------------------------------------------------------- the machine

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device | str | None = None) -> dict:
    """What the numbers were measured on: device, CPU/GPU names, versions, threads, date."""
    device = torch.device(device) if device is not None else env.device()
    info = {
        "device": device.type,
        "cpu": cpu_name(),
        "gpu": None,
        "gpu_memory_gib": None,
        "torch": torch.__version__,
        "transformers": None,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        gpu = env.report()  # the same GPU facts chapter 00 shows
        info.update(gpu=gpu["gpu"], gpu_memory_gib=gpu["gpu_memory_gib"], cuda=torch.version.cuda)
    return info


def match_gpu(name: str, memory_bytes: int | None = None) -> memory.GPU | None:
    """The `kvlab.memory.GPUS` entry for a device name such as 'NVIDIA A100-SXM4-80GB' (or None)."""
    upper = name.upper()
    candidates = [g for g in memory.GPUS.values() if g.name.split()[0] in upper]
    if len(candidates) > 1 and memory_bytes is not None:  # A100 40GB vs 80GB: go by memory size
        return min(candidates, key=lambda g: abs(g.memory_bytes - memory_bytes))
    return candidates[0] if candidates else None


def copy_bandwidth(device: torch.device | str = "cpu", nbytes: int = 32 * memory.MiB,
                   repeats: int = 5) -> float:
    """Measured memory bandwidth in bytes/s: copy a buffer far larger than the caches.
    A copy reads nbytes and writes nbytes, so it moves 2 × nbytes."""
    device = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = [time_call(lambda: dst.copy_(src), device) for _ in range(repeats + 1)][1:]
    return 2 * nbytes / median(times)


def device_bandwidth(device: torch.device | str | None = None) -> tuple[float, str]:
    """(bytes/s, where the figure comes from): the data-sheet figure of a known GPU, otherwise
    a measured copy bandwidth."""
    device = torch.device(device) if device is not None else env.device()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        known = match_gpu(props.name, props.total_memory)
        if known is not None:
            return known.bandwidth_bytes_per_s, f"data sheet ({known.name}, kvlab.memory.GPUS)"
    return copy_bandwidth(device), "measured copy bandwidth"


# ----------------------------------------------------------------------------- roofline

@dataclass(frozen=True)
class Roofline:
    """The memory-bandwidth bound of one decode step: every weight and every cached K/V row is
    read once per step, and no step can be faster than moving those bytes."""

    bytes_per_step: int
    bandwidth_bytes_per_s: float
    batch_size: int

    @property
    def seconds_per_step(self) -> float:
        return self.bytes_per_step / self.bandwidth_bytes_per_s

    @property
    def tokens_per_s(self) -> float:
        """Upper bound on tokens/s for the whole batch (each step yields batch_size tokens)."""
        return self.batch_size / self.seconds_per_step


def decode_step_bytes(config: ModelConfig, context: int, batch_size: int = 1,
                      dtype: str = "fp16") -> int:
    """Bytes one decode step reads: all weights once, plus the K/V of `context` cached tokens
    for each sequence in the batch."""
    return memory.weight_bytes(config, dtype) + memory.kv_cache_bytes(config, context, batch_size, dtype)


def roofline(config: ModelConfig, bandwidth_bytes_per_s: float, context: int = 0,
             batch_size: int = 1, dtype: str = "fp16") -> Roofline:
    """The roofline for a model, a GPU (or measured) bandwidth, a context length and a batch."""
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s} must be > 0")
    return Roofline(decode_step_bytes(config, context, batch_size, dtype), bandwidth_bytes_per_s,
                    batch_size)


# ----------------------------------------------------------------------------- overhead

def count_ops(fn: Callable[[], object]) -> int:
    """How many PyTorch operations one call of fn dispatches. On a GPU each is (at least) one
    kernel launch, so this count × the cost of a launch is a floor under a step's time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Counter.count += 1
            return func(*args, **(kwargs or {}))

    with _Counter():
        fn()
    return _Counter.count


def fit_step_time(fed_tokens: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares line seconds ≈ overhead + per_token × fed_tokens over naive decoding steps.
    The intercept is the fixed cost of any step (Python, dispatch, launches); the slope is the cost
    of one more token of work. Returns (overhead_s, per_token_s)."""
    if len(fed_tokens) != len(seconds) or len(fed_tokens) < 2:
        raise ValueError(f"need two or more (fed_tokens, seconds) pairs; got {len(fed_tokens)} "
                         f"and {len(seconds)}")
    x = torch.tensor(fed_tokens, dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1)
    overhead, per_token = torch.linalg.lstsq(design, y[:, None]).solution[:, 0].tolist()
    return overhead, per_token


# ----------------------------------------------------------------------------- sweeps

def _prompt(config: ModelConfig, batch: int, length: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=g).to(device)


def _model(config: ModelConfig, device, dtype, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(config).to(device=device, dtype=dtype).eval()


def _row(sweep: str, method: str, times: list[float], tokens: int, **extra) -> dict:
    m = median(times)
    return {"sweep": sweep, "method": method, **extra, "repeats": len(times), "median_s": m,
            "min_s": min(times), "tokens_per_s": tokens / m}


def sweep_lengths(model: Transformer, lengths: Sequence[int], prompt_len: int = 8, repeats: int = 3,
                  progress: bool = False, clock: str = "wall") -> list[dict]:
    """Naive (no cache) vs cached decoding vs the fixed-shape decoder, tokens/s per length."""
    device = next(model.parameters()).device
    ids = _prompt(model.config, 1, prompt_len, device)
    rows = []
    for n in lengths:
        fns = {"naive": lambda n=n: generate(model, ids, n, cache=None),
               "cached (static)": lambda n=n: generate(model, ids, n, cache="static"),
               "fast eager": lambda n=n: fast_generate(model, ids, n)}
        times = time_interleaved(fns, repeats, 1, device, progress, f"length {n}", clock)
        rows += [_row("lengths", k, v, n, new_tokens=n, batch=1, clock=clock) for k, v in times.items()]
    return rows


def sweep_modes(model: Transformer, new_tokens: int, modes: Sequence[str], prompt_len: int = 8,
                batch: int = 1, repeats: int = 3, progress: bool = False, clock: str = "wall") -> list[dict]:
    """The fixed-shape decoder eager vs CUDA-graphed vs compiled; setup (capture/compile) timed
    separately, since a server pays it once."""
    device = next(model.parameters()).device
    ids = _prompt(model.config, batch, prompt_len, device)
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
    return [_row("modes", k, v, batch * new_tokens, new_tokens=new_tokens, batch=batch, clock=clock,
                 setup_s=setup[k]) for k, v in times.items()]


def sweep_batch(model: Transformer, batch_sizes: Sequence[int], new_tokens: int, mode: str = "eager",
                prompt_len: int = 8, repeats: int = 3, progress: bool = False,
                clock: str = "wall") -> list[dict]:
    """Tokens/s of the whole batch: a decode step reads the weights once for all sequences."""
    device = next(model.parameters()).device
    rows = []
    for b in batch_sizes:
        ids = _prompt(model.config, b, prompt_len, device)
        dec = FastDecoder(model, b, prompt_len + new_tokens)
        with torch.inference_mode():
            step = make_step(dec, mode)
        fns = {f"batch {b}": lambda ids=ids, dec=dec, step=step: fast_generate(
            model, ids, new_tokens, mode=mode, decoder=dec, step_fn=step)}
        times = time_interleaved(fns, repeats, 1, device, progress, f"batch {b}", clock)
        rows += [_row("batch", f"fast {mode}", times[f"batch {b}"], b * new_tokens,
                      new_tokens=new_tokens, batch=b, clock=clock)]
    return rows


def memory_check(model: Transformer, batch: int, seq_len: int) -> dict:
    """The cache's bytes (and, on a GPU, the peak allocated memory of a run) vs kvlab.memory."""
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
        fast_generate(model, _prompt(cfg, batch, 8, device), seq_len - 8, decoder=dec)
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return row


def roofline_rows(model: Transformer, bandwidth: float, source: str, measured: Sequence[dict]) -> list[dict]:
    """Achieved bandwidth of measured decode runs (rows with method, batch, new_tokens, tokens/s)
    against the device's bandwidth: bytes per step at the mean context × steps per second."""
    cfg = model.config
    dtype = TORCH_DTYPE_NAMES[next(model.parameters()).dtype]
    rows = []
    for r in measured:
        context = 8 + r["new_tokens"] // 2  # prompt of 8, then the context grows one a step
        bound = roofline(cfg, bandwidth, context, r["batch"], dtype)
        achieved = bound.bytes_per_step * r["tokens_per_s"] / r["batch"]
        rows.append({"sweep": "roofline", "method": r["method"], "batch": r["batch"],
                     "new_tokens": r["new_tokens"], "tokens_per_s": r["tokens_per_s"],
                     "bytes_per_step": bound.bytes_per_step, "bound_tokens_per_s": bound.tokens_per_s,
                     "bandwidth_bytes_per_s": bandwidth, "bandwidth_source": source,
                     "achieved_bytes_per_s": achieved, "fraction_of_bandwidth": achieved / bandwidth})
    return rows


# ----------------------------------------------------------------------------- vs transformers

def hf_twin(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """A random-weight `transformers` LlamaForCausalLM of this shape (no download) and the kvlab
    model built from it by `from_hf`: the same weights in both."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .hf import from_hf

    hf_cfg = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.d_model,
                         intermediate_size=config.d_ff, num_hidden_layers=config.n_layers,
                         num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
                         head_dim=config.head_dim, max_position_embeddings=config.max_seq_len,
                         rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
                         tie_word_embeddings=config.tie_embeddings,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype).eval()
    # No end-of-sequence token: both sides generate exactly max_new_tokens.
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf, from_hf(hf)


def compare_hf(config: ModelConfig = CPU_CONFIG, new_tokens: int = 64, prompt_len: int = 16,
               repeats: int = 5, device=None, dtype: torch.dtype | None = None,
               progress: bool = False, clock: str = "wall",
               fast_modes: Sequence[str] = ("eager",)) -> list[dict]:
    """kvlab cached decoding vs `transformers` generate (dynamic and static cache) on the same
    weights, batch 1, greedy, interleaved; rows carry medians, ratios and a token-equality check.

    fast_modes: the `kvlab.fast` modes to time too ("graph" needs a GPU). Each keeps one decoder
    and one captured/compiled step across calls, as transformers keeps its static cache."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    device = torch.device(device) if device is not None else env.device()
    dtype = dtype or half_dtype(device)
    hf, kv = hf_twin(config, 0, dtype, device)
    ids = _prompt(config, 1, prompt_len, device)
    mask = torch.ones_like(ids)
    outputs: dict[str, torch.Tensor] = {}

    def keep(name, tokens):
        outputs[name] = tokens

    def run_hf(impl):
        kw = {} if impl is None else {"cache_implementation": impl}
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, **kw)

    fns = {
        "kvlab generate (static cache)": lambda: keep("kvlab generate (static cache)",
                                                      generate(kv, ids, new_tokens, cache="static").tokens),
        "transformers generate (dynamic cache)": lambda: keep("transformers generate (dynamic cache)",
                                                              run_hf(None)),
        "transformers generate (static cache)": lambda: keep("transformers generate (static cache)",
                                                             run_hf("static")),
    }
    for mode in fast_modes:
        dec = FastDecoder(kv, 1, prompt_len + new_tokens)
        with torch.inference_mode():
            step = make_step(dec, mode)
        fns[f"kvlab fast {mode}"] = lambda m=mode, d=dec, s=step: keep(
            f"kvlab fast {m}", fast_generate(kv, ids, new_tokens, mode=m, decoder=d, step_fn=s).tokens)
    times = time_interleaved(fns, repeats, 1, device, progress, "kvlab vs transformers", clock)
    reference = outputs["kvlab generate (static cache)"]
    base = {k: median(v) for k, v in times.items()}
    hf_dyn = base["transformers generate (dynamic cache)"]
    hf_static = base["transformers generate (static cache)"]

    def agreement(tokens):  # exact in fp32; in half precision a near-tie may round the other way
        return (tokens[:, prompt_len:].cpu() == reference[:, prompt_len:].cpu()).float().mean().item()

    return [_row("compare_hf", k, v, new_tokens, new_tokens=new_tokens, batch=1, prompt_len=prompt_len,
                 clock=clock, dtype=TORCH_DTYPE_NAMES[dtype],
                 model=f"L{config.n_layers} d{config.d_model} "
                       f"H{config.n_heads}/{config.n_kv_heads} V{config.vocab_size}",
                 tokens_identical=bool(torch.equal(outputs[k].cpu(), reference.cpu())),
                 tokens_agree=agreement(outputs[k]),
                 speedup_vs_hf_dynamic=hf_dyn / base[k], speedup_vs_hf_static=hf_static / base[k])
            for k, v in times.items()]


# ----------------------------------------------------------------------------- files

def write_results(result: dict, out_dir: str | Path, stem: str | None = None) -> dict[str, Path]:
    """Write result (with "machine" and "rows") as JSON, CSV (machine columns on every row) and a
    markdown summary; refresh out_dir/README.md, the index of every result there."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    m = result["machine"]
    if stem is None:
        kind = "cpu" if m["device"] != "cuda" else "gpu-" + _slug(m["gpu"] or "cuda")
        stem = f"{kind}-{m['date'][:10]}"
    paths = {"json": out / f"{stem}.json", "csv": out / f"{stem}.csv", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    keys: list[str] = []
    for row in result["rows"]:
        keys += [k for k in row if k not in keys]
    mkeys = ["device", "cpu", "gpu", "torch", "transformers", "threads", "date"]
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + [f"machine_{k}" for k in mkeys])
        w.writeheader()
        for row in result["rows"]:
            w.writerow({**row, **{f"machine_{k}": m.get(k) for k in mkeys}})
    paths["md"].write_text(summary_markdown(result))
    paths["index"] = write_index(out)
    return paths


def _slug(text: str) -> str:
    words = [w for w in "".join(c if c.isalnum() else " " for c in text.lower()).split()
             if w not in ("nvidia", "tesla")]
    return "-".join(words)[:40] or "gpu"


def _fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


SECTIONS = {
    "compare_hf": ("kvlab vs transformers (same random weights, batch 1, greedy)",
                   ["method", "model", "dtype", "new_tokens", "clock", "tokens_per_s",
                    "speedup_vs_hf_dynamic", "speedup_vs_hf_static", "tokens_identical", "tokens_agree",
                    "repeats"]),
    "lengths": ("Naive vs cached decoding across generated lengths (batch 1)",
                ["method", "new_tokens", "clock", "tokens_per_s", "median_s", "repeats"]),
    "modes": ("Fixed-shape decode step: eager vs graphed / compiled",
              ["method", "batch", "new_tokens", "clock", "tokens_per_s", "setup_s", "repeats"]),
    "batch": ("Batch size (tokens/s of the whole batch)",
              ["method", "batch", "new_tokens", "clock", "tokens_per_s", "repeats"]),
    "memory": ("Cache memory: measured vs kvlab.memory's formula",
               ["method", "batch", "seq_len", "dtype", "cache_bytes", "predicted_cache_bytes",
                "cache_allocated_bytes", "peak_allocated_bytes", "weight_bytes"]),
    "roofline": ("Roofline: bytes per decode step ÷ bandwidth",
                 ["method", "batch", "new_tokens", "tokens_per_s", "bound_tokens_per_s",
                  "bytes_per_step", "fraction_of_bandwidth", "bandwidth_source"]),
}


def summary_markdown(result: dict) -> str:
    """A short human summary: the machine, the model, one table a sweep, and the notes."""
    m = result["machine"]
    where = m["gpu"] if m["device"] == "cuda" else f"CPU only ({m['cpu']}), no GPU in this run"
    lines = [f"# kvlab benchmark — {where}", "",
             f"Recorded by `python -m kvlab.bench {result.get('args', '')}`".rstrip() + ".", "",
             "| machine | |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in m.items() if v is not None]
    lines += ["", f"Model for the sweeps: {result.get('model', '')}. "
              "Times are medians of the repeats; runs of things compared with each other were "
              "interleaved in one process."]
    for key, (title, cols) in SECTIONS.items():
        rows = [r for r in result["rows"] if r["sweep"] == key]
        if rows:
            lines += ["", f"## {title}", "", _table(rows, [c for c in cols if any(c in r for r in rows)])]
    lines += _target_lines(result)
    for note in result.get("notes", []):
        lines += ["", f"> {note}"]
    return "\n".join(lines) + "\n"


def _target_lines(result: dict) -> list[str]:
    """The targets of issues 2 and 6, checked against this result's numbers."""
    rows = {r["method"]: r for r in result["rows"] if r["sweep"] == "compare_hf"}
    if not rows:
        return []
    out = ["", "## Targets"]
    if result["machine"]["device"] != "cuda":
        for name, r in rows.items():
            if name.startswith("kvlab"):
                worst = min(r["speedup_vs_hf_dynamic"], r["speedup_vs_hf_static"])
                verdict = ("NOT met" if worst < 1.5 else
                           "met, and the 2× aim too" if worst >= 2 else "met, the 2× aim not reached")
                out.append(f"- CPU, {name}: at least 1.5× `transformers` generate (aim 2×): "
                           f"{r['speedup_vs_hf_dynamic']:.2f}× vs its dynamic cache, "
                           f"{r['speedup_vs_hf_static']:.2f}× vs its static cache — {verdict}.")
    fast = [r for name, r in rows.items() if name.startswith("kvlab fast")]
    if result["machine"]["device"] == "cuda" and fast:
        best = max(fast, key=lambda r: r["speedup_vs_hf_static"])
        out.append(f"- GPU: faster than `transformers` generate with its static cache: best "
                   f"{best['method']} at {best['speedup_vs_hf_static']:.2f}× — "
                   f"{'met' if best['speedup_vs_hf_static'] > 1 else 'NOT met'}.")
    roof = [r for r in result["rows"] if r["sweep"] == "roofline" and r["batch"] == 1]
    if result["machine"]["device"] == "cuda" and roof:
        best = max(roof, key=lambda r: r["fraction_of_bandwidth"])
        frac = best["fraction_of_bandwidth"]
        out.append(f"- GPU, batch 1: at least 60 % of the bandwidth roofline: best {best['method']} "
                   f"reached {frac:.0%} — {'met' if frac >= 0.6 else 'NOT met'}.")
    return out


def write_index(out_dir: str | Path) -> Path:
    """benchmarks/README.md: one line per recorded result, and whether any GPU result exists."""
    out = Path(out_dir)
    results = []
    for path in sorted(out.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            results.append((path, data["machine"], data["rows"]))
        except (ValueError, KeyError):
            continue
    lines = ["# Recorded benchmarks", "",
             "Written by `python -m kvlab.bench` (see `kvlab/bench.py` for the method: warm-up, "
             "medians of several repeats, CUDA events on a GPU, interleaved comparisons).", "",
             "| result | device | CPU / GPU | torch | threads | date "
             "| kvlab vs transformers (dynamic / static) |",
             "|---|---|---|---|---|---|---|"]
    for path, m, rows in results:
        ratios = [f"{r['method'].replace('kvlab ', '')}: {r['speedup_vs_hf_dynamic']:.2f}× / "
                  f"{r['speedup_vs_hf_static']:.2f}×"
                  for r in rows if r["sweep"] == "compare_hf" and r["method"].startswith("kvlab")]
        lines.append(f"| [{path.stem}]({path.stem}.md) | {m['device']} | {m['gpu'] or m['cpu']} | "
                     f"{m['torch']} | {m['threads']} | {m['date']} | {'; '.join(ratios) or '—'} |")
    if not any(m["device"] == "cuda" for _, m, _ in results):
        lines += ["", "No GPU result has been recorded yet: every result above was measured on a CPU. "
                  "Run `python -m kvlab.bench --compare-hf` on a GPU machine to add one, or "
                  "`bash tools/gpu_check.sh`, which also runs the GPU tests and chapter 06 there."]
    path = out / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- command line

def fast_modes(device: torch.device, with_compile: bool = False) -> list[str]:
    """The `kvlab.fast` modes worth timing here: eager always, the CUDA graph on a GPU, and
    torch.compile when asked (on the CPU it takes a while to build)."""
    return ["eager"] + (["graph"] if device.type == "cuda" else []) + (["compile"] if with_compile else [])


def run(args: argparse.Namespace) -> dict:
    """Run the sweeps args ask for; return {"machine", "model", "rows", "notes", "args"}."""
    device = torch.device(args.device) if args.device else env.device()
    dtype = half_dtype(device)
    config = PRESETS[args.model] if args.model else (GPU_CONFIG if device.type == "cuda" else CPU_CONFIG)
    quick = args.quick
    if quick:
        config = config.with_(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256)
    sweeps = [s for s in args.sweeps.split(",") if s and s != "none"]
    unknown = set(sweeps) - {"lengths", "modes", "batch", "memory", "roofline"}
    if unknown:
        raise ValueError(f"unknown sweeps {sorted(unknown)}; allowed: lengths, modes, batch, memory, "
                         "roofline, none")
    rows: list[dict] = []
    notes = []
    model = _model(config, device, dtype)
    lengths = [8, 16] if quick else ([32, 64, 128, 256] if device.type == "cpu" else [64, 256, 512])
    new_tokens = 8 if quick else (64 if device.type == "cpu" else 256)
    progress = not args.no_progress
    clock = args.clock or ("cpu" if device.type == "cpu" else "wall")
    if "lengths" in sweeps:
        rows += sweep_lengths(model, lengths, repeats=args.repeats, progress=progress, clock=clock)
    if "modes" in sweeps or "roofline" in sweeps:
        modes = fast_modes(device, args.compile)
        if not args.compile and device.type != "cuda":
            notes.append("Compiled/graphed decoding was not run: CUDA graphs need a GPU, and "
                         "torch.compile on the CPU was not requested (--compile).")
        rows += sweep_modes(model, new_tokens, modes, repeats=args.repeats, progress=progress, clock=clock)
    if "batch" in sweeps:
        mode = "graph" if device.type == "cuda" else "eager"
        rows += sweep_batch(model, [1, 4] if quick else [1, 4, 16], new_tokens, mode,
                            repeats=args.repeats, progress=progress, clock=clock)
    if "memory" in sweeps:
        rows.append(memory_check(model, 4, 8 + new_tokens))
    if "roofline" in sweeps:
        bandwidth, source = device_bandwidth(device)
        rows += roofline_rows(model, bandwidth, source, [r for r in rows if r["sweep"] in ("modes", "batch")])
    if args.compare_hf:
        hf_config = CPU_CONFIG if device.type == "cpu" else GPU_CONFIG
        if quick:
            hf_config = config
        rows += compare_hf(hf_config, 8 if quick else args.hf_new_tokens, repeats=args.repeats,
                           device=device, progress=progress, clock=clock,
                           fast_modes=fast_modes(device, args.compile))
    if clock == "cpu":
        notes.append("Timed in CPU seconds of this process (time.process_time, one thread), so other "
                     "programs on a shared machine do not skew the numbers; tokens/s are per CPU second.")
    if device.type != "cuda":
        notes.append("No GPU was available for this run: every number above is a CPU measurement.")
    model_desc = (f"{config.name or 'custom'}: {config.n_layers} layers, d_model {config.d_model}, "
                  f"{config.n_heads} heads / {config.n_kv_heads} KV heads, vocab {config.vocab_size}, "
                  f"{memory.param_count(config):,} parameters, {TORCH_DTYPE_NAMES[dtype]}")
    return {"machine": machine(device), "model": model_desc, "rows": rows, "notes": notes,
            "args": " ".join(args.argv)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvlab.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--compare-hf", action="store_true",
                   help="also time transformers generate (dynamic and static cache) on the same weights")
    p.add_argument("--sweeps", default="lengths,modes,batch,memory,roofline",
                   help="comma-separated: lengths, modes, batch, memory, roofline (or none)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median)")
    p.add_argument("--hf-new-tokens", type=int, default=64, help="tokens to generate in --compare-hf")
    p.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="a preset (random weights); default: a small model on the CPU, 1.1B on a GPU")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the GPU when there is one)")
    p.add_argument("--clock", choices=CLOCKS, default=None,
                   help="wall or cpu (process) time; default cpu on the CPU, wall on a GPU")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default 1 on the CPU)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile (slow to build on CPU)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every code path")
    p.add_argument("--out", default="benchmarks", help="folder for the result files")
    p.add_argument("--stem", default=None, help="file name stem (default: <device>-<date>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else []
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    import sys

    args = parse_args(argv if argv is not None else sys.argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    elif not torch.cuda.is_available() or args.device == "cpu":
        # Decode steps are too small to gain from intra-op threads, and on a shared machine a helper
        # thread waiting for a core stalls every operation: one thread gives steady numbers.
        torch.set_num_threads(1)
    result = run(args)
    paths = write_results(result, args.out, args.stem)
    print(summary_markdown(result))
    print("written:", ", ".join(str(p) for p in paths.values()))
    return result


if __name__ == "__main__":
    main()
