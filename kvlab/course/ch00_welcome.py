"""Chapter 00, Welcome: the course roadmap and the byte-token warm-up exercise."""

from __future__ import annotations

import matplotlib.pyplot as plt

from .style import Verdict, arrow, as_number, box, close, number_hint, report

# The course's chapters, in order: (number, title, what it builds or measures, group, explorer), where
# `explorer` says whether the chapter has an interactive explorer. Chapters 08 and 10 are new.
ROADMAP = [
    ("00", "Welcome", "how the course\nworks, terms", "start", False),
    ("01", "One token\nat a time", "naive decoding:\nO(n²) K/V rows", "why", False),
    ("02", "The KV\ncache", "compute once,\nstore it: O(n) rows", "why", True),
    ("03", "How big is\nthe cache?", "2·L·H_kv·D·S·B\n× bytes per value", "size", True),
    ("04", "MHA → GQA\n→ MQA", "share K/V heads:\nfewer bytes", "size", True),
    ("05", "FP16 →\nINT8", "quantize:\nfewer bits", "size", True),
    ("06", "Fast on\nthe GPU", "static cache,\ngraphs, roofline", "speed", False),
    ("07", "Serving\nmany users", "batching,\npaging", "speed", False),
    ("08", "Scheduling\nmany requests", "continuous batching,\nchunked prefill", "speed", True),
    ("09", "Reuse\nand evict", "prefix sharing,\nwindows, eviction", "reuse", True),
    ("10", "Speculative\ndecoding", "draft, verify,\nroll the cache back", "reuse", True),
    ("11", "Review", "quiz, cheat sheet,\nplanning", "check", False),
]
GROUPS = {  # group -> (label, colour)
    "start": ("start", "#f5f5f5"), "why": ("why a cache", "#dbe9f6"),
    "size": ("how big, and how to shrink it", "#fde2c8"), "speed": ("how fast, how many", "#d9f0d3"),
    "reuse": ("reuse, bound, roll back", "#e8dff5"), "check": ("check", "#eeeeee"),
}


def chapters_with_explorers() -> list[str]:
    """The numbers of the chapters that have an explorer (sliders and drop-downs that redraw a plot)."""
    return [num for num, _, _, _, explorer in ROADMAP if explorer]


def plot_roadmap():
    """The course at a glance: one box per chapter in two rows, coloured by the question it answers."""
    from matplotlib.patches import Patch

    per_row, step = 6, 1.35
    fig, ax = plt.subplots(figsize=(9.4, 4.4), layout="constrained")
    for i, (num, title, note, group, explorer) in enumerate(ROADMAP):
        row, col = divmod(i, per_row)
        x, y = col * step, 2.1 - row * 2.05
        box(ax, x, y, 1.15, 1.1, f"{num}\n{title}", GROUPS[group][1], fontsize=9)
        if explorer:
            ax.text(x + 1.1, y + 1.05, "◆", ha="right", va="top", fontsize=8, color="#8172B2")
        ax.text(x + 0.575, y - 0.1, note, ha="center", va="top", fontsize=8, color="#444444")
        if col:
            arrow(ax, (x - 0.2, y + 0.55), (x, y + 0.55))
    handles = [Patch(facecolor=color, edgecolor="#333333", label=label) for label, color in GROUPS.values()]
    handles.append(Patch(facecolor="white", edgecolor="white", label="◆ has an explorer"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=4, fontsize=8,
              frameon=False)
    ax.set_xlim(-0.1, per_row * step)
    ax.set_ylim(-0.85, 3.3)
    ax.axis("off")
    ax.set_title("The course: from the naive decoder to serving, reusing and rolling back caches")
    return fig


# ---- exercise -------------------------------------------------------------------------------------


def check_byte_tokens(answer, text: str = "KV cache 缓存") -> Verdict:
    """How many byte-level tokens (UTF-8 bytes) does `text` take?"""
    expected = len(text.encode("utf-8"))
    if answer is None:
        return report(False, "", "replace None with a number: count the UTF-8 bytes of the text.")
    value = as_number(answer)
    if value is None:
        return report(False, "", f"{number_hint(answer)} Count the UTF-8 bytes of the text.")
    cjk = sum(ord(c) >= 0x2E80 for c in text)  # Chinese characters: 3 bytes each in UTF-8
    wrong = {len(text): "you counted characters; count UTF-8 bytes: a Chinese character is 3.",
             expected - cjk: "2 bytes a Chinese character is GBK or UTF-16; UTF-8 uses 3."}
    if value != expected and value in wrong:
        return report(False, "", wrong[value])
    return report(close(answer, expected), f"{text!r} is {expected} byte tokens.",
                  "ASCII letters and spaces take 1 byte each; a Chinese character takes 3.")
