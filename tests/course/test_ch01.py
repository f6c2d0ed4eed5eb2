"""Chapter 01: the instruments measure what the model does (K/V rows through the projections, FLOPs
with the attention written out, equal to the chapter's formula), the diagrams and plots draw, and the
K/V-work checker accepts the right answer, names the usual slips and gives any other answer a hint."""

import matplotlib
import pytest
import torch
from answers import WRONG_PAIRS, WRONG_VALUES, hint_test, verdict_test
from torch.utils.flop_counter import FlopCounterMode

from kvlab.cache import DynamicKVCache
from kvlab.config import ModelConfig
from kvlab.course import ch01_autoregressive_generation as ch01
from kvlab.generate import generate
from kvlab.model import Transformer

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    matplotlib.pyplot.close("all")


@pytest.mark.parametrize("cached", [False, True])
def test_generation_loop_counts_rows(cached):
    fig = ch01.plot_generation_loop(("a", "b", "c", "d", "e"), prompt_len=2, cached=cached)
    texts = [t.get_text() for t in fig.axes[0].texts]
    # naive: 2 + 3 + 4 rows; cached: prefill 2, then 1 + 1
    assert f"total: {4 if cached else 9}" in texts


def test_generation_loop_rejects_bad_prompt_len():
    with pytest.raises(ValueError, match="prompt_len=5"):
        ch01.plot_generation_loop(("a", "b"), prompt_len=5)


def test_chapter_figures_draw():
    figs = [ch01.plot_step_costs([1, 2, 3], [("rows", "K/V rows", [1, 2, 3], [1, 2, 3], "theory"),
                                             ("time", "ms", [1.0, 1.5, 2.0], None, "")]),
            ch01.plot_growth_fit([8, 16, 32], {"rows": [36, 136, 528]}, {"rows": (2.0, -0.5)}),
            ch01.plot_growth_fit({"rows": [8, 16], "time": [4, 8]}, {"rows": [36, 136], "time": [1.0, 3.5]},
                                 {"rows": (2.0, -0.5), "time": (1.8, -2.0)}),
            ch01.plot_step_times([0.1, 0.2], [0.1, 0.1]),
            ch01.plot_step_times([0.1, 0.2], None)]
    assert all(isinstance(f, matplotlib.figure.Figure) for f in figs)
    assert len(figs[0].axes) == 2


def test_kv_work_matches_generate_and_hints(capsys):
    p, n = 7, 5
    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=2, n_kv_heads=2, d_ff=8, vocab_size=5,
                      max_seq_len=32)
    model = Transformer(cfg).eval()
    naive = generate(model, [1] * p, n, cache=None).kv_rows
    cached = generate(model, [1] * p, n, cache="dynamic").kv_rows
    assert naive == sum(p + i for i in range(n)) and cached == p + n - 1
    assert ch01.check_kv_work((naive, cached), prompt_len=p, new_tokens=n)
    assert not ch01.check_kv_work(None, prompt_len=p, new_tokens=n)
    assert not ch01.check_kv_work((n * (n + 1) // 2, cached), prompt_len=p, new_tokens=n)
    assert "prompt" in capsys.readouterr().out.splitlines()[-1]
    assert not ch01.check_kv_work((naive, p + n), prompt_len=p, new_tokens=n)
    assert "never fed back" in capsys.readouterr().out
    assert not ch01.check_kv_work((f"{naive:,}", cached))  # the default exercise has other numbers


test_any_wrong_answer_gets_a_hint = hint_test([ch01.check_kv_work], WRONG_VALUES + WRONG_PAIRS)
test_whatever_is_typed_the_checker_answers_with_a_verdict = verdict_test([ch01.check_kv_work])


def _model(n_kv_heads=2, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=n_kv_heads, d_ff=24, vocab_size=11,
                      max_seq_len=64)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize(("fed", "cached"), [(1, 0), (9, 0), (1, 12), (5, 7)])
def test_forward_flops_equals_the_flop_counter_with_attention_written_out(n_kv_heads, fed, cached):
    model = _model(n_kv_heads)
    cache = DynamicKVCache(model.config)
    ids = torch.randint(0, 11, (1, cached + fed))
    with torch.inference_mode():
        if cached:
            model(ids[:, :cached], cache=cache)
        with ch01.explicit_attention(model), FlopCounterMode(display=False) as counter:
            model(ids[:, cached:], cache=cache)
    want = ch01.forward_flops(model.config, fed, cached + fed)
    assert counter.get_total_flops() == want.total
    assert want.attention == 4 * 2 * 16 * fed * (cached + fed) and want.linear > 0


def test_explicit_attention_computes_the_same_logits_and_is_undone():
    model, ids = _model(), torch.randint(0, 11, (1, 10))
    with torch.inference_mode():
        fused = model(ids)
        with ch01.explicit_attention(model):
            written_out = model(ids)
        assert torch.equal(model(ids), fused)  # undone: the fused kernel again, bit for bit
    torch.testing.assert_close(written_out, fused)  # (that it ran: the flop-counter test above)


def test_forward_flops_rejects_a_context_shorter_than_what_is_fed():
    with pytest.raises(ValueError, match="context"):
        ch01.forward_flops(_model().config, 5, 3)
    with pytest.raises(ValueError, match="fed"):
        ch01.forward_flops(_model().config, 0)


def test_count_kv_rows_counts_what_passes_through_each_projection():
    model = _model()
    with ch01.count_kv_rows(model) as rows:
        naive = generate(model, [1, 2, 3], 4, cache=None)
        cached = generate(model, [[1, 2, 3], [4, 5, 6]], 4, cache="dynamic")  # a batch of two
    assert rows[0] == rows[1] == [3, 4, 5, 6] + [6, 2, 2, 2]  # naive: 3…6; cached, 2 sequences: 2×3, then 2
    assert naive.tokens.shape == (1, 7) and cached.tokens.shape == (2, 7)
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]))
    assert len(rows[0]) == 8  # the hooks are gone after the block


def test_count_kv_rows_sees_every_generate_cache_kind():
    # the docstring's promise: every `generate` cache kind goes through the model's modules
    model = _model()
    for kind in (None, "dynamic", "static"):
        with ch01.count_kv_rows(model) as rows:
            generate(model, [1, 2, 3], 4, cache=kind)
        assert sum(rows[0]) == (3 + 4 + 5 + 6 if kind is None else 3 + 3)


def test_cpu_step_seconds_times_each_forward_pass_on_the_cpu_clock():
    model = _model()
    with ch01.cpu_step_seconds(model) as seconds:
        run = generate(model, [1, 2, 3], 5, cache=None)
    assert len(seconds) == len(run.steps) == 5 and all(s >= 0 for s in seconds)
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]))
    assert len(seconds) == 5  # the hooks are gone after the block


def test_cpu_step_seconds_does_not_count_time_the_process_spends_waiting():
    import time

    model = _model()
    generate(model, [1, 2, 3], 1, cache=None)  # a first pass, so one-time set-up is not timed below
    with ch01.cpu_step_seconds(model) as seconds:
        wait = model.register_forward_pre_hook(lambda *_: time.sleep(0.5))  # inside the timed pass
        run = generate(model, [1, 2, 3], 1, cache=None)
        wait.remove()
    assert run.steps[0].seconds >= 0.5 > 0.25 > seconds[0]  # wall time counts the sleep, CPU time not


def test_step_plots_draw_several_theory_lines():
    theory = {"linear": [2, 4, 6], "+ attn": [2, 4.5, 7]}
    fig = ch01.plot_step_costs([1, 2, 3], [("flops", "FLOPs", [2, 4, 7], theory, "")])
    assert [line.get_label() for line in fig.axes[0].lines] == ["measured", "linear", "+ attn"]
    fig = ch01.plot_step_time_vs_length([1, 4, 16], [1e-3, 1.2e-3, 3e-3], [10, 40, 160])
    assert fig.axes[0].get_xscale() == "log"


def test_growth_fit_scales_every_series_to_one_at_the_same_n():
    fig = ch01.plot_growth_fit({"rows": [8, 16, 32], "time": [8, 16, 32, 64]},
                               {"rows": [36, 136, 528], "time": [1.0, 3.5, 9.0, 20.0]},
                               {"rows": (2.0, -0.5), "time": (1.5, -2.0)}, scale_at=16)
    ax = fig.axes[0]
    markers = [line for line in ax.lines if line.get_linestyle() == "None"]
    for line in markers:
        xs, ys = line.get_data()
        assert ys[list(xs).index(16)] == pytest.approx(1.0)
    assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
    matplotlib.pyplot.close(fig)
    with pytest.raises(ValueError, match="scale_at=64"):
        ch01.plot_growth_fit({"rows": [8, 16], "time": [8, 64]}, {"rows": [1, 2], "time": [1, 2]},
                             {"rows": (1, 0), "time": (1, 0)}, scale_at=64)
