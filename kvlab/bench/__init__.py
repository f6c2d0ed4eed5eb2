"""Benchmarks done right: `python -m kvlab.bench [--compare-hf] [--real-model]`.

Timing rules: run each thing once to warm up (lazy initialisation, caches, CUDA graph capture),
then several times, and quote the **median**. On a GPU, work is queued asynchronously: a timer
read right after a call measures how fast Python *queued* the kernels, not how fast the GPU ran
them, so every timed call is bracketed by CUDA events and synchronized. When two things are
compared (kvlab against `transformers`), their runs are interleaved in one process, so a busy
machine slows both alike.

The package, one job a module; the names below are importable from `kvlab.bench` itself:
- `timing`: `time_call`, `time_interleaved`, `median`, `op_counts`, `fit_step_time`;
- `machine`: what a run was measured on, and the bandwidth it runs against (a GPU's data-sheet
  entry, `kvlab.memory.match_gpu`, or "unknown" and a copy measured beyond its L2);
- `sweeps`: naive vs cached decoding across lengths, the fixed-shape step eager vs CUDA-graphed /
  compiled, batch size, cache memory measured vs `kvlab.memory`'s formula, and the achieved share of
  the bandwidth roofline (`kvlab.roofline` holds the theory);
- `compare`: `compare_hf` (the same random weights in `transformers` and in kvlab, side by side) and
  `compare_real_model` (the course's real model), with transformers eager and compiled, labelled, and
  the tokens checked by `first_divergence` and `teacher_forced_agreement`;
- `speculation`: speculative vs plain greedy decoding on kvlab-tiny (prompt lookup, kvlab-tiny-draft) and
  the real model (prompt lookup, early exit), with the acceptance and Leviathan et al.'s expected speed-up;
- `report`: result files `benchmarks/<device>-<date>.json|.csv|.md` and the index `benchmarks/README.md`;
- `cli`: the command line (`python -m kvlab.bench --help`).
"""

from .compare import (
    compare_hf,
    compare_models,
    compare_real_model,
    first_divergence,
    hf_compiles,
    hf_generate_kwargs,
    hf_twin,
    teacher_forced_agreement,
)
from .machine import (
    copy_bandwidth,
    copy_bytes_beyond_l2,
    cpu_name,
    device_bandwidth,
    machine,
)
from .speculation import pass_costs, speculative_prompts, sweep_speculative
from .sweeps import (
    CPU_CONFIG,
    GPU_CONFIG,
    TORCH_DTYPE_NAMES,
    memory_check,
    random_model,
    random_prompt,
    roofline_rows,
    sweep_batch,
    sweep_lengths,
    sweep_modes,
)
from .timing import CLOCKS, fit_step_time, median, op_counts, time_call, time_interleaved

__all__ = ["CLOCKS", "CPU_CONFIG", "GPU_CONFIG", "TORCH_DTYPE_NAMES", "compare_hf",
           "compare_models", "compare_real_model", "copy_bandwidth", "copy_bytes_beyond_l2", "cpu_name",
           "device_bandwidth", "first_divergence", "fit_step_time", "hf_compiles", "hf_generate_kwargs",
           "hf_twin", "machine", "median", "memory_check", "op_counts", "pass_costs",
           "random_model", "random_prompt", "roofline_rows", "speculative_prompts", "sweep_batch",
           "sweep_lengths", "sweep_modes", "sweep_speculative", "teacher_forced_agreement", "time_call",
           "time_interleaved"]
