"""What the numbers were measured on (device, CPU and GPU names, versions) and the bandwidth a
decode step runs against: a known GPU's data-sheet figure (matched on its full CUDA name and its
memory), otherwise a measured copy far larger than the GPU's L2 cache, or on the CPU than its caches."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
from dataclasses import dataclass
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
        known, l2 = match_gpu(props.name, props.total_memory), _l2_bytes(props)
        info.update(gpu=gpu["gpu"], gpu_memory_gib=gpu["gpu_memory_gib"], cuda=torch.version.cuda,
                    gpu_l2_mib=l2 / memory.MiB if l2 else None,
                    gpu_data_sheet=known.name if known else "unknown")
    return info


@dataclass(frozen=True)
class KnownGPU:
    """A GPU model as its data sheet names it, and how its CUDA device name and memory identify it."""

    name: str                   # e.g. "H100 80GB PCIe"
    chip: str                   # the word of the CUDA name that names the chip: "H100"
    forms: frozenset            # form-factor words the name may carry (see _form); None: none named
    sold_gb: int                # memory as sold: "80GB" is 80 GiB of chips, CUDA reports a little less
    bandwidth_bytes_per_s: float
    source: str


# The data sheets' memory bandwidths. The SXM/PCIe/NVL variants of one chip differ (an H100 PCIe has
# 60 % of an H100 SXM's bandwidth), so a name is matched whole, not by its first word. Entries of
# kvlab.memory.GPUS take their figure from there (sources in docs/references.md, "GPUs"); the others:
#   A100 80GB PCIe 1,935 GB/s, A100 40GB (PCIe and SXM) 1,555 GB/s: NVIDIA A100 data sheet,
#     https://www.nvidia.com/en-us/data-center/a100/
#   H100 PCIe 2.0 TB/s, H100 NVL 3.9 TB/s: NVIDIA H100 data sheet,
#     https://www.nvidia.com/en-us/data-center/h100/
# Not listed, so "unknown" (measured): GH200 (its HBM differs by version), H200 NVL, H800, MIG slices.


def _sheet(name: str) -> float:
    return memory.GPUS[name].bandwidth_bytes_per_s


KNOWN_GPUS: tuple[KnownGPU, ...] = (
    KnownGPU("T4 16GB", "T4", frozenset({None}), 16, _sheet("T4 16GB"),
             "NVIDIA T4 data sheet (kvlab.memory.GPUS)"),
    KnownGPU("A100 40GB", "A100", frozenset({None, "PCIE", "SXM"}), 40, _sheet("A100 40GB"),
             "NVIDIA A100 data sheet: 1,555 GB/s for the PCIe and the SXM 40GB part (kvlab.memory.GPUS)"),
    KnownGPU("A100 80GB SXM", "A100", frozenset({"SXM"}), 80, _sheet("A100 80GB"),
             "NVIDIA A100 data sheet (kvlab.memory.GPUS)"),
    KnownGPU("A100 80GB PCIe", "A100", frozenset({"PCIE"}), 80, 1935e9, "NVIDIA A100 data sheet"),
    # CUDA names the H100 SXM5 part "NVIDIA H100 80GB HBM3": HBM3 without PCIe or NVL means SXM.
    KnownGPU("H100 80GB SXM", "H100", frozenset({"SXM", "HBM3"}), 80, _sheet("H100 80GB"),
             "NVIDIA H100 data sheet (kvlab.memory.GPUS)"),
    KnownGPU("H100 80GB PCIe", "H100", frozenset({"PCIE"}), 80, 2.0e12, "NVIDIA H100 data sheet"),
    KnownGPU("H100 NVL 94GB", "H100", frozenset({"NVL"}), 94, 3.9e12, "NVIDIA H100 data sheet"),
    KnownGPU("H200 141GB SXM", "H200", frozenset({None, "SXM"}), 141, _sheet("H200 141GB"),
             "NVIDIA H200 data sheet (kvlab.memory.GPUS)"),
)

# The memory CUDA reports, as a share of the memory as sold in GiB: a T4 "16GB" reports 14.56 GiB
# (0.91), an A100 "80GB" 79.15 GiB (0.99). Anything outside (a MIG slice, another model) is not a match.
_MEMORY_SHARE = (0.88, 1.01)


def _form(words: set[str]) -> str | None:
    """The form factor a CUDA device name states: PCIE, NVL, SXM (SXM4, SXM5…), HBM3, or None."""
    for form in ("PCIE", "NVL"):
        if form in words:
            return form
    if any(w.startswith("SXM") for w in words):
        return "SXM"
    return "HBM3" if "HBM3" in words else None


def match_gpu(name: str, memory_bytes: int | None = None) -> KnownGPU | None:
    """The data-sheet entry (`KNOWN_GPUS`) for a CUDA device name such as 'NVIDIA A100-SXM4-80GB' and
    its total memory in bytes, or None ("unknown") unless exactly one entry fits: the chip, the form
    factor (PCIe, NVL, SXM), the size in the name ("80GB") and the memory CUDA reports must all agree.
    Without memory_bytes, a chip sold in several sizes needs its size in the name."""
    words = set(re.findall(r"[A-Z0-9]+", name.upper()))
    if "MIG" in words:  # a slice of a GPU has a share of its bandwidth
        return None
    sizes = {int(w[:-2]) for w in words if re.fullmatch(r"\d+GB", w)}
    if not sizes and memory_bytes is None and len({g.sold_gb for g in KNOWN_GPUS if g.chip in words}) > 1:
        return None  # the chip comes in several sizes, and neither the name nor the memory says which
    form = _form(words)
    fits = [g for g in KNOWN_GPUS
            if g.chip in words and form in g.forms and (not sizes or sizes == {g.sold_gb})
            and (memory_bytes is None
                 or _MEMORY_SHARE[0] <= memory_bytes / (g.sold_gb * memory.GiB) <= _MEMORY_SHARE[1])]
    return fits[0] if len(fits) == 1 else None


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
    """(bytes/s, where the figure comes from): the data-sheet figure of a GPU `match_gpu` knows,
    otherwise a measured copy bandwidth (an unknown GPU says so, and its name)."""
    device = torch.device(device) if device is not None else env.device()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        known = match_gpu(props.name, props.total_memory)
        if known is not None:
            return known.bandwidth_bytes_per_s, f"data sheet ({known.name}: {known.source})"
        nbytes = copy_bytes_beyond_l2(_l2_bytes(props))
        return (copy_bandwidth(device, nbytes),
                f"unknown GPU {props.name!r}: measured copy of {nbytes / memory.MiB:,.0f} MiB")
    return copy_bandwidth(device), "measured copy bandwidth"
