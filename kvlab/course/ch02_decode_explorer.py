"""Chapter 02, the decode explorer: Play through a cached decode of kvlab-tiny: the text growing, one
layer's K or V cache filling one row a step, the newest token's attention over the cached positions,
and the work counted so far. The recording is kvlab.trace's; this module only draws it."""

from __future__ import annotations

import functools

import matplotlib.pyplot as plt

from .. import trace as _trace
from .style import CACHED_FACE, NEW_FACE, PROMPT_FACE, explorer_plot

DECODE_PROMPT = "KV cache 缓存"
DECODE_STEPS = 24
OLD_FACE = "#E8E8E8"  # cache rows not filled yet


@functools.lru_cache(maxsize=8)
def decode_frames(prompt: str = DECODE_PROMPT, max_new_tokens: int = DECODE_STEPS) -> _trace.DecodeTrace:
    """The recorded decode of `prompt` by kvlab-tiny (computed once per prompt and length)."""
    from ..generate import encode_bytes

    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt={prompt!r} must be a non-empty string")
    return _trace.record(_tiny(), encode_bytes(prompt), max_new_tokens)


@functools.lru_cache(maxsize=1)
def _tiny():
    from ..pretrained import load

    return load("kvlab-tiny")


@functools.lru_cache(maxsize=1)
def _cjk_font() -> str | None:
    """A font with Chinese glyphs, if this machine has one (Colab often has none)."""
    from matplotlib import font_manager

    names = sorted({f.name for f in font_manager.fontManager.ttflist if "CJK" in f.name})
    return next((n for n in names if "Sans" in n and "SC" in n), names[0] if names else None)


def _shown(text: str) -> str:
    """Text as matplotlib can draw it here: CJK characters become their UTF-8 bytes without a font."""
    if _cjk_font() or all(ord(c) < 0x2E80 for c in text):
        return text
    return "".join(c if ord(c) < 0x2E80 else "⟨" + c.encode().hex(" ") + "⟩" for c in text)


def _fonts() -> list[str]:
    return ["DejaVu Sans"] + ([_cjk_font()] if _cjk_font() else [])


# The frame's panels, in inches from the bottom left (left, bottom, width, height): fixed, so redraws
# are fast and nothing jumps. Left third: the text, then the counts; right: the cache and the attention,
# as tall as a slide allows. Saved inline (100 dpi, 0.1 in padding) it is about 1140 × 430 px.
FIGSIZE = (11.2, 4.1)
TEXT_BOX, COUNTS_BOX = (0.0, 1.5, 3.45, 2.13), (0.55, 0.44, 2.8, 0.52)
HEAT_BOX, COLORBAR_BOX, BARS_BOX = (4.35, 0.44, 3.6, 3.47), (8.05, 0.44, 0.12, 3.47), (8.95, 0.44, 1.75, 3.47)
ROW_LABEL_PT, STAGGER_PT = 7, 28  # row labels' font size; the pad that moves every other one left


def _panel(fig, box, **kwargs):
    width, height = FIGSIZE
    left, bottom, w, h = box
    return fig.add_axes((left / width, bottom / height, w / width, h / height), **kwargs)


def plot_decode_frame(frames: _trace.DecodeTrace, step: int, layer: int = 0, head: int = 0,
                      side: str = "K"):
    """One frame of a recorded decode: the text (newest token highlighted) above the K/V rows computed
    so far, and beside them the K or V cache of one layer and head filling row by row (prefill rows set
    apart from decoded ones) with the newest token's attention over the cached positions. Returns the
    Figure."""
    import numpy as np
    from matplotlib.patches import Rectangle

    from .. import validate

    frame = frames[step]
    keys = frames.keys
    layer = validate.integer("layer", layer, low=0, high=keys.shape[0] - 1)
    head = validate.integer("head", head, low=0, high=frames.attention.shape[2] - 1)
    side = validate.choice("side", side, ("K", "V"))
    kv_head = frames.kv_head(head)
    full = (frames.keys if side == "K" else frames.values)[layer, kv_head].numpy()  # (S_max, D)
    total, dim, filled, p = full.shape[0], full.shape[1], frame.positions, frames.prompt_len

    fig = plt.figure(figsize=FIGSIZE)
    _draw_text(_panel(fig, TEXT_BOX), frames, frame)

    ax = _panel(fig, HEAT_BOX)
    shown = np.full_like(full, np.nan)
    shown[:filled] = full[:filled]
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad=OLD_FACE)
    limit = float(np.abs(full).max()) or 1.0     # one colour scale for every step: rows keep their colour
    image = ax.imshow(shown, aspect="auto", cmap=cmap, vmin=-limit, vmax=limit, interpolation="nearest")
    fig.colorbar(image, cax=_panel(fig, COLORBAR_BOX), label=f"{side} value")
    ax.axhline(p - 0.5, color="black", lw=1.6)
    ax.add_patch(Rectangle((-0.5, filled - frame.fed - 0.5), dim, frame.fed, fill=False,
                           edgecolor=NEW_FACE, lw=2.5))
    rows = [_row_label(lab, b) for lab, b in zip(_trace.byte_labels(frame.tokens), frame.tokens, strict=True)]
    ax.set_yticks(range(filled), rows, fontsize=ROW_LABEL_PT, fontfamily=_fonts())
    if HEAT_BOX[3] * 72 / total < 1.3 * ROW_LABEL_PT:  # rows closer than a line: stagger the labels
        for tick in ax.yaxis.get_major_ticks()[1::2]:
            tick.set_pad(STAGGER_PT)
            tick.tick1line.set(markersize=STAGGER_PT + 2, markeredgecolor="#999999")  # leads to its row
    ax.set_ylim(total - 0.5, -0.5)
    ax.set_xlabel(f"channel (head_dim = {dim})")
    ax.set_title(f"{side} cache, layer {layer}, KV head {kv_head}: {filled} of {total} rows filled",
                 fontsize=10)
    note = dict(textcoords="offset points", fontsize=8, ha="right",
                bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.85))
    ax.annotate(f"prefill: {p} rows at once ↑", xy=(dim - 0.5, p - 0.5), xytext=(-3, 3), va="bottom", **note)
    # The decode note sits under the newest row, in the rows not filled yet, so it never covers the
    # newest row's outline; once those run out (the last steps), above the newest row instead.
    newest_top = filled - frame.fed - 0.5
    if total - filled >= 3:
        ax.annotate("↑ decode: one row a step", xy=(dim - 0.5, filled - 0.5), xytext=(-3, -3), va="top",
                    **note)
    else:
        ax.annotate("decode: one row a step ↓", xy=(dim - 0.5, newest_top), xytext=(-3, 3), va="bottom",
                    **note)

    bars = _panel(fig, BARS_BOX, sharey=ax)
    weights = frame.attention[layer, head].numpy()
    colors = [PROMPT_FACE if i < p else CACHED_FACE for i in range(filled)]
    colors[-1] = NEW_FACE
    bars.barh(range(filled), weights, color=colors, edgecolor="#555555", lw=0.4, height=0.85)
    bars.set_xlim(0, max(0.05, float(weights.max())) * 1.15)
    bars.tick_params(labelleft=False)  # the rows are the cache's, labelled on its left ...
    positions = bars.secondary_yaxis("right")  # ... and numbered here, so this panel reads alone
    every = 5 if total <= 60 else 10
    positions.set_yticks(range(0, total, every), [str(i) for i in range(0, total, every)], fontsize=7)
    positions.set_ylabel("cached position (same rows as the cache)", fontsize=8)
    bars.set_xlabel(f"weight (query head {head}; sums to 1)")
    bars.set_title("newest token's attention", fontsize=10)
    bars.grid(True, axis="x", alpha=0.3)

    _draw_counts(_panel(fig, COUNTS_BOX), frames, frame)
    return fig


CHIP_H, LINE_H, CHIP_GAP = 0.23, 0.275, 0.03  # inches: a chip's height, a line's, the gap between chips


def _draw_text(ax, frames: _trace.DecodeTrace, frame: _trace.Frame) -> None:
    """The tokens so far as chips: prompt grey, decoded blue, the token fed this step orange, and the
    token it predicted (not in the cache yet) dashed. Multi-byte characters span their bytes. Chips wrap
    onto as many lines as the panel holds; when the text outgrows it, the oldest chips give way to "…"."""
    ax.set_axis_off()
    size = ax.get_position().size * ax.figure.get_size_inches()
    ax.set_xlim(0, size[0])                     # data units are inches: chips keep their size
    ax.set_ylim(-size[1], 0)
    newest_start = frame.positions - frame.fed
    predicted = _trace.byte_labels(frame.tokens + [frame.next_token])[-1]
    chips = [(start, n, _shown(text)) for start, n, text in
             [*_trace.characters(frame.tokens), (frame.positions, 1, predicted)]]
    labels = [text + (f" ×{n}B" if n > 1 and not text.startswith("⟨") else "") for _, n, text in chips]
    widths = [sum(0.203 if ord(c) >= 0x2E80 else 0.111 for c in label) + 0.126 for label in labels]
    first, places = _wrap(widths, size[0], int((size[1] - CHIP_H) / LINE_H) + 1)
    if first:
        chips, labels = [(-1, 0, "…"), *chips[first:]], ["…", *labels[first:]]
    for (start, n, _), label, (x, y, width) in zip(chips, labels, places, strict=True):
        if start < 0:
            face, style = "none", "none"
        elif start >= frame.positions:
            face, style = "white", "--"
        elif start + n > newest_start and frame.step > 0:  # holds the byte fed this step
            face, style = NEW_FACE, "-"
        else:
            face, style = (PROMPT_FACE if start < frames.prompt_len else CACHED_FACE), "-"
        ax.add_patch(plt.Rectangle((x, y - CHIP_H / 2), width - CHIP_GAP, CHIP_H, facecolor=face,
                                   edgecolor="#555555", lw=0.7, ls=style))
        ax.text(x + (width - CHIP_GAP) / 2, y, label, ha="center", va="center", fontsize=8.5,
                fontfamily=_fonts())
    fed = "the prompt (prefill)" if frame.step == 0 else f"1 token: {_trace.byte_labels(frame.tokens)[-1]!r}"
    ax.set_title(_shown(f"step {frame.step}: fed {fed};\npredicted next {predicted!r} (dashed)"),
                 fontsize=10, loc="left", fontfamily=_fonts())


def _wrap(widths: list[float], width: float, lines: int) -> tuple[int, list[tuple[float, float, float]]]:
    """Chips of these widths in lines of `width`: the first chip shown and (x, y, width) of each chip
    drawn, led by a "…" chip when the oldest ones had to go so that the rest fit in `lines` lines."""
    for first in range(len(widths)):
        x, line, places = 0.0, 0, []
        for w in ([0.25] if first else []) + widths[first:]:
            if x and x + w > width:
                x, line = 0.0, line + 1
            places.append((x, -CHIP_H / 2 - 0.01 - line * LINE_H, w))
            x += w
        if line < lines:
            return first, places
    return first, places


def _draw_counts(ax, frames: _trace.DecodeTrace, frame: _trace.Frame) -> None:
    """K/V rows computed so far (per layer) by the naive and the cached decoder, and cache bytes."""
    from ..memory import format_bytes

    final = frames[len(frames) - 1]
    ax.barh([1, 0], [frame.naive_rows, frame.cached_rows], color=["#C44E52", "#4C72B0"], height=0.7)
    ax.set_yticks([1, 0], ["naive", "cached"])
    ax.set_xlim(0, final.naive_rows * 1.15)    # room for the last count's number
    ax.set_xlabel("K/V rows computed so far, per layer")
    for y, rows in ((1, frame.naive_rows), (0, frame.cached_rows)):
        ax.text(rows, y, f" {rows:,}", va="center", fontsize=8.5)
    ax.set_title(f"the cache holds {format_bytes(frame.cache_bytes)}\n(K and V, {frames.keys.shape[0]} "
                 f"layers, {frame.positions} positions)", fontsize=9, loc="left")


def decode_readout(frames: _trace.DecodeTrace, step: int) -> str:
    """The explorer's readout: what this step fed and predicted, and the counts."""
    from ..memory import format_bytes

    f = frames[step]
    return (f"step {f.step} of {len(frames) - 1}: cache holds {f.positions} positions "
            f"({frames.prompt_len} from the prefill + {f.step} decoded)\n"
            f"text so far: {_trace.readable_text(f.tokens)!r}  → next "
            f"{_trace.byte_labels(f.tokens + [f.next_token])[-1]!r}\n"
            f"K/V rows computed per layer: naive {f.naive_rows:,}, cached {f.cached_rows:,} "
            f"({f.naive_rows / f.cached_rows:.1f}×); cache {format_bytes(f.cache_bytes)}")


def decode_explorer(prompt: str = DECODE_PROMPT, max_new_tokens: int = DECODE_STEPS):
    """Play through a cached decode of kvlab-tiny: Play / the step slider move through the steps;
    layer, head and K/V choose what the heat map shows. Frames are recorded once, so scrubbing is fast."""
    import ipywidgets as w

    frames = decode_frames(prompt, max_new_tokens)
    last = len(frames) - 1
    step = w.IntSlider(value=0, min=0, max=last, description="step", continuous_update=True)
    play = w.Play(value=0, min=0, max=last, step=1, interval=1200, description="Play")
    w.jslink((play, "value"), (step, "value"))
    layer = w.Dropdown(options=list(range(frames.keys.shape[0])), value=0, description="layer")
    head = w.Dropdown(options=list(range(frames.attention.shape[2])), value=0, description="head")
    side = w.Dropdown(options=["K", "V"], value="K", description="cache")
    for control in (layer, head, side):
        control.layout = w.Layout(width="170px")
    readout = w.HTML()
    readout.add_class("kvlab-readout")

    def draw(step, layer, head, side):
        return plot_decode_frame(frames, step, layer, head, side), decode_readout(frames, step)

    out = explorer_plot(draw, {"step": step, "layer": layer, "head": head, "side": side}, readout)
    out.layout.height = "430px"
    box = w.VBox([w.HBox([play, step]), w.HBox([layer, head, side]), out, readout])
    box.add_class("kvlab-decode-explorer")
    return box


def _row_label(label: str, byte: int) -> str:
    """A cache row's tick label: without a font for its character, the row's own byte ("bc 2/3"); with
    one, a character of several bytes is named once, on its first byte ("缓 1/3", "· 2/3", "· 3/3"),
    since rows are a few pixels tall and repeated CJK glyphs would pile into one unreadable column."""
    if _shown(label) != label:
        return f"{byte:02x} {label.split(' ')[1]}"
    if " " in label and not label.split(" ")[1].startswith("1/"):
        return "· " + label.split(" ")[1]
    return label
