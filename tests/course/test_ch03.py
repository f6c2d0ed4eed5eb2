"""Chapter 03: weights vs cache, the memory explorer (the numbers its drawing function shows, and the
widget around it), and the cache-size checker, which names the usual slips and takes any answer."""

import html

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from answers import WRONG_VALUES, hint_test, verdict_test  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvlab import PRESETS  # noqa: E402
from kvlab.course import ch03_cache_memory as ch03  # noqa: E402
from kvlab.course.ch03_cache_memory import (  # noqa: E402
    MEMORY_BATCH_SIZES,
    MEMORY_DTYPES,
    MEMORY_SEQ_LENS,
    memory_config,
    memory_explorer,
    memory_models,
    plot_memory,
)
from kvlab.memory import (  # noqa: E402
    CUDA_CONTEXT_BYTES,
    GB,
    GPUS,
    GiB,
    format_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    plan,
)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def lines(text):
    return text.split("\n")


def test_default_readout_llama_2_7b_on_a100_80gb():
    """The explorer opens on a model within its trained context (Llama-2-7B: 4,096 tokens), and the
    readout counts the CUDA context as the planner does."""
    fig, text = plot_memory()
    assert isinstance(fig, Figure)
    gpu, p = GPUS["A100 80GB"], plan(PRESETS["llama-2-7b"], "A100 80GB", 4096)
    used = p.weight_bytes + p.cache_bytes + CUDA_CONTEXT_BYTES
    assert text == "\n".join([
        "llama-2-7b (MHA): 32 layers × 32 KV heads × 128 dims = 512.00 KiB per token in fp16",
        "KV cache for 4,096 tokens × batch 1: 2.00 GiB · weights (fp16): 12.55 GiB · "
        f"A100 80GB: {format_bytes(gpu.memory_bytes)}",
        f"✓ Fits: {format_bytes(used)} used (weights + cache + 0.50 GiB CUDA context), "
        f"{format_bytes(gpu.memory_bytes - used)} to spare.",
        f"Longest context that fits at batch 1: {p.max_context:,} tokens (the model was trained for up "
        "to 4,096).",
        f"Most concurrent sequences of 4,096 tokens that fit: {p.max_batch}.",
    ])
    assert used + p.free_for_cache - p.cache_bytes == gpu.memory_bytes  # "to spare" is the planner's
    assert p.max_batch > 25 and p.max_context > 100_000  # what the chapter says: about 30, over 100K


def test_controls_cover_the_issue():
    assert MEMORY_SEQ_LENS[0] == 128 and MEMORY_SEQ_LENS[-1] == 2**20
    assert all(b == 2 * a for a, b in zip(MEMORY_SEQ_LENS, MEMORY_SEQ_LENS[1:], strict=False))
    assert MEMORY_BATCH_SIZES[0] == 1 and MEMORY_BATCH_SIZES[-1] == 1024
    assert MEMORY_DTYPES == ["fp32", "fp16", "bf16", "fp8", "int8"]
    assert memory_models() == [*PRESETS, "custom"]


@pytest.mark.parametrize("model", ["llama-7b", "llama-2-70b", "deepseek-v2"])
@pytest.mark.parametrize("gpu", ["T4 16GB", "H200 141GB"])
@pytest.mark.parametrize("seq_len, batch_size, dtype", [(128, 1, "fp16"), (32768, 8, "int8"),
                                                         (2**20, 1024, "fp32")])
def test_readout_agrees_with_plan(model, gpu, seq_len, batch_size, dtype):
    config = PRESETS[model]
    _, text = plot_memory(model, seq_len, batch_size, dtype, gpu)
    p = plan(config, gpu, seq_len, batch_size, dtype=dtype, weight_dtype="fp16")
    first, second, verdict, context, users, *beyond = lines(text)
    trained = ch03.trained_context(config)
    assert beyond == ([f"⚠ {seq_len:,} tokens is beyond the {trained:,} {model} was trained for (shaded): "
                       "the memory is real, the model's quality there is not."] if seq_len > trained else [])
    assert f"= {format_bytes(kv_bytes_per_token(config, dtype))} per token in {dtype}" in first
    assert f"{seq_len:,} tokens × batch {batch_size}: {format_bytes(p.cache_bytes)}" in second
    assert f"weights (fp16): {format_bytes(p.weight_bytes)}" in second
    assert verdict.startswith("✓" if p.fits else "✗")
    expected_context = f"{p.max_context:,} tokens" if p.max_context else "none."
    assert context.startswith(f"Longest context that fits at batch {batch_size}: {expected_context}")
    assert users == f"Most concurrent sequences of {seq_len:,} tokens that fit: " + (
        f"{p.max_batch:,}." if p.max_batch else "none.")


def test_extreme_settings_draw_and_explain():
    fig, text = plot_memory("llama-7b", 2**20, 1024, "fp32", "T4 16GB")
    assert isinstance(fig, Figure)
    assert "KV cache for 1,048,576 tokens × batch 1024: 1024.00 TiB" in text
    assert "Most concurrent sequences of 1,048,576 tokens that fit: none." in text


def test_weights_alone_do_not_fit():
    fig, text = plot_memory("llama-3.1-405b", 4096, 1, "fp16", "T4 16GB")
    t4 = format_bytes(GPUS["T4 16GB"].memory_bytes - CUDA_CONTEXT_BYTES)
    assert f"✗ The weights alone (755.96 GiB) do not fit on T4 16GB ({t4} usable): no room for any " \
        "cache." in text
    assert "Longest context that fits at batch 1: none." in text
    notes = [t.get_text() for t in fig.axes[0].texts]
    assert any("weights alone" in n for n in notes)


def test_the_gpu_line_and_the_current_point_are_drawn():
    fig, _ = plot_memory("llama-2-70b", 131072, 1, "fp16", "H200 141GB")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"   # linear growth: a straight line
    gpu_lines = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(gpu_lines) == 1
    # the line is what the planner can use: the GPU's memory less the CUDA context
    assert gpu_lines[0].get_ydata()[0] == pytest.approx(GPUS["H200 141GB"].memory_bytes - CUDA_CONTEXT_BYTES)
    marker = [ln for ln in ax.get_lines() if ln.get_marker() == "o"]
    p = plan(PRESETS["llama-2-70b"], "H200 141GB", 131072)
    assert marker[0].get_xdata()[0] == 131072
    assert marker[0].get_ydata()[0] == pytest.approx(p.weight_bytes + p.cache_bytes)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(f"fits: {p.max_context:,}" in t for t in legend)
    # Llama-2-70B was trained for 4,096 tokens: the lengths beyond are shaded, from there on.
    assert any("beyond the trained\ncontext (4,096)" in t for t in legend)
    shade = [patch for patch in ax.patches if patch.get_label().startswith("beyond")]
    assert len(shade) == 1 and shade[0].get_x() == 4096


def test_the_cache_is_a_straight_line_of_slope_one_on_the_log_log_plot():
    import numpy as np

    fig, _ = plot_memory("llama-3-8b", 4096, 2, "fp16", "A100 80GB")
    cache = next(ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("KV cache"))
    x, y = np.asarray(cache.get_xdata()), np.asarray(cache.get_ydata())
    slope = np.diff(np.log2(y)) / np.diff(np.log2(x))
    assert np.allclose(slope, 1.0)
    assert y[0] == pytest.approx(x[0] * 2 * kv_bytes_per_token(PRESETS["llama-3-8b"]))


@pytest.mark.parametrize("model, trained", [("mistral-7b", 8192), ("qwen2.5-7b", 32768),
                                            ("deepseek-v2", 32768), ("llama-2-7b", 4096)])
def test_the_explorer_warns_beyond_the_trained_not_the_declared_context(model, trained):
    # Mistral-7B's, Qwen2.5's and DeepSeek-V2's configs declare more positions than the models were
    # trained on
    assert ch03.trained_context(PRESETS[model]) == trained <= PRESETS[model].max_seq_len
    _, text = plot_memory(model, 2 * trained, 1, "fp16", "H200 141GB")
    assert f"beyond the {trained:,} {model} was trained for" in text
    assert "⚠" not in plot_memory(model, trained, 1, "fp16", "H200 141GB")[1]


def test_deepseek_v2_declares_its_config_s_163840_positions_and_was_trained_to_32k():
    # config.json: max_position_embeddings 163,840 (YaRN ×40 over 4,096); report §3.1.4: trained at 32K
    assert PRESETS["deepseek-v2"].max_seq_len == 163840
    assert ch03.trained_context(PRESETS["deepseek-v2"]) == 32768


def test_a_sliding_window_caps_the_explorer_s_cache_and_the_readout_says_so():
    import numpy as np

    mistral, window = PRESETS["mistral-7b"], ch03.WINDOWED["mistral-7b"]
    fig, text = plot_memory("mistral-7b", 131072, 1, "fp16", "A100 80GB")
    capped = kv_cache_bytes(mistral, window)
    p = plan(mistral, "A100 80GB", window)
    first, second, verdict, context, users, dagger, beyond = lines(text)
    assert f"131,072 tokens (rolling: the last 4,096) × batch 1: {format_bytes(capped)}" in second
    assert verdict.startswith("✓ Fits")
    assert context == ("Longest context that fits at batch 1: any length: the rolling cache stops growing at "
                       "4,096 tokens (the model was trained for up to 8,192).")
    assert users == f"Most concurrent sequences of 131,072 tokens that fit: {p.max_batch:,}."
    assert dagger.startswith("† mistral-7b attends within a 4,096-token sliding window: a rolling cache "
                             f"holds at most {format_bytes(capped)}")
    assert f"full attention would need {format_bytes(kv_cache_bytes(mistral, 131072))}" in dagger
    assert beyond.startswith("⚠ 131,072 tokens is beyond the 8,192")
    ax = fig.axes[0]
    cache = next(ln for ln in ax.get_lines() if ln.get_label().startswith("KV cache (fp16"))
    x, y = np.asarray(cache.get_xdata()), np.asarray(cache.get_ydata())
    assert y.max() == capped and np.all(y[x >= window] == capped)          # flat from the window on
    assert np.allclose(y[x <= window], x[x <= window] * kv_bytes_per_token(mistral))
    full = next(ln for ln in ax.get_lines() if ln.get_label().startswith("KV cache with full"))
    assert full.get_linestyle() == ":" and np.asarray(full.get_ydata())[-1] > capped
    marker = next(ln for ln in ax.get_lines() if ln.get_marker() == "o")
    assert marker.get_ydata()[0] == pytest.approx(p.weight_bytes + capped)
    assert not any(t.get_text().startswith("longest context") for t in ax.get_legend().get_texts())


def test_a_window_that_does_not_fit_gives_the_planner_s_longest_context():
    _, text = plot_memory("mistral-7b", 131072, 1024, "fp16", "A100 80GB")
    p = plan(PRESETS["mistral-7b"], "A100 80GB", 4096, 1024)
    assert not p.fits and 0 < p.max_context < 4096
    assert f"Longest context that fits at batch 1024: {p.max_context:,} tokens" in text
    assert f"Most concurrent sequences of 131,072 tokens that fit: {p.max_batch:,}." in text


def test_a_model_trained_for_the_whole_range_has_no_shading_or_warning():
    fig, text = plot_memory("custom", 2**20, 1, "fp16", "A100 80GB", 32, 8, 128)
    assert "⚠" not in text
    assert not [p for p in fig.axes[0].patches if p.get_label().startswith("beyond")]


def test_custom_shape_counts_the_cache_only():
    fig, text = plot_memory("custom", 131072, 1, "fp16", "A100 80GB", layers=32, kv_heads=8, head_dim=128)
    assert lines(text)[0] == "custom: 32 layers × 8 KV heads × 128 dims = 128.00 KiB per token in fp16"
    assert "16.00 GiB · weights not counted (custom shape)" in text
    # Same cache as Llama-3-8B (32 layers, 8 KV heads, 128 dims), which it matches.
    assert memory_config("custom", 32, 8, 128).head_dim == PRESETS["llama-3-8b"].head_dim
    custom = memory_config("custom", 32, 8, 128)
    assert kv_bytes_per_token(custom) == kv_bytes_per_token(PRESETS["llama-3-8b"])


@pytest.mark.parametrize("layers, kv_heads, head_dim, reason", [
    (32, 8, 3, "head_dim=3 is odd"),
    (0, 8, 128, "n_layers=0 must be an integer >= 1"),
    (32, None, 128, "needs layers, kv_heads and head_dim"),
])
def test_invalid_custom_shape_draws_a_message(layers, kv_heads, head_dim, reason):
    fig, text = plot_memory("custom", 4096, 1, "fp16", "T4 16GB", layers, kv_heads, head_dim)
    assert text.startswith("✗ custom shape not valid:") and reason in text
    assert isinstance(fig, Figure)


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "llama-8"}, "model='llama-8' is not a preset; allowed: llama-7b"),
    ({"dtype": "fp64"}, "dtype='fp64' is not"),
    ({"gpu": "V100"}, "gpu='V100' is not"),
    ({"seq_len": 0}, "seq_len=0 must be an integer >= 1"),
    ({"batch_size": 0}, "batch_size=0 must be an integer >= 1"),
])
def test_programming_errors_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plot_memory(**kwargs)


def test_weights_vs_cache_bars():
    cases = [("7B @ 4K", 13 * GiB, 2 * GiB), ("7B @ 128K", 13 * GiB, 64 * GiB)]
    fig = ch03.plot_weights_vs_cache(cases, gpu_bytes=80 * 10**9, gpu_label="A100 80GB")
    ax = fig.axes[0]
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    assert heights == [2, 13, 13, 64]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["7B @ 4K", "7B @ 128K"]


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from walk(child)


def test_widget_controls_readout_and_updates():
    box = memory_explorer()
    assert "kvlab-memory-explorer" in box._dom_classes
    widgets = list(walk(box))
    controls = {w.description: w for w in widgets if getattr(w, "description", "")}
    assert set(controls) == {"model", "GPU", "layers", "KV heads", "head dim", "seq len", "batch",
                             "cache dtype"}
    readout = [w for w in widgets if "kvlab-readout" in w._dom_classes]
    assert len(readout) == 1
    readout = readout[0]
    assert list(controls["GPU"].options) == list(GPUS)
    assert controls["seq len"].label == "4,096"  # the slider's readout shows the token count

    def shown():
        return html.unescape(readout.value.split(">", 1)[1].rsplit("</pre>", 1)[0])

    assert shown() == plot_memory()[1]
    controls["seq len"].value = 131072
    controls["batch"].value = 4
    controls["cache dtype"].value = "int8"
    controls["GPU"].value = "H100 80GB"
    assert shown() == plot_memory("llama-2-7b", 131072, 4, "int8", "H100 80GB")[1]
    controls["model"].value = "custom"
    custom_box = [w for w in widgets if controls["layers"] in getattr(w, "children", ())][0]
    assert custom_box.layout.display == "flex"
    controls["KV heads"].value = 8
    assert shown() == plot_memory("custom", 131072, 4, "int8", "H100 80GB", 32, 8, 128)[1]
    controls["model"].value = "qwen2.5-7b"
    assert custom_box.layout.display == "none"
    assert shown() == plot_memory("qwen2.5-7b", 131072, 4, "int8", "H100 80GB")[1]


# --- the exercise: size the cache ----------------------------------------------------------------

def test_cache_size_checker(capsys):
    expected = kv_cache_bytes(PRESETS["qwen2.5-7b"], 32768, 8) / GiB
    assert expected == 14
    assert ch03.check_cache_size(14) and ch03.check_cache_size("14.0")
    assert "✓" in capsys.readouterr().out
    for wrong, hint in [(None, "answer with a number of GiB"), ("lots", "got 'lots'"),
                        (7, "K alone"), (98, "use n_kv_heads, not n_heads"),
                        (expected * GiB / GB, "decimal GB"), (expected * GiB, "looks like bytes"),
                        (28, "4 bytes an element (fp32)"), (1.75, "multiply by the batch (8"),
                        (14 * 1024, "in MiB"), (15, "15.03 GB (10**9 bytes), rounded"),
                        ("15.0", "rounded"), (13, "PRESETS['qwen2.5-7b']"),
                        (expected * GiB / 10**6, "decimal MB (10**6 bytes)"), ("15,032.4", "decimal MB")]:
        assert bool(ch03.check_cache_size(wrong)) is False
        assert hint in capsys.readouterr().out, wrong
    assert ch03.check_cache_size(32, model="llama-3-8b")  # 128 KiB × 32,768 × 8


@pytest.mark.parametrize("answer, slips", [
    (28 * GiB / GB, ["4 bytes an element (fp32)", "decimal GB"]),      # 30.06: fp32, in GB
    (30, ["4 bytes an element (fp32)", "30.06 GB (10**9 bytes), rounded"]),
    (1.75 * GiB / GB, ["multiply by the batch (8", "decimal GB"]),     # 1.88: one sequence, in GB
    (7 * 1024, ["K alone", "in MiB"]),
    (98 * GiB, ["use n_kv_heads, not n_heads", "looks like bytes"]),
])
def test_cache_size_checker_names_two_slips_at_once(answer, slips, capsys):
    assert not ch03.check_cache_size(answer)
    hint = capsys.readouterr().out
    assert "two slips at once" in hint and all(s in hint for s in slips), hint


test_any_wrong_answer_gets_a_hint = hint_test([ch03.check_cache_size], WRONG_VALUES)
test_whatever_is_typed_the_checker_answers_with_a_verdict = verdict_test([ch03.check_cache_size])
