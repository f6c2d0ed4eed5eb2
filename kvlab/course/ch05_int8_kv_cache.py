"""Chapter 05, FP16 → INT8: per-channel magnitudes (outlier keys), error by scale granularity, the
quantized cache's bytes against FP16, the quantization explorer (and the drawing behind it), and the
per-channel quantization exercise. The measurement the explorer shows is `kvlab.quality`'s."""

from __future__ import annotations

import matplotlib.pyplot as plt

from .. import memory, quality, quant, validate
from ..cache import quantized_cache_bytes
from ..config import PRESETS, PUBLISHED
from .ch03_cache_memory import WINDOWED, trained_context
from .style import Verdict, bytes_label, dense_tensor, explorer_plot, new_figure, report, tokens_label


def plot_channel_magnitudes(k_absmax, v_absmax, title: str = "", heads: int | None = None):
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


def plot_granularity_errors(errors: dict, title: str = ""):
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


def plot_perplexity_change(change: dict, title: str = "", unit: str = "byte", spread: float = 2.0):
    """Held-out loss change of each cache against the exact one (nats per `unit`: "byte" for
    kvlab-tiny, "token" for a BPE model), with error bars of ± `spread` paired standard errors:
    `change` maps a label to (difference, standard error). With `spread` the test's cut (2 for many
    windows; `quality.t_critical(windows - 1)` for a few), a bar whose error bar crosses zero is a
    change that cannot be told from noise."""
    import numpy as np

    labels = list(change)
    delta = np.array([change[k][0] for k in labels], dtype=float)
    se = np.array([change[k][1] for k in labels], dtype=float)
    unit = validate.choice("unit", unit, ("byte", "token"))
    if not spread > 0:
        raise ValueError(f"spread={spread!r} must be a positive number of standard errors")
    bar = spread * se
    fig, ax = new_figure(7.0, 0.9 + 0.6 * len(labels))
    y = np.arange(len(labels))
    ax.barh(y, delta, xerr=bar, color=["#2ca02c" if "int8" in k else "#9467bd" for k in labels],
            capsize=5, height=0.5)
    ax.axvline(0, color="black", lw=1)
    for yi, d, e in zip(y, delta, bar, strict=True):
        ax.annotate(f"{d:+.2e} (± {spread:.3g} SE: {e:.1e})", (max(d + e, 0), yi), xytext=(6, 0),
                    textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=9)
    ax.invert_yaxis()
    lim = float(np.max(np.abs(delta) + bar)) * 2.2 or 1.0
    ax.set_xlim(-lim / 3, lim)
    ax.set_xlabel(f"held-out loss change vs the exact cache (nats per {unit}), ± {spread:.3g} paired SE")
    ax.set_title(title or "perplexity change", fontsize=10)
    return fig


def plot_bytes_ratio(seq_lens, ratios: dict, references: dict | None = None, limit: float | None = 0.55):
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


# ---- the quantization explorer -------------------------------------------------------------------


QUANT_DTYPES = ["fp32", "fp16", "int8", "int4"]
QUANT_GROUP_SIZE = 32                          # tokens sharing a per-channel (or per-block) scale
# scales -> (key_granularity, value_granularity) of a QuantizedKVCache; "tensor" is no such cache:
# one scale per layer for all of K and one for V, calibrated in advance (quality.FixedScaleKVCache).
QUANT_SCALES = {"kivi": ("channel", "token"), "token": ("token", "token"),
                "channel": ("channel", "channel"), "block": ("tensor", "token"), "tensor": None}
QUANT_SCALE_LABELS = {
    "kivi": "K per channel, V per token (KIVI)", "token": "per token (K and V)",
    "channel": "per channel (K and V)",
    "block": f"K one scale per {QUANT_GROUP_SIZE}-token block, V per token",
    "tensor": "per tensor: one calibrated scale a layer for K, one for V"}
QUANT_SEQ_LENS = [2**k for k in range(9, 18)]  # 512 … 131,072 tokens


def quant_models() -> list[str]:
    """The explorer's model choices (for the memory chart): the published presets."""
    return list(PUBLISHED)


def quant_measurement(dtype: str = "int8", scales: str = "kivi") -> dict:
    """The errors of one setting measured on kvlab.quality's small run (remembered there, so the
    explorer measures each setting once), with "run" saying what was measured."""
    _check_quant_choice(dtype, scales)
    if dtype in ("fp32", "fp16"):
        return quality.small_run_errors(dtype)
    if QUANT_SCALES[scales] is None:
        return quality.small_run_errors(dtype, calibrated=True)
    k_g, v_g = QUANT_SCALES[scales]
    return quality.small_run_errors(dtype, key_granularity=k_g, value_granularity=v_g,
                                    group_size=QUANT_GROUP_SIZE)


def _check_quant_choice(dtype: str, scales: str) -> None:
    validate.choice("dtype", dtype, QUANT_DTYPES)
    validate.choice("scales", scales, QUANT_SCALES)


def quant_cache_bytes(config, seq_len: int, dtype: str = "int8", scales: str = "kivi",
                      batch_size: int = 1) -> int:
    """Cache bytes of one setting: fp32/fp16 from kvlab.memory, int8/int4 with their fp16 scales
    and the fp16 window of unfinished blocks (kvlab.cache.quantized_cache_bytes); per tensor, the
    codes and two fp32 scales a layer (FixedScaleKVCache.format_nbytes)."""
    _check_quant_choice(dtype, scales)
    if dtype in ("fp32", "fp16"):
        return memory.kv_cache_bytes(config, seq_len, batch_size, dtype)
    if QUANT_SCALES[scales] is None:
        return memory.kv_cache_bytes(config, seq_len, batch_size, dtype) + 4 * 2 * config.n_layers
    k_g, v_g = QUANT_SCALES[scales]
    return quantized_cache_bytes(config, seq_len, batch_size, bits=8 if dtype == "int8" else 4,
                                 key_granularity=k_g, value_granularity=v_g, group_size=QUANT_GROUP_SIZE)


def plot_quant(dtype: str = "int8", scales: str = "kivi", seq_len: int = 4096,
               model: str = "llama-2-7b"):
    """Cache memory of `model` against sequence length for fp32 / fp16 / int8 / int4 (the chosen
    storage in bold), and the errors measured for the chosen dtype and scale granularity on a small
    cached run (`quant_measurement`). Returns (Figure, readout text). An MLA model (one latent per
    token, no K/V heads to scale per channel) draws the fp formats only and says so. Lengths beyond
    the context the model was trained for are shaded (chapter 03's `trained_context`), and a
    sliding-window model's cap is marked (chapter 03's `WINDOWED`). Unknown names or a non-positive
    seq_len raise ValueError."""
    import numpy as np

    _check_quant_choice(dtype, scales)
    validate.integer("seq_len", seq_len)
    validate.choice("model", model, quant_models())
    config = PRESETS[model]
    lens = np.array(sorted({*[2**k for k in range(7, 21)], seq_len}), dtype=float)
    fmt = memory.format_bytes
    message, lines = "", []
    formats = QUANT_DTYPES if config.kv_latent_dim is None else ["fp32", "fp16"]
    curves = {}
    for d in formats:
        label = d if d in ("fp32", "fp16") else f"{d} + scales"
        curves[label] = np.array([quant_cache_bytes(config, int(s), d, scales) for s in lens], dtype=float)
    chosen = dtype if dtype in ("fp32", "fp16") else f"{dtype} + scales"
    fp16 = memory.kv_cache_bytes(config, seq_len, 1, "fp16")
    if chosen in curves:
        size = quant_cache_bytes(config, seq_len, dtype, scales)
        lines.append(f"{model}: KV cache for {seq_len:,} tokens in {dtype}"
                     + (f" ({_scales_text(scales)})" if dtype in ("int8", "int4") else "")
                     + f": {fmt(size)} = {size / fp16:.3f}× FP16 ({fmt(fp16)})")
    else:
        message = "MLA latent: no int8 / int4 curve (errors: small MHA run)"
        lines.append(f"✗ {model} caches an MLA latent, not K and V heads: kvlab's int8 / int4 K/V "
                     "layout does not apply, so the chart shows fp32 and fp16 only.")
    m = quant_measurement(dtype, scales)
    errors = {"K": m["k_relative_rms_error"], "V": m["v_relative_rms_error"],
              "attention output": m["attention_relative_rms_error"],
              "logits": m["logits_relative_rms_error"]}
    lines.append(f"Measured on {m['run']}:")
    lines.append("  relative RMS error: " + ", ".join(f"{k} {v:.3%}" for k, v in errors.items()))
    lines.append(f"  greedy (arg-max) agreement with the exact cache: {m['top1_agreement']:.1%} of "
                 f"{m['tokens']} positions; loss {m['loss_exact']:.4f} → {m['loss_quant']:.4f} nats/token")
    if dtype == "fp32":
        lines.append("  fp32 is the reference here: nothing is rounded.")
    elif dtype == "fp16":
        lines.append("  fp16 keeps every value to about 3 significant digits; scales only apply to "
                     "int8 / int4.")
    elif scales != "kivi":
        lines.append("  compare with 'K per channel, V per token (KIVI)' on the same dtype.")
    trained, window = trained_context(config), WINDOWED.get(model)
    if seq_len > trained:
        lines.append(f"⚠ {seq_len:,} tokens is beyond the {trained:,} {model} was trained for (shaded): "
                     "the bytes are real arithmetic, the model's quality there is not.")
    if window and chosen in curves:
        capped = quant_cache_bytes(config, min(seq_len, window), dtype, scales)
        lines.append(f"† {model} attends within a {window:,}-token sliding window: a rolling cache holds "
                     f"at most {window:,} tokens a sequence, {fmt(capped)} here; the curves are full "
                     "attention.")
    title = f"{model}: KV cache, batch 1 (computed)"
    setting = dtype + (f", {QUANT_SCALE_LABELS[scales]}" if dtype in ("int8", "int4") else "")
    measured_on = m["run"].split(" on ")[0]   # the quality is measured on a small model, not `model`
    fig = plot_quant_memory_and_error(lens, curves, chosen if chosen in curves else "fp16", seq_len, errors,
                                      title=title,
                                      message=f"{message or setting}\nerror measured on {measured_on}",
                                      trained_context=trained, window=window)
    return fig, "\n".join(lines)


def _scales_text(scales: str) -> str:
    """The readout's words for a scale setting: its label, and the token groups where it has them."""
    blocks = scales in ("kivi", "channel", "block")   # a scale spans a block of tokens
    return QUANT_SCALE_LABELS[scales] + (f", groups of {QUANT_GROUP_SIZE} tokens" if blocks else "")


def plot_quant_memory_and_error(seq_lens, curves: dict, chosen: str, seq_len: int, errors: dict,
                                title: str = "", message: str = "", trained_context: int | None = None,
                                window: int | None = None):
    """The quantization explorer's figure. Left: cache bytes against sequence length, one line a
    storage format (`curves`: label -> bytes array), the chosen one bold, a dot at seq_len; lengths
    beyond `trained_context` shaded, a sliding `window` marked. Right: the measured relative errors
    of the chosen setting (`errors`: name -> value)."""
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 3.6), layout="constrained",
                                      gridspec_kw={"width_ratios": [1.35, 1]})
    lens = np.asarray(seq_lens, dtype=float)
    if trained_context and trained_context < lens[-1]:
        left.axvspan(max(trained_context, lens[0]), lens[-1], color="#999999", alpha=0.18, lw=0,
                     label=f"beyond the trained context ({tokens_label(trained_context)})")
    if window:
        left.axvline(window, color="#d62728", ls="--", lw=1,
                     label=f"sliding window ({window:,}): a rolling cache stops")
    colors = {"fp32": "#7f7f7f", "fp16": "#1f77b4", "int8": "#2ca02c", "int4": "#9467bd"}
    for label, values in curves.items():
        bold = label == chosen
        left.plot(lens, values, lw=3 if bold else 1.2, alpha=1 if bold else 0.6,
                  color=colors.get(label.split()[0]), label=label)
        if bold:
            at = float(np.interp(seq_len, lens, values))
            left.plot([seq_len], [at], "o", color="black", zorder=5)
            left.annotate(bytes_label(at), (seq_len, at), textcoords="offset points", xytext=(6, -14),
                          fontsize=9)
    left.axvline(seq_len, color="black", lw=0.6, ls=":")
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: bytes_label(y)))
    left.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: tokens_label(int(x))))
    left.set_xlabel("sequence length (tokens)")
    left.set_ylabel("KV cache")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=7, loc="upper left")
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


def quant_explorer():
    """Cache dtype (fp32 / fp16 / int8 / int4), scale granularity, sequence length and model →
    cache memory against sequence length, with the errors measured for the chosen setting."""
    import ipywidgets as w

    style, wide = {"description_width": "90px"}, w.Layout(width="420px")
    dtype = w.Dropdown(options=QUANT_DTYPES, value="int8", description="cache dtype", style=style)
    scales = w.Dropdown(options=[(label, key) for key, label in QUANT_SCALE_LABELS.items()],
                        value="kivi", description="scales", style=style, layout=wide)
    seq_len = w.SelectionSlider(options=[(f"{s:,}", s) for s in QUANT_SEQ_LENS], value=4096,
                                description="seq len", style=style, layout=wide,
                                continuous_update=False)
    model = w.Dropdown(options=quant_models(), value="llama-2-7b", description="model", style=style,
                       layout=wide)
    readout = w.HTML()
    readout.add_class("kvlab-readout")

    def draw(**values):
        return plot_quant(**values)

    out = explorer_plot(draw, {"dtype": dtype, "scales": scales, "seq_len": seq_len, "model": model},
                        readout)
    box = w.VBox([w.HBox([dtype, scales]), w.HBox([model, seq_len]), out, readout])
    box.add_class("kvlab-quant-explorer")
    return box


# ---- exercise: absmax int8, one scale per channel -------------------------------------------------


def check_quantize_keys_per_channel(fn) -> Verdict:
    """The learner's `fn(k) -> (codes, scale)`: absmax int8 of a (tokens, channels) tensor with one
    scale per channel. Compared with kvlab.quant.quantize(k, "channel") on keys with an outlier
    channel and channels whose largest value is negative. The hints name the likely mistakes:
    reducing over the wrong dim (one scale per token, or one for the whole tensor), the max without
    abs, the scale not divided by 127 (or by 128 / 255), a truncating cast, (scale, codes) swapped.
    Scales in fp16 or bf16 are fine (they halve the scales' bytes), to their precision: the codes
    may be rounded with the float32 scale or with the cast one."""
    import torch

    if fn is None:
        return report(False, "", "write a function quantize_keys(k) that returns (codes, scale).")
    if not callable(fn):
        return report(False, "", f"pass the function itself (got a {type(fn).__name__}).")
    g = torch.Generator().manual_seed(5)
    for tokens, channels in ((32, 16), (7, 64)):
        k = torch.randn(tokens, channels, generator=g)
        k[:, 3] *= 25                  # an outlier channel, as real keys have
        k[:, 5] = -k[:, 5].abs() * 4   # a channel whose large values are all negative
        try:
            result = fn(k.clone())
        except Exception as err:  # noqa: BLE001 - any error in the learner's code becomes a hint
            return report(False, "", f"your function raised {type(err).__name__}: {err}")
        hint = _quantize_keys_hint(k, result)
        if hint:
            return report(False, "", hint)
    return report(True, "Right: one scale per channel, so the outlier channel no longer coarsens "
                        "the others; every value is within half a step of the original"
                        + ("." if result[1].dtype == torch.float32 else
                           f" (plus the rounding of the scale itself to {result[1].dtype})."), "")


def _quantize_keys_hint(k, result) -> str:
    """What is wrong with `result` for keys k, or "" when it is right."""
    import torch

    want = quant.quantize(k, "channel")
    tokens, channels = k.shape
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and all(isinstance(t, torch.Tensor) for t in result)):
        return "return two tensors: (codes, scale)."
    codes, scale = result
    if not (dense_tensor(codes) and dense_tensor(scale)):
        return "return ordinary dense tensors (not sparse, nested or meta ones)."
    if scale.dtype == torch.int8 and codes.is_floating_point() and codes.shape != k.shape:
        return "return (codes, scale) in that order: the int8 codes first, then the scale."
    if codes.dtype != torch.int8 or codes.shape != k.shape:
        return (f"codes must be int8 with k's shape {tuple(k.shape)}; got {codes.dtype}, "
                f"{tuple(codes.shape)}.")
    if scale.is_complex() or not scale.is_floating_point():
        return ("scale must hold real floats (torch.float32, or float16 to halve its bytes); got "
                f"{scale.dtype}.")
    if scale.numel() == 1:
        return ("that is one scale for the whole tensor: take the absmax of each channel (column), "
                "over the tokens: k.abs().amax(dim=0, keepdim=True).")
    if scale.numel() == tokens and tokens != channels:
        return ("that is one scale per token (row): reduce over the tokens (dim 0) instead, keeping "
                "one scale per channel.")
    if tuple(scale.shape) not in ((1, channels), (channels,)):
        return (f"scale has shape {tuple(scale.shape)}; it should be (1, {channels}), one value per "
                "channel, so that k / scale divides each column by its own scale (amax(dim=0, "
                "keepdim=True)).")
    s = scale.float().reshape(1, channels)
    eps = max(torch.finfo(scale.dtype).eps, 1e-6)   # fp16 / bf16 scales are fine, to their precision
    ratio = (s / want.scale).median().item()
    if abs(ratio - 127) < 1:
        return "divide the absmax by 127, the largest int8 code you use: scale = absmax / 127."
    for wrong in (128, 255):
        if abs(ratio - 127 / wrong) < 0.002:
            return (f"divide by 127, not {wrong}: symmetric int8 uses the codes -127 … 127, so the "
                    "largest |value| lands on 127.")
    if not torch.allclose(s, want.scale, rtol=4 * eps):
        if torch.allclose(s.abs(), (k.amax(0, keepdim=True) / 127).abs(), rtol=4 * eps):
            return ("take the absolute value before the max: k.amax(dim=0) misses a channel whose "
                    "large values are negative; use k.abs().amax(dim=0, keepdim=True) / 127.")
        return "scale = absmax of each channel / 127: k.abs().amax(dim=0, keepdim=True) / 127."
    # The codes of the scale as returned, or of the float32 scale before a cast to fp16 / bf16
    # (bf16 keeps 8 bits of mantissa: k / scale then moves by up to half a code near 127).
    exact = torch.round(k / s).clamp(-127, 127)
    off = min((codes.float() != exact).float().mean(), (codes.float() != want.data.float()).float().mean())
    if (codes.int() - want.data.int()).abs().max() > 1 or off > 0.01:
        if torch.equal(codes.float(), torch.trunc(k / s).clamp(-127, 127)):
            return ("round to the nearest integer (torch.round) before casting to int8; a bare cast "
                    "truncates toward zero.")
        return "codes = round(k / scale), clamped to -127 … 127, as int8."
    if (k - codes.float() * s).abs().max() > s.max() * (0.5 + 127 * eps) * 1.001:
        return "codes × scale should be within half a scale of k."
    return ""
