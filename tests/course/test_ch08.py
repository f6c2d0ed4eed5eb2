"""Chapter 08: the drawing functions draw what a run holds, the explorer's readout is the scheduler's,
the explorer redraws on a control change, and the two checkers accept the right answers, name the
usual slips and give anything else a hint."""

import html

import matplotlib
import pytest
from answers import WRONG_VALUES, hint_test, verdict_test

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from kvlab import PRESETS  # noqa: E402
from kvlab.cache import blocks_needed  # noqa: E402
from kvlab.course import ch08_scheduling as ch08  # noqa: E402
from kvlab.scheduler import Request, RooflineClock, Scheduler, static_batching  # noqa: E402

LLAMA = PRESETS["llama-3-8b"]


def small_run(**kw):
    requests = [Request([1] * 12, 6), Request([2] * 3, 4, arrival=2), Request([3] * 20, 3, arrival=3)]
    return Scheduler(None, config=LLAMA, num_blocks=kw.pop("num_blocks", 16), block_size=4,
                     token_budget=kw.pop("token_budget", 8), clock="steps", **kw).run(requests)


def test_segments_cover_each_request_from_arrival_to_last_token():
    run = small_run()
    for r in run.results:
        segs = ch08.request_segments(run)[r.index]
        assert segs[0][0] == r.request.arrival and segs[-1][1] == r.finish
        assert sum(1 for *_, phase in segs if phase == "decode") == len(r.output) - 1
        assert all(a <= b for a, b, _ in segs)


def test_a_tight_pool_shows_preemptions_on_the_timeline():
    requests = [Request([1] * 8, 12), Request([2] * 8, 12)]   # 5 blocks of 4 each, at the end
    run = Scheduler(None, config=LLAMA, num_blocks=6, block_size=4, clock="steps").run(requests)
    assert run.preemptions > 0
    phases = {p for segs in ch08.request_segments(run).values() for *_, p in segs}
    assert "preempt" in phases


def test_swapped_out_time_is_drawn_as_swapped_out_and_the_legend_names_every_mark():
    requests = [Request([1] * 8, 12), Request([2] * 8, 12)]
    run = Scheduler(None, config=LLAMA, num_blocks=6, block_size=4, clock="steps",
                    preemption="swap").run(requests)
    outs = [(s.start, i) for s in run.steps for i, kind, _ in s.events if kind == "swap-out"]
    ins = [(s.start, i) for s in run.steps for i, kind, _ in s.events if kind == "swap-in"]
    assert outs and ins
    segs = ch08.request_segments(run)
    (t_out, i), (t_in, _) = outs[0], next(x for x in ins if x[1] == outs[0][1])
    swapped = [(a, b) for a, b, p in segs[i] if p == "swap-out"]
    assert swapped and swapped[0][0] == t_out and swapped[-1][1] <= t_in
    assert all(p != "waiting" or b <= t_out or a >= t_in for a, b, p in segs[i])
    labels = [t.get_text() for t in ch08.plot_timeline(run).axes[0].get_legend().get_texts()]
    assert "swapped out" in labels and "arrival" in labels
    recompute = Scheduler(None, config=LLAMA, num_blocks=6, block_size=4, clock="steps").run(requests)
    labels = [t.get_text() for t in ch08.plot_timeline(recompute).axes[0].get_legend().get_texts()]
    assert "preempted (recompute)" in labels and "swapped out" not in labels
    plt.close("all")


def test_figures_draw_what_they_are_given():
    run = small_run()
    fig = ch08.plot_timeline(run)
    assert fig.axes[0].get_ylim() == (len(run.results) - 0.5, -0.5)
    fig = ch08.plot_pool_usage({"a": run}, 16)
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == [s.blocks_used for s in run.steps]
    fig = ch08.plot_chunked_tradeoff([64, 128], [0.1, 0.05], [0.01, 0.02])
    assert [p.get_height() for p in fig.axes[0].patches] == pytest.approx([100, 50])
    fig = ch08.plot_preemption_costs([16, 32], [1e-3, 2e-3], [3e-3, 6e-3], "H100")
    assert list(fig.axes[0].get_lines()[1].get_ydata()) == pytest.approx([3, 6])
    fig = ch08.plot_scale([1, 2], {"p": {"throughput": [1, 2], "ttft_median": [0.1, 0.2]}},
                          {"throughput": "t", "ttft_median": "s"})
    assert fig.axes[1].get_yscale() == "log"
    plt.close("all")


def test_step_rows_replay_what_each_step_fed():
    requests = [Request([1] * 8, 12), Request([2] * 8, 12), Request([3] * 20, 4, arrival=2)]
    clock = RooflineClock(LLAMA, "H100 80GB")
    for preemption in ("recompute", "swap"):
        run = Scheduler(None, config=LLAMA, num_blocks=8, block_size=4, token_budget=16, clock=clock,
                        preemption=preemption).run(requests)
        assert run.preemptions > 0
        rows = ch08.step_rows(run)
        assert [sum(n for _, n in r) for r in rows] == [s.tokens for s in run.steps]
        # the roofline clock charged each step for exactly these rows
        assert all(clock.step_seconds(r) == s.seconds for r, s in zip(rows, run.steps, strict=True)
                   if not any(kind.startswith("swap") for _, kind, _ in s.events))


def test_static_runs_draw_too():
    requests = [Request([1] * 5, 3), Request([2] * 2, 2, arrival=1)]
    run = static_batching(requests, None, 2, "steps", config=LLAMA)   # request 1 waits for batch 0
    segs = ch08.request_segments(run)
    assert segs[1][0] == (1, 3, "waiting")
    plt.close(ch08.plot_timeline(run))


def test_explorer_readout_is_the_schedulers():
    run = Scheduler(None, config=LLAMA, num_blocks=32, block_size=ch08.EXPLORER_BLOCK, token_budget=16,
                    max_batch=64, clock="steps").run(ch08.explorer_stream(0.5))
    fig, text = ch08.plot_schedule(16, 32, 0.5)
    plt.close(fig)
    assert f"{len(run.steps)} steps for {run.output_tokens} output tokens" in text
    assert f"{run.preemptions} preemptions" in text
    with pytest.raises(ValueError, match="token_budget"):
        ch08.plot_schedule(7, 32, 0.5)


def test_explorer_streams_keep_their_lengths_at_every_rate():
    slow, fast = ch08.explorer_stream(0.05), ch08.explorer_stream(2.0)
    assert [len(r.prompt) for r in slow] == [len(r.prompt) for r in fast]
    assert slow[-1].arrival > fast[-1].arrival


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from walk(child)


def shown(readout) -> str:
    return html.unescape(readout.value.split(">", 1)[1].rsplit("<", 1)[0])


def test_scheduling_explorer_redraws_on_a_control_change():
    box = ch08.scheduling_explorer()
    controls = {w.description: w for w in walk(box) if getattr(w, "description", "")}
    assert set(controls) == {"token budget", "KV blocks", "arrivals/step"}
    readout = [w for w in walk(box) if "kvlab-readout" in w._dom_classes][0]
    assert shown(readout) == ch08.plot_schedule()[1]
    controls["KV blocks"].value = 24
    controls["token budget"].value = 16
    assert shown(readout) == ch08.plot_schedule(16, 24, 0.3)[1]
    plt.close("all")


# --- the exercises --------------------------------------------------------------------------------

def test_ttft_checker(capsys):
    ex = ch08.TTFT_EXERCISE
    right = -(-ex["prompt_len"] // (ex["token_budget"] - ex["decoders"]))
    assert ch08.ttft_steps(**ex) == right == 5
    assert ch08.check_ttft_under_budget(right) and ch08.check_ttft_under_budget("5")
    assert "✓" in capsys.readouterr().out
    slips = [(-(-ex["prompt_len"] // ex["token_budget"]), "take one token each"),
             (right + 1, "also produces the first token"),
             (ex["prompt_len"] / (ex["token_budget"] - ex["decoders"]), "round up"),
             (ex["prompt_len"] / ex["token_budget"], "round up"), (7, "budget minus one token")]
    for wrong, hint in slips:
        assert not ch08.check_ttft_under_budget(wrong)
        assert hint in capsys.readouterr().out, wrong
    assert ch08.ttft_steps(10, 0, 4) == 3 and ch08.check_ttft_under_budget(3, 10, 0, 4)


def test_blocks_freed_checker(capsys):
    ex = ch08.BLOCKS_EXERCISE
    right = blocks_needed(ex["prompt_len"] + ex["generated"] - 1, ex["block_size"])
    assert right == 5 and ch08.check_blocks_freed(right)
    assert "✓" in capsys.readouterr().out
    for wrong, hint in [(6, "not been fed yet"), (4, "round up"), ("five", "a number of blocks")]:
        assert not ch08.check_blocks_freed(wrong)
        assert hint in capsys.readouterr().out, wrong


def test_the_freed_blocks_are_what_the_scheduler_frees():
    # a request alone in a pool that runs out right after its 31st token: it preempts itself
    ex = ch08.BLOCKS_EXERCISE
    requests = [Request([1] * ex["prompt_len"], 64)]
    run = Scheduler(None, config=LLAMA, num_blocks=200, block_size=ex["block_size"], clock="steps").run(
        requests)
    step = next(s for s in run.steps if len(run.results[0].token_times) and
                sum(1 for t in run.results[0].token_times if t <= s.start) == ex["generated"])
    assert step.blocks_used == blocks_needed(ex["prompt_len"] + ex["generated"], ex["block_size"])
    before = run.steps[step.index - 1].blocks_used
    assert before == blocks_needed(ex["prompt_len"] + ex["generated"] - 1, ex["block_size"])


def test_mean_and_se():
    assert ch08.mean_and_se([1.0, 3.0]) == (2.0, 1.0) and ch08.mean_and_se([5.0]) == (5.0, 0.0)


test_any_wrong_answer_gets_a_hint = hint_test([ch08.check_ttft_under_budget, ch08.check_blocks_freed],
                                              WRONG_VALUES)
test_whatever_is_typed_the_checkers_answer_with_a_verdict = verdict_test(
    [ch08.check_ttft_under_budget, ch08.check_blocks_freed])
