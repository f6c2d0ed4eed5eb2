"""Chapter 06, A fast decoder on the GPU: naive vs cached tokens/s, the fixed cost of a step (and
which of its operations launch a kernel), the decode roofline with its compute roof (the theory is
`kvlab.roofline`), and the roofline exercise. The chapter draws its overhead bars with chapter 02's
`cost_bars`."""

from __future__ import annotations

from .. import memory, roofline
from ..bench.timing import op_counts  # noqa: F401  (the notebook calls ch06.op_counts)
from ..config import PRESETS
from ..memory import GPUS
from .style import Verdict, close, new_figure, report


def gpu_label(name: str) -> str:
    """A kvlab.memory.GPUS name with its form factor where the data sheet's bandwidth depends on it:
    "A100 80GB" -> "A100 SXM 80GB" (the PCIe part moves 1,935 GB/s, not 2,039)."""
    return name.replace(" ", " SXM ", 1) if "SXM" in GPUS[name].note else name


def plot_lengths(rows: list[dict], title: str = "Naive vs cached decoding"):
    """Tokens/s against generated length, one line per method (rows from `bench.sweep_lengths`)."""
    fig, ax = new_figure(7.0, 4.0)
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["new_tokens"])
        ax.plot([r["new_tokens"] for r in mine], [r["tokens_per_s"] for r in mine], "o-", label=method)
    ax.set_xscale("log", base=2)
    return _labelled(fig, "tokens generated", "tokens / s (median)", title)


def plot_step_time(fed_tokens, seconds, overhead_s: float, per_token_s: float,
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
    return _labelled(fig, "tokens fed through the model in this step", "ms", title)


def _labelled(fig, xlabel: str, ylabel: str, title: str):
    """Axis labels, a y axis from 0, the title and the legend of a one-axes timing figure."""
    ax = fig.axes[0]
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    return fig


def plot_roofline(bandwidths: dict[str, float], points: list[dict],
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


def plot_intensity(config, gpu_names: list[str], contexts: list[int], batches: list[int],
                   title: str | None = None):
    """Arithmetic intensity (FLOPs per byte) of a decode step against the batch size, one line per
    context length, with each GPU's ridge point (peak FP16 FLOP/s ÷ bandwidth) as a dashed line:
    below its ridge a step is memory-bound on that GPU."""
    fig, ax = new_figure(7.5, 4.2)
    for ctx in contexts:
        ys = [roofline.roofline(config, 1.0, ctx, b).arithmetic_intensity for b in batches]
        ax.plot(batches, ys, "o-", ms=3, label=f"context {ctx:,} tokens")
    for name in gpu_names:
        ridge = roofline.ridge_point(roofline.PEAK_FP16_FLOPS[name], GPUS[name].bandwidth_bytes_per_s)
        ax.axhline(ridge, ls="--", color="grey", lw=1)
        ax.annotate(f"ridge point, {gpu_label(name)}: {ridge:.0f} FLOPs/byte", (batches[0], ridge),
                    textcoords="offset points", xytext=(2, 3), fontsize=8, color="dimgrey")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("FLOPs per byte read")
    ax.set_title(title or f"{config.name}, FP16: arithmetic intensity of a decode step")
    ax.legend(fontsize=8, loc="lower right")
    return fig


# ---- exercise: the roofline of Llama-3-8B with INT8 weights on a T4 -------------------------------
# In FP16 its 16 GB of weights do not fit a T4 (chapter 03's planner, kvlab.memory.plan, refuses
# it); in INT8 they do.


ROOFLINE_EXERCISE = {"model": "llama-3-8b", "gpu": "T4 16GB", "dtype": "int8"}


def check_llama3_int8_t4_roofline(answer) -> Verdict:
    """Upper bound on tokens/s for Llama-3-8B with INT8 weights at batch 1 (short context) on a T4.
    The hints name the likely slips: seconds or milliseconds per token, the whole embedding table
    counted as read, the output layer left out (Llama-3 does not tie it to the embedding), bytes in
    GiB divided into GB/s, and the FP16 bound."""
    cfg, gpu = PRESETS[ROOFLINE_EXERCISE["model"]], GPUS[ROOFLINE_EXERCISE["gpu"]]
    dtype, bw = ROOFLINE_EXERCISE["dtype"], gpu.bandwidth_bytes_per_s
    bound = roofline.roofline(cfg, bw, context=0, dtype=dtype)
    hint = ("every decode step reads each weight once, except the input embedding, of which it "
            "looks up one row: bytes = roofline.decode_step_bytes(config, 0, 1, 'int8'); the T4 moves "
            "320 GB/s, so tokens/s ≤ bandwidth ÷ bytes per step.")
    if answer is None:
        return report(False, "", hint)
    output_layer = cfg.vocab_size * cfg.d_model          # one byte a weight in INT8
    named = [
        ((1 / bound.tokens_per_s,), 0.02,
         "that looks like seconds per token; the question asks for tokens/s."),
        ((1e3 / bound.tokens_per_s,), 0.02,
         "that looks like milliseconds per token; the question asks for tokens/s."),
        ((bw / memory.weight_bytes(cfg, dtype),), 0.01,
         f"you counted the whole embedding table ({cfg.vocab_size:,} rows) as read every step; a step "
         "looks up one row of it."),
        ((bw / (bound.bytes_per_step - output_layer), bw / (bound.bytes_per_step / memory.GiB * 1e9)), 0.005,
         f"too high: either you left out the output layer ({cfg.vocab_size:,} × {cfg.d_model:,}, read "
         "whole every step: Llama-3 does not tie it to the embedding), or you took the bytes in GiB "
         "against a bandwidth in GB/s (320 GB/s is 320 × 10⁹ bytes a second)."),
        ((roofline.roofline(cfg, bw, context=0, dtype="fp16").tokens_per_s,
          bw / memory.weight_bytes(cfg, "fp16")), 0.02,
         "that is the FP16 bound: INT8 weights take one byte each."),
    ]
    for values, rel, text in named:
        if any(close(answer, v, rel=rel) for v in values):
            return report(False, "", f"{text} In general: {hint}")
    return report(close(answer, bound.tokens_per_s, rel=0.02),
                  f"{bound.tokens_per_s:.1f} tokens/s at most: {bound.bytes_per_step / 1e9:.2f} GB read a "
                  f"step ÷ {bw / 1e9:.0f} GB/s, twice the FP16 bound (which would not fit the card)",
                  hint)
