"""Argument checks shared by every kvlab module.

A course that teaches exactness must not answer a wrong question: every public function refuses bad
input up front, with a message that names the argument, the value it got and what is allowed
(`batch_size=0 must be an integer >= 1`), instead of failing deep inside PyTorch or returning a wrong
number. All checks raise `ValueError`: counts (`integer`), numbers (`number`), flags (`boolean`), names
(`choice`), devices (`device`), tensors (`tensor`) and float dtypes (`float_dtype`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import numpy as np

# A bound on any count of tokens (a context, a batch): far above any model's context, far below where
# int64 overflows or a float loses whole numbers, so arithmetic in seconds or bytes stays exact.
MAX_TOKENS = 2**40


def integer(name: str, value, low: int | None = 1, high: int | None = None) -> int:
    """`value` as a Python int when it is a whole number (not a bool, not a float) in [low, high].

    numpy integers are accepted (and converted); `low=None` means no lower bound.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={shown(value)} must be an integer{_range_text(low, high)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name}={shown(value)} must be an integer{_range_text(low, high)}")
    return value


def number(name: str, value, low: float | None = None, high: float | None = None,
           low_inclusive: bool = True, high_inclusive: bool = True) -> float:
    """`value` as a finite float in [low, high] (open at an end with `low_inclusive=False` or
    `high_inclusive=False`). numpy scalars are accepted; an integer too large for a float
    (10**400) is refused like infinity, not left to raise OverflowError later."""
    bounds = _range_text(low, high, low_inclusive, high_inclusive)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={shown(value)} must be a finite number{bounds}")
    try:
        as_float = float(value)
    except OverflowError:  # a Python int beyond a float's range (about 1.8e308)
        raise ValueError(f"{name}={shown(value)} must be a finite number{bounds}: it is beyond a "
                         "float's range (about 1.8e308)") from None
    if not math.isfinite(as_float):
        raise ValueError(f"{name}={shown(value)} must be a finite number{bounds}")
    too_low = low is not None and (as_float < low if low_inclusive else as_float <= low)
    too_high = high is not None and (as_float > high if high_inclusive else as_float >= high)
    if too_low or too_high:
        raise ValueError(f"{name}={as_float!r} must be a number{bounds}")
    return as_float


def boolean(name: str, value) -> bool:
    """`value` as a bool when it is True or False (numpy's bools too). Anything else is refused:
    a truthy string such as "no" or a number such as 2 would otherwise silently mean True."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name}={shown(value)} must be True or False")


def choice(name: str, value, allowed: Iterable):
    """`value` when it is one of `allowed`; else a message listing them."""
    allowed = list(allowed)
    try:
        ok = value in allowed
    except TypeError:  # an unhashable value asked of a dict's keys
        ok = False
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: {', '.join(map(repr, allowed))}")
    return value


def device(name: str, value):
    """`value` as a torch.device kvlab can use here: "cpu", "meta", and "cuda" / "cuda:N" or "mps"
    only where PyTorch has them; None (PyTorch's default device) passes through. A name torch does
    not know ("gpu"), a GPU this machine lacks, or a CPU-only build asked for "cuda" is refused with
    the devices that are allowed, instead of torch's own error deep inside an allocation."""
    import torch

    if value is None:
        return None
    allowed = ["'cpu'", "'meta'"]
    if torch.cuda.is_available():
        allowed += ["'cuda'"] + [f"'cuda:{i}'" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        allowed.append("'mps'")
    no_cuda = ("this is a CPU-only build of PyTorch" if torch.version.cuda is None
               else "no CUDA GPU is visible on this machine")
    allowed_text = f"allowed: {', '.join(allowed)}"
    if not torch.cuda.is_available():
        allowed_text += f" (CUDA is not available: {no_cuda})"
    dev = None
    if not isinstance(value, bool) and isinstance(value, (str, torch.device, int)):
        try:
            dev = torch.device(value)
        except (RuntimeError, ValueError, TypeError):
            dev = None
    if dev is None:
        raise ValueError(f"{name}={shown(value)} is not a device; {allowed_text}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={shown(value)} needs CUDA, which is not available ({no_cuda}); "
                         f"allowed: {', '.join(allowed)}")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{name}={shown(value)}: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s); {allowed_text}")
    if dev.type not in ("cpu", "meta", "cuda") and f"'{dev.type}'" not in allowed:
        raise ValueError(f"{name}={shown(value)} is not a device kvlab can use here; {allowed_text}")
    return dev


def tensor(name: str, value, *, floating: bool = False, non_empty: bool = False):
    """`value` when it is a torch.Tensor (of a floating-point dtype with `floating`, with at least
    one element with `non_empty`); lists and NumPy arrays are refused, saying how to convert them."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(value).__name__} {shown(value)} "
                         "(convert it with torch.as_tensor(...))")
    if floating and not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor; got dtype {value.dtype}")
    if non_empty and value.numel() == 0:
        raise ValueError(f"{name} has shape {tuple(value.shape)}: no elements")
    return value


def float_dtype(name: str, value, purpose: str = "hold floating-point values"):
    """`value` when it is a floating-point torch.dtype; an integer or bool dtype would truncate."""
    import torch

    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"{name}={value!r} cannot {purpose}; allowed: a floating-point "
                         "torch.dtype (torch.float32, torch.float16, torch.bfloat16)")
    return value


def _range_text(low, high, low_inclusive: bool = True, high_inclusive: bool = True) -> str:
    if low is not None and high is not None:
        return f" in {'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}"
    if low is not None:
        return f" {'>=' if low_inclusive else '>'} {low}"
    if high is not None:
        return f" {'<=' if high_inclusive else '<'} {high}"
    return ""


def shown(value) -> str:
    """repr(value), shortened for a message: a 400-digit integer as its first digits and its length."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        digits = str(abs(value))
        return f"{'-' if value < 0 else ''}{digits[:6]}... (an integer of {len(digits)} digits)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
