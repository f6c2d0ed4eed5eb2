"""kvlab.validate: the argument checks every module shares."""

import math

import numpy as np
import pytest

from kvlab.validate import choice, integer, number


@pytest.mark.parametrize("value", [1, 7, np.int64(7), np.int32(1), np.uint8(3)])
def test_integer_accepts_whole_numbers_and_returns_a_python_int(value):
    out = integer("n", value)
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value, message", [
    (0, "n=0 must be an integer >= 1"),
    (-3, "n=-3 must be an integer >= 1"),
    (2.0, "n=2.0 must be an integer >= 1"),
    (2.5, "n=2.5 must be an integer >= 1"),
    (True, "n=True must be an integer >= 1"),
    ("3", "n='3' must be an integer >= 1"),
    (None, "n=None must be an integer >= 1"),
    (np.float64(3), "n=np.float64(3.0) must be an integer >= 1"),
])
def test_integer_refuses_what_is_not_a_count(value, message):
    with pytest.raises(ValueError) as err:
        integer("n", value)
    assert str(err.value) == message


def test_integer_bounds():
    assert integer("n", 0, low=0) == 0 and integer("n", -5, low=None) == -5
    assert integer("n", 10, low=0, high=10) == 10
    with pytest.raises(ValueError, match=r"n=11 must be an integer in \[0, 10\]"):
        integer("n", 11, low=0, high=10)
    with pytest.raises(ValueError, match="n=3 must be an integer <= 2"):
        integer("n", 3, low=None, high=2)
    assert integer("n", 2**70) == 2**70  # Python ints have no overflow


def test_number():
    assert number("t", 1) == 1.0 and type(number("t", np.float32(0.5))) is float
    assert number("t", 0.0, low=0) == 0.0
    with pytest.raises(ValueError, match=r"t=0\.0 must be a number > 0"):
        number("t", 0.0, low=0, low_inclusive=False)
    with pytest.raises(ValueError, match=r"t=2\.0 must be a number in \[0, 1\]"):
        number("t", 2.0, low=0, high=1)
    for bad in (math.nan, math.inf, -math.inf, "1", None, True):
        with pytest.raises(ValueError, match=f"t={bad!r} must be a finite number"):
            number("t", bad)


def test_choice():
    assert choice("kind", "a", ("a", "b")) == "a"
    assert choice("kind", "x", {"x": 1}) == "x"
    with pytest.raises(ValueError, match="kind='c' is not allowed; allowed: 'a', 'b'"):
        choice("kind", "c", ["a", "b"])
    with pytest.raises(ValueError, match=r"kind=\['a'\] is not allowed"):
        choice("kind", ["a"], {"a": 1})  # unhashable: refused, not a TypeError
