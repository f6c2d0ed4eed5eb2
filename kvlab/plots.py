"""The matplotlib figures the notebooks and widgets share. Each function returns its Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt

from .memory import GiB, format_bytes


def new_figure(width: float = 7.0, height: float = 4.0):
    """A figure and axes in the course's house style."""
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    ax.grid(True, alpha=0.3)
    return fig, ax


# --- Chapter 03: how big is the KV cache? ---------------------------------------------------

WEIGHT_COLOR, CACHE_COLOR, GPU_COLOR = "#4C72B0", "#DD8452", "#C44E52"


def weights_vs_cache(cases, gpu_bytes: int | None = None, gpu_label: str = ""):
    """Side-by-side bars of weight bytes and KV-cache bytes (in GiB) for each case.

    `cases`: a sequence of (label, weight_bytes, cache_bytes). An optional GPU capacity is drawn as
    a dashed line, so the eye sees at once what fits.
    """
    import numpy as np

    labels = [c[0] for c in cases]
    weights = np.array([c[1] for c in cases], dtype=float) / GiB
    caches = np.array([c[2] for c in cases], dtype=float) / GiB
    fig, ax = new_figure(8.0, 4.2)
    x = np.arange(len(cases))
    w = 0.38
    for offset, values, label, color in ((-w / 2, weights, "weights (fp16)", WEIGHT_COLOR),
                                         (w / 2, caches, "KV cache (fp16)", CACHE_COLOR)):
        bars = ax.bar(x + offset, values, w, label=label, color=color)
        ax.bar_label(bars, [f"{v:.3g}" for v in values], fontsize=8, padding=2)
    if gpu_bytes:
        ax.axhline(gpu_bytes / GiB, color=GPU_COLOR, ls="--", lw=1.2,
                   label=f"{gpu_label} = {gpu_bytes / GiB:.1f} GiB".strip(" ="))
    ax.set_xticks(x, labels, fontsize=9)
    ax.set_ylabel("memory (GiB)")
    ax.set_title("Model weights vs KV cache (batch 1)")
    ax.legend(loc="upper left", fontsize=9)
    ax.set_ylim(0, max(weights.max(), caches.max(), (gpu_bytes or 0) / GiB) * 1.15)
    return fig


def memory_vs_seq_len(seq_lens, weight_bytes: int, cache_bytes, capacity_bytes: int,
                      capacity_label: str, current_seq_len: int, max_context: int = 0,
                      title: str = "", cache_label: str = "KV cache", weight_label: str = "weights",
                      note: str = ""):
    """Memory against sequence length (log x): the weights plus the KV cache stacked, the GPU's
    capacity as a line, the current setting marked and the longest context that fits dotted.

    The y axis (GiB) stops a little above the GPU (or the weights, if they are bigger), so the
    crossing stays readable; a current setting above the axis is marked at its top with its value.
    `note` (e.g. "the weights alone do not fit") is written across the plot.
    """
    import numpy as np

    s = np.asarray(seq_lens, dtype=float)
    cache = np.asarray(cache_bytes, dtype=float) / GiB
    wt = weight_bytes / GiB
    cap = capacity_bytes / GiB
    top = max(1.6 * cap, 1.15 * wt)
    fig, ax = new_figure(9.0, 4.2)
    ax.fill_between(s, 0, wt, color=WEIGHT_COLOR, alpha=0.85, lw=0, label=weight_label)
    ax.fill_between(s, wt, wt + cache, color=CACHE_COLOR, alpha=0.85, lw=0, label=cache_label)
    ax.axhline(cap, color=GPU_COLOR, ls="--", lw=1.5, label=f"{capacity_label}: {cap:.1f} GiB")
    if s[0] <= max_context <= s[-1]:
        ax.axvline(max_context, color=GPU_COLOR, ls=":", lw=1.2,
                   label=f"longest context\nthat fits: {max_context:,}")
    current = wt + float(np.interp(current_seq_len, s, cache))  # the cache is linear in tokens
    text = format_bytes(current * GiB)
    if current <= top:
        ax.plot([current_seq_len], [current], "o", ms=9, mfc="white", mec="black", mew=2,
                label=f"this setting:\n{current_seq_len:,} tokens, {text}", zorder=5, clip_on=False)
    else:  # off the chart: mark it at the top edge
        ax.plot([current_seq_len], [top], "^", ms=10, mfc="white", mec="black", mew=2,
                label=f"this setting (off the chart):\n{current_seq_len:,} tokens, {text}", zorder=5,
                clip_on=False)
    if note:
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", fontsize=11,
                bbox={"boxstyle": "round", "fc": "white", "ec": GPU_COLOR, "alpha": 0.95})
    ax.set_xscale("log", base=2)
    ax.set_xlim(s[0], s[-1])
    ticks = [t for t in (128, 1024, 4096, 32768, 131072, 2**20) if s[0] <= t <= s[-1]]
    ax.set_xticks(ticks, [_tokens_label(t) for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(0, top)
    ax.set_xlabel("sequence length (tokens, log scale)")
    ax.set_ylabel("memory (GiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.9)
    return fig


def _tokens_label(n: int) -> str:
    """128, 4K, 128K, 1M: binary K and M, as context lengths are usually quoted."""
    for unit, size in (("M", 2**20), ("K", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


# --- Chapter 08: capacity planning -----------------------------------------------------------


def capacity_curve(config, gpu_names=None, dtype: str = "fp16", weight_dtype: str = "fp16",
                   reserve_fraction: float = 0.1, seq_lens=None):
    """How many sequences of each length fit next to the weights, one line per GPU (log-log).

    A GPU whose memory the weights (plus reserve) already fill gets no line, and the legend says so.
    """
    from .memory import GPUS, plan

    gpu_names = list(GPUS) if gpu_names is None else list(gpu_names)
    seq_lens = [2**k for k in range(9, 18)] if seq_lens is None else list(seq_lens)
    curves: dict[tuple, list[str]] = {}  # GPUs with the same memory share one line
    for name in gpu_names:
        batches = tuple(plan(config, name, s, 1, dtype, weight_dtype, reserve_fraction).max_batch
                        for s in seq_lens)
        curves.setdefault(batches, []).append(name)
    fig, ax = new_figure(7.5, 4.2)
    for batches, names in curves.items():
        label = " = ".join(names)
        if not any(batches):
            ax.plot([], [], linestyle="none", marker="x", color="grey",
                    label=f"{label}: the weights do not fit")
            continue
        xs = [s for s, b in zip(seq_lens, batches, strict=True) if b > 0]
        ax.plot(xs, [b for b in batches if b > 0], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seq_lens, [_tokens_label(s) for s in seq_lens])
    ax.set_xlabel("tokens per sequence (prompt + output)")
    ax.set_ylabel("sequences that fit at once")
    name = config.name or "model"
    ax.set_title(f"{name}: weights {weight_dtype}, cache {dtype}, {reserve_fraction:.0%} of memory reserved")
    ax.legend(fontsize=8)
    return fig


# --- Chapter 04: MHA → GQA → MQA (and MLA) ----------------------------------------------------

ATTENTION_COLORS = {"MHA": "#4C72B0", "GQA": "#55A868", "MQA": "#C44E52", "MLA": "#8172B2"}


def _attention_color(label: str) -> str:
    return ATTENTION_COLORS.get(label.split()[0], "#777777")


def kv_head_sharing(n_heads: int = 8, kv_heads=(8, 2, 1)):
    """Which KV head each query head reads: one row per KV-head count (MHA, GQA, MQA).

    Query heads are circles, KV heads squares; a line joins each query head to the KV head it
    reads (query head h reads KV head h // (n_heads / n_kv_heads), as `repeat_kv` lays them out).
    """
    from .gqa import kv_groups

    fig, ax = new_figure(8.0, 1.55 * len(kv_heads) + 0.3)
    ax.grid(False)
    ax.axis("off")
    for row, n_kv in enumerate(kv_heads):
        groups = kv_groups(n_heads, n_kv)
        kind = "MHA" if n_kv == n_heads else ("MQA" if n_kv == 1 else "GQA")
        color = ATTENTION_COLORS[kind]
        y_q, y_kv = -row * 1.6, -row * 1.6 - 0.9
        for g, heads in enumerate(groups):
            x_kv = sum(heads) / len(heads)
            for h in heads:
                ax.plot([h, x_kv], [y_q, y_kv], color=color, lw=1.2, alpha=0.7, zorder=1)
            ax.scatter([x_kv], [y_kv], marker="s", s=260, color=color, zorder=3)
            ax.annotate(f"{g}", (x_kv, y_kv), ha="center", va="center", color="white", fontsize=7,
                        zorder=4)
        ax.scatter(range(n_heads), [y_q] * n_heads, s=170, facecolor="white", edgecolor="black",
                   zorder=3)
        for h in range(n_heads):
            ax.annotate(f"{h}", (h, y_q), ha="center", va="center", fontsize=7, zorder=4)
        ax.text(-1.0, (y_q + y_kv) / 2, f"{kind}\n{n_kv} KV head{'s' * (n_kv > 1)}", ha="right",
                va="center", fontsize=10, color=color, fontweight="bold")
        ax.text(n_heads, (y_q + y_kv) / 2, f"cache: {n_kv}/{n_heads}\nof MHA", ha="left",
                va="center", fontsize=9)
    ax.set_xlim(-3.2, n_heads + 1.6)
    ax.set_title("○ query heads (top of each row) read ■ KV heads (bottom); only KV heads are cached",
                 fontsize=10)
    return fig


def kv_cache_bars(rows, title: str = ""):
    """Real models' KV cache: a solid bar as published, a pale bar for the same shape with MHA.

    `rows`: a sequence of (label, cache_bytes, mha_bytes, kind) with kind "MHA"/"GQA"/"MQA"/"MLA".
    Values are drawn in GiB, each solid bar labelled with its size and how many times smaller
    than MHA it is.
    """
    import numpy as np

    labels = [r[0] for r in rows]
    actual = np.array([r[1] for r in rows], dtype=float) / GiB
    mha = np.array([r[2] for r in rows], dtype=float) / GiB
    fig, ax = new_figure(8.5, 0.55 * len(rows) + 1.4)
    y = np.arange(len(rows))[::-1]
    ax.barh(y, mha, 0.7, color="#DDDDDD", edgecolor="#999999", hatch="//", label="same shape with MHA")
    for yi, a, m, row in zip(y, actual, mha, rows, strict=True):
        ax.barh(yi, a, 0.7, color=ATTENTION_COLORS.get(row[3], "#777777"))
        if m > a:
            ax.text(m, yi, f" {m:,.3g} GiB with MHA", va="center", fontsize=8, color="#666666")
        ax.text(a + mha.max() * 0.01, yi, f"{a:,.3g} GiB ({row[3]}, {m / a:.3g}× smaller)" if m > a
                else f"{a:,.3g} GiB", va="center", fontsize=8, fontweight="bold",
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.5})
    for kind, color in ATTENTION_COLORS.items():
        if any(r[3] == kind for r in rows):
            ax.barh([np.nan], [0], color=color, label=f"{kind} as published")
    ax.set_yticks(y, labels, fontsize=9)
    ax.set_xlim(0, mha.max() * 1.3)
    ax.set_xlabel("KV cache (GiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    return fig


def _bytes_tick(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.4g} B"


def gqa_memory(seq_lens, curves: dict, seq_len: int, title: str = "", message: str = ""):
    """Left: KV-cache bytes against sequence length (log–log) for each attention variant;
    right: the same variants at `seq_len` as bars, labelled with the ratio to the first (MHA).

    `curves`: label -> bytes at each of `seq_lens`, plus the bytes at `seq_len` as the last item of
    a (bytes_array, bytes_at_seq_len) pair. A `message` (e.g. a setting that is not allowed) is
    printed across the figure.
    """
    import numpy as np
    from matplotlib.ticker import FixedLocator, FuncFormatter

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10.0, 4.2), layout="constrained",
                                 gridspec_kw={"width_ratios": [1.5, 1]})
    s = np.asarray(seq_lens, dtype=float)
    for label, (values, _) in curves.items():
        ax.plot(s, np.maximum(np.asarray(values, dtype=float), 1), lw=2.2,
                color=_attention_color(label), label=label,
                ls="--" if label.startswith("MLA") else "-")
    if curves:
        ax.axvline(seq_len, color="black", lw=1, ls=":")
        for label, (_, at) in curves.items():
            ax.plot([seq_len], [max(at, 1)], "o", ms=7, mfc="white", mec=_attention_color(label),
                    mew=2, zorder=5)
        ax.legend(loc="upper left", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlim(s[0], s[-1])
    xt = [t for t in (128, 1024, 8192, 65536, 2**20, 2**23, 2**26) if s[0] <= t <= s[-1]]
    ax.set_xticks(xt, [_tokens_label(t) for t in xt])
    lo, hi = ax.get_ylim()
    yt = [2.0**k for k in range(0, 64, 5) if lo <= 2.0**k <= hi]
    ax.yaxis.set_major_locator(FixedLocator(yt))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _bytes_tick(v)))
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("sequence length (tokens, log scale)")
    ax.set_ylabel("KV cache (log scale)")
    ax.set_title(title, fontsize=10)

    labels = list(curves)
    at = np.array([curves[k][1] for k in labels], dtype=float)
    if labels:
        unit, size = next(((u, z) for u, z in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2),
                                               ("KiB", 1024)) if at.max() >= z), ("B", 1))
        bars = bx.bar(range(len(labels)), at / size, color=[_attention_color(k) for k in labels])
        ratio = [f"{at[0] / a:.3g}× smaller" if a and a < at[0] else "" for a in at]
        # Each bar in its own unit, as the readout prints it (the axis shares the largest's unit).
        bx.bar_label(bars, [f"{format_bytes(a)}\n{r}".strip() for a, r in zip(at, ratio, strict=True)],
                     fontsize=8, padding=2)
        bx.set_xticks(range(len(labels)), [k.replace(" (", "\n(") for k in labels], fontsize=8)
        bx.set_ylim(0, at.max() / size * 1.25 or 1)
        bx.set_ylabel(f"KV cache ({unit})")
    bx.grid(True, axis="y", alpha=0.3)
    bx.set_title(f"at {seq_len:,} tokens", fontsize=10)
    if message:
        fig.text(0.5, 0.5, message, ha="center", va="center", fontsize=11, color="#C44E52", wrap=True,
                 bbox={"facecolor": "white", "edgecolor": "#C44E52", "alpha": 0.95})
    return fig


def pooled_loss(labels, losses, baseline_label: str = ""):
    """Held-out loss (nats per byte) of a model and its mean-pooled GQA/MQA conversions, as bars."""
    fig, ax = new_figure(6.5, 3.6)
    colors = [_attention_color(k) for k in labels]
    bars = ax.bar(range(len(labels)), losses, color=colors)
    ax.bar_label(bars, [f"{v:.3f}" for v in losses], fontsize=9, padding=2)
    ax.set_xticks(range(len(labels)), labels, fontsize=9)
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_ylim(0, max(losses) * 1.2)
    suffix = f": {baseline_label}" if baseline_label else ""
    ax.set_title(f"Mean-pooling K/V heads without uptraining{suffix}", fontsize=10)
    return fig


# ---- Chapter 07: serving many users -----------------------------------------------------------

SLOT_COLORS = {"prompt": "#4C72B0", "generated": "#55A868", "future": "#F2C14E",
               "internal": "#C44E52", "gap": "#E8E8E8"}
SLOT_LABELS = {"prompt": "prompt tokens", "generated": "generated tokens",
               "future": "reserved for future tokens", "internal": "held but empty (internal fragm.)",
               "gap": "free"}


def kv_memory_layout(panels: dict, width: int = 64):
    """KV memory drawn slot by slot, `width` slots a row, one panel per layout.

    panels maps a title to (layout, capacity) or, for a paged layout, (layout, capacity,
    block_size); a layout is a list of (start slot, length, kind, request) as
    `kvlab.paging.simulate(..., layout_step=…)` records it. A request's number is written where
    its chunk starts (a black bar marks the start) or, for a paged panel, in each of its blocks.
    """
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    kinds = list(SLOT_COLORS)
    rows = [-(-panel[1] // width) for panel in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.9 + 0.22 * sum(rows) + 0.5 * len(panels)),
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
        ax.imshow(grid.reshape(n_rows, width), cmap=ListedColormap(list(SLOT_COLORS.values())),
                  vmin=-0.5, vmax=len(kinds) - 0.5, aspect="auto", interpolation="nearest")
        if block_size:
            for x in range(0, width + 1, block_size):
                ax.axvline(x - 0.5, color="white", lw=0.8)
        for y in range(n_rows + 1):
            ax.axhline(y - 0.5, color="white", lw=0.8)
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.legend(handles=[Patch(color=SLOT_COLORS[k], label=SLOT_LABELS[k]) for k in kinds],
               loc="outside lower center", ncols=len(kinds), fontsize=8, frameon=False)
    return fig


WASTE_COLORS = {"used": "#55A868", "future": "#F2C14E", "internal": "#C44E52",
                "external": "#8C8C8C", "free": "#E8E8E8"}
WASTE_LABELS = {"used": "holds a token's K/V", "future": "reserved for future tokens",
                "internal": "internal fragmentation", "external": "external fragmentation",
                "free": "free (too little for the next request)"}


def waste_breakdown(results: dict, band: tuple[float, float] | None = (0.6, 0.8),
                    band_label: str = "60–80 % waste (vLLM's figure for pre-paging systems)"):
    """Stacked bars: how the KV memory is spent under each policy (labels -> SimResult)."""
    fig, ax = new_figure(8.5, 0.8 + 0.6 * len(results))
    labels = list(results)[::-1]
    left = [0.0] * len(labels)
    for part, color in WASTE_COLORS.items():
        widths = [results[k].fractions()[part] * 100 for k in labels]
        ax.barh(labels, widths, left=left, color=color, label=WASTE_LABELS[part],
                edgecolor="white", linewidth=0.5)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for i, k in enumerate(labels):
        used = results[k].used * 100
        inside = used > 85  # no room to the right: write it inside the green bar
        ax.text(used - 1 if inside else used + 1, i, f"waste {results[k].waste:.0%}",
                va="center", ha="right" if inside else "left", fontsize=9,
                color="white" if inside else "black")
    if band:
        ax.axvspan((1 - band[1]) * 100, (1 - band[0]) * 100, color="#4C72B0", alpha=0.15,
                   label=band_label)
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the KV memory (%), averaged over time while requests wait")
    ax.grid(True, axis="x", alpha=0.3)
    ax.grid(False, axis="y")
    fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    return fig


def concurrency_vs_memory(memory_bytes, per_sequence_bytes: dict, markers: dict | None = None,
                          title: str = ""):
    """Concurrent sequences that fit in a KV budget, one line per policy (label -> bytes each
    running sequence costs), with optional named budgets (e.g. GPUs) marked on the x axis."""
    import numpy as np

    fig, ax = new_figure(7.5, 4.2)
    mem = np.asarray(memory_bytes, dtype=float)
    for label, per_seq in per_sequence_bytes.items():
        ax.plot(mem / GiB, np.floor(mem / per_seq), label=label, lw=2)
    for name, budget in (markers or {}).items():
        ax.axvline(budget / GiB, color="gray", ls=":", lw=1)
        ax.text(budget / GiB, ax.get_ylim()[1] * 0.98, f"{name} ", rotation=90, va="top",
                ha="right", fontsize=8, color="dimgray")
        for per_seq in per_sequence_bytes.values():
            n = budget // per_seq
            ax.plot(budget / GiB, n, "o", color="black", ms=3)
            ax.annotate(f"{n:,.0f}", (budget / GiB, n), xytext=(4, -10), textcoords="offset points",
                        fontsize=8)
    ax.set_xlabel("memory for the KV cache (GiB)")
    ax.set_ylabel("sequences decoded at once")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=9)
    return fig


def block_size_tradeoff(block_sizes, waste, table_entries, read_seconds=None):
    """Left: waste (last blocks) vs block size; right: block-table entries a sequence needs and,
    if given, the measured time to read one sequence block by block."""
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
        twin = ax2.twinx()
        twin.plot(block_sizes, [s * 1e3 for s in read_seconds], "^--", color="#55A868")
        twin.set_yscale("log")
        twin.set_ylabel("measured read, block by block (ms)", color="#55A868")
    return fig


def request_lengths(prompt_lens, output_lens, max_len: int):
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


# --- Chapter 05: FP16 → INT8 -------------------------------------------------------------------

def channel_magnitudes(k_absmax, v_absmax, title: str = "", heads: int | None = None):
    """Per-channel max |value| over all cached tokens, K above V on the same scale: the few tall
    K bars are the outlier channels that make per-token scales coarse for keys."""
    import numpy as np

    k, v = np.asarray(k_absmax, dtype=float), np.asarray(v_absmax, dtype=float)
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 4.6), layout="constrained", sharex=True, sharey=True)
    for ax, values, name, color in ((axes[0], k, "K", "#d62728"), (axes[1], v, "V", "#1f77b4")):
        ax.bar(np.arange(len(values)), values, width=1.0, color=color)
        ax.set_ylabel(f"max |{name}|")
        ax.grid(True, axis="y", alpha=0.3)
        ratio = values.max() / np.median(values) if np.median(values) > 0 else float("inf")
        ax.text(0.99, 0.92, f"{name}: largest channel = {ratio:.1f}× the median channel",
                transform=ax.transAxes, ha="right", va="top", fontsize=9,
                bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none"})
        if heads:
            for h in range(1, heads):
                ax.axvline(h * len(values) / heads - 0.5, color="grey", lw=0.6, ls=":")
    axes[1].set_xlabel("channel (KV head × head dim)" + (", dotted lines between heads" if heads else ""))
    axes[0].set_title(title or "Per-channel magnitude of the cached K and V")
    return fig


def granularity_errors(errors: dict, title: str = ""):
    """Grouped bars: relative RMS error of K and V for each scale granularity."""
    import numpy as np

    labels = list(errors)
    names = list(next(iter(errors.values())))
    fig, ax = new_figure(7.0, 3.6)
    width = 0.8 / len(names)
    colors = {"K": "#d62728", "V": "#1f77b4"}
    for j, name in enumerate(names):
        vals = [errors[g][name] for g in labels]
        pos = np.arange(len(labels)) + (j - (len(names) - 1) / 2) * width
        bars = ax.bar(pos, vals, width, label=name, color=colors.get(name))
        ax.bar_label(bars, labels=[f"{x:.2%}" for x in vals], fontsize=8, padding=2)
    ax.set_xticks(np.arange(len(labels)), labels)
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:.1%}"))
    ax.set_ylabel("relative RMS error")
    ax.set_title(title or "int8 reconstruction error by scale granularity")
    ax.legend()
    return fig


def bytes_ratio(seq_lens, ratios: dict, references: dict | None = None, limit: float | None = 0.55):
    """Quantized-cache bytes ÷ FP16-cache bytes against the cache length (log x): the fixed
    full-precision window costs at short lengths, the scales stay."""
    fig, ax = new_figure(7.0, 3.8)
    for label, values in ratios.items():
        ax.plot(seq_lens, values, marker="o", ms=3, label=label)
    ax.axhline(0.5, color="grey", ls="--", lw=1, label="int8 codes alone (0.5)")
    if limit is not None:
        ax.axhline(limit, color="#d62728", ls=":", lw=1, label=f"{limit} (the course's bound)")
    for label, value in (references or {}).items():
        ax.axhline(value, color="#2ca02c", ls="-.", lw=1, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(seq_lens), [f"{n:,}" for n in seq_lens])
    ax.set_xlabel("cache length (positions, max_seq_len)")
    ax.set_ylabel("bytes ÷ FP16 cache bytes")
    ax.set_title("How close to half: an int8 cache against FP16")
    ax.legend(fontsize=8)
    return fig


def quant_memory_and_error(seq_lens, curves: dict, chosen: str, seq_len: int, errors: dict,
                           title: str = "", message: str = ""):
    """The quantization explorer's figure. Left: cache bytes against sequence length, one line a
    storage format (`curves`: label -> bytes array), the chosen one bold, a dot at seq_len.
    Right: the measured relative errors of the chosen setting (`errors`: name -> value)."""
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.2), layout="constrained",
                                      gridspec_kw={"width_ratios": [1.35, 1]})
    lens = np.asarray(seq_lens, dtype=float)
    colors = {"fp32": "#7f7f7f", "fp16": "#1f77b4", "int8": "#2ca02c", "int4": "#9467bd"}
    for label, values in curves.items():
        bold = label == chosen
        left.plot(lens, values, lw=3 if bold else 1.2, alpha=1 if bold else 0.6,
                  color=colors.get(label.split()[0]), label=label)
        if bold:
            at = float(np.interp(seq_len, lens, values))
            left.plot([seq_len], [at], "o", color="black", zorder=5)
            left.annotate(_bytes_tick(at), (seq_len, at), textcoords="offset points", xytext=(6, -14),
                          fontsize=9)
    left.axvline(seq_len, color="black", lw=0.6, ls=":")
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: _bytes_tick(y)))
    left.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: _tokens_label(int(x))))
    left.set_xlabel("sequence length (tokens)")
    left.set_ylabel("KV cache")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8, loc="upper left")
    left.set_title(title, fontsize=10)
    names, values = list(errors), [errors[n] for n in errors]
    y = np.arange(len(names))
    if any(v > 0 for v in values):
        bars = right.barh(y, [max(v, 1e-7) for v in values], color=colors.get(chosen.split()[0], "C0"))
        right.bar_label(bars, labels=[f"{v:.2%}" if v >= 1e-4 else f"{v:.1e}" for v in values],
                        fontsize=8, padding=2)
        right.set_xscale("log")
        right.set_xlim(1e-5, 1.0)
    else:
        right.text(0.5, 0.5, "exact: no error\n(the reference itself)", ha="center", va="center",
                   transform=right.transAxes)
    right.set_yticks(y, names)
    right.invert_yaxis()
    right.set_xlabel("relative RMS error (measured)")
    right.grid(True, axis="x", alpha=0.3)
    right.set_title(message or "errors of this setting on a small model", fontsize=9)
    return fig


# ---- Chapters 01–02: the generation loop, prefill/decode, naive vs cached costs -----------------

def _box(ax, x, y, w, h, text, face, edge="#333333", hatch=None, fontsize=9, color="black"):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=face, edgecolor=edge, hatch=hatch, lw=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=color)


def _arrow(ax, start, end, color="#333333", style="-|>", rad=0.0, lw=1.2):
    ax.annotate("", xy=end, xytext=start,
                arrowprops=dict(arrowstyle=style, color=color, lw=lw,
                                connectionstyle=f"arc3,rad={rad}"))


_PROMPT, _NEW, _CACHED, _MODEL = "#DDDDDD", "#F2B880", "#A8C8E8", "#FFF2CC"


def generation_loop(tokens=("The", "KV", "cache", "saves", "work", "."), prompt_len: int = 2,
                    cached: bool = False):
    """The autoregressive loop, one row a step: what goes into the model, what comes out.

    Naive (cached=False): every step feeds the whole sequence again and computes K, V for all of
    it. Cached: earlier tokens' K, V come from the cache (blue); only the newest token is fed
    (after the prompt is prefilled). The right column counts the K/V rows each step computes.
    """
    tokens = [str(t) for t in tokens]
    if not 1 <= prompt_len < len(tokens):
        raise ValueError(f"prompt_len={prompt_len} must be in 1..{len(tokens) - 1} "
                         f"for {len(tokens)} tokens")
    steps = len(tokens) - prompt_len
    w, gap = 1.0, 0.12
    model_x = len(tokens) * (w + gap) + 0.4
    out_x = model_x + 2.3
    fig, ax = plt.subplots(figsize=(1.0 * (out_x + 4.5), 0.62 * steps + 1.3), layout="constrained")
    total = 0
    for s in range(steps):
        y = steps - 1 - s
        seen = prompt_len + s  # tokens in the sequence when step s starts
        fed_from = 0 if (not cached or s == 0) else seen - 1
        for i in range(seen):
            fed = i >= fed_from
            face = (_PROMPT if i < prompt_len else _NEW) if fed else _CACHED
            just_made = s > 0 and i == seen - 1  # last step's output, appended to the input
            _box(ax, i * (w + gap), y, w, 0.7, tokens[i], face,
                 edge="#C0504D" if just_made else "#333333", color="black" if fed else "#44546A")
        _arrow(ax, (seen * (w + gap) - gap + 0.05, y + 0.35), (model_x - 0.05, y + 0.35))
        _box(ax, model_x, y, 1.7, 0.7, "model", _MODEL)
        _arrow(ax, (model_x + 1.75, y + 0.35), (out_x - 0.05, y + 0.35))
        _box(ax, out_x, y, w, 0.7, tokens[seen], _NEW, edge="#C0504D")
        rows = seen - fed_from
        total += rows
        ax.text(out_x + w + 0.4, y + 0.35, f"K/V rows: {rows}", va="center", fontsize=9)
    ax.text(out_x + w + 0.4, -0.75, f"total: {total}", va="center", fontsize=9, weight="bold")
    ax.set_xlim(-0.3, out_x + 4.2)
    ax.set_ylim(-1.1, steps + 0.35)
    ax.axis("off")
    kind = "with a KV cache: old K, V are read, not recomputed" if cached else \
        "naive: every step runs the whole sequence through the model again"
    ax.set_title(f"Autoregressive generation, {kind}", fontsize=10)
    ax.text(model_x + 0.85, steps + 0.05, "one forward pass per step", ha="center", fontsize=8,
            color="dimgray")
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=_PROMPT, edgecolor="#333333", label="prompt token, fed"),
               Patch(facecolor=_NEW, edgecolor="#333333", label="generated token, fed")]
    if cached:
        handles.append(Patch(facecolor=_CACHED, edgecolor="#333333", label="K, V read from the cache"))
    handles.append(Patch(facecolor="white", edgecolor="#C0504D", label="output, appended to the next input"))
    ax.legend(handles=handles, loc="lower left", fontsize=8, ncol=len(handles), frameon=False,
              bbox_to_anchor=(0, -0.02))
    return fig


def prefill_decode(prompt_len: int = 4, decode_steps: int = 3):
    """Prefill (all prompt tokens in parallel fill the cache) and decode (one token a step:
    its Q, K, V; append K, V; attend Q over the cache; pick the next token; repeat)."""
    if prompt_len < 1 or decode_steps < 1:
        raise ValueError(f"prompt_len={prompt_len} and decode_steps={decode_steps} must be >= 1")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained",
                                   gridspec_kw={"width_ratios": [1, 1.25]})
    for ax in (ax1, ax2):
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 7)
        ax.axis("off")
    # Prefill: the prompt row goes through the model at once; every K, V lands in the cache.
    ax1.set_title("Prefill: the whole prompt at once, in parallel", fontsize=10)
    n = prompt_len
    cw = 8.6 / n
    for i in range(n):
        _box(ax1, 0.7 + i * cw, 5.6, cw * 0.9, 0.8, f"t{i + 1}", _PROMPT)
        _arrow(ax1, (0.7 + i * cw + cw * 0.45, 5.55), (0.7 + i * cw + cw * 0.45, 4.45))
    _box(ax1, 0.7, 3.4, 8.6 - cw * 0.1, 1.0, f"model: Q, K, V for all {n} tokens\n"
         f"in one matrix product per layer", _MODEL)
    _arrow(ax1, (5.0, 3.35), (5.0, 2.25))
    for i in range(n):
        _box(ax1, 0.7 + i * cw, 1.2, cw * 0.9, 1.0, f"K{i + 1}\nV{i + 1}", _CACHED)
    ax1.text(5.0, 0.6, f"KV cache after prefill: {n} positions (every layer, every KV head)",
             ha="center", fontsize=9)
    _arrow(ax1, (9.35, 3.9), (9.9, 3.9), color="#C0504D")
    ax1.text(9.7, 4.15, "first\ntoken", fontsize=8, color="#C0504D", ha="center")
    # Decode: one token per step.
    ax2.set_title("Decode: one new token per step, in a loop", fontsize=10)
    total = n + decode_steps
    _box(ax2, 0.2, 5.6, 1.4, 0.8, "new token", _NEW, edge="#C0504D")
    _arrow(ax2, (1.65, 6.0), (2.35, 6.0))
    _box(ax2, 2.4, 5.6, 2.6, 0.8, "its Q, K, V\n(one row each)", _MODEL)
    slots = total + 1
    sw = 3.8 / slots
    for i in range(total):
        face = _CACHED if i < n else ("#7FB3E0" if i == total - 1 else _CACHED)
        label = f"{i + 1}" if slots <= 12 else ""
        _box(ax2, 6.0 + i * sw, 3.9, sw * 0.9, 1.0, label, face, fontsize=7)
    _arrow(ax2, (5.05, 6.0), (6.0 + (total - 0.55) * sw, 4.95), color="#4C72B0", rad=-0.2)
    ax2.text(7.4, 6.1, "append its K, V", fontsize=8, color="#4C72B0")
    ax2.text(6.0, 5.1, f"KV cache: {n} prefilled + {decode_steps} decoded",
             ha="left", fontsize=8, color="#4C72B0")
    _arrow(ax2, (3.7, 5.55), (3.7, 3.45))
    ax2.text(3.8, 4.6, "Q of the new token", fontsize=8)
    _box(ax2, 2.0, 2.4, 5.4, 1.0, "softmax(Q_new · K_cacheᵀ / √d) · V_cache\nattention over every "
         "cached position", "#E2F0D9")
    _arrow(ax2, (6.0 + total * sw / 2, 3.85), (6.6, 3.45), color="#4C72B0")
    ax2.text(6.0 + total * sw / 2 + 0.1, 3.55, "all cached K, V", fontsize=8, color="#4C72B0")
    _arrow(ax2, (4.7, 2.35), (4.7, 1.45))
    _box(ax2, 3.6, 0.6, 2.2, 0.8, "next token", _NEW, edge="#C0504D")
    _arrow(ax2, (3.55, 1.0), (0.9, 5.55), color="#C0504D", rad=-0.3)
    ax2.text(0.3, 2.4, "repeat until\ndone", fontsize=8, color="#C0504D")
    return fig


def cost_per_step(steps, measured: dict, theory: dict | None = None, ylabel: str = "",
                  title: str = "", cumulative: bool = False, log: bool = False):
    """Measured cost per step (markers) against theory (lines); optionally cumulative, log-log.

    measured / theory: label -> values, one per step (steps are 1-based step numbers).
    """
    import numpy as np

    fig, ax = new_figure(6.0, 3.8)
    colors = ["#C44E52", "#4C72B0", "#55A868", "#8172B2"]
    for (label, values), color in zip(measured.items(), colors, strict=False):
        values = np.cumsum(values) if cumulative else np.asarray(values)
        ax.plot(steps, values, "o", ms=3.5, color=color, label=f"{label} (measured)")
    for (label, values), color in zip((theory or {}).items(), colors, strict=False):
        values = np.cumsum(values) if cumulative else np.asarray(values)
        ax.plot(steps, values, "-", lw=1.5, color=color, alpha=0.6, label=label)
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("step (new token number)")
    ax.set_ylabel(("total " if cumulative else "") + ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def growth_fit(n, values: dict, fits: dict, ylabel: str = "cumulative cost (relative to the last N)"):
    """Log-log plot of cumulative costs with their fitted power-law lines and exponents.

    n: the N values (or a dict label -> N values, when the series were measured at different N);
    values: label -> cumulative cost at each N; fits: label -> (exponent, log-intercept) from
    numpy.polyfit(log N, log cost, 1). Each series is scaled to 1 at its last N.
    """
    import numpy as np

    fig, ax = new_figure(6.0, 3.8)
    colors = ["#C44E52", "#4C72B0", "#55A868", "#8172B2"]
    styles = ["o", "s", "^", "D"]
    for (label, vals), color, marker in zip(values.items(), colors, styles, strict=False):
        ns = np.asarray(n[label] if isinstance(n, dict) else n, dtype=float)
        vals = np.asarray(vals, dtype=float)
        ax.plot(ns, vals / vals[-1], marker, ms=5, color=color, alpha=0.8)
        slope, intercept = fits[label]
        line = np.exp(intercept) * ns ** slope
        ax.plot(ns, line / vals[-1], "-", color=color, alpha=0.6,
                label=f"{label}: exponent {slope:.2f}")
    every = np.concatenate([np.asarray(v, dtype=float) for v in n.values()]) if isinstance(n, dict) \
        else np.asarray(n, dtype=float)
    ref = np.geomspace(every.min(), every.max(), 20)
    ax.plot(ref, (ref / ref[-1]) ** 2, ":", color="gray", label="∝ N² (reference)")
    ax.plot(ref, ref / ref[-1], "--", color="gray", lw=1, label="∝ N (reference)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens generated, N")
    ax.set_ylabel(ylabel)
    ax.set_title("Naive decoding: total work grows like N²", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def step_times(naive_seconds, cached_seconds,
               title: str = "Per-step time: growing without a cache, flat with one"):
    """Wall time of each step: naive grows with the sequence, cached stays flat.

    Dots are single steps; the line is a running median over 9 steps, which a busy machine's
    scheduling noise does not move much. Either series may be None.
    """
    import numpy as np

    fig, ax = new_figure(6.0, 3.8)
    for seconds, color, label in ((naive_seconds, "#C44E52", "naive (no cache)"),
                                  (cached_seconds, "#4C72B0", "KV cache")):
        if seconds is None:
            continue
        ms = np.asarray(seconds, dtype=float) * 1e3
        steps = np.arange(1, len(ms) + 1)
        ax.plot(steps, ms, ".", ms=3, color=color, alpha=0.35)
        half = 4
        median = [np.median(ms[max(0, i - half):i + half + 1]) for i in range(len(ms))]
        ax.plot(steps, median, "-", lw=2, color=color, label=f"{label}, running median")
    ax.set_xlabel("step (new token number)")
    ax.set_ylabel("time per step (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def speedup_vs_tokens(n_tokens, speedups, rows_ratio=None):
    """Measured total speed-up of the cached decoder over the naive one vs tokens generated,
    with, if given, the ratio of K/V rows computed (the work the cache removes)."""
    fig, ax = new_figure(6.0, 3.8)
    ax.plot(n_tokens, speedups, "o-", color="#4C72B0", label="measured speed-up (time)")
    if rows_ratio is not None:
        ax.plot(n_tokens, rows_ratio, "s--", color="gray", alpha=0.8,
                label="K/V rows: naive ÷ cached")
    ax.axhline(1, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(n_tokens), [str(n) for n in n_tokens])
    ax.set_xlabel("tokens generated, N")
    ax.set_ylabel("naive ÷ cached (log scale)")
    ax.set_title("The longer the generation, the more the cache saves", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def copy_cost(seq_lens, copied: dict, allocations: dict | None = None):
    """Bytes written into cache storage (left) and allocations (right) vs sequence length, for
    each cache kind: concatenation grows like S², pre-allocation like S."""
    import numpy as np

    ncols = 2 if allocations else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 3.8), layout="constrained")
    axes = np.atleast_1d(axes)
    colors = ["#C44E52", "#4C72B0", "#55A868"]
    for (label, values), color in zip(copied.items(), colors, strict=False):
        axes[0].plot(seq_lens, np.asarray(values) / 2**20, "o-", ms=3.5, color=color, label=label)
    axes[0].set_ylabel("bytes written into the cache (MiB)")
    axes[0].set_title("Copying: concatenation rewrites the whole cache", fontsize=10)
    if allocations:
        for (label, values), color in zip(allocations.items(), colors, strict=False):
            axes[1].plot(seq_lens, values, "o-", ms=3.5, color=color, label=label)
        axes[1].set_ylabel("tensors allocated")
        axes[1].set_title("Allocations", fontsize=10)
    for ax in axes:
        ax.set_xlabel("sequence length S (tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def cost_bars(labels, values, ylabel: str, title: str = "", fmt: str = "{:,.0f}"):
    """One bar per variant, its value written on top (e.g. naive / K-only cache / KV cache)."""
    fig, ax = new_figure(6.0, 3.6)
    colors = ["#C44E52", "#DD8452", "#4C72B0", "#55A868"]
    bars = ax.bar(list(labels), list(values), color=colors[:len(labels)])
    for bar, value in zip(bars, values, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), fmt.format(value),
                ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    return fig


# ---- chapter 06: a fast decoder (kvlab.bench results) ----------------------------------------

def lengths_plot(rows: list[dict], title: str = "Naive vs cached decoding"):
    """Tokens/s against generated length, one line per method (rows from `bench.sweep_lengths`)."""
    fig, ax = new_figure(7.0, 4.0)
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["new_tokens"])
        ax.plot([r["new_tokens"] for r in mine], [r["tokens_per_s"] for r in mine], "o-", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens generated")
    ax.set_ylabel("tokens / s (median)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    return fig


def step_time_plot(fed_tokens, seconds, overhead_s: float, per_token_s: float,
                   title: str = "Time of one naive decoding step"):
    """Measured step times against tokens fed, with the fitted line overhead + per_token × tokens:
    the intercept is what every step costs, however little work it does."""
    fig, ax = new_figure(7.0, 4.0)
    ms = [s * 1e3 for s in seconds]
    ax.plot(fed_tokens, ms, ".", alpha=0.5, label="measured step")
    xs = [0, max(fed_tokens)]
    ax.plot(xs, [(overhead_s + per_token_s * x) * 1e3 for x in xs], "-",
            label=f"fit: {overhead_s * 1e3:.2f} ms + {per_token_s * 1e6:.1f} µs × tokens")
    ax.axhline(overhead_s * 1e3, color="grey", ls=":", label="fixed cost of any step")
    ax.set_xlabel("tokens fed through the model in this step")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    return fig


def roofline_plot(bandwidths: dict[str, float], points: list[dict],
                  title: str = "Decode roofline: tokens/s ≤ bandwidth ÷ bytes per step"):
    """Log-log: one bound line per device (label -> bytes/s) and points, each a dict with label,
    bytes_per_step, tokens_per_s, published (True for figures from papers/READMEs) and optionally
    a matplotlib marker."""
    fig, ax = new_figure(10.0, 5.0)
    all_bytes = [p["bytes_per_step"] for p in points]
    lo, hi = min(all_bytes) / 3, max(all_bytes) * 3
    for label, bw in bandwidths.items():
        ax.plot([lo, hi], [bw / lo, bw / hi], "-", lw=1.2, label=f"bound: {label} ({bw / 1e9:,.0f} GB/s)")
    for p in points:
        marker = p.get("marker") or ("*" if p.get("published") else "o")
        ax.plot(p["bytes_per_step"], p["tokens_per_s"], marker, ms=12 if marker == "*" else 8,
                label=p["label"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes read per decode step (weights + KV cache)")
    ax.set_ylabel("tokens / s at batch 1")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: lines stay visible
    return fig


def step_costs(steps, panels):
    """Side-by-side panels of per-step costs, measured (markers) against theory (line).

    panels: list of (title, ylabel, measured values, theory values or None, theory label), each
    optionally followed by its own step numbers (otherwise `steps`).
    """
    import numpy as np

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), layout="constrained")
    for ax, panel in zip(np.atleast_1d(axes), panels, strict=True):
        title, ylabel, measured, theory, theory_label = panel[:5]
        xs = panel[5] if len(panel) > 5 else steps
        ax.plot(xs, measured, "o", ms=3, color="#C44E52", label="measured")
        if theory is not None:
            ax.plot(xs, theory, "-", color="#4C72B0", alpha=0.7, label=theory_label)
        ax.set_xlabel("step (new token number)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig


# ---- Chapter 00: the course roadmap -----------------------------------------------------------

ROADMAP = [
    ("01", "One token\nat a time", "naive decoding\nO(n²) work"),
    ("02", "The KV\ncache", "compute once,\nstore it: O(n)"),
    ("03", "How big is\nthe cache?", "2·L·H_kv·D·S·B\nbytes"),
    ("04", "MHA → GQA\n→ MQA", "share K/V heads:\nfewer bytes"),
    ("05", "FP16 →\nINT8", "quantize:\nfewer bits"),
    ("06", "Fast on\nthe GPU", "static cache,\ngraphs, roofline"),
    ("07", "Serving\nmany users", "batching,\npaging"),
    ("08", "Review", "quiz, cheat sheet,\nplanning"),
]


def roadmap():
    """The course at a glance: one box per chapter, grouped by the question it answers."""
    fig, ax = plt.subplots(figsize=(11, 3.2), layout="constrained")
    groups = {"why": ("#dbe9f6", range(0, 2)), "how big, and how to shrink it": ("#fde2c8", range(2, 5)),
              "how fast / how many": ("#d9f0d3", range(5, 7)), "check": ("#eeeeee", range(7, 8))}
    for label, (color, idx) in groups.items():
        for i in idx:
            num, title, note = ROADMAP[i]
            _box(ax, i * 1.35, 0.9, 1.15, 1.1, f"{num}\n{title}", color, fontsize=9)
            ax.text(i * 1.35 + 0.575, 0.55, note, ha="center", va="top", fontsize=8, color="#444444")
            if i:
                _arrow(ax, (i * 1.35 - 0.2, 1.45), (i * 1.35, 1.45))
        ax.text(idx[0] * 1.35, 2.15, label, fontsize=9, fontweight="bold", color="#444444")
    ax.set_xlim(-0.1, len(ROADMAP) * 1.35)
    ax.set_ylim(-0.1, 2.4)
    ax.axis("off")
    ax.set_title("The course: from the naive decoder to serving many users")
    return fig
