"""The checkers' number parsing (kvlab.course.style): a right answer counts whatever form it takes
(an int, a float, text with thousands separators, a one-element NumPy array or PyTorch tensor of
any shape; for two numbers a tuple, a list, or a two-element array or tensor), and anything else
is refused with a hint that quotes the value and says what is allowed."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.course import ch01_autoregressive_generation as ch01
from kvlab.course import ch07_serving_many_users as ch07
from kvlab.course.style import NUMBER_FORMS, as_number, as_numbers, number_hint, numbers_hint, numeric

ONE_ELEMENT = [np.array([15]), np.array([[15]]), np.array(15), np.int64(15), np.float32(15),
               torch.tensor([15]), torch.tensor([[15.0]]), torch.tensor(15, dtype=torch.float64),
               torch.tensor([15.0], requires_grad=True), 15, 15.0, "15", " 1_5 ", "1.5e1"]


@pytest.mark.parametrize("answer", ONE_ELEMENT, ids=repr)
def test_a_one_element_array_or_tensor_is_read_as_its_number(answer):
    assert as_number(answer) == 15.0


@settings(max_examples=60, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_any_finite_float_reads_the_same_bare_in_an_array_or_in_a_tensor(x):
    in_tensor = torch.tensor([[x]], dtype=torch.float64)
    assert as_number(x) == as_number(np.array([x])) == as_number(in_tensor) == x


NOT_A_NUMBER = {  # answer -> words the hint must contain
    None: "got None",
    True: "yes/no",
    "lots": "'lots'",
    b"14": "bytes",
    complex(1, 2): "complex",
    float("nan"): "not a finite number",
    10**400: "401 digits",
}
NOT_A_NUMBER_ARRAYS = [
    (np.array([1, 2]), "2 numbers"), (torch.ones(3), "3 numbers"), (np.empty(0), "0 numbers"),
    (np.array([True]), "yes/no"), (torch.tensor([True]), "yes/no"), (np.complex128(1 + 2j), "complex"),
    (torch.tensor([1 + 2j]), "complex"), (np.array([np.inf]), "not a finite number"),
    (torch.empty(1, device="meta"), "cannot be read"), ([15], "list"),
]


@pytest.mark.parametrize(("answer", "words"), list(NOT_A_NUMBER.items()) + NOT_A_NUMBER_ARRAYS, ids=repr)
def test_anything_else_is_refused_with_a_hint_naming_it_and_what_is_allowed(answer, words):
    assert as_number(answer) is None
    hint = number_hint(answer)
    assert words in hint and NUMBER_FORMS in hint


def test_numeric_checkers_take_a_one_element_array_and_name_a_bad_answer(capsys):
    assert numeric(np.array([2.5]), 2.5, 1e-9, "ok", "hint")
    assert not numeric(np.array([2.5, 1.0]), 2.5, 1e-9, "ok", "hint")
    assert "array([2.5, 1. ])" in capsys.readouterr().out


TWO = [(39, 14), [39, "14"], ("39", 14.0), np.array([39, 14]), np.array([[39], [14]]),
       torch.tensor([39, 14]), torch.tensor([39.0, 14.0]), (np.array([39]), torch.tensor([14]))]


@pytest.mark.parametrize("answer", TWO, ids=repr)
def test_two_numbers_are_read_from_a_pair_or_a_two_element_array(answer):
    assert as_numbers(answer, 2) == (39.0, 14.0)


@pytest.mark.parametrize(("answer", "words"), [
    (None, "got None"), ("39, 14", "a str"), ((39, 14, 1), "3 values"), (np.array([39, 14, 1]), "3 elements"),
    (torch.tensor([True, False]), "yes/no"), (np.array([1 + 1j, 2]), "complex"),
    ((39, None), "its wasted_slots: got None"), ((float("nan"), 14), "its blocks: got nan"),
    (torch.tensor([39.0, math.inf]), "its wasted_slots: got inf"), (([39], [14]), "its blocks: got [39]"),
    (torch.empty(2, device="meta"), "cannot be read"),
], ids=repr)
def test_a_pair_that_is_not_two_numbers_is_refused_naming_the_part(answer, words):
    assert as_numbers(answer, 2) is None
    hint = numbers_hint(answer, ("blocks", "wasted_slots"))
    assert words in hint and "(blocks, wasted_slots)" in hint and "array or tensor of 2" in hint


def test_two_number_checkers_accept_arrays_and_tensors():
    assert ch07.check_paged_blocks(np.array([39, 14])) and ch07.check_paged_blocks(torch.tensor([39, 14]))
    assert ch07.check_paged_sequences_fit(np.array([102]))
    assert ch07.check_paged_sequences_fit(torch.tensor(102.0))
    p, n = ch01.KV_WORK_EXERCISE["prompt_len"], ch01.KV_WORK_EXERCISE["new_tokens"]
    naive, cached = n * p + n * (n - 1) // 2, p + n - 1
    assert ch01.check_kv_work((naive, cached))  # the hints' arithmetic, as a reference
    assert ch01.check_kv_work(np.array([naive, cached])) and ch01.check_kv_work(torch.tensor([naive, cached]))
