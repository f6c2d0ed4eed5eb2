"""Chapter 07: the figures draw from kvlab.fragmentation's simulation, and the paging checkers accept
the right answers, name the usual slips and give any other answer a hint."""

import matplotlib
from answers import WRONG_PAIRS, WRONG_VALUES, hint_test, verdict_test

from kvlab.course import ch07_serving_many_users as ch07
from kvlab.fragmentation import POLICIES, RequestMix, sample_requests, simulate

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def test_chapter_07_figures():
    p, o = sample_requests(80, RequestMix(), seed=0)
    res = {pol: simulate(p, o, pol, capacity=4 * 2048, layout_step=3) for pol in POLICIES}
    figs = [ch07.plot_request_lengths(p, o, 2048),
            ch07.plot_waste_breakdown(res),
            ch07.plot_kv_memory_layout({"max": (res["max"].layout, 4 * 2048),
                                        "paged": (res["paged"].layout, 4 * 2048, 16)}, width=256),
            ch07.plot_concurrency_vs_memory([1e9, 8e10], {"max": 1e9, "paged": 2.5e8},
                                            {"A100 80GB": 7e10}),
            ch07.plot_block_size_tradeoff([1, 16, 256], [0.0, 0.02, 0.2], [500, 32, 2], [1e-3, 1e-4, 1e-5]),
            ch07.plot_block_size_tradeoff([1, 16, 256], [0.0, 0.02, 0.2], [500, 32, 2],
                                          {"loop": [1e-3, 1e-4, 1e-5], "gather": [1e-5, 1e-5, 1e-5]})]
    assert all(isinstance(f, matplotlib.figure.Figure) for f in figs)
    assert [t.get_text() for t in figs[-1].axes[-1].get_legend().get_texts()] == ["loop", "gather"]
    waste_labels = [t.get_text() for t in figs[1].axes[0].texts]
    assert all(label.startswith("waste ") for label in waste_labels) and len(waste_labels) == len(POLICIES)
    plt.close("all")


def test_reserve_max_waste_formula_matches_the_simulation():
    for mix in (RequestMix(), RequestMix(prompt_median=400, output_median=300), RequestMix(max_len=4096)):
        p, o = sample_requests(400, mix, seed=1)
        simulated = simulate(p, o, "max", capacity=16 * mix.max_len, max_len=mix.max_len).waste
        assert abs(ch07.reserve_max_waste(p, o, mix.max_len) - simulated) < 0.01
    # one request of prompt 10 and output 4 holds 10 + 2.5 slots on average, of 100 reserved
    assert ch07.reserve_max_waste([10], [4], 100) == 1 - 12.5 / 100


def test_chapter_07_checkers(capsys):
    assert ch07.check_paged_blocks((39, 14)) and ch07.check_paged_blocks([39, "14"])
    assert not ch07.check_paged_blocks(None) and not ch07.check_paged_blocks((38, 22))
    assert not ch07.check_paged_blocks((39, 0)) and not ch07.check_paged_blocks("39")
    assert ch07.check_paged_blocks((2, 15), n_tokens=17, block_size=16)
    assert ch07.check_paged_sequences_fit(93) and not ch07.check_paged_sequences_fit(32)
    assert not ch07.check_paged_sequences_fit(None) and not ch07.check_paged_sequences_fit(94)
    assert "round up" in capsys.readouterr().out


CHECKERS = [ch07.check_paged_blocks, ch07.check_paged_sequences_fit]
test_any_wrong_answer_gets_a_hint = hint_test(CHECKERS, WRONG_VALUES + WRONG_PAIRS)
test_whatever_is_typed_the_checker_answers_with_a_verdict = verdict_test(CHECKERS)
