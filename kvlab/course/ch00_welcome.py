"""Chapter 00, Welcome: the course roadmap and the byte-token warm-up exercise."""

from __future__ import annotations

import matplotlib.pyplot as plt

from .style import Verdict, arrow, box, close, report

ROADMAP = [
    ("01", "One token\nat a time", "naive decoding:\nO(n²) K/V rows"),
    ("02", "The KV\ncache", "compute once,\nstore it: O(n) rows"),
    ("03", "How big is\nthe cache?", "2·L·H_kv·D·S·B\n× bytes per value"),
    ("04", "MHA → GQA\n→ MQA", "share K/V heads:\nfewer bytes"),
    ("05", "FP16 →\nINT8", "quantize:\nfewer bits"),
    ("06", "Fast on\nthe GPU", "static cache,\ngraphs, roofline"),
    ("07", "Serving\nmany users", "batching,\npaging"),
    ("08", "Review", "quiz, cheat sheet,\nplanning"),
    ("09", "Reuse\nand evict", "prefix sharing,\nwindows, eviction"),
]


def plot_roadmap():
    """The course at a glance: one box per chapter, grouped by the question it answers."""
    fig, ax = plt.subplots(figsize=(12.2, 3.2), layout="constrained")
    groups = {"why": ("#dbe9f6", range(0, 2)), "how big, and how to shrink it": ("#fde2c8", range(2, 5)),
              "how fast / how many": ("#d9f0d3", range(5, 7)), "check": ("#eeeeee", range(7, 8)),
              "reuse and bound": ("#e8dff5", range(8, 9))}
    for label, (color, idx) in groups.items():
        for i in idx:
            num, title, note = ROADMAP[i]
            box(ax, i * 1.35, 0.9, 1.15, 1.1, f"{num}\n{title}", color, fontsize=9)
            ax.text(i * 1.35 + 0.575, 0.55, note, ha="center", va="top", fontsize=8, color="#444444")
            if i:
                arrow(ax, (i * 1.35 - 0.2, 1.45), (i * 1.35, 1.45))
        ax.text(idx[0] * 1.35, 2.15, label, fontsize=9, fontweight="bold", color="#444444")
    ax.set_xlim(-0.1, len(ROADMAP) * 1.35)
    ax.set_ylim(-0.1, 2.4)
    ax.axis("off")
    ax.set_title("The course: from the naive decoder to serving many users, and reusing their caches")
    return fig


# ---- exercise -------------------------------------------------------------------------------------


def check_byte_tokens(answer, text: str = "KV cache 缓存") -> Verdict:
    """How many byte-level tokens (UTF-8 bytes) does `text` take?"""
    expected = len(text.encode("utf-8"))
    if answer is None:
        return report(False, "", "replace None with a number: count the UTF-8 bytes of the text.")
    return report(close(answer, expected), f"{text!r} is {expected} byte tokens.",
                  "ASCII letters and spaces take 1 byte each; a Chinese character takes 3.")
