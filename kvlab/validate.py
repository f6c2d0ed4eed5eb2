"""Argument checks shared by every kvlab module.

A course that teaches exactness must not answer a wrong question: every public function refuses bad
input up front, with a message that names the argument, the value it got and what is allowed
(`batch_size=0 must be an integer >= 1`), instead of failing deep inside PyTorch or returning a wrong
number. All checks raise `ValueError`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable


def integer(name: str, value, low: int | None = 1, high: int | None = None) -> int:
    """`value` as a Python int when it is a whole number (not a bool, not a float) in [low, high].

    numpy integers are accepted (and converted); `low=None` means no lower bound.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be an integer{_range_text(low, high)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name}={value!r} must be an integer{_range_text(low, high)}")
    return value


def number(name: str, value, low: float | None = None, high: float | None = None,
           low_inclusive: bool = True) -> float:
    """`value` as a finite float in [low, high] (or (low, high] with `low_inclusive=False`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number{_range_text(low, high, low_inclusive)}")
    value = float(value)
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    if too_low or (high is not None and value > high):
        raise ValueError(f"{name}={value!r} must be a number{_range_text(low, high, low_inclusive)}")
    return value


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


def _range_text(low, high, low_inclusive: bool = True) -> str:
    if low is not None and high is not None:
        return f" in {'[' if low_inclusive else '('}{low}, {high}]"
    if low is not None:
        return f" {'>=' if low_inclusive else '>'} {low}"
    if high is not None:
        return f" <= {high}"
    return ""
