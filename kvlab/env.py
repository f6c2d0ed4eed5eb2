"""Where am I running? Device, GPU, bf16 support, Colab, versions — and sizes that suit them."""

from __future__ import annotations

import os
import platform
import shutil
import sys

import torch

from . import validate


def device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The course's CPU thread policy, in one place. Its tensors are tiny (a decode step multiplies
# matrices of a few kilobytes): splitting such work over threads costs more in hand-offs than it
# gains, and on a shared two-core machine a helper thread that waits for a core stalls every
# operation. One thread gives the fastest and steadiest timings there. A learner with many cores who
# runs bigger sizes changes it once: `export KVLAB_THREADS=8` before starting Jupyter (every chapter),
# or `kvlab.env.setup(threads=8)` in one chapter's set-up cell.
DEFAULT_CPU_THREADS = 1
THREADS_VARIABLE = "KVLAB_THREADS"


def setup(threads: int | None = None) -> torch.device:
    """A chapter's set-up call: set PyTorch's CPU threads and return the device to run on.

    threads: intra-op CPU threads. None means ${KVLAB_THREADS} when it is set, else 1 on a machine
    without a GPU; on a GPU machine (where the CPU only queues kernels) None leaves torch's default.
    """
    if threads is None and os.environ.get(THREADS_VARIABLE):
        text = os.environ[THREADS_VARIABLE]
        try:
            threads = int(text)
        except ValueError:
            raise ValueError(f"{THREADS_VARIABLE}={text!r} must be a whole number of threads >= 1") from None
    dev = device()
    if threads is None and dev.type == "cpu":
        threads = DEFAULT_CPU_THREADS
    if threads is not None:
        torch.set_num_threads(validate.integer("threads", threads))
    return dev


def available_memory(dev=None) -> int | None:
    """Bytes that can still be allocated on `dev` (default: the CPU): the GPU's free memory, or the
    system's available memory (Linux /proc/meminfo); None where it cannot be told (the meta
    device). A device this machine does not have is refused (`kvlab.validate.device`)."""
    dev = validate.device("dev", dev) or torch.device("cpu")
    if dev.type == "cuda":  # validate.device refused it if CUDA is not available
        return torch.cuda.mem_get_info(dev)[0]
    if dev.type == "meta":
        return None
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def on_colab() -> bool:
    return "COLAB_RELEASE_TAG" in os.environ or "google.colab" in sys.modules


def fast_bf16(dev: torch.device | None = None) -> bool:
    """Does this GPU compute bf16 natively (Ampere, compute capability 8.0, and newer)?

    Not `torch.cuda.is_bf16_supported()`: that also says yes where bf16 is only emulated (a T4).
    """
    dev = dev or device()
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 8


def half_dtype(dev: torch.device | None = None) -> torch.dtype:
    """bf16 where the GPU does it fast, fp16 on older GPUs (Colab's T4), fp32 on the CPU."""
    dev = dev or device()
    if dev.type != "cuda":
        return torch.float32
    return torch.bfloat16 if fast_bf16(dev) else torch.float16


def cpp_compiler() -> str | None:
    """The C++ compiler `torch.compile` would use on the CPU ($CXX, g++, c++ or clang++), or None."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else []
    return next(filter(None, map(shutil.which, names + ["g++", "c++", "clang++"])), None)


def report() -> dict:
    """The facts a learner (or a bug report) needs; `print_report()` shows them."""
    dev = device()
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": dev.type,
        "cpu_threads": torch.get_num_threads(),
        "colab": on_colab(),
        "gpu": None,
        "gpu_memory_gib": None,
        "bf16": None,
        "compute_dtype": str(half_dtype(dev)).replace("torch.", ""),
        "cpp_compiler": os.path.basename(cpp_compiler() or "") or None,  # for torch.compile on a CPU
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 1024**3, 1),
                    bf16=fast_bf16(dev))
    return info


def print_report() -> None:
    for key, value in report().items():
        print(f"{key:>15}: {value}")
