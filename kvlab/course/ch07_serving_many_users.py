"""Chapter 07, Serving many users: request lengths, where the KV memory goes under each policy
(slot by slot and in total), sequences that fit, the block-size trade-off, and the paging exercises."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..memory import GiB
from .style import (
    Verdict,
    as_number,
    as_numbers,
    new_figure,
    number_hint,
    numbers_hint,
    numeric,
    report,
)


def plot_request_lengths(prompt_lens, output_lens, max_len: int):
    """Histograms (log-spaced bins) of the prompt, output and total lengths of a request mix."""
    import numpy as np

    fig, ax = new_figure(7.5, 3.6)
    bins = np.geomspace(1, max_len, 40)
    for values, label, color in ((prompt_lens, "prompt", "#4C72B0"), (output_lens, "output", "#55A868"),
                                 (np.asarray(prompt_lens) + np.asarray(output_lens), "prompt + output",
                                  "#8C8C8C")):
        ax.hist(values, bins=bins, histtype="step", lw=2, label=label, color=color)
    ax.axvline(max_len, color="#C44E52", ls="--", lw=1.5)
    ax.text(max_len, ax.get_ylim()[1] * 0.95, f"max length {max_len:,} ", ha="right", va="top",
            fontsize=8, color="#C44E52")
    ax.set_xscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("requests")
    ax.legend(fontsize=9, loc="upper left")
    return fig


# What a slot of KV memory is spent on: its colour and legend label, for both memory figures.
SLOT_KINDS = {
    "prompt": ("#4C72B0", "prompt tokens"),
    "generated": ("#55A868", "generated tokens"),
    "used": ("#55A868", "holds a token's K/V"),
    "future": ("#F2C14E", "reserved for future tokens"),
    "internal": ("#C44E52", "held but empty (internal fragmentation)"),
    "external": ("#8C8C8C", "external fragmentation"),
    "free": ("#E8E8E8", "free (too little for the next request)"),
    "gap": ("#E8E8E8", "free"),
}
WASTE_PARTS = ("used", "future", "internal", "external", "free")   # plot_waste_breakdown's bars
LAYOUT_PARTS = ("prompt", "generated", "future", "internal", "gap")  # plot_kv_memory_layout's slots


def plot_waste_breakdown(results: dict, band: tuple[float, float] | None = (0.6, 0.8),
                         source: str = "vLLM's figure for pre-paging systems"):
    """Stacked bars: how the KV memory is spent under each policy (labels -> SimResult). `band`, a
    range of waste, is shaded where the green bar of tokens would end (waste 60–80 %: used 20–40 %)."""
    fig, ax = new_figure(8.5, 0.8 + 0.6 * len(results))
    labels = list(results)[::-1]
    left = [0.0] * len(labels)
    for part in WASTE_PARTS:
        color, label = SLOT_KINDS[part]
        widths = [results[k].fractions()[part] * 100 for k in labels]
        ax.barh(labels, widths, left=left, color=color, label=label,
                edgecolor="white", linewidth=0.5)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for i, k in enumerate(labels):
        used = results[k].used * 100
        inside = used > 85  # no room to the right: write it inside the green bar
        ax.text(used - 1 if inside else used + 1, i, f"waste {results[k].waste:.0%}",
                va="center", ha="right" if inside else "left", fontsize=9,
                color="white" if inside else "black")
    if band:
        lo, hi = (1 - band[1]) * 100, (1 - band[0]) * 100
        ax.axvspan(lo, hi, color="#4C72B0", alpha=0.15,
                   label=f"used {lo:.0f}–{hi:.0f} % (= {band[0]:.0%}–{band[1]:.0%} waste, {source})")
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the KV memory (%), averaged over time while requests wait")
    ax.grid(True, axis="x", alpha=0.3)
    ax.grid(False, axis="y")
    fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    return fig


def plot_kv_memory_layout(panels: dict, width: int = 64):
    """KV memory drawn slot by slot, `width` slots a row, one panel per layout.

    panels maps a title to (layout, capacity) or, for a paged layout, (layout, capacity,
    block_size); a layout is a list of (start slot, length, kind, request) as
    `kvlab.fragmentation.simulate(..., layout_step=…)` records it. A request's number is written where
    its chunk starts (a black bar marks the start) or, for a paged panel, in each of its blocks.
    """
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    kinds = list(LAYOUT_PARTS)
    rows = [-(-panel[1] // width) for panel in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.9 + 0.15 * sum(rows) + 0.5 * len(panels)),
                             layout="constrained", squeeze=False,
                             gridspec_kw={"height_ratios": rows})
    for ax, (title, panel) in zip(axes[:, 0], panels.items(), strict=True):
        layout, capacity = panel[0], panel[1]
        block_size = panel[2] if len(panel) > 2 else None
        n_rows = -(-capacity // width)
        grid = np.full(n_rows * width, np.nan)
        grid[:capacity] = kinds.index("gap")
        seen = set()
        for start, n, kind, req in layout:
            grid[start:start + n] = kinds.index(kind if kind in kinds else "gap")
            first = req >= 0 and (start % block_size == 0 if block_size else req not in seen)
            if first:
                seen.add(req)
                ax.text(start % width, start // width, str(req), fontsize=5.5, va="center",
                        ha="left", color="white")
                if not block_size:
                    ax.plot([start % width - 0.5] * 2, [start // width - 0.5, start // width + 0.5],
                            color="black", lw=1.2)
        ax.imshow(grid.reshape(n_rows, width), cmap=ListedColormap([SLOT_KINDS[k][0] for k in kinds]),
                  vmin=-0.5, vmax=len(kinds) - 0.5, aspect="auto", interpolation="nearest")
        if block_size:
            for x in range(0, width + 1, block_size):
                ax.axvline(x - 0.5, color="white", lw=0.8)
        for y in range(n_rows + 1):
            ax.axhline(y - 0.5, color="white", lw=0.8)
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.legend(handles=[Patch(color=SLOT_KINDS[k][0], label=SLOT_KINDS[k][1]) for k in kinds],
               loc="outside lower center", ncols=len(kinds), fontsize=8, frameon=False)
    return fig


def plot_concurrency_vs_memory(memory_bytes, per_sequence_bytes: dict, markers: dict | None = None,
                               title: str = ""):
    """Concurrent sequences that fit in a KV budget, one line per policy (label -> bytes each
    running sequence costs), with optional named budgets (e.g. GPUs) marked on the x axis."""
    import numpy as np

    fig, ax = new_figure(7.5, 4.2)
    mem = np.asarray(memory_bytes, dtype=float)
    for label, per_seq in per_sequence_bytes.items():
        ax.plot(mem / GiB, np.floor(mem / per_seq), label=label, lw=2)
    markers = markers or {}
    if markers:   # named on a top axis, where no line or count runs through the names
        top = ax.secondary_xaxis("top")
        top.set_xticks([b / GiB for b in markers.values()], list(markers), fontsize=8, color="dimgray")
    for budget in markers.values():
        ax.axvline(budget / GiB, color="gray", ls=":", lw=1)
        counts = sorted(budget // per_seq for per_seq in per_sequence_bytes.values())
        for i, n in enumerate(counts):   # neighbours' labels on alternate sides, so close ones part
            ax.plot(budget / GiB, n, "o", color="black", ms=3)
            ax.annotate(f"{n:,.0f}", (budget / GiB, n), xytext=(4 if i % 2 == 0 else -4, -10),
                        textcoords="offset points", ha="left" if i % 2 == 0 else "right", fontsize=8)
    ax.set_xlabel("memory for the KV cache (GiB)")
    ax.set_ylabel("sequences decoded at once")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=9)
    return fig


def plot_block_size_tradeoff(block_sizes, waste, table_entries, read_seconds=None):
    """Left: waste (last blocks) vs block size; right: block-table entries a sequence needs and,
    if given, measured times to read one sequence through its table: a list (one line) or a dict
    label -> list (one line each)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(block_sizes), [str(b) for b in block_sizes])
        ax.set_xlabel("block size (tokens)")
        ax.grid(True, alpha=0.3)
    ax1.plot(block_sizes, [w * 100 for w in waste], "o-", color="#C44E52")
    ax1.axhline(4, color="gray", ls="--", lw=1)
    ax1.text(block_sizes[0], 4, " 4 %: vLLM reports under this", va="bottom", fontsize=8,
             color="dimgray")
    ax1.set_ylabel("waste: empty slots in last blocks (%)")
    ax1.set_title("bigger blocks waste more", fontsize=10)
    ax2.plot(block_sizes, table_entries, "s-", color="#4C72B0", label="block-table entries")
    ax2.set_yscale("log")
    ax2.set_ylabel("block-table entries per sequence", color="#4C72B0")
    ax2.set_title("smaller blocks mean more lookups", fontsize=10)
    if read_seconds is not None:
        if not isinstance(read_seconds, dict):
            read_seconds = {"measured read, block by block": read_seconds}
        twin = ax2.twinx()
        for (label, secs), style in zip(read_seconds.items(), ["^--", "v:", "d-."], strict=False):
            twin.plot(block_sizes, [s * 1e3 for s in secs], style, color="#55A868", label=label)
        twin.set_yscale("log")
        twin.set_ylabel("measured read time (ms)", color="#55A868")
        twin.legend(fontsize=7, loc="upper right")
    return fig


def reserve_max_waste(prompt_lens, output_lens, max_len: int) -> float:
    """The share of KV memory that reserving max_len per request leaves without a token, from the
    request lengths alone: a running request holds its prompt plus the tokens generated so far, on
    average prompt + (output + 1) / 2 over the output-many steps it runs, so long answers weigh
    more. Waste = 1 − that time-weighted average ÷ max_len (on a busy server, where the memory is
    always full of reservations)."""
    p = np.asarray(prompt_lens, dtype=np.float64)
    o = np.asarray(output_lens, dtype=np.float64)
    held = (o * (p + (o + 1) / 2)).sum() / o.sum()
    return float(1 - held / max_len)


# ---- exercises: blocks of one sequence, sequences that fit -----------------------------------------


PAGED_BLOCKS_EXERCISE = {"n_tokens": 1234, "block_size": 32}
# 630 tokens: 40 blocks (the last one 10 slots short), so each usual slip gives its own number.
PAGED_FIT_EXERCISE = {"num_blocks": 4096, "block_size": 16, "n_tokens": 630, "max_len": 2048}


def _whole(value: float) -> bool:
    return value == int(value)


def check_paged_blocks(answer, n_tokens: int = PAGED_BLOCKS_EXERCISE["n_tokens"],
                       block_size: int = PAGED_BLOCKS_EXERCISE["block_size"]) -> Verdict:
    """(blocks, wasted slots) of one sequence of n_tokens tokens in blocks of block_size. The hints
    name the usual slips: rounding the blocks down (or not at all), giving the tokens in the last
    block instead of its empty slots, giving all the slots, and the two numbers swapped."""
    from ..cache.paged import blocks_needed, wasted_slots

    blocks, wasted = blocks_needed(n_tokens, block_size), wasted_slots(n_tokens, block_size)
    got = as_numbers(answer, 2)
    if got is None:
        return report(False, "", numbers_hint(answer, ("blocks", "wasted_slots")))
    got_blocks, got_wasted = got
    filled_last = n_tokens - (blocks - 1) * block_size  # tokens in the last, partly filled block
    if (got_blocks, got_wasted) == (wasted, blocks) and blocks != wasted:
        return report(False, "", "the two numbers are swapped: blocks first, then wasted slots.")
    if got_blocks == n_tokens // block_size and got_blocks != blocks:
        return report(False, "", f"{n_tokens:,} ÷ {block_size} = {n_tokens / block_size:g}: a partly "
                                 "filled last block is still a whole block, so round up, not down.")
    if not _whole(got_blocks):
        return report(False, "", f"blocks come whole: round {got_blocks:g} up to the next integer.")
    if got_blocks != blocks:
        return report(False, "", f"divide {n_tokens:,} tokens by {block_size} tokens a block and "
                                 "round up.")
    if got_wasted == filled_last and filled_last != wasted:
        return report(False, "", f"{filled_last} is how many tokens the last block holds "
                                 f"({n_tokens:,} − {blocks - 1} × {block_size}); the question asks "
                                 "for its empty slots.")
    if got_wasted == blocks * block_size:
        return report(False, "", f"{got_wasted:,.0f} is all the slots of the {blocks} blocks; "
                                 f"subtract the {n_tokens:,} that hold a token.")
    return report(got_wasted == wasted,
                  f"Right: {blocks} blocks hold {blocks * block_size:,} slots, {wasted} of them "
                  "empty, all in the last block.",
                  "wasted slots = blocks × block_size − tokens.")


def check_paged_sequences_fit(answer, num_blocks: int = PAGED_FIT_EXERCISE["num_blocks"],
                              block_size: int = PAGED_FIT_EXERCISE["block_size"],
                              n_tokens: int = PAGED_FIT_EXERCISE["n_tokens"],
                              max_len: int = PAGED_FIT_EXERCISE["max_len"]) -> Verdict:
    """How many sequences of n_tokens fit at once in a pool of num_blocks blocks with paging. The
    hints name the usual slips: counting slots as if a sequence needed only its tokens (no partly
    filled last block), rounding the blocks of a sequence down or to the nearest, rounding the
    final division up or not at all, the reservation answer, and the blocks of one sequence."""
    from ..cache.paged import blocks_needed

    per_seq = blocks_needed(n_tokens, block_size)
    expected = num_blocks // per_seq
    reserved = num_blocks * block_size // max_len
    value = as_number(answer)
    if value is None:
        return report(False, "", number_hint(answer))
    exact_blocks = n_tokens / block_size
    slips = {
        reserved: f"that is how many fit when each reserves {max_len:,} slots; with paging each "
                  "takes only the blocks its tokens fill.",
        per_seq: f"{per_seq} is how many blocks one sequence takes; now divide the pool by it.",
        -(-num_blocks // per_seq): f"{num_blocks:,} ÷ {per_seq} = {num_blocks / per_seq:.2f}: a "
                                   "sequence that does not fit whole cannot run, so round down.",
        num_blocks * block_size // n_tokens: f"that counts only the {n_tokens} slots each sequence "
                                             f"fills, but it holds whole blocks: {n_tokens} ÷ "
                                             f"{block_size} = {exact_blocks:g} rounds up to {per_seq}.",
        num_blocks // max(1, round(exact_blocks)): f"{n_tokens} ÷ {block_size} = {exact_blocks:g} "
                                                  "blocks rounds up, not to the nearest: the last "
                                                  "block is taken whole.",
    }
    slips.pop(expected, None)  # with other numbers a slip can land on the right answer
    if value in slips:
        return report(False, "", slips[value])
    if abs(value - num_blocks / per_seq) < 0.01 and not _whole(value):
        return report(False, "", f"{value:g} sequences: only whole sequences run, so round down.")
    return numeric(answer, expected, 1e-9,
                   f"Right: {per_seq} blocks a sequence, {expected} sequences instead of {reserved} "
                   f"with max-length reservation ({expected / reserved:.1f}×).",
                   "blocks in the pool ÷ blocks one sequence needs (rounded up), rounded down.")
