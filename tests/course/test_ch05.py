"""Chapter 05: the figures draw, the quantization explorer (its drawing function and the widget around
it) shows kvlab's bytes and kvlab.quality's measurement, and the per-channel quantization checker
accepts a right function and gives anything else a hint."""

import matplotlib
import pytest
import torch
from answers import WRONG_FUNCTIONS, WRONG_VALUES, hint_test

from kvlab import PRESETS, memory, quality
from kvlab.cache import quantized_cache_bytes
from kvlab.course import ch05_int8_kv_cache as ch05

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def test_chapter_figures_draw():
    k = torch.ones(16)
    k[3] = 25
    fig = ch05.plot_channel_magnitudes(k, torch.ones(16), heads=2)
    assert any("25.0× the median" in t.get_text() for t in fig.axes[0].texts)
    fig2 = ch05.plot_granularity_errors({"per token": {"K": 0.02, "V": 0.01},
                                         "per channel": {"K": 0.005, "V": 0.01}})
    assert [t.get_text() for t in fig2.axes[0].texts][:2] == ["2.00%", "0.50%"]
    fig3 = ch05.plot_bytes_ratio([256, 4096], {"int8": [0.6, 0.52]}, references={"q8_0": 0.53125})
    assert fig3.axes[0].get_xscale() == "log"
    plt.close("all")


def test_the_measurement_is_kvlab_quality_s_small_run_remembered():
    a = ch05.quant_measurement("int8", "kivi")
    b = quality.small_run_errors("int8", key_granularity="channel", value_granularity="token",
                                 group_size=ch05.QUANT_GROUP_SIZE)
    assert a == b and a is not b  # one measurement, handed out as copies
    a["k_relative_rms_error"] = -1
    assert ch05.quant_measurement("int8", "kivi")["k_relative_rms_error"] > 0


@pytest.mark.parametrize("args", [("int8", "kivi", 4096, "llama-2-7b"),
                                  ("int4", "tensor", 512, "deepseek-v2"),
                                  ("fp32", "token", 131072, "llama-3.1-405b"),
                                  ("fp16", "channel", 1, "gpt2")])
def test_draw_quant_at_extreme_settings(args):
    fig, text = ch05.plot_quant(*args)
    assert fig.axes and "Measured on" in text and "greedy" in text
    if args[3] == "deepseek-v2":
        assert "MLA" in text
    else:
        assert "× FP16" in text
    plt.close(fig)


def test_draw_quant_numbers_match_kvlab():
    fig, text = ch05.plot_quant("int8", "kivi", 4096, "llama-2-7b")
    plt.close(fig)
    size = quantized_cache_bytes(PRESETS["llama-2-7b"], 4096)
    assert memory.format_bytes(size) in text
    m = ch05.quant_measurement("int8", "kivi")
    assert f"K {m['k_relative_rms_error']:.3%}" in text
    assert ch05.quant_measurement("fp32", "tensor")["logits_relative_rms_error"] == 0


def test_draw_quant_refuses_unknown_names():
    with pytest.raises(ValueError, match="dtype='int3' is not allowed"):
        ch05.plot_quant("int3")
    with pytest.raises(ValueError, match="scales='row' is not allowed"):
        ch05.plot_quant("int8", "row")
    with pytest.raises(ValueError, match="model='tiny' is not allowed"):
        ch05.plot_quant("int8", "kivi", 4096, "tiny")
    with pytest.raises(ValueError, match="seq_len=0"):
        ch05.plot_quant("int8", "kivi", 0)


def test_quant_explorer_controls_and_readout():
    box = ch05.quant_explorer()
    controls = {}

    def walk(w):
        for child in getattr(w, "children", ()):
            walk(child)
        if getattr(w, "description", ""):
            controls[w.description] = w

    walk(box)
    assert {"cache dtype", "scales", "seq len", "model"} <= set(controls)
    readouts = []

    def find(w):
        for child in getattr(w, "children", ()):
            find(child)
        if "kvlab-readout" in getattr(w, "_dom_classes", ()):
            readouts.append(w)

    find(box)
    assert len(readouts) == 1
    before = readouts[0].value
    controls["cache dtype"].value = "fp16"
    assert readouts[0].value != before and "fp16" in readouts[0].value


def test_quantize_keys_exercise_checker():
    def good(k):
        s = k.abs().amax(0, keepdim=True) / 127
        return torch.round(k / s).clamp(-127, 127).to(torch.int8), s

    def per_token(k):
        s = k.abs().amax(1, keepdim=True) / 127
        return torch.round(k / s).to(torch.int8), s

    def truncating(k):
        s = k.abs().amax(0, keepdim=True) / 127
        return (k / s).to(torch.int8), s

    assert ch05.check_quantize_keys_per_channel(good)
    for wrong in (None, 3, per_token, truncating, lambda k: 1 / 0):
        assert not ch05.check_quantize_keys_per_channel(wrong)


def test_a_function_that_returns_float64_codes_or_the_wrong_shape_gets_a_hint(capsys):
    def float_codes(k):
        s = k.abs().amax(0, keepdim=True) / 127
        return torch.round(k / s).double(), s

    assert not ch05.check_quantize_keys_per_channel(float_codes)
    assert "must be int8" in capsys.readouterr().out
    assert not ch05.check_quantize_keys_per_channel(lambda k: (k.to(torch.int8), torch.ones(3, 3)))
    assert "one value per channel" in capsys.readouterr().out


def _keys_answer(reduce=lambda k: k.abs().amax(0, keepdim=True) / 127, rounding=torch.round,
                 scale_dtype=None):
    def answer(k):
        s = reduce(k)
        s = s if scale_dtype is None else s.to(scale_dtype)
        return rounding(k / s.float()).clamp(-127, 127).to(torch.int8), s
    return answer


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_the_keys_checker_accepts_scales_in_half_precision(scale_dtype):
    assert ch05.check_quantize_keys_per_channel(_keys_answer(scale_dtype=scale_dtype))

    def cast_after_the_codes(k):      # codes from the float32 scale, the scale stored in half
        s = k.abs().amax(0, keepdim=True) / 127
        return torch.round(k / s).clamp(-127, 127).to(torch.int8), s.to(scale_dtype)

    assert ch05.check_quantize_keys_per_channel(cast_after_the_codes)


@pytest.mark.parametrize("answer, hint", [
    (_keys_answer(reduce=lambda k: k.amax(0, keepdim=True) / 127), "absolute value before the max"),
    (_keys_answer(reduce=lambda k: k.abs().amax(0, keepdim=True)), "divide the absmax by 127"),
    (_keys_answer(reduce=lambda k: k.abs().amax(0, keepdim=True) / 128), "not 128"),
    (_keys_answer(reduce=lambda k: k.abs().amax(0, keepdim=True) / 255), "not 255"),
    (_keys_answer(reduce=lambda k: k.abs().amax(1, keepdim=True) / 127), "one scale per token"),
    (_keys_answer(reduce=lambda k: k.abs().max() / 127), "one scale for the whole tensor"),
    (_keys_answer(rounding=torch.trunc), "torch.round"),
    (lambda k: _keys_answer()(k)[::-1], "in that order"),
    (lambda k: (_keys_answer()(k)[0], _keys_answer()(k)[1].reshape(-1, 1)), "should be (1, "),
    (lambda k: (_keys_answer()(k)[0], _keys_answer()(k)[1].to(torch.complex64)), "real floats"),
    (lambda k: (_keys_answer()(k)[0].to_sparse(), _keys_answer()(k)[1]), "dense"),
    (lambda k: (_keys_answer()(k)[0], _keys_answer()(k)[1].to("meta")), "dense"),
])
def test_the_keys_checker_names_the_likely_mistakes(answer, hint, capsys):
    assert not ch05.check_quantize_keys_per_channel(answer)
    assert hint in capsys.readouterr().out


test_any_wrong_answer_gets_a_hint = hint_test(
    [ch05.check_quantize_keys_per_channel], WRONG_VALUES + WRONG_FUNCTIONS)


def test_perplexity_change_draws_two_standard_errors():
    import matplotlib.pyplot as plt

    fig = ch05.plot_perplexity_change({"int8": (1e-5, 2e-5), "int4": (2e-3, 4e-4)}, title="t")
    labels = [t.get_text() for t in fig.axes[0].texts]
    plt.close(fig)
    assert labels == ["+1.00e-05 (± 2 SE: 4.0e-05)", "+2.00e-03 (± 2 SE: 8.0e-04)"]
    fig = ch05.plot_perplexity_change({"int8": (1e-5, 2e-5), "int4": (2e-3, 4e-4)}, unit="token",
                                      spread=2.571)
    label, texts = fig.axes[0].get_xlabel(), [t.get_text() for t in fig.axes[0].texts]
    plt.close(fig)
    assert "nats per token" in label and "± 2.57 paired SE" in label
    assert texts[0] == "+1.00e-05 (± 2.57 SE: 5.1e-05)"
    with pytest.raises(ValueError, match="spread=0"):
        ch05.plot_perplexity_change({"int8": (1e-5, 2e-5)}, spread=0)


def test_the_quality_panel_says_which_model_it_was_measured_on():
    import matplotlib.pyplot as plt

    fig, _ = ch05.plot_quant("int8", "kivi", 4096, "llama-3-8b")
    title = fig.axes[1].get_title()
    plt.close(fig)
    assert "measured on kvlab-tiny" in title or "measured on a random tiny-mha model" in title


def test_the_scale_choices_say_what_they_are_and_per_tensor_is_one_calibrated_scale():
    block, tensor = ch05.quant_measurement("int8", "block"), ch05.quant_measurement("int8", "tensor")
    kivi = ch05.quant_measurement("int8", "kivi")
    assert "32-token block" in ch05.QUANT_SCALE_LABELS["block"]
    assert "calibrated" in ch05.QUANT_SCALE_LABELS["tensor"]
    # the block setting differs from KIVI in its keys only (V per token in both)
    assert block["v_rounding_error"] == pytest.approx(kivi["v_rounding_error"], rel=0.02)
    assert tensor["k_rounding_error"] > block["k_rounding_error"] > kivi["k_rounding_error"]
    cfg = PRESETS["llama-2-7b"]
    assert ch05.quant_cache_bytes(cfg, 4096, "int8", "tensor") == (
        memory.kv_cache_bytes(cfg, 4096, dtype="int8") + 4 * 2 * cfg.n_layers)
    texts = {s: ch05.plot_quant("int8", s, 4096, "llama-2-7b")[1] for s in ch05.QUANT_SCALES}
    plt.close("all")
    assert "groups of 32 tokens" in texts["kivi"] and "groups of 32 tokens" in texts["block"]
    assert "groups of" not in texts["token"] and "groups of" not in texts["tensor"]


def test_the_explorer_shades_untrained_lengths_and_marks_a_sliding_window():
    fig, text = ch05.plot_quant("int8", "kivi", 8192, "mistral-7b")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    plt.close(fig)
    assert "sliding window" in text and "4,096" in text
    assert any("sliding window" in t for t in labels) and any("trained context" in t for t in labels)
    _, text = ch05.plot_quant("int8", "kivi", 16384, "llama-2-7b")
    plt.close("all")
    assert "beyond the 4,096" in text and "sliding" not in text
