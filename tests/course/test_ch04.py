"""Chapter 04: the figures draw, the GQA explorer (its drawing function and the widget around it) reads
what kvlab.gqa and kvlab.memory compute, and the KV-heads checker names the slips and takes any answer."""

import matplotlib
import pytest
from answers import WRONG_VALUES, hint_test, verdict_test

from kvlab import PRESETS, gqa
from kvlab.course import ch04_mha_gqa_mqa as ch04
from kvlab.memory import GiB, kv_cache_bytes

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def test_chapter_figures_draw():
    fig = ch04.plot_kv_head_sharing(8, (8, 2, 1))
    labels = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "MHA" in labels and "GQA" in labels and "MQA" in labels
    rows = [("Llama-2-70B", 40 * GiB, 320 * GiB, "GQA"), ("Llama-7B", 2 * GiB, 2 * GiB, "MHA")]
    fig2 = ch04.plot_kv_cache_bars(rows, "test")
    labels = [t.get_text() for t in fig2.axes[0].texts]
    assert labels == ["40 GiB (GQA; MHA: 320 GiB, 8× smaller)", "2 GiB (MHA)"]   # one label a row
    # each to the right of both its bars, so neither label covers a bar or the other's size
    assert [t.get_position()[0] for t in fig2.axes[0].texts] == pytest.approx([320 * 1.01, 2 + 320 * 0.01])
    fig3 = ch04.plot_pooled_loss(["MHA (4 KV)", "GQA (2 KV)"], [1.5, 1.7], [0.1, 0.2], "MHA (4 KV)")
    assert [t.get_text() for t in fig3.axes[0].texts] == ["1.500", "1.700"]
    assert "2 standard errors" in fig3.axes[0].get_title()
    plt.close("all")


def test_a_what_if_kv_head_count_is_drawn_beside_the_published_one():
    fig, text = ch04.plot_gqa("llama-3-8b", n_kv_heads=2, seq_len=32768)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    plt.close(fig)
    assert "GQA (8 KV heads, published)" in legend and "GQA (2 KV heads)" in legend
    assert "GQA (8 KV heads, published)     4.00 GiB" in text and "what-if" in text
    fig, text = ch04.plot_gqa("llama-3-8b", seq_len=32768)    # the published count: no extra curve
    plt.close(fig)
    assert "published)" not in text and "GQA (8 KV heads)" in text


def test_gqa_variants_are_kvlab_gqa_variants_of_the_chosen_shape():
    configs, message = ch04.gqa_variants("llama-2-70b")
    assert message == "" and list(configs) == list(gqa.variants(PRESETS["llama-2-70b"]))
    configs, message = ch04.gqa_variants("llama-3-8b", n_kv_heads=5)
    assert "GQA (5 KV heads)" not in configs and "must divide n_heads=32" in message
    configs, _ = ch04.gqa_variants("custom", n_kv_heads=4, n_heads=8, layers=2, head_dim=16)
    assert [c.n_kv_heads for c in configs.values()] == [8, 4, 1]


def test_draw_gqa_default_reads_320_and_40_gib():
    fig, text = ch04.plot_gqa()
    plt.close(fig)
    assert "320.00 GiB" in text and "40.00 GiB" in text and "8× smaller" in text
    assert "64× smaller" in text  # MQA


def test_draw_gqa_bars_say_what_the_readout_says():
    # Llama-2-70B at 4,096 tokens: MHA 10 GiB, GQA-8 1.25 GiB, MQA 160 MiB (not "0.156 GiB").
    fig, text = ch04.plot_gqa(seq_len=4096)
    bar_labels = [t.get_text().split("\n")[0] for t in fig.axes[1].texts]
    plt.close(fig)
    assert bar_labels == ["10.00 GiB", "1.25 GiB", "160.00 MiB"]
    assert all(label in text for label in bar_labels)


@pytest.mark.parametrize("kw", [
    dict(model="custom", n_heads=1, layers=1000, head_dim=1024, seq_len=2**20),
    dict(model="custom", n_heads=256, n_kv_heads=256, layers=1, head_dim=2, seq_len=1),
    dict(model="llama-3-8b", n_kv_heads=5, seq_len=128),
    dict(model="custom", head_dim=7),
    dict(model="deepseek-v2", seq_len=2**24, batch_size=1024, dtype="fp32"),
    dict(model="smollm2-135m", n_kv_heads=3),
])
def test_draw_gqa_extreme_settings_never_raise(kw):
    fig, text = ch04.plot_gqa(**kw)
    plt.close(fig)
    assert text


def test_draw_gqa_explains_what_is_not_allowed():
    fig, text = ch04.plot_gqa("llama-3-8b", n_kv_heads=5)
    plt.close(fig)
    assert "n_kv_heads=5 must divide n_heads=32; allowed: [1, 2, 4, 8, 16, 32]" in text
    fig, text = ch04.plot_gqa("custom", head_dim=7)
    plt.close(fig)
    assert "head_dim=7 is odd" in text


def test_draw_gqa_warns_beyond_the_trained_context_and_names_a_window():
    _, text = ch04.plot_gqa()                       # llama-2-70b at 131,072: trained for 4,096
    assert text.splitlines()[-1] == ("⚠ 131,072 tokens is beyond the 4,096 llama-2-70b was trained for: "
                                     "the memory is real, the model's quality there is not.")
    assert "⚠" not in ch04.plot_gqa(seq_len=4096)[1]
    assert "⚠" not in ch04.plot_gqa("llama-3.1-405b", seq_len=131072)[1]   # trained for 128K
    _, text = ch04.plot_gqa("mistral-7b", seq_len=8192)
    assert ("† mistral-7b attends within a 4,096-token sliding window: a rolling cache holds at most "
            "512.00 MiB at any length; the sizes above are full attention.") in text and "⚠" not in text
    _, text = ch04.plot_gqa("custom", seq_len=2**20)    # a custom shape has no trained context
    assert "⚠" not in text and "†" not in text
    plt.close("all")


def test_draw_gqa_mla_bar_for_deepseek():
    fig, text = ch04.plot_gqa("deepseek-v2")
    plt.close(fig)
    assert "MLA" in text and "2.25 KV heads" in text and "56.9× smaller" in text


def test_draw_gqa_refuses_programming_errors():
    with pytest.raises(ValueError, match="model='nope'"):
        ch04.plot_gqa("nope")
    with pytest.raises(ValueError, match="seq_len=0"):
        ch04.plot_gqa(seq_len=0)


def test_gqa_explorer_builds_and_keeps_kv_heads_divisors():
    box = ch04.gqa_explorer()
    controls = {c.description: c for c in _walk(box) if getattr(c, "description", "")}
    assert {"model", "query heads", "KV heads", "layers", "head dim", "seq len"} <= set(controls)
    controls["query heads"].value = 12
    assert list(controls["KV heads"].options) == [1, 2, 3, 4, 6, 12]
    assert controls["model"].value == "custom"
    controls["model"].value = "qwen2.5-7b"
    assert controls["query heads"].value == 28 and controls["KV heads"].value == 4
    readout = next(c for c in _walk(box) if "kvlab-readout" in c._dom_classes)
    _, expected = ch04.plot_gqa("qwen2.5-7b", 4, controls["seq len"].value, 28, 28, 128)
    plt.close("all")
    assert "qwen2.5-7b" in readout.value and "7× smaller" in readout.value
    assert expected.splitlines()[1].strip() in readout.value


def test_gqa_explorer_redraws_once_per_change(monkeypatch):
    calls = []
    real = ch04.plot_gqa

    def counting(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(ch04, "plot_gqa", counting)
    box = ch04.gqa_explorer()
    controls = {c.description: c for c in _walk(box) if getattr(c, "description", "")}
    calls.clear()
    controls["model"].value = "deepseek-v2"   # sets layers, heads, head dim and KV heads at once
    assert len(calls) == 1 and (calls[0]["model"], calls[0]["n_kv_heads"]) == ("deepseek-v2", 128)
    calls.clear()
    controls["query heads"].value = 12        # KV heads re-chosen, model becomes custom
    assert len(calls) == 1 and calls[0]["model"] == "custom" and 12 % calls[0]["n_kv_heads"] == 0
    plt.close("all")


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _walk(child)


# --- the exercise checker -----------------------------------------------------------------------

def test_kv_heads_for_budget_checker(capsys):
    assert ch04.check_kv_heads_for_budget(8)
    assert not ch04.check_kv_heads_for_budget(None)
    assert not ch04.check_kv_heads_for_budget(16)
    assert "over the 16 GiB budget" in capsys.readouterr().out
    assert not ch04.check_kv_heads_for_budget(5)
    assert "Allowed: [1, 2, 4, 8, 16, 32]" in capsys.readouterr().out
    assert not ch04.check_kv_heads_for_budget(4)


@pytest.mark.parametrize("answer, named, not_named", [
    # 4 bytes a head: 4 GiB a head, 4 heads; a 16 GB budget is 14.9 GiB: 7 heads, largest divisor 4
    (4, ["4-byte (fp32) elements", "the cache is fp16", "16 GB (16 × 10⁹ bytes)", "16 GiB, 16 × 1024³"],
     ["batch", "K only"]),
    (32, ["forgetting the batch", "each of the 4 sequences"], ["fp32", "K only", "10⁹"]),   # 0.5 GiB a head
    (16, ["counting K only", "K and V, a factor 2"], ["fp32", "batch", "10⁹"]),             # 1 GiB a head
    (2, ["fit (4 GiB), but a larger divisor fits too"], ["is what", "fp32", "batch", "K only", "10⁹"]),
    (1, ["1 KV head fits (2 GiB)"], ["is what"]),
    (0, ["a whole number ≥ 1", "0 does not"], ["is what"]),
    (-8, ["a whole number ≥ 1", "-8 does not"], ["is what"]),
])
def test_kv_heads_for_budget_names_the_slip_that_gives_the_answer(answer, named, not_named, capsys):
    assert not ch04.check_kv_heads_for_budget(answer)
    hint = capsys.readouterr().out
    assert all(s in hint for s in named) and not any(s in hint for s in not_named), hint


def test_kv_heads_for_budget_is_what_the_budget_allows():
    cfg = PRESETS["llama-3-8b"]
    assert kv_cache_bytes(cfg.with_(n_kv_heads=8), 32768, 4) <= 16 * GiB < kv_cache_bytes(
        cfg.with_(n_kv_heads=16), 32768, 4)
    assert ch04.check_kv_heads_for_budget("8") and ch04.check_kv_heads_for_budget(8.0)


test_any_wrong_answer_gets_a_hint = hint_test([ch04.check_kv_heads_for_budget],
                                              WRONG_VALUES + [8.5, -8, 0, 10**20])
test_whatever_is_typed_the_checker_answers_with_a_verdict = verdict_test([ch04.check_kv_heads_for_budget])


def test_a_preset_with_a_changed_shape_is_no_longer_named_as_that_model():
    fig, text = ch04.plot_gqa("llama-3-8b", n_kv_heads=8, layers=40)
    title = fig.axes[0].get_title()
    plt.close(fig)
    assert text.startswith("custom shape (from llama-3-8b): 40 layers")
    assert "Published:" not in text and title.startswith("custom shape (from llama-3-8b)")
    fig, text = ch04.plot_gqa("llama-3-8b", n_kv_heads=8)
    plt.close(fig)
    assert text.startswith("llama-3-8b: 32 layers") and "Published: llama-3-8b" in text
