"""Chapter 11: the quiz checkers (right answers pass; wrong ones, None and anything else a learner types
print a hint, none raises), the capacity curve, and the notebook asking every question once."""

import pytest
from answers import WRONG_VALUES, Opaque, stable_id, verdict_test

from kvlab import PRESETS, memory
from kvlab.course import ch07_serving_many_users as ch07
from kvlab.course import ch11_review as ch11
from kvlab.fragmentation import RequestMix, sample_requests, simulate

# Right answers, from REFERENCE.md where it gives them (not recomputed the checkers' way).
RIGHT = {
    "check_cache_not_weights": "b",
    "check_k_and_v": "c",
    "check_bigger_cache": "d",
    "check_bytes_per_token": 512 * 1024,          # Llama-2-7B: 512 KiB a token
    "check_total_cache": 4.0,                     # Llama-3-8B: 128 KiB × 8,192 × 4 = 4 GiB
    "check_rows_naive": 8_390_656,                # 4096 · 4097 / 2
    "check_rows_cached": 4096,
    "check_gqa_ratio": 8,                         # 64 → 8 KV heads
    "check_int8_cache": 2.0,                      # 128 KiB / 2 × 32,768 = 2 GiB
    "check_paging_blocks": 63,                    # ceil(1000 / 16)
    "check_prefix_sharing": "b",
    "check_window_cache": 0.5,                    # Mistral-7B: 128 KiB × 4,096 = 0.5 GiB
    "check_continuous_batching": "c",
    "check_chunked_prefill": "b",
    "check_preemption": "c",
    "check_tpot": 50.0,                           # (10.75 - 0.8) s / 199 tokens = 50 ms
    "check_speculative_identical": "b",
    "check_rollback_refused": "d",
    "check_speculative_speedup": (1 + 0.7 + 0.49 + 0.343) / 1.3,   # Leviathan et al., eq. 1, k·c + 1
}
CHECKERS = [*RIGHT, "check_plan_max_batch", "check_plan_70b_int8", "check_sim_reserved_waste"]


@pytest.mark.parametrize("name", list(RIGHT))
def test_right_answer_passes(name, capsys):
    assert bool(getattr(ch11, name)(RIGHT[name])) is True
    assert capsys.readouterr().out.startswith("✓")


@pytest.mark.parametrize("name", CHECKERS)
@pytest.mark.parametrize("answer", [None, "", "e", [1, 2], Opaque(), True] + WRONG_VALUES, ids=stable_id)
def test_unanswered_or_wrong_type_prints_hint_and_never_raises(name, answer, capsys):
    assert bool(getattr(ch11, name)(answer)) is False
    assert capsys.readouterr().out.startswith("✗ Not yet. Hint:")


@pytest.mark.parametrize("name", CHECKERS)
def test_wrong_answer_fails(name):
    wrong = "a" if name in ch11.QUIZ_CHOICES else 12345.678
    assert bool(getattr(ch11, name)(wrong)) is False


def test_letters_are_forgiving():
    assert ch11.check_cache_not_weights(" B ")
    assert ch11.check_k_and_v("(c)")


def test_numbers_may_be_strings_with_separators():
    assert ch11.check_rows_naive("8,390,656")
    assert ch11.check_rows_naive("8_390_656")


def test_bytes_and_percentages_get_a_unit_hint(capsys):
    assert not ch11.check_total_cache(4 * 1024**3)
    assert "GiB" in capsys.readouterr().out
    waste = _sim_waste("max")
    assert not ch11.check_sim_reserved_waste(100 * waste)
    assert "percentage" in capsys.readouterr().out


def _sim_waste(policy):
    p, o = sample_requests(1000, RequestMix(max_len=4096), seed=0)
    return simulate(p, o, policy, capacity=32 * 4096, max_len=4096).waste


def test_the_simulator_exercise_accepts_the_simulated_waste_and_names_the_usual_slips(capsys):
    waste = _sim_waste("max")
    p, o = sample_requests(1000, RequestMix(max_len=4096), seed=0)
    assert abs(waste - ch07.reserve_max_waste(p, o, 4096)) < 0.01      # chapter 07's formula agrees
    assert ch11.check_sim_reserved_waste(waste) and ch11.check_sim_reserved_waste(f"{waste:.3f}")
    capsys.readouterr()
    assert not ch11.check_sim_reserved_waste(1 - waste)
    assert ".used" in capsys.readouterr().out
    assert not ch11.check_sim_reserved_waste(_sim_waste("paged"))
    assert "paged policy" in capsys.readouterr().out


def test_capacity_answers_match_plan_and_require_fit():
    cfg = PRESETS["llama-3-8b"]
    n = memory.plan(cfg, "A100 80GB", 8192, 1, reserve_fraction=0.1).max_batch
    assert ch11.check_plan_max_batch(n)
    memory.require_fit(cfg, "A100 80GB", 8192, n, reserve_fraction=0.1)
    with pytest.raises(memory.DoesNotFitError):
        memory.require_fit(cfg, "A100 80GB", 8192, n + 1, reserve_fraction=0.1)
    big = PRESETS["llama-2-70b"]
    assert not memory.plan(big, "H200 141GB", 4096, 1, reserve_fraction=0.1).fits  # FP16 weights
    m = memory.plan(big, "H200 141GB", 4096, 1, weight_dtype="int8", reserve_fraction=0.1).max_batch
    assert m > 0 and ch11.check_plan_70b_int8(m) and not ch11.check_plan_70b_int8(m + 1)


def test_capacity_curve_merges_equal_gpus_and_names_those_that_cannot_hold_the_weights():
    import matplotlib.pyplot as plt

    fig = ch11.plot_capacity_curve(PRESETS["llama-3-8b"])
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "T4 16GB: the weights do not fit" in labels
    named = [name for label in labels for name in label.split(":")[0].split(" ≈ ")]
    assert sorted(named) == sorted(memory.GPUS)  # every GPU once, on its own line or sharing one
    assert "A100 80GB ≈ H100 80GB" in labels     # 891 against 892 sequences at most: one line
    curves = [line.get_ydata() for line in fig.axes[0].get_lines() if len(line.get_ydata())]
    for i, a in enumerate(curves):                # no two lines lie within one sequence of each other
        for b in curves[i + 1:]:
            assert len(a) != len(b) or any(abs(x - y) > max(1, 0.01 * y) for x, y in zip(a, b, strict=True))
    plt.close(fig)


def test_the_review_notebook_asks_every_quiz_question_once():
    from pathlib import Path

    import nbformat

    nb = nbformat.read(Path(__file__).resolve().parents[2] / "notebooks" / "11_review.ipynb", as_version=4)
    asked = [c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("answer = None")]
    for name in CHECKERS:
        assert sum(f"ch11.{name}(answer)" in s for s in asked) == 1, name


test_whatever_is_typed_every_checker_answers_with_a_verdict = verdict_test(
    [getattr(ch11, n) for n in CHECKERS], 30)


def test_the_window_question_names_the_stream_mistake(capsys):
    whole_stream = memory.kv_cache_bytes(PRESETS["mistral-7b"], 100_000, 1, "fp16") / memory.GiB
    assert not ch11.check_window_cache(whole_stream)
    assert "keeps only the last 4,096" in capsys.readouterr().out


def test_the_tpot_question_names_counting_the_first_token(capsys):
    for wrong in (10.75 / 200 * 1000, 9.95 / 200 * 1000):
        assert not ch11.check_tpot(wrong)
        assert "leaves out the first token" in capsys.readouterr().out


@pytest.mark.parametrize(("wrong", "hint"), [
    (1 + 0.7 + 0.49 + 0.343, "divide by k·c + 1"),              # the tokens a step, not the speed-up
    ((1 + 0.7 + 0.49) / 1.3, "k + 1 terms"),                   # the sum stopped at α^(k-1): 1.685
    ((1 + 0.7 + 0.49 + 0.343) / 1.1, "cost k·c, not c"),       # one draft pass: 2.303
    ((1 + 0.7 + 0.49 + 0.343) / 0.3, "add the verify pass"),   # no verify pass: 8.44
])
def test_the_speedup_question_names_the_usual_mistakes(wrong, hint, capsys):
    assert not ch11.check_speculative_speedup(wrong)
    assert hint in capsys.readouterr().out
