"""The chapter 08 quiz checkers: right answers pass, wrong ones and None print a hint, none raises."""

import pytest

from kvlab import PRESETS, check, memory

# Right answers, from REFERENCE.md where it gives them (not recomputed the checkers' way).
RIGHT = {
    "quiz_cache_not_weights": "b",
    "quiz_k_and_v": "c",
    "quiz_bigger_cache": "d",
    "quiz_bytes_per_token": 512 * 1024,          # Llama-2-7B: 512 KiB a token
    "quiz_total_cache": 4.0,                     # Llama-3-8B: 128 KiB × 8,192 × 4 = 4 GiB
    "quiz_rows_naive": 8_390_656,                # 4096 · 4097 / 2
    "quiz_rows_cached": 4096,
    "quiz_gqa_ratio": 8,                         # 64 → 8 KV heads
    "quiz_int8_cache": 2.0,                      # 128 KiB / 2 × 32,768 = 2 GiB
    "quiz_paging_blocks": 63,                    # ceil(1000 / 16)
    "quiz_reserved_waste": 1 - 1000 / 4096,
}
CHECKERS = [*RIGHT, "plan_max_batch", "plan_70b_int8"]


@pytest.mark.parametrize("name", list(RIGHT))
def test_right_answer_passes(name, capsys):
    assert bool(getattr(check, name)(RIGHT[name])) is True
    assert capsys.readouterr().out.startswith("✓")


@pytest.mark.parametrize("name", CHECKERS)
@pytest.mark.parametrize("answer", [None, "", "e", [1, 2], object(), True])
def test_unanswered_or_wrong_type_prints_hint_and_never_raises(name, answer, capsys):
    assert bool(getattr(check, name)(answer)) is False
    assert capsys.readouterr().out.startswith("✗ Not yet. Hint:")


@pytest.mark.parametrize("name", CHECKERS)
def test_wrong_answer_fails(name):
    wrong = "a" if name in check.QUIZ_CHOICES else 12345.678
    assert bool(getattr(check, name)(wrong)) is False


def test_letters_are_forgiving():
    assert check.quiz_cache_not_weights(" B ")
    assert check.quiz_k_and_v("(c)")


def test_numbers_may_be_strings_with_separators():
    assert check.quiz_rows_naive("8,390,656")
    assert check.quiz_rows_naive("8_390_656")


def test_bytes_and_percentages_get_a_unit_hint(capsys):
    assert not check.quiz_total_cache(4 * 1024**3)
    assert "GiB" in capsys.readouterr().out
    assert not check.quiz_reserved_waste(75.59)
    assert "percentage" in capsys.readouterr().out


def test_capacity_answers_match_plan_and_require_fit():
    cfg = PRESETS["llama-3-8b"]
    n = memory.plan(cfg, "A100 80GB", 8192, 1, reserve_fraction=0.1).max_batch
    assert check.plan_max_batch(n)
    memory.require_fit(cfg, "A100 80GB", 8192, n, reserve_fraction=0.1)
    with pytest.raises(memory.DoesNotFitError):
        memory.require_fit(cfg, "A100 80GB", 8192, n + 1, reserve_fraction=0.1)
    big = PRESETS["llama-2-70b"]
    assert not memory.plan(big, "H200 141GB", 4096, 1, reserve_fraction=0.1).fits  # FP16 weights
    m = memory.plan(big, "H200 141GB", 4096, 1, weight_dtype="int8", reserve_fraction=0.1).max_batch
    assert m > 0 and check.plan_70b_int8(m) and not check.plan_70b_int8(m + 1)


def test_capacity_curve_merges_equal_gpus_and_names_those_that_cannot_hold_the_weights():
    import matplotlib.pyplot as plt

    from kvlab import plots

    fig = plots.capacity_curve(PRESETS["llama-3-8b"])
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "A100 80GB = H100 80GB" in labels
    assert "T4 16GB: the weights do not fit" in labels
    plt.close(fig)


def test_the_review_notebook_asks_every_quiz_question_once():
    from pathlib import Path

    import nbformat

    nb = nbformat.read(Path(__file__).resolve().parents[1] / "notebooks" / "08_review.ipynb", as_version=4)
    asked = [c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("answer = None")]
    for name in CHECKERS:
        assert sum(f"check.{name}(answer)" in s for s in asked) == 1, name
