"""What a learner might type as an answer, for the checkers' "a hint, never a traceback" tests."""

import re

import numpy as np
import torch
from hypothesis import strategies as st


def stable_id(value) -> str:
    """A test id from repr(value) without memory addresses, the same in every pytest-xdist worker."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


class Opaque:
    """An object no checker knows; its fixed repr keeps test ids equal across pytest-xdist workers."""

    def __repr__(self) -> str:
        return "Opaque()"


# Values no exercise accepts: each must get a hint (a false Verdict), not an exception.
WRONG_VALUES = [
    None, "", "lots", "nan", "inf", "1e999", float("nan"), float("inf"), -float("inf"), 10**400, -(10**400),
    True, [1, 2, 3], (), {"a": 1}, Opaque(), b"14", complex(1, 2), torch.tensor([1.0, 2.0]),
    torch.tensor(float("nan")), torch.ones(3, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.int8),
    print, np.array([1.0, 2.0]), np.array([True]), np.complex128(1 + 2j), torch.tensor([1 + 2j]),
]
# Two-number answers (naive, cached) / (blocks, wasted) with a part no exercise accepts.
WRONG_PAIRS = [(None, None), ("a", "b"), (float("nan"), 1), (1, float("inf")), (10**400, 1),
               (torch.ones(2), 1), ([1], [2]), (1, 2, 3), "12", (Opaque(), 1),
               np.array([1, 2, 3]), torch.tensor([True, False]), (np.array([1, 2]), 1)]


def _raises(*_):
    raise RuntimeError("my bug")


def _float64(*args):
    return tuple(torch.zeros_like(a, dtype=torch.float64) for a in args[:3])


# Functions a learner might pass where a function is asked for.
WRONG_FUNCTIONS = [None, 5, "decode_step", _raises, lambda *a: None, lambda *a: 1.0, lambda *a: "x",
                   lambda *a: (torch.zeros(1),), lambda *a: (torch.zeros(1), torch.zeros(1), torch.zeros(1)),
                   lambda *a: [a[0]] * 3, lambda *a: (torch.zeros(3, 3, dtype=torch.float64),) * 2, _float64,
                   lambda *a: tuple(x.to(torch.int8) for x in a[:3]), lambda *a: {"out": a[0]}]


def anything():
    """A hypothesis strategy for whatever a learner might type: numbers of any size (NaN and
    infinity too), text, bytes, None, booleans and small lists and tuples of those."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
                        st.binary(max_size=8), st.complex_numbers())
    return st.one_of(scalars, st.lists(scalars, max_size=3), st.tuples(scalars, scalars))


def hint_test(checkers, answers):
    """A test, parametrized over `answers`, that each of `checkers` prints a hint and returns a false
    Verdict for every one of them (and raises nothing)."""
    import pytest

    @pytest.mark.parametrize("answer", answers, ids=stable_id)
    def test_any_wrong_answer_gets_a_hint(answer, capsys):
        assert not any(checker(answer) for checker in checkers)
        assert capsys.readouterr().out.count("✗ Not yet. Hint:") == len(checkers)

    return test_any_wrong_answer_gets_a_hint


def verdict_test(checkers, examples: int = 40):
    """A hypothesis test: whatever a learner types (`anything()`), each checker answers with a
    Verdict, right or wrong, and raises nothing."""
    from hypothesis import given, settings

    from kvlab.course.style import Verdict

    @settings(max_examples=examples, deadline=None)
    @given(anything())
    def test_whatever_is_typed_the_checkers_answer_with_a_verdict(answer):
        assert all(isinstance(checker(answer), Verdict) for checker in checkers)

    return test_whatever_is_typed_the_checkers_answer_with_a_verdict
