"""The command line, `python -m kvlab.bench [--compare-hf] [--real-model]`: run the sweeps and
comparisons asked for, write the result files (`kvlab.bench.report`) and print the summary. A run whose
fp32 comparison gives other tokens than transformers fails (exit status 1) after writing its files."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch

from .. import course_model, env, memory
from ..config import PRESETS
from .compare import compare_hf, compare_real_model
from .machine import copy_bandwidth, device_bandwidth, machine, matvec_bandwidth
from .profile import decode_profile
from .report import scheduler_failures, speculative_failures, summary_markdown, token_failures, write_results
from .scheduling import scheduler_kvlab_tiny, scheduler_real_model
from .speculation import speculative_kvlab_tiny, speculative_real_model
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
    """Run the sweeps and comparisons args ask for; return {"machine", "model", "rows", "notes", "args"}."""
    device = torch.device(args.device) if args.device else env.device()
    on_gpu = device.type == "cuda"
    dtype = env.half_dtype(device)
    config = PRESETS[args.model] if args.model else (GPU_CONFIG if on_gpu else CPU_CONFIG)
    quick = args.quick
    if quick:
        config = config.with_(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256)
    sweeps = [s for s in args.sweeps.split(",") if s and s != "none"]
    unknown = set(sweeps) - {"lengths", "modes", "batch", "memory", "roofline", "speculative", "scheduler",
                             "profile"}
    if unknown:
        raise ValueError(f"unknown sweeps {sorted(unknown)}; allowed: lengths, modes, batch, memory, "
                         "roofline, speculative, scheduler, profile, none")
    batch_sizes = _positive_ints("--batch-sizes", args.batch_sizes)
    spec_ks = _positive_ints("--speculative-k", args.speculative_k)
    rows: list[dict] = []
    notes = []
    lengths = [8, 16] if quick else ([32, 64, 128, 256] if device.type == "cpu" else [64, 256, 512])
    new_tokens = args.new_tokens or (8 if quick else (256 if on_gpu else 64))
    progress = not args.no_progress
    clock = args.clock or ("wall" if on_gpu else "cpu")
    modes = fast_modes(device, args.compile)
    if not args.compile and not on_gpu and ("modes" in sweeps or args.compare_hf or args.real_model):
        notes.append("Compiled/graphed decoding was not run: CUDA graphs need a GPU, and "
                     "torch.compile on the CPU was not requested (--compile).")
    comparing = args.compare_hf or args.real_model
    bandwidth, source = device_bandwidth(device) if on_gpu or "roofline" in sweeps else (None, None)
    # On a GPU, also the share of what a copy far larger than the L2 cache moves: the data-sheet figure
    # is a peak that no program reaches.
    measured = copy_bandwidth(device) if on_gpu else None
    random_sweeps = [s for s in sweeps if s not in ("speculative", "scheduler", "profile")]
    if random_sweeps:
        model = random_model(config, device, dtype)
        if "lengths" in sweeps:
            rows += sweep_lengths(model, lengths, repeats=args.repeats, progress=progress, clock=clock)
        if "modes" in sweeps or "roofline" in sweeps:
            rows += sweep_modes(model, new_tokens, modes, repeats=args.repeats, progress=progress,
                                clock=clock)
        if "batch" in sweeps:
            rows += sweep_batch(model, [1, 4] if quick else batch_sizes, new_tokens,
                                "graph" if on_gpu else "eager", repeats=args.repeats, progress=progress,
                                clock=clock)
        if "memory" in sweeps:
            shape = (8, min(1024, config.max_seq_len)) if on_gpu and not quick else (4, 8 + new_tokens)
            rows.append(memory_check(model, *shape, mode="graph" if on_gpu else "eager"))
        if "roofline" in sweeps:
            rows += roofline_rows(model, bandwidth, source,
                                  [r for r in rows if r["sweep"] in ("modes", "batch")], measured)
        del model
    if "speculative" in sweeps:  # trained models: random ones guess nothing worth accepting
        spec = dict(repeats=args.repeats, clock=clock, progress=progress)
        rows += speculative_kvlab_tiny([2] if quick else spec_ks, 8 if quick else args.speculative_new_tokens,
                                       n_prompts=1 if quick else 4, prompt_len=16 if quick else 128,
                                       device=device, **spec)
        if args.real_model:
            rows += speculative_real_model([2] if quick else [3], 8 if quick else 48,
                                           n_prompts=1 if quick else 2, prompt_len=16 if quick else 96,
                                           device=device, **spec)
    if "profile" in sweeps:  # where a decode step's time goes: the real model when asked for
        target = (course_model.load_course_model(device=device)[0] if args.real_model
                  else random_model(config, device, dtype))
        rows += decode_profile(target, prompt_len=8 if quick else 64, steps=2 if quick else 16)
        del target
    if "scheduler" in sweeps:  # a trained model, real text: outputs checked against each request alone
        sched = dict(repeats=args.repeats, clock=clock, progress=progress, device=device, quick=quick)
        rows += scheduler_kvlab_tiny(**sched)
        if args.real_model:
            rows += scheduler_real_model(**sched)
    # On the CPU the roof of a batch-1 decode is what a matrix-vector product streams, on the clock
    # of the timings; on a GPU the data-sheet figure (and the measured copy beside it).
    roof = (bandwidth if on_gpu else matvec_bandwidth(device, clock=clock)) if comparing else None
    compare_args = dict(repeats=args.repeats, device=device, progress=progress, clock=clock,
                        fast_modes=modes, hf_compiled=on_gpu or args.compile, bandwidth_bytes_per_s=roof,
                        measured_bandwidth_bytes_per_s=measured)
    if args.compare_hf:
        hf_config = config if quick or args.model or on_gpu else HF_CONFIGS[args.hf_config]
        rows += compare_hf(hf_config, 8 if quick else args.hf_new_tokens,
                           prompt_len=args.prompt_tokens or 16, **compare_args)
    if args.real_model:
        rows += compare_real_model(8 if quick else args.hf_new_tokens,
                                   prompt_len=args.prompt_tokens or (8 if quick else 64), **compare_args)
    if clock == "cpu":
        threads = torch.get_num_threads()
        notes.append(f"Timed in CPU seconds of this process (time.process_time, all its {threads} "
                     f"thread{'s' if threads > 1 else ''} together), so other programs on a shared "
                     "machine do not skew the numbers; tokens/s are per CPU second. OpenMP wait policy: "
                     f"{os.environ.get('OMP_WAIT_POLICY', 'unset')} (see kvlab.bench.__main__).")
    if not on_gpu:
        notes.append("No GPU was available for this run: every number above is a CPU measurement.")
    model_desc = (f"{config.name or 'custom'}: {config.n_layers} layers, d_model {config.d_model}, "
                  f"{config.n_heads} heads / {config.n_kv_heads} KV heads, vocab {config.vocab_size}, "
                  f"{memory.param_count(config):,} parameters, {TORCH_DTYPE_NAMES[dtype]}"
                  if random_sweeps else "none (no sweeps on random weights run)")
    return {"machine": machine(device), "model": model_desc, "rows": rows, "notes": notes,
            "args": " ".join(args.argv)}


def _positive_ints(option: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{option} {text!r} must be comma-separated whole numbers >= 1, e.g. 1,4,16")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvlab.bench",
                                description="Benchmarks done right: warm-up, medians, CUDA events, "
                                            "interleaved comparisons.")
    p.add_argument("--compare-hf", action="store_true",
                   help="also time transformers generate (dynamic and static cache) on the same weights")
    p.add_argument("--sweeps", default="lengths,modes,batch,memory,roofline,speculative,scheduler,profile",
                   help="comma-separated: lengths, modes, batch, memory, roofline, speculative, scheduler, "
                        "profile "
                        "(or none)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median)")
    p.add_argument("--real-model", action="store_true",
                   help="also compare kvlab and transformers on the course's real model, and run the "
                        "speculative, scheduler and profile sweeps on it "
                        "(kvlab.course_model.load_course_model; $KVLAB_REAL_MODEL picks another checkpoint)")
    p.add_argument("--hf-new-tokens", type=int, default=64,
                   help="tokens to generate in --compare-hf and --real-model")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt length of --compare-hf (default 16) and --real-model (default 64)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="tokens to generate in the modes, batch and memory sweeps (default 64 on the "
                        "CPU, 256 on a GPU)")
    p.add_argument("--batch-sizes", default="1,4,16", help="batch sizes of the batch sweep")
    p.add_argument("--speculative-k", default="1,2,4,6",
                   help="guesses per verify pass of the speculative sweep on kvlab-tiny (with --real-model "
                        "the real model is run with k=3)")
    p.add_argument("--speculative-new-tokens", type=int, default=96,
                   help="tokens each prompt of the speculative sweep generates on kvlab-tiny")
    p.add_argument("--hf-config", choices=sorted(HF_CONFIGS), default="small",
                   help="model for --compare-hf on the CPU: small (overhead-bound, the default) or 25m "
                        "(bandwidth-bound)")
    p.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="a preset (random weights) for the sweeps and --compare-hf; default: a small "
                        "model on the CPU (--hf-config for --compare-hf), 1.1B on a GPU")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the GPU when there is one)")
    p.add_argument("--clock", choices=CLOCKS, default=None,
                   help="wall or cpu (process) time; default cpu on the CPU, wall on a GPU")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: kvlab.env.setup's, 1 on the CPU)")
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile (slow to build on CPU); on the CPU also adds "
                        "transformers' compiled static-cache generate, which a GPU run always has")
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
    failures = token_failures(result) + speculative_failures(result) + scheduler_failures(result)
    if failures:  # the files are written, for a look at the rows; the run still fails
        raise SystemExit("same weights in fp32, speculative decoding and the scheduler must give identical "
                         "tokens, "
                         "but:\n" + "\n".join(failures))
    return result

