"""Where am I running? Device, GPU, bf16 support, Colab, versions — and sizes that suit them."""

from __future__ import annotations

import os
import platform
import shutil
import sys

import torch


def device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
