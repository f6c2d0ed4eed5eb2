"""Chapter 04, MHA → GQA → MQA: which KV head each query head reads, real models' caches, the loss of
pooled heads, the GQA explorer (and the drawing behind it), and the KV-heads-for-a-budget exercise."""

from __future__ import annotations

import matplotlib.pyplot as plt

from .. import gqa, memory, validate
from ..config import PRESETS, PUBLISHED, ModelConfig, divisors
from ..memory import GiB, format_bytes
from .ch03_cache_memory import WINDOWED, trained_context
from .style import (
    Verdict,
    as_number,
    bytes_label,
    bytes_unit,
    explorer_plot,
    new_figure,
    positive_int,
    report,
    shown,
    tokens_label,
)

ATTENTION_COLORS = {"MHA": "#4C72B0", "GQA": "#55A868", "MQA": "#C44E52", "MLA": "#8172B2"}
PUBLISHED_COLOR = "#222222"  # a model's published KV-head count, next to a what-if


def _attention_color(label: str) -> str:
    if "published" in label:
        return PUBLISHED_COLOR
    return ATTENTION_COLORS.get(label.split()[0].rstrip(","), "#777777")


def plot_kv_head_sharing(n_heads: int = 8, kv_heads=(8, 2, 1)):
    """Which KV head each query head reads: one row per KV-head count (MHA, GQA, MQA).

    Query heads are circles, KV heads squares; a line joins each query head to the KV head it
    reads (query head h reads KV head h // (n_heads / n_kv_heads), as `repeat_kv` lays them out).
    """
    from ..gqa import kv_groups

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


def plot_kv_cache_bars(rows, title: str = ""):
    """Real models' KV cache: a solid bar as published, a pale bar for the same shape with MHA.

    `rows`: a sequence of (label, cache_bytes, mha_bytes, kind) with kind "MHA"/"GQA"/"MQA"/"MLA".
    Values are drawn in GiB, each solid bar labelled with its size and how many times smaller
    than MHA it is.
    """
    import numpy as np

    labels = [r[0] for r in rows]
    actual = np.array([r[1] for r in rows], dtype=float) / GiB
    mha = np.array([r[2] for r in rows], dtype=float) / GiB
    fig, ax = new_figure(8.5, 0.38 * len(rows) + 1.2)
    y = np.arange(len(rows))[::-1]
    ax.barh(y, mha, 0.7, color="#DDDDDD", edgecolor="#999999", hatch="//", label="same shape with MHA")
    for yi, a, m, row in zip(y, actual, mha, rows, strict=True):
        ax.barh(yi, a, 0.7, color=ATTENTION_COLORS.get(row[3], "#777777"))
        # One label a row, right of the longer bar, so it never covers the other bar's size.
        text = (f"{a:,.3g} GiB ({row[3]}; MHA: {m:,.3g} GiB, {m / a:.3g}× smaller)" if m > a
                else f"{a:,.3g} GiB ({row[3]})")
        ax.text(max(a, m) + mha.max() * 0.01, yi, text, va="center", fontsize=8)
    for kind, color in ATTENTION_COLORS.items():
        if any(r[3] == kind for r in rows):
            ax.barh([np.nan], [0], color=color, label=f"{kind} as published")
    ax.set_yticks(y, labels, fontsize=9)
    ax.set_xlim(0, mha.max() * 1.6)
    ax.set_xlabel("KV cache (GiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    return fig


def plot_pooled_loss(labels, losses, errors=None, baseline_label: str = "", title: str = ""):
    """Held-out loss (nats per byte) of each model as bars, with ± 2 standard errors when given."""
    import numpy as np

    fig, ax = new_figure(8.5, 3.8)
    colors = [_attention_color(k) for k in labels]
    yerr = None if errors is None else 2 * np.asarray(errors, dtype=float)
    untrained = ["//" if k.endswith("pooled") else "" for k in labels]   # pooled, no training since
    bars = ax.bar(range(len(labels)), losses, color=colors, yerr=yerr, capsize=4, hatch=untrained,
                  edgecolor="white")
    for text in ax.bar_label(bars, [f"{v:.3f}" for v in losses], fontsize=8, label_type="center"):
        text.set_bbox({"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.9})
    ax.set_xticks(range(len(labels)), [k.replace(", ", ",\n").replace(" (", "\n(") for k in labels],
                  fontsize=8)
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_ylim(0, max(losses) * 1.2)
    if baseline_label:
        ax.axhline(losses[labels.index(baseline_label)], color="black", lw=1, ls=":",
                   label=baseline_label)
        ax.legend(fontsize=8, loc="upper left")
    bars_note = "" if errors is None else " (bars: ± 2 standard errors over windows)"
    ax.set_title((title or "Mean-pooled K/V heads") + bars_note, fontsize=10)
    return fig


# ---- the GQA explorer ---------------------------------------------------------------------------


GQA_SEQ_LENS = [2**k for k in range(7, 21)]   # 128 … 1,048,576 tokens, log-spaced
GQA_CUSTOM = {"layers": 32, "n_heads": 32, "head_dim": 128}  # a custom shape starts as Llama-2-7B's


def gqa_models() -> list[str]:
    """The GQA explorer's model choices: the published presets, then "custom"."""
    return [*PUBLISHED, "custom"]


def gqa_variants(model: str = "llama-2-70b", n_kv_heads: int | None = None,
                 n_heads: int | None = None, layers: int | None = None,
                 head_dim: int | None = None) -> tuple[dict, str]:
    """The configs the GQA explorer compares, and a message ("" when the setting is allowed).

    Returns ({label: ModelConfig}, message): MHA, the chosen GQA (when 1 < n_kv_heads < n_heads),
    MQA, and MLA for a preset that uses it. A preset's shape can be overridden; None keeps it.
    An n_kv_heads that does not divide n_heads (or an invalid custom shape) is not an exception: the
    message says what is allowed and the chosen variant is left out.
    """
    if model not in gqa_models():
        raise ValueError(f"model={model!r} is not a choice; allowed: {', '.join(gqa_models())}")
    if model == "custom":
        base = {"n_layers": GQA_CUSTOM["layers"], "n_heads": GQA_CUSTOM["n_heads"],
                "head_dim": GQA_CUSTOM["head_dim"], "latent": None}
    else:
        p = PRESETS[model]
        base = {"n_layers": p.n_layers, "n_heads": p.n_heads, "head_dim": p.head_dim,
                "latent": p.kv_latent_dim}
    L = base["n_layers"] if layers is None else layers
    H = base["n_heads"] if n_heads is None else n_heads
    D = base["head_dim"] if head_dim is None else head_dim
    if n_kv_heads is None:
        n_kv_heads = H if model == "custom" else PRESETS[model].n_kv_heads
    try:
        shape = ModelConfig(n_layers=L, d_model=H * D if positive_int(H) and positive_int(D) else 1,
                            n_heads=H, n_kv_heads=H, head_dim=D, d_ff=1, vocab_size=1,
                            max_seq_len=max(GQA_SEQ_LENS), name=model, n_params=1,
                            kv_latent_dim=base["latent"])
    except ValueError as err:
        return {}, f"shape not valid: {err}"
    if not positive_int(n_kv_heads) or H % n_kv_heads:
        message = f"n_kv_heads={n_kv_heads!r} must divide n_heads={H}; allowed: {divisors(H)}"
        return gqa.variants(shape), message
    return gqa.variants(shape.with_(n_kv_heads=n_kv_heads)), ""


def plot_gqa(model: str = "llama-2-70b", n_kv_heads: int | None = None, seq_len: int = 131072,
             n_heads: int | None = None, layers: int | None = None, head_dim: int | None = None,
             dtype: str = "fp16", batch_size: int = 1):
    """KV-cache memory against sequence length for MHA, the chosen GQA, MQA (and MLA).

    Returns (Figure, readout text). The readout gives each variant's cache at seq_len and how many
    times smaller than MHA it is. A KV-head count that does not divide the query heads, or an
    invalid shape, draws what it can and says what is allowed. Unknown model or dtype names and a
    non-positive seq_len or batch_size raise ValueError (they are programming errors).
    """
    import numpy as np

    memory.dtype_bits(dtype)
    validate.integer("seq_len", seq_len)
    validate.integer("batch_size", batch_size)
    configs, message = gqa_variants(model, n_kv_heads, n_heads, layers, head_dim)
    published_note = ""
    # A preset whose layers, query heads or head dim were changed is no longer that model.
    as_published = model != "custom" and _same_shape(model, n_heads, layers, head_dim)
    name = model if as_published else "custom shape" if model == "custom" else f"custom shape (from {model})"
    if configs and as_published:
        configs, published_note = _with_published(model, configs)
    seq_lens = [s for s in GQA_SEQ_LENS if s >= min(seq_len, 128)]
    seq_lens += [2**k for k in range(21, 64) if 2 ** (k - 1) < seq_len]
    lens = np.array(seq_lens, dtype=float)
    curves, lines = {}, []
    for label, cfg in configs.items():
        per_token = memory.kv_bytes_per_token(cfg, dtype) * batch_size
        curves[label] = (lens * per_token, per_token * seq_len)
    if configs:
        mha = next(iter(configs.values()))
        lines.append(f"{name}: {mha.n_layers} layers × {mha.n_heads} query heads × head dim "
                     f"{mha.head_dim}; KV cache for {seq_len:,} tokens, {dtype}, batch {batch_size}:")
        mha_bytes = curves[next(iter(curves))][1]
        for label, (_, at) in curves.items():
            cfg = configs[label]
            ratio = f"{mha_bytes / at:.3g}× smaller than MHA" if at < mha_bytes else "the baseline"
            lines.append(f"  {label:<28} {memory.format_bytes(at):>11}   {ratio}")
            if cfg.kv_latent_dim is not None:
                lines.append(f"  (MLA caches {cfg.kv_latent_dim} elements per token per layer: as "
                             f"much as GQA with {gqa.gqa_equivalent_kv_heads(cfg):.3g} KV heads of dim "
                             f"{cfg.head_dim})")
        if as_published:
            lines.append(_published_line(model) + published_note)
            lines += _context_notes(model, seq_len, dtype, batch_size)
    if message:
        lines.append(f"✗ {message}")
    title = f"{name}: KV cache ({dtype}, batch {batch_size})"
    fig = plot_gqa_memory(lens, curves, seq_len, title=title, message=message)
    return fig, "\n".join(lines)


def _same_shape(model: str, n_heads, layers, head_dim) -> bool:
    p = PRESETS[model]
    return all(v is None or v == getattr(p, k) for k, v in
               (("n_heads", n_heads), ("n_layers", layers), ("head_dim", head_dim)))


def _with_published(model: str, configs: dict) -> tuple[dict, str]:
    """Add the model's published KV-head count to the variants when the chosen one differs, so a
    what-if (Llama-3-8B with 2 KV heads) is never mistaken for the real model; MHA first, by KV heads."""
    p = PRESETS[model]
    if p.kv_latent_dim is not None or any(c.n_kv_heads == p.n_kv_heads and c.kv_latent_dim is None
                                          for c in configs.values()):
        return configs, ""
    label = f"{p.attention_kind} ({p.n_kv_heads} KV heads, published)"
    configs = {**configs, label: next(iter(configs.values())).with_(n_kv_heads=p.n_kv_heads)}
    order = sorted(configs, key=lambda k: (configs[k].kv_latent_dim is not None, -configs[k].n_kv_heads))
    return {k: configs[k] for k in order}, " (drawn dashed, marked \"published\"; your choice is a what-if)"


def _context_notes(model: str, seq_len: int, dtype: str, batch_size: int) -> list[str]:
    """What the sizes above leave out for this preset: a sliding window that caps its cache, and
    a length beyond the context it was trained for (chapter 03's TRAINED_CONTEXT)."""
    p, notes = PRESETS[model], []
    window = WINDOWED.get(model)
    if window:
        capped = format_bytes(memory.kv_cache_bytes(p, window, batch_size, dtype))
        notes.append(f"† {model} attends within a {window:,}-token sliding window: a rolling cache holds "
                     f"at most {capped} at any length; the sizes above are full attention.")
    if seq_len > trained_context(p):
        notes.append(f"⚠ {seq_len:,} tokens is beyond the {trained_context(p):,} {model} was trained "
                     "for: the memory is real, the model's quality there is not.")
    return notes


def _published_line(model: str) -> str:
    p = PRESETS[model]
    if p.kv_latent_dim is not None:
        return f"Published: {model} uses MLA."
    return f"Published: {model} uses {p.attention_kind} with {p.n_kv_heads} KV heads."


def plot_gqa_memory(seq_lens, curves: dict, seq_len: int, title: str = "", message: str = ""):
    """Left: KV-cache bytes against sequence length (log–log) for each attention variant;
    right: the same variants at `seq_len` as bars, labelled with the ratio to the first (MHA).

    `curves`: label -> bytes at each of `seq_lens`, plus the bytes at `seq_len` as the last item of
    a (bytes_array, bytes_at_seq_len) pair. A `message` (e.g. a setting that is not allowed) is
    printed across the figure.
    """
    import numpy as np
    from matplotlib.ticker import FixedLocator, FuncFormatter

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10.0, 3.6), layout="constrained",
                                 gridspec_kw={"width_ratios": [1.5, 1]})
    s = np.asarray(seq_lens, dtype=float)
    for label, (values, _) in curves.items():
        ax.plot(s, np.maximum(np.asarray(values, dtype=float), 1), lw=2.2,
                color=_attention_color(label), label=label,
                ls="--" if label.startswith("MLA") or "published" in label else "-")
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
    ax.set_xticks(xt, [tokens_label(t) for t in xt])
    lo, hi = ax.get_ylim()
    yt = [2.0**k for k in range(0, 64, 5) if lo <= 2.0**k <= hi]
    ax.yaxis.set_major_locator(FixedLocator(yt))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: bytes_label(v)))
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("sequence length (tokens, log scale)")
    ax.set_ylabel("KV cache (log scale)")
    ax.set_title(title, fontsize=10)

    labels = list(curves)
    at = np.array([curves[k][1] for k in labels], dtype=float)
    if labels:
        unit, size = bytes_unit(at.max())
        bars = bx.bar(range(len(labels)), at / size, color=[_attention_color(k) for k in labels],
                      hatch=["//" if "published" in k else "" for k in labels], edgecolor="white")
        ratio = [f"{at[0] / a:.3g}× smaller" if a and a < at[0] else "" for a in at]
        # Each bar in its own unit, as the readout prints it (the axis shares the largest's unit).
        bx.bar_label(bars, [f"{format_bytes(a)}\n{r}".strip() for a, r in zip(at, ratio, strict=True)],
                     fontsize=8, padding=2)
        bx.set_xticks(range(len(labels)), [k.replace(" (", "\n(").replace(", ", ",\n") for k in labels],
                      fontsize=8)
        bx.set_ylim(0, at.max() / size * 1.25 or 1)
        bx.set_ylabel(f"KV cache ({unit})")
    bx.grid(True, axis="y", alpha=0.3)
    bx.set_title(f"at {seq_len:,} tokens", fontsize=10)
    if message:
        fig.text(0.5, 0.5, message, ha="center", va="center", fontsize=11, color="#C44E52", wrap=True,
                 bbox={"facecolor": "white", "edgecolor": "#C44E52", "alpha": 0.95})
    return fig


def gqa_explorer():
    """Model (preset or custom), query heads, KV heads (divisors only), layers, head dim and
    sequence length → KV-cache memory against sequence length for MHA, GQA, MQA (and MLA), with
    readouts of each variant's size and its ratio to MHA.

    Controls (by description) map to `plot_gqa` arguments: "model" → model, "KV heads" →
    n_kv_heads, "seq len" → seq_len, "query heads" → n_heads, "layers" → layers, "head dim" →
    head_dim. Choosing a preset loads its shape; changing a preset's shape switches to "custom".
    """
    import ipywidgets as w

    style, wide = {"description_width": "100px"}, w.Layout(width="420px")
    start = PRESETS["llama-2-70b"]
    model = w.Dropdown(options=gqa_models(), value="llama-2-70b", description="model", style=style,
                       layout=wide)
    n_heads = w.BoundedIntText(value=start.n_heads, min=1, max=256, description="query heads",
                               style=style)
    n_kv = w.Dropdown(options=divisors(start.n_heads), value=start.n_kv_heads,
                      description="KV heads", style=style)
    layers = w.BoundedIntText(value=start.n_layers, min=1, max=1000, description="layers",
                              style=style)
    head_dim = w.BoundedIntText(value=start.head_dim, min=2, max=1024, step=2,
                                description="head dim", style=style)
    seq_len = w.SelectionSlider(options=[(f"{s:,}", s) for s in GQA_SEQ_LENS], value=131072,
                                description="seq len", style=style, layout=wide,
                                continuous_update=False)
    readout = w.HTML()
    readout.add_class("kvlab-readout")
    syncing = [False]  # True while controls are set by code, so only one redraw happens

    def set_kv_options(h: int, keep: int) -> None:
        options = divisors(h)
        n_kv.options = options
        n_kv.value = keep if keep in options else max(d for d in options if d <= max(keep, 1))

    def on_model(change) -> None:
        if change["new"] == "custom":
            return
        p = PRESETS[change["new"]]
        syncing[0] = True
        try:
            layers.value, head_dim.value, n_heads.value = p.n_layers, p.head_dim, p.n_heads
            set_kv_options(p.n_heads, p.n_kv_heads)
        finally:
            syncing[0] = False

    def on_shape(change) -> None:
        if syncing[0]:
            return
        syncing[0] = True
        try:
            if change["owner"] is n_heads:
                set_kv_options(n_heads.value, n_kv.value)
            if model.value != "custom" and not _same_shape(model.value, n_heads.value,
                                                           layers.value, head_dim.value):
                model.value = "custom"
        finally:
            syncing[0] = False

    # Registered before interactive_output, so the controls are in sync when it redraws.
    model.observe(on_model, names="value")
    for control in (n_heads, layers, head_dim):
        control.observe(on_shape, names="value")

    def draw(**values):
        return plot_gqa(**values)  # looked up when called, so a test can count the redraws

    out = explorer_plot(draw, {"model": model, "n_kv_heads": n_kv, "seq_len": seq_len,
                               "n_heads": n_heads, "layers": layers, "head_dim": head_dim},
                        readout, skip=lambda: syncing[0])
    box = w.VBox([w.HBox([model, seq_len]), w.HBox([n_heads, n_kv]), w.HBox([layers, head_dim]),
                  out, readout])
    box.add_class("kvlab-gqa-explorer")
    return box


# ---- exercise: KV heads for a memory budget --------------------------------------------------------


KV_BUDGET_EXERCISE = {"model": "llama-3-8b", "seq_len": 32768, "batch_size": 4, "dtype": "fp16",
                      "budget_gib": 16}


def check_kv_heads_for_budget(answer) -> Verdict:
    """The most KV heads (a divisor of the query heads) whose cache fits the budget.

    The exercise: a model of Llama-3-8B's shape (32 layers, 32 query heads, head_dim 128) serves
    4 sequences of 32,768 tokens with an fp16 cache, and the cache may use at most 16 GiB. Recognises
    the usual slips and says which: 4-byte (fp32) elements, the batch forgotten, K without V, and
    the budget read as decimal GB.
    """
    ex = KV_BUDGET_EXERCISE
    base = PRESETS[ex["model"]]
    batch, budget = ex["batch_size"], ex["budget_gib"]

    def size(k: int) -> int:
        return memory.kv_cache_bytes(base.with_(n_kv_heads=k), ex["seq_len"], batch, ex["dtype"])

    allowed = divisors(base.n_heads)

    def most(per_head: float, budget_bytes: float = budget * GiB) -> int:
        """The largest allowed KV-head count whose cache fits (0: none)."""
        return max((k for k in allowed if k * per_head <= budget_bytes), default=0)

    expected = most(size(1))
    value = as_number(answer)
    if value is None or value != int(value):  # as_number is finite, so int() cannot fail
        return report(False, "", f"answer with a whole number of KV heads (got {shown(answer)}). One KV "
                      f"head costs 2 × layers × head_dim × tokens × batch × 2 bytes.")
    k = int(value)
    if k not in allowed:
        return report(False, "", f"the KV heads are a whole number ≥ 1 that divides the {base.n_heads} "
                      f"query heads, so each group has the same size; {k} does not. Allowed: {allowed}.")
    # What each usual slip leads to: (its answer, the slip, the correction).
    slips = [
        (most(size(1) * 2), "4-byte (fp32) elements", "the cache is fp16, 2 bytes an element"),
        (most(size(1) / batch), "forgetting the batch",
         f"each of the {batch} sequences caches its own K and V"),
        (most(size(1) / 2), "counting K only", "the cache holds K and V, a factor 2"),
        (most(size(1), budget * 10**9), f"reading the budget as {budget} GB ({budget} × 10⁹ bytes)",
         f"the budget is {budget} GiB, {budget} × 1024³ bytes"),
    ]
    named = [(what, fix) for wrong, what, fix in slips if k == wrong != expected]
    slip = (f"{k} is what {' or '.join(w for w, _ in named)} gives: {'; '.join(f for _, f in named)}. "
            if named else "")
    heads = f"{k} KV heads" if k > 1 else "1 KV head"
    if k > expected:
        return report(False, "", f"{slip}{heads} need {size(k) / GiB:g} GiB: over the {budget} GiB "
                      "budget.")
    if k < expected:
        fit = "fit" if k > 1 else "fits"
        return report(False, "", f"{slip}{heads} {fit} ({size(k) / GiB:g} GiB), but a larger divisor "
                      "fits too, and more KV heads usually mean better quality.")
    return report(True, f"Right: {k} KV heads take {size(k) / GiB:g} GiB, {base.n_heads // k}× "
                  f"less than MHA's {size(base.n_heads) / GiB:g} GiB — Llama-3-8B's own choice.", "")
