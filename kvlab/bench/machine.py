"""What the numbers were measured on (device, CPU and GPU names, versions) and the bandwidth a
decode step runs against: a GPU's data-sheet figure, or a measured copy on the CPU."""

from __future__ import annotations

import datetime as dt
import platform
from pathlib import Path

import torch

from .. import env, memory
from .timing import median, time_call


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


def matvec_bandwidth(device: torch.device | str = "cpu", nbytes: int = 128 * memory.MiB,
                     repeats: int = 10, clock: str = "wall") -> float:
    """Bytes/s a matrix-vector product streams (the matrix is read once; vector and result are tiny):
    the roof a batch-1 decode step of a bandwidth-bound model runs into. Measure it with the clock
    the decode timings use."""
    device = torch.device(device)
    cols = 4096
    w = torch.randn(nbytes // 4 // cols, cols, device=device)
    x = torch.randn(cols, device=device)
    times = [time_call(lambda: torch.mv(w, x), device, clock) for _ in range(repeats + 1)][1:]
    return w.nbytes / median(times)


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
