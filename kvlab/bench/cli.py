"""The command line, `python -m kvlab.bench [--compare-hf]`: run the sweeps asked for, write the result
files (`kvlab.bench.report`) and print the summary."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from .. import env, memory
from ..config import PRESETS
from .compare import compare_hf
from .machine import device_bandwidth, machine, matvec_bandwidth
from .report import summary_markdown, write_results
from .sweeps import (
    CPU_CONFIG,
    GPU_CONFIG,
    HF_CONFIGS,
    TORCH_DTYPE_NAMES,
    memory_check,
    random_model,
    roofline_rows,
    sweep_batch,
    sweep_lengths,
    sweep_modes,
)
from .timing import CLOCKS


def fast_modes(device: torch.device, with_compile: bool = False) -> list[str]:
    """The `kvlab.fast` modes worth timing here: eager always, the CUDA graph on a GPU, and
    torch.compile when asked (on the CPU it takes a while to build)."""
    return ["eager"] + (["graph"] if device.type == "cuda" else []) + (["compile"] if with_compile else [])


def run(args: argparse.Namespace) -> dict:
    """Run the sweeps args ask for; return {"machine", "model", "rows", "notes", "args"}."""
    device = torch.device(args.device) if args.device else env.device()
    dtype = env.half_dtype(device)
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
    model = random_model(config, device, dtype)
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
        hf_config = HF_CONFIGS[args.hf_config] if device.type == "cpu" else GPU_CONFIG
        if quick:
            hf_config = config
        # On the CPU the roof is what a matrix-vector product streams, on the same clock as the timings.
        bandwidth = (matvec_bandwidth(device, clock=clock) if device.type == "cpu"
                     else device_bandwidth(device)[0])
        rows += compare_hf(hf_config, 8 if quick else args.hf_new_tokens, repeats=args.repeats,
                           device=device, progress=progress, clock=clock,
                           fast_modes=fast_modes(device, args.compile), bandwidth_bytes_per_s=bandwidth)
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
    p = argparse.ArgumentParser(prog="python -m kvlab.bench",
                                description="Benchmarks done right: warm-up, medians, CUDA events, "
                                            "interleaved comparisons.")
    p.add_argument("--compare-hf", action="store_true",
                   help="also time transformers generate (dynamic and static cache) on the same weights")
    p.add_argument("--sweeps", default="lengths,modes,batch,memory,roofline",
                   help="comma-separated: lengths, modes, batch, memory, roofline (or none)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median)")
    p.add_argument("--hf-new-tokens", type=int, default=64, help="tokens to generate in --compare-hf")
    p.add_argument("--hf-config", choices=sorted(HF_CONFIGS), default="small",
                   help="model for --compare-hf on the CPU: small (overhead-bound, the default) or 25m "
                        "(bandwidth-bound)")
    p.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="a preset (random weights); default: a small model on the CPU, 1.1B on a GPU")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the GPU when there is one)")
    p.add_argument("--clock", choices=CLOCKS, default=None,
                   help="wall or cpu (process) time; default cpu on the CPU, wall on a GPU")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: kvlab.env.setup's, 1 on the CPU)")
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
    env.setup(args.threads)  # the course's thread policy (kvlab.env): one CPU thread unless asked
    if args.device == "cpu" and args.threads is None and torch.cuda.is_available():
        torch.set_num_threads(env.DEFAULT_CPU_THREADS)  # a CPU run on a GPU machine: the same policy
    result = run(args)
    paths = write_results(result, args.out, args.stem)
    print(summary_markdown(result))
    print("written:", ", ".join(str(p) for p in paths.values()))
    return result

