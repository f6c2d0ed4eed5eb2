"""Chapter 02's decode explorer: a frame shows the recorded decode (rows filled, attention, counts),
and the widget redraws when the step slider, the layer, head or K/V controls move."""

import html

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

import IPython.display  # noqa: E402
import ipywidgets as widgets  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvlab.course import ch02_decode_explorer as explorer  # noqa: E402
from kvlab.course import ch02_kv_cache as ch02  # noqa: E402
from kvlab.generate import encode_bytes, generate  # noqa: E402
from kvlab.pretrained import load  # noqa: E402

PROMPT, STEPS = "KV 缓存", 8


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def frames():
    return ch02.decode_frames(PROMPT, STEPS)


def heat_rows(fig) -> int:
    """Rows of the heat map that hold cache values (the others are not filled yet)."""
    data = fig.axes[1].images[0].get_array()
    return int((~np.ma.getmaskarray(data) & ~np.isnan(np.ma.getdata(data))).all(axis=1).sum())


def test_frames_are_kvlab_tinys_decode_and_computed_once(frames):
    expected = generate(load("kvlab-tiny"), encode_bytes(PROMPT), STEPS).tokens[0].tolist()
    assert frames.tokens == expected
    assert ch02.decode_frames(PROMPT, STEPS) is frames  # cached: scrubbing never recomputes


def test_a_frame_draws_the_cache_filled_to_its_step(frames):
    p = len(encode_bytes(PROMPT))
    for step in (0, 3, STEPS - 1):
        fig = ch02.plot_decode_frame(frames, step, layer=1, head=2, side="K")
        assert isinstance(fig, Figure)
        assert heat_rows(fig) == p + step
        bars = fig.axes[3].patches            # one attention bar per cached position
        assert len(bars) == p + step
        assert sum(b.get_width() for b in bars) == pytest.approx(1.0, abs=1e-5)
        counts = [t.get_text().strip() for t in fig.axes[4].texts][:2]
        assert counts == [f"{frames[step].naive_rows:,}", f"{frames[step].cached_rows:,}"]
    k = ch02.plot_decode_frame(frames, 2, side="K").axes[1].images[0].get_array()
    v = ch02.plot_decode_frame(frames, 2, side="V").axes[1].images[0].get_array()
    assert not np.ma.allequal(k, v)


def test_the_text_shows_characters_and_the_newest_token(frames):
    fig = ch02.plot_decode_frame(frames, 0)
    chips = [t.get_text() for t in fig.axes[0].texts]
    # 缓 is 3 bytes: one chip; drawn as its bytes where matplotlib has no Chinese font
    assert chips[:4] == ["K", "V", "␣", "缓 ×3B" if explorer._cjk_font() else "⟨e7 bc 93⟩"]
    assert "fed the prompt (prefill)" in fig.axes[0].get_title(loc="left")


def test_bad_controls_are_refused(frames):
    with pytest.raises(ValueError, match="step=8 must be an integer"):
        ch02.plot_decode_frame(frames, STEPS)
    with pytest.raises(ValueError, match="layer=9"):
        ch02.plot_decode_frame(frames, 0, layer=9)
    with pytest.raises(ValueError, match="side='Q' is not allowed"):
        ch02.plot_decode_frame(frames, 0, side="Q")
    with pytest.raises(ValueError, match="prompt=''"):
        ch02.decode_frames("", 4)


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from walk(child)


def test_explorer_builds_and_redraws_when_controls_move(frames, monkeypatch):
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, *a, **k: shown.append(obj))
    box = ch02.decode_explorer(PROMPT, STEPS)
    parts = list(walk(box))
    play = next(w for w in parts if isinstance(w, widgets.Play))
    slider = next(w for w in parts if isinstance(w, widgets.IntSlider))
    controls = {w.description: w for w in parts if isinstance(w, widgets.Dropdown)}
    readout = next(w for w in parts if "kvlab-readout" in w._dom_classes)
    assert (play.max, slider.max) == (STEPS - 1, STEPS - 1)
    assert set(controls) == {"layer", "head", "cache"}
    p = len(encode_bytes(PROMPT))
    assert heat_rows(shown[-1]) == p
    slider.value = 5                                     # what Play does, one step at a time
    assert heat_rows(shown[-1]) == p + 5
    assert html.unescape(readout.value).count(ch02.decode_readout(frames, 5).split("\n")[0]) == 1
    before = shown[-1].axes[1].images[0].get_array()
    controls["cache"].value = "V"
    assert not np.ma.allequal(before, shown[-1].axes[1].images[0].get_array())
    controls["layer"].value = 3
    assert "layer 3" in shown[-1].axes[1].get_title()


def test_without_a_chinese_font_characters_show_as_their_bytes(frames, monkeypatch):
    monkeypatch.setattr(explorer, "_cjk_font", lambda: None)  # as on Colab, which ships no CJK font
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Glyph … missing from font" would be a UserWarning
        fig = ch02.plot_decode_frame(frames, 0)
        fig.canvas.draw()
    chips = [t.get_text() for t in fig.axes[0].texts]
    assert chips[3:5] == ["⟨e7 bc 93⟩", "⟨e5 ad 98⟩"]  # 缓 and 存, byte by byte
    rows = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    assert rows[3:6] == ["e7 1/3", "bc 2/3", "93 3/3"]  # each row is one byte of 缓


def test_the_attention_panel_numbers_its_rows(frames):
    fig = ch02.plot_decode_frame(frames, 5)
    (positions,) = fig.axes[3].child_axes      # the secondary axis on the right of the bars
    assert "cached position" in positions.get_ylabel()
    labels = [t.get_text() for t in positions.get_yticklabels()]
    assert labels[:3] == ["0", "5", "10"]


@pytest.mark.parametrize("step", [0, 1, 2, STEPS - 1])
def test_the_decode_note_never_covers_the_newest_row(frames, step):
    # the note hangs below the newest row (va top) or, when no empty rows are left, sits above it
    # (va bottom): either way outside the rows outlined in orange
    fig = ch02.plot_decode_frame(frames, step, layer=1, head=0)
    note = next(t for t in fig.axes[1].texts if "decode: one row a step" in t.get_text())
    frame = frames[step]
    below, above = frame.positions - 0.5, frame.positions - frame.fed - 0.5
    assert (note.xy[1], note.get_va()) in ((below, "top"), (above, "bottom"))
