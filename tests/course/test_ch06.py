"""Chapter 06: the figures draw, operations are told apart from views, and the roofline checker
accepts the bound kvlab.roofline computes, names the usual mistakes, and gives any other answer a hint."""

import matplotlib
import torch
from answers import WRONG_VALUES, hint_test, verdict_test

from kvlab import PRESETS, memory, roofline
from kvlab.course import ch06_gpu_decoder as ch06

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def test_chapter_figures_draw():
    rows = [{"method": m, "new_tokens": n, "tokens_per_s": t}
            for m, n, t in [("naive", 8, 50.0), ("naive", 16, 30.0), ("cached", 8, 80.0),
                            ("cached", 16, 80.0)]]
    fig = ch06.plot_lengths(rows)
    assert [ln.get_label() for ln in fig.axes[0].get_lines()] == ["naive", "cached"]
    fig2 = ch06.plot_step_time([8, 16, 32], [0.002, 0.0021, 0.0023], 0.002, 1e-5)
    assert any("fit: 2.00 ms" in t.get_text() for t in fig2.axes[0].get_legend().get_texts())
    fig3 = ch06.plot_roofline({"T4": 320e9}, [{"label": "x", "bytes_per_step": 1e9, "tokens_per_s": 100},
                                              {"label": "paper", "bytes_per_step": 1e10, "tokens_per_s": 20,
                                               "published": True}])
    assert fig3.axes[0].get_xscale() == "log"
    plt.close("all")


def test_intensity_plot_draws_the_ridge_points():
    fig = ch06.plot_intensity(PRESETS["llama-3-8b"], ["A100 80GB", "H100 80GB"], [0, 2048], [1, 8, 64])
    assert len(fig.axes[0].get_lines()) == 2 + 2       # two contexts, two ridge lines
    assert fig.axes[0].get_yscale() == "log"
    plt.close("all")


def test_op_counts_tell_views_from_operations_that_run_a_kernel():
    x = torch.ones(4, 6)
    counts = ch06.op_counts(lambda: (x.view(6, 4).t()[1:] * 2).sum())
    assert counts == {"total": 5, "views": 3, "launching": 2}   # view, t, slice; mul, sum


def test_roofline_exercise_checker(capsys):
    t4, cfg = memory.GPUS["T4 16GB"], PRESETS["llama-3-8b"]
    assert not memory.plan(cfg, "T4 16GB", 4096, weight_dtype="fp16", reserve_fraction=0.1).fits
    assert memory.plan(cfg, "T4 16GB", 4096, weight_dtype="int8", reserve_fraction=0.1).fits
    bound = roofline.roofline(cfg, t4.bandwidth_bytes_per_s, dtype="int8").tokens_per_s
    check = ch06.check_llama3_int8_t4_roofline
    assert check(bound) and check(f"{bound:.2f}")
    assert not check(None) and not check(bound * 2)
    assert not check(1 / bound)
    assert "seconds per token" in capsys.readouterr().out
    assert not check(t4.bandwidth_bytes_per_s / memory.weight_bytes(cfg, "int8"))
    assert "whole embedding table" in capsys.readouterr().out
    assert not check(bound / 2)
    assert "FP16 bound" in capsys.readouterr().out


def test_roofline_checker_names_the_output_layer_gib_and_milliseconds(capsys):
    t4, cfg = memory.GPUS["T4 16GB"].bandwidth_bytes_per_s, PRESETS["llama-3-8b"]
    step = roofline.decode_step_bytes(cfg, 0, 1, "int8")
    check = ch06.check_llama3_int8_t4_roofline
    no_output_layer = t4 / (step - cfg.vocab_size * cfg.d_model)     # 45.85: Llama-3 does not tie it
    in_gib = t4 / (step / memory.GiB * 1e9)                           # 45.78: GiB against GB/s
    for wrong in (no_output_layer, in_gib):
        assert not check(round(wrong, 2))
        out = capsys.readouterr().out
        assert "output layer" in out and "GiB" in out and "In general:" in out
    assert not check(round(1e3 * step / t4, 2))                       # 23.45 ms per token
    assert "milliseconds per token" in capsys.readouterr().out


test_any_wrong_answer_gets_a_hint = hint_test([ch06.check_llama3_int8_t4_roofline], WRONG_VALUES)
test_whatever_is_typed_the_checker_answers_with_a_verdict = verdict_test([ch06.check_llama3_int8_t4_roofline])


def test_gpu_labels_name_the_sxm_parts_whose_bandwidth_the_course_uses():
    assert ch06.gpu_label("A100 80GB") == "A100 SXM 80GB"
    assert ch06.gpu_label("H100 80GB") == "H100 SXM 80GB"
    assert ch06.gpu_label("T4 16GB") == "T4 16GB"
