"""What the numbers were measured on (device, CPU and GPU names, versions) and the bandwidth a
decode step runs against: a known GPU's data-sheet figure (matched on its full CUDA name and its
memory), otherwise a measured copy far larger than the GPU's L2 cache, or on the CPU than its caches."""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path

import torch

from .. import env, memory
from .timing import median, time_call, time_interleaved


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device | str | None = None) -> dict:
    """What the numbers were measured on: device, CPU/GPU names, versions, threads, date; on a GPU
    also its L2 size and the data-sheet entry it matched ("unknown" when none did)."""
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
        # How idle OpenMP threads wait: spinning ("ACTIVE", and by default for a while) burns CPU
        # time that a CPU-time clock counts as work (kvlab.bench.__main__ sets PASSIVE).
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (OpenMP's default: spin, then sleep)"),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        gpu = env.report()  # the same GPU facts chapter 00 shows
        props = torch.cuda.get_device_properties(device)
        known, l2 = memory.match_gpu(props.name, props.total_memory), _l2_bytes(props)
        info.update(gpu=gpu["gpu"], gpu_memory_gib=gpu["gpu_memory_gib"], cuda=torch.version.cuda,
                    gpu_l2_mib=l2 / memory.MiB if l2 else None,
                    gpu_data_sheet=known.name if known else "unknown")
    return info


def _l2_bytes(props) -> int:
    """The L2 cache size CUDA reports (0 when this PyTorch does not expose it)."""
    return int(getattr(props, "L2_cache_size", 0) or 0)


# A copy must stream from memory, not from a cache: 4× the L2 (an H200 reports 60 MB of L2, so a
# 32 MiB copy would run from it), and never less than this floor.
COPY_FLOOR_BYTES = 256 * memory.MiB
COPY_WITHOUT_L2_SIZE = memory.GiB  # when the L2 size is unknown: far beyond any GPU's L2


def copy_bytes_beyond_l2(l2_bytes: int | None) -> int:
    """Bytes to copy so that an L2 cache of l2_bytes holds at most a quarter of them."""
    if not l2_bytes:
        return COPY_WITHOUT_L2_SIZE
    return max(4 * int(l2_bytes), COPY_FLOOR_BYTES)


def copy_bandwidth(device: torch.device | str = "cpu", nbytes: int | None = None,
                   repeats: int = 5) -> float:
    """Measured memory bandwidth in bytes/s: copy a buffer far larger than the caches (on a GPU at
    least 4× its L2, `copy_bytes_beyond_l2`; on the CPU 128 MiB, beyond most CPUs' last-level cache).
    A copy reads nbytes and writes nbytes, so it moves 2 × nbytes."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (copy_bytes_beyond_l2(_l2_bytes(torch.cuda.get_device_properties(device)))
                  if device.type == "cuda" else 128 * memory.MiB)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = [time_call(lambda: dst.copy_(src), device) for _ in range(repeats + 1)][1:]
    return 2 * nbytes / median(times)


def matvec_bandwidth(device: torch.device | str = "cpu", nbytes: int = 128 * memory.MiB,
                     repeats: int = 10, clock: str = "wall") -> float:
    """Bytes/s a matrix-vector product streams (the matrix is read once; vector and result are tiny):
    the roof a batch-1 decode step of a bandwidth-bound model runs into. The matrix is multiplied in
    both layouts a decoder may store it in, (out, in) as `torch.mv` reads it and (in, out) as
    `x @ W_t` does, interleaved, and the faster counts (a BLAS may stream one better than the
    other). Measure it with the clock the decode timings use."""
    device = torch.device(device)
    cols = 4096
    w = torch.randn(nbytes // 4 // cols, cols, device=device)
    w_t = w.t().contiguous()
    x = torch.randn(cols, device=device)
    times = time_interleaved({"(out, in)": lambda: torch.mv(w, x), "(in, out)": lambda: x @ w_t},
                             repeats, 1, device, clock=clock)
    return w.nbytes / min(median(t) for t in times.values())


def device_bandwidth(device: torch.device | str | None = None) -> tuple[float, str]:
    """(bytes/s, where the figure comes from): the data-sheet figure of a GPU `kvlab.memory.match_gpu` knows,
    otherwise a measured copy bandwidth (an unknown GPU says so, and its name)."""
    device = torch.device(device) if device is not None else env.device()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        known = memory.match_gpu(props.name, props.total_memory)
        if known is not None:
            return known.bandwidth_bytes_per_s, f"data sheet ({known.name}: {known.source})"
        nbytes = copy_bytes_beyond_l2(_l2_bytes(props))
        return (copy_bandwidth(device, nbytes),
                f"unknown GPU {props.name!r}: measured copy of {nbytes / memory.MiB:,.0f} MiB")
    return copy_bandwidth(device), "measured copy bandwidth"
