"""Chapter 07: the figures draw from kvlab.fragmentation's simulation, the paging checkers accept
the right answers, name the usual slips and give any other answer a hint, and the cache oracle passes
the paged cache and locates a broken block table."""

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
    top = [t.get_text() for ax in figs[3].axes[0].child_axes for t in ax.get_xticklabels()]
    assert top == ["A100 80GB"]                      # the budgets are named on the top axis
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
    assert ch07.check_paged_sequences_fit(102) and not ch07.check_paged_sequences_fit(32)
    assert not ch07.check_paged_sequences_fit(None) and not ch07.check_paged_sequences_fit(101)
    assert ch07.check_paged_sequences_fit(93, n_tokens=700)  # the checker computes, for any numbers
    assert "round up" in capsys.readouterr().out


# The likely slips in each exercise and a word of the hint that must name each one.
BLOCKS_SLIPS = [((38, 18), "round up, not down"), ((38.5625, 14), "blocks come whole"),
                ((39, 18), "how many tokens the last block holds"), ((39, 1248), "all the slots"),
                ((14, 39), "swapped")]
FIT_SLIPS = [(32, "reserves 2,048"), (40, "blocks one sequence takes"), (103, "round down"),
             (104, "rounds up to 40"), (105, "not to the nearest"), (102.4, "only whole sequences")]


def test_the_exercises_numbers_keep_each_slip_apart():
    blocks, fit = ch07.PAGED_BLOCKS_EXERCISE, ch07.PAGED_FIT_EXERCISE
    assert len({blocks["n_tokens"] // blocks["block_size"] + 1, blocks["n_tokens"] % blocks["block_size"],
                -blocks["n_tokens"] % blocks["block_size"]}) == 3
    right = fit["num_blocks"] // -(-fit["n_tokens"] // fit["block_size"])
    assert len({a for a, _ in FIT_SLIPS} | {right}) == 7


def test_each_likely_slip_gets_a_hint_that_names_it(capsys):
    for answer, words in BLOCKS_SLIPS:
        assert not ch07.check_paged_blocks(answer)
        assert words in capsys.readouterr().out, answer
    for answer, words in FIT_SLIPS:
        assert not ch07.check_paged_sequences_fit(answer)
        assert words in capsys.readouterr().out, answer


def test_a_slip_that_lands_on_the_right_answer_is_not_called_a_slip(capsys):
    # 700 tokens: 65,536 slots ÷ 700 = 93 is also 4,096 ÷ 44 blocks; the right answer must count
    assert ch07.check_paged_sequences_fit(93, n_tokens=700)
    assert "✓" in capsys.readouterr().out


CHECKERS = [ch07.check_paged_blocks, ch07.check_paged_sequences_fit]
test_any_wrong_answer_gets_a_hint = hint_test(CHECKERS, WRONG_VALUES + WRONG_PAIRS)
test_whatever_is_typed_the_checker_answers_with_a_verdict = verdict_test(CHECKERS)


# --- the cache oracle on the paged cache (section 3) -------------------------------------------------

def _model_and_batch():
    import torch

    from kvlab import PRESETS
    from kvlab.model import Transformer

    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny-gqa"]).eval()
    lengths = [13, 6, 9]                                   # left-padded to 13, as in section 1
    ids = torch.randint(1, model.config.vocab_size, (3, 13 + 6))
    mask = torch.ones_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :13 - n] = 0
    return model, ids, mask


def test_the_paged_cache_passes_the_oracle_on_a_padded_batch():
    from kvlab import oracle
    from kvlab.cache import PagedKVCache

    model, ids, mask = _model_and_batch()
    cache = PagedKVCache(model.config, 3, ids.shape[1], block_size=4, num_blocks=3 * 5)
    report = oracle.check(model, cache, ids, prompt_len=13, attention_mask=mask)
    assert report.ok and report.passes == 1 + 6, str(report)


def test_the_oracle_locates_a_broken_block_table():
    from kvlab import oracle
    from kvlab.cache import PagedKVCache

    model, ids, _ = _model_and_batch()
    # two entries of a table swapped after the prompt: the first moved position is named
    cache = PagedKVCache(model.config, 1, 32, block_size=4)
    watch = oracle.Oracle(model, cache)
    watch.feed(ids[:1, :13])
    table = cache.block_tables[0]
    table[1], table[2] = table[2], table[1]
    watch.feed(ids[:1, 13:14])
    first = watch.report.first
    assert (first.what, first.layer, first.position) == ("keys", 0, 4), str(watch.report)
    assert "keys of layer 0 at position 4" in str(watch.report)
    # row 1's table points at row 0's block: row 1 reads row 0's keys at those positions
    cache = PagedKVCache(model.config, 2, 32, block_size=4)
    watch = oracle.Oracle(model, cache)
    watch.feed(ids[:2, :8])                                 # blocks 0-1 for row 0, 2-3 for row 1
    cache.block_tables[1][1] = cache.block_tables[0][1]    # row 1's second block is row 0's
    watch.feed(ids[:2, 8:9])
    first = watch.report.first
    assert (first.what, first.layer, first.position) == ("keys", 0, 4), str(watch.report)
    # the same steps through an intact cache: nothing to report
    cache = PagedKVCache(model.config, 2, 32, block_size=4)
    watch = oracle.Oracle(model, cache)
    for part in (ids[:2, :8], ids[:2, 8:9], ids[:2, 9:10]):
        watch.feed(part)
    assert watch.report.ok and watch.report.passes == 3
