"""Chapter 03, How big is the cache?: weights vs cache, the memory explorer (and the drawing behind
it), and the cache-size exercise."""

from __future__ import annotations

from .. import memory, validate
from ..config import PRESETS, ModelConfig
from ..memory import GiB, format_bytes
from .style import (
    Verdict,
    as_number,
    bytes_label,
    close,
    explorer_plot,
    new_figure,
    report,
    shown,
    tokens_label,
)

WEIGHT_COLOR, CACHE_COLOR, GPU_COLOR = "#4C72B0", "#DD8452", "#C44E52"


def plot_weights_vs_cache(cases, gpu_bytes: int | None = None, gpu_label: str = ""):
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


# ---- the memory explorer ------------------------------------------------------------------------


MEMORY_DTYPES = ["fp32", "fp16", "bf16", "fp8", "int8"]
MEMORY_SEQ_LENS = [2**k for k in range(7, 21)]     # 128 … 1,048,576 tokens, log-spaced
MEMORY_BATCH_SIZES = [2**k for k in range(0, 11)]  # 1 … 1,024 sequences
# PRESETS keep each config's declared context (max_position_embeddings); these models were trained
# on shorter sequences: Mistral 7B's paper, Table 1 (context_len 8192, sliding window 4096);
# Qwen2.5 (pre-trained to 32,768 tokens; its model cards reach 131,072 with YaRN rope scaling); and
# DeepSeek-V2 (report, section 3.1.4: pre-trained at 4K, its YaRN extension trained at 32K for 1,000
# steps, evaluated at 128K; its config declares 163,840 = 40 × 4,096 positions).
TRAINED_CONTEXT = {"mistral-7b": 8192, "qwen2.5-7b": 32768, "qwen2.5-72b": 32768,
                   "deepseek-v2": 32768}
# Sliding-window attention: these models attend to the last W tokens only, so a rolling cache never
# holds more than W tokens a sequence (Mistral-7B v0.1's config.json: "sliding_window": 4096).
WINDOWED = {"mistral-7b": 4096}


def trained_context(config) -> int:
    """The longest sequence `config`'s model was trained on: its declared context unless
    TRAINED_CONTEXT names a shorter one."""
    return TRAINED_CONTEXT.get(config.name, config.max_seq_len)


WEIGHT_DTYPE = "fp16"  # the explorer's weights stay fp16; its dtype control is the cache's


def memory_models() -> list[str]:
    """The explorer's model choices: every preset, then "custom" (your own L, H_kv, D)."""
    return [*PRESETS, "custom"]


def memory_config(model: str = "llama-7b", layers: int | None = None, kv_heads: int | None = None,
                  head_dim: int | None = None):
    """The ModelConfig the explorer sizes: a preset by name, or a "custom" cache shape.

    A custom shape only describes the cache (L layers × H_kv heads × D dims); it has no published
    weights, so it counts one parameter (2 bytes: nothing next to gigabytes) and the explorer says
    "weights not counted".
    """
    if model == "custom":
        if layers is None or kv_heads is None or head_dim is None:
            raise ValueError("model='custom' needs layers, kv_heads and head_dim (positive integers)")
        # d_model, d_ff and the vocabulary do not enter the cache: 1 each.
        return ModelConfig(n_layers=layers, d_model=1, n_heads=kv_heads, n_kv_heads=kv_heads,
                           head_dim=head_dim, d_ff=1, vocab_size=1, max_seq_len=max(MEMORY_SEQ_LENS),
                           name="custom", n_params=1)
    if model not in PRESETS:
        raise ValueError(f"model={model!r} is not a preset; allowed: {', '.join(memory_models())}")
    return PRESETS[model]


def _shape_text(config) -> str:
    if config.kv_latent_dim is not None:
        return f"{config.n_layers} layers × one {config.kv_latent_dim}-element latent"
    return f"{config.n_layers} layers × {config.n_kv_heads} KV heads × {config.head_dim} dims"


def plot_memory(model: str = "llama-2-7b", seq_len: int = 4096, batch_size: int = 1,
                dtype: str = "fp16", gpu: str = "A100 80GB", layers: int | None = None,
                kv_heads: int | None = None, head_dim: int | None = None):
    """Memory against sequence length for one model, batch, cache dtype and GPU.

    Returns (Figure, readout text). The readout gives the cache size, whether it fits next to the
    fp16 weights and the CUDA context (`kvlab.memory.CUDA_CONTEXT_BYTES`, as chapter 03's planner
    counts it), the longest context that fits and the most concurrent sequences that fit (from
    `kvlab.memory.plan`, no reserve for activations). Settings that do not fit (even the weights
    alone) draw the plot and say so; an invalid custom shape draws an empty plot and the reason.
    Unknown names (model, dtype, GPU) and a non-positive seq_len or batch_size raise ValueError.
    """
    import numpy as np

    memory.dtype_bits(dtype)            # unknown names are programming errors: raise
    g = memory.gpu(gpu)
    validate.integer("seq_len", seq_len)
    validate.integer("batch_size", batch_size)
    try:
        config = memory_config(model, layers, kv_heads, head_dim)
    except ValueError as err:
        if model != "custom":
            raise
        fig, ax = new_figure(9.0, 3.6)
        ax.text(0.5, 0.5, f"custom shape not valid:\n{err}", ha="center", va="center", wrap=True,
                transform=ax.transAxes)
        ax.set_axis_off()
        return fig, f"✗ custom shape not valid: {err}"

    custom = model == "custom"
    window = None if custom else WINDOWED.get(config.name)
    cached = min(seq_len, window) if window else seq_len   # a rolling cache stops at the window
    p = memory.plan(config, g, cached, batch_size, dtype=dtype, weight_dtype=WEIGHT_DTYPE)
    fmt = memory.format_bytes
    weights = 0 if custom else p.weight_bytes
    per_token = memory.kv_bytes_per_token(config, dtype)
    label = "custom" if custom else f"{config.name} ({config.attention_kind})"
    rolling = f" (rolling: the last {cached:,})" if window and seq_len > window else ""
    lines = [
        f"{label}: {_shape_text(config)} = {fmt(per_token)} per token in {dtype}",
        f"KV cache for {seq_len:,} tokens{rolling} × batch {batch_size}: {fmt(p.cache_bytes)} · weights "
        + ("not counted (custom shape)" if custom else f"({WEIGHT_DTYPE}): {fmt(weights)}")
        + f" · {g.name}: {fmt(g.memory_bytes)}",
    ]
    total = weights + p.cache_bytes
    ctx = p.context_bytes            # the CUDA context takes this much before anything is loaded
    usable = g.memory_bytes - ctx
    if p.free_for_cache < 0:
        note = f"The weights alone ({fmt(weights)}) do not fit on {g.name} ({fmt(usable)} usable)"
        lines.append(f"✗ {note}: no room for any cache.")
    elif p.fits:
        note = ""
        lines.append(f"✓ Fits: {fmt(total + ctx)} used (weights + cache + {ctx / memory.GiB:.2f} GiB "
                     f"CUDA context), {fmt(usable - total)} to spare.")
    else:
        note = f"Does not fit: needs {fmt(total + ctx)}"
        lines.append(f"✗ Does not fit: needs {fmt(total + ctx)} with the {ctx / memory.GiB:.2f} GiB "
                     f"CUDA context, {fmt(total - usable)} more than {g.name} holds.")
    trained_for = None if custom else trained_context(config)
    trained = "" if custom else f" (the model was trained for up to {trained_for:,})"
    # With a window, a cache that fits at the window's length fits at every length.
    unbounded = window is not None and memory.plan(config, g, window, batch_size, dtype=dtype,
                                                   weight_dtype=WEIGHT_DTYPE).fits
    longest = (f"any length: the rolling cache stops growing at {window:,} tokens{trained}." if unbounded
               else f"{p.max_context:,} tokens{trained}." if p.max_context else "none.")
    lines.append(f"Longest context that fits at batch {batch_size}: {longest}")
    lines.append(f"Most concurrent sequences of {seq_len:,} tokens that fit: "
                 + (f"{p.max_batch:,}." if p.max_batch else "none."))

    # The cache grows linearly in tokens: a straight line of slope 1 on log–log axes (until a
    # window caps it; the window's length is a grid point, so the bend is drawn where it is).
    seq_lens = np.geomspace(MEMORY_SEQ_LENS[0], MEMORY_SEQ_LENS[-1], 400)
    if window:
        seq_lens = np.union1d(seq_lens, [window])
        lines.append(_window_line(config, window, seq_len, batch_size, dtype))
    full = seq_lens * batch_size * per_token
    cache = np.minimum(seq_lens, window) * batch_size * per_token if window else full
    if trained_for and seq_len > trained_for:
        lines.append(f"⚠ {seq_len:,} tokens is beyond the {trained_for:,} {config.name} was trained for "
                     "(shaded): the memory is real, the model's quality there is not.")
    fig = plot_memory_vs_seq_len(
        seq_lens, weights, cache, usable, f"{g.name} less the\nCUDA context", seq_len,
        0 if unbounded else p.max_context,
        title=f"{label}, batch {batch_size}, {dtype} cache on {g.name}",
        cache_label=f"KV cache ({dtype}, batch {batch_size})"
        + (f",\nrolling {window:,}-token window" if window else ""),
        weight_label="weights: not counted" if custom else f"weights ({WEIGHT_DTYPE})", note=note,
        trained_context=trained_for, full_cache_bytes=full if window else None)
    return fig, "\n".join(lines)


def _window_line(config, window: int, seq_len: int, batch_size: int, dtype: str) -> str:
    """The readout's note on a sliding window: what a rolling cache holds, and full attention."""
    at_most = format_bytes(memory.kv_cache_bytes(config, window, batch_size, dtype))
    full = format_bytes(memory.kv_cache_bytes(config, seq_len, batch_size, dtype))
    return (f"† {config.name} attends within a {window:,}-token sliding window: a rolling cache holds "
            f"at most {at_most} (the last {window:,} tokens of each sequence) at any length; "
            + (f"full attention would need {full} at {seq_len:,} tokens (dotted)." if seq_len > window
               else f"beyond {window:,} tokens full attention would keep growing (dotted)."))


def plot_memory_vs_seq_len(seq_lens, weight_bytes: int, cache_bytes, capacity_bytes: int,
                           capacity_label: str, current_seq_len: int, max_context: int = 0,
                           title: str = "", cache_label: str = "KV cache", weight_label: str = "weights",
                           note: str = "", trained_context: int | None = None,
                           full_cache_bytes=None):
    """Memory against sequence length on log–log axes: the weights (flat), the KV cache (a straight
    line of slope 1: linear growth), their sum, the GPU's capacity, the current setting and the
    longest context that fits. Lengths beyond `trained_context` (the model's published context) are
    shaded: the memory there is real arithmetic, but the model was not trained for it. A model with
    a sliding window passes its capped cache as `cache_bytes` and the full-attention cache as
    `full_cache_bytes`, drawn dotted for comparison.

    Both axes are logarithmic so that linear growth looks linear (a straight line) at every scale.
    `note` (e.g. "the weights alone do not fit") is written across the plot.
    """
    import numpy as np
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    s = np.asarray(seq_lens, dtype=float)
    cache = np.asarray(cache_bytes, dtype=float)
    wt, cap = float(weight_bytes), float(capacity_bytes)
    total = wt + cache
    fig, ax = new_figure(9.0, 3.6)
    if trained_context and trained_context < s[-1]:
        ax.axvspan(max(trained_context, s[0]), s[-1], color="#999999", alpha=0.18, lw=0,
                   label=f"beyond the trained\ncontext ({trained_context:,})")
    if wt > 2:   # a custom shape counts no weights
        ax.plot(s, np.full_like(s, wt), color=WEIGHT_COLOR, lw=1.6, label=weight_label)
    ax.plot(s, cache, color=CACHE_COLOR, lw=1.6, label=cache_label)
    if full_cache_bytes is not None:
        ax.plot(s, np.asarray(full_cache_bytes, dtype=float), color=CACHE_COLOR, lw=1.2, ls=":",
                label="KV cache with full\nattention (no window)")
    ax.plot(s, total, color="black", lw=2.4, label="weights + cache" if wt > 2 else "total")
    ax.axhline(cap, color=GPU_COLOR, ls="--", lw=1.5, label=f"{capacity_label}: {format_bytes(cap)}")
    if s[0] <= max_context <= s[-1]:
        ax.axvline(max_context, color=GPU_COLOR, ls=":", lw=1.2,
                   label=f"longest context\nthat fits: {max_context:,}")
    current = wt + float(np.interp(current_seq_len, s, cache))  # the cache is linear in tokens
    ax.plot([current_seq_len], [current], "o", ms=9, mfc="white", mec="black", mew=2,
            label=f"this setting:\n{current_seq_len:,} tokens, {format_bytes(current)}", zorder=5,
            clip_on=False)
    if note:
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", fontsize=11,
                bbox={"boxstyle": "round", "fc": "white", "ec": GPU_COLOR, "alpha": 0.95})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlim(s[0], s[-1])
    lo = max(min(cache[0], wt if wt > 2 else cache[0], cap) / 2, 1.0)
    ax.set_ylim(lo, max(total[-1], cap) * 2)
    ticks = [t for t in (128, 1024, 4096, 32768, 131072, 2**20) if s[0] <= t <= s[-1]]
    ax.set_xticks(ticks, [tokens_label(t) for t in ticks])
    y_lo, y_hi = ax.get_ylim()
    every = max(1, int(np.ceil(np.log2(y_hi / y_lo) / 8)))   # about 8 labelled powers of two
    yt = [2.0**k for k in range(0, 80, every) if y_lo <= 2.0**k <= y_hi]
    ax.yaxis.set_major_locator(FixedLocator(yt))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: bytes_label(v)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_locator(NullLocator())
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("sequence length (tokens, log scale)")
    ax.set_ylabel("memory (log scale)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.9)
    return fig


def memory_explorer():
    """Model, sequence length (log scale), batch, cache dtype and GPU → memory vs sequence length,
    with readouts of the cache size, the longest context and the most sequences that fit."""
    import ipywidgets as w

    style, wide = {"description_width": "90px"}, w.Layout(width="420px")
    model = w.Dropdown(options=memory_models(), value="llama-2-7b", description="model",
                       style=style, layout=wide)
    layers = w.BoundedIntText(value=32, min=1, max=1000, description="layers", style=style)
    kv_heads = w.BoundedIntText(value=32, min=1, max=1024, description="KV heads", style=style)
    head_dim = w.BoundedIntText(value=128, min=2, max=1024, step=2, description="head dim",
                                style=style)
    custom_box = w.HBox([layers, kv_heads, head_dim], layout=w.Layout(display="none"))
    seq_len = w.SelectionSlider(options=[(f"{s:,}", s) for s in MEMORY_SEQ_LENS], value=4096,
                                description="seq len", style=style, layout=wide,
                                continuous_update=False)
    batch = w.SelectionSlider(options=[(f"{b:,}", b) for b in MEMORY_BATCH_SIZES], value=1,
                              description="batch", style=style, layout=wide,
                              continuous_update=False)
    dtype = w.Dropdown(options=MEMORY_DTYPES, value="fp16", description="cache dtype", style=style)
    gpu = w.Dropdown(options=list(memory.GPUS), value="A100 80GB", description="GPU", style=style)
    readout = w.HTML()
    readout.add_class("kvlab-readout")

    def show_custom(change) -> None:
        custom_box.layout.display = "flex" if change["new"] == "custom" else "none"

    model.observe(show_custom, names="value")

    def draw(model, seq_len, batch_size, dtype, gpu, layers, kv_heads, head_dim):
        shape = (layers, kv_heads, head_dim) if model == "custom" else (None, None, None)
        return plot_memory(model, seq_len, batch_size, dtype, gpu, *shape)

    out = explorer_plot(draw, {
        "model": model, "seq_len": seq_len, "batch_size": batch, "dtype": dtype, "gpu": gpu,
        "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}, readout)
    box = w.VBox([w.HBox([model, gpu]), custom_box, seq_len, batch, dtype, out, readout])
    box.add_class("kvlab-memory-explorer")
    return box


# ---- exercise: size the cache --------------------------------------------------------------------


CACHE_SIZE_EXERCISE = {"model": "qwen2.5-7b", "seq_len": 32768, "batch_size": 8, "dtype": "fp16"}


def check_cache_size(answer, model: str = CACHE_SIZE_EXERCISE["model"],
                     seq_len: int = CACHE_SIZE_EXERCISE["seq_len"],
                     batch_size: int = CACHE_SIZE_EXERCISE["batch_size"],
                     dtype: str = CACHE_SIZE_EXERCISE["dtype"]) -> Verdict:
    """The KV cache of `model` for `batch_size` sequences of `seq_len` tokens, in GiB.

    Recognises the usual slips and says which: K without V, query heads instead of KV heads,
    4-byte (fp32) elements, the batch forgotten; decimal GB instead of GiB (also rounded to a whole
    number), MiB, decimal MB or bytes instead of GiB; and any two of them at once (one of the first
    four in one of the wrong units).
    """
    from ..memory import DTYPE_BITS, GB, GiB, MiB, kv_cache_bytes

    config = PRESETS[model]
    expected = kv_cache_bytes(config, seq_len, batch_size, dtype)
    value = as_number(answer)
    if value is None:
        return report(False, "", f"answer with a number of GiB (got {shown(answer)}): 2 (K and V) × "
                      "layers × KV heads × head_dim × tokens × batch × bytes per element ÷ 1024**3.")
    if close(value, expected / GiB, 1e-3):
        return report(True, f"Right: {expected:,} bytes = {expected / GiB:g} GiB.", "")
    element = DTYPE_BITS[dtype] / 8  # bytes
    counted = [  # (the bytes a slip counts, ÷ the right bytes; what it got wrong), the right count first
        (1, ""),
        (1 / 2, "that is half the answer: K alone. The cache holds K and V, a factor 2."),
        (config.n_rep, f"{model} has {config.n_kv_heads} KV heads (shared by {config.n_heads} query "
         "heads): use n_kv_heads, not n_heads."),
        (4 / element, f"that counts 4 bytes an element (fp32); the cache is {dtype}: {element:g} bytes an "
         "element."),
        (1 / batch_size, f"that is the cache of one sequence: multiply by the batch ({batch_size} "
         "sequences, each with its own keys and values)."),
    ]
    units = [  # (the unit a slip divides by; what it got wrong), the right unit first
        (GiB, ""),
        (GB, "that is decimal GB (10**9 bytes); the question asks for GiB (1024**3)."),
        (MiB, "that is in MiB (1024**2 bytes): divide by 1024 once more for GiB."),
        (10**6, "that is decimal MB (10**6 bytes); the question asks for GiB (1024**3)."),
        (1, "that looks like bytes: the question asks for GiB (divide by 1024**3)."),
    ]
    for factor, what in counted:       # one slip, then two at once
        for unit, which in units:
            wrong = expected * factor / unit
            if (what or which) and wrong != expected / GiB and close(value, wrong, 1e-3):
                return report(False, "", _slips(what, which))
    for factor, what in counted:       # GB rounded to a whole number ("15" for 15.03 GB)
        in_gb = expected * factor / GB
        if value == round(in_gb) != round(expected * factor / GiB):
            return report(False, "", _slips(what, f"{value:g} is the decimal figure, {in_gb:.2f} GB "
                                     "(10**9 bytes), rounded; the question asks for GiB (1024**3 bytes): "
                                     "divide the bytes by 1024**3."))
    return report(False, "", f"2 (K and V) × layers × KV heads × head_dim × {seq_len:,} tokens × "
                  f"batch {batch_size} × bytes per {dtype} element, then ÷ 1024**3. Read the shape "
                  f"from kvlab.PRESETS[{model!r}].")


def _slips(*hints: str) -> str:
    """One hint, or two slips named together."""
    named = [h for h in hints if h]
    return named[0] if len(named) == 1 else "two slips at once: " + " And ".join(named)
