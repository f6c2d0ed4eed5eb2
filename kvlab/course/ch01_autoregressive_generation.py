"""Chapter 01, One token at a time: the generation loop, the instruments that measure the naive
decoder (K/V rows through the projections, FLOPs of the written-out attention, CPU time per step),
its per-step costs and their growth, and the K/V-work exercise. `plot_step_times`, `count_kv_rows`
and `cpu_step_seconds` are reused by chapter 02."""

from __future__ import annotations

import contextlib

import matplotlib.pyplot as plt

from ..roofline import ForwardFlops, forward_flops  # noqa: F401  (the notebook calls ch01.forward_flops)
from .style import (
    CACHED_FACE,
    MODEL_FACE,
    NEW_FACE,
    PROMPT_FACE,
    Verdict,
    arrow,
    as_numbers,
    box,
    log_log,
    new_figure,
    numbers_hint,
    report,
)


def plot_generation_loop(tokens=("The", "KV", "cache", "saves", "work", "."), prompt_len: int = 2,
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
            face = (PROMPT_FACE if i < prompt_len else NEW_FACE) if fed else CACHED_FACE
            just_made = s > 0 and i == seen - 1  # last step's output, appended to the input
            box(ax, i * (w + gap), y, w, 0.7, tokens[i], face,
                edge="#C0504D" if just_made else "#333333", color="black" if fed else "#44546A")
        arrow(ax, (seen * (w + gap) - gap + 0.05, y + 0.35), (model_x - 0.05, y + 0.35))
        box(ax, model_x, y, 1.7, 0.7, "model", MODEL_FACE)
        arrow(ax, (model_x + 1.75, y + 0.35), (out_x - 0.05, y + 0.35))
        box(ax, out_x, y, w, 0.7, tokens[seen], NEW_FACE, edge="#C0504D")
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

    handles = [Patch(facecolor=PROMPT_FACE, edgecolor="#333333", label="prompt token, fed"),
               Patch(facecolor=NEW_FACE, edgecolor="#333333", label="generated token, fed")]
    if cached:
        handles.append(Patch(facecolor=CACHED_FACE, edgecolor="#333333", label="K, V read from the cache"))
    handles.append(Patch(facecolor="white", edgecolor="#C0504D", label="output, appended to the next input"))
    ax.legend(handles=handles, loc="lower left", fontsize=8, ncol=len(handles), frameon=False,
              bbox_to_anchor=(0, -0.02))
    return fig


# ---- instruments: what a forward pass really does -----------------------------------------------


@contextlib.contextmanager
def count_kv_rows(model):
    """Count the rows (tokens × sequences) that pass through each layer's fused Q/K/V projection,
    with a forward hook on every `block.attn.qkv`: `rows[layer]` gets one entry per forward pass.

    It measures what the model computes, not what the caller fed. Only forward passes through the
    model's modules are seen: `kvlab.fast.fast_generate` multiplies the weights directly and is not
    counted; every `generate` cache kind (naive, "dynamic", "static", …) is.
    """
    rows = [[] for _ in model.layers]
    hooks = [block.attn.qkv.register_forward_hook(
        lambda _module, inputs, _output, seen=seen: seen.append(inputs[0].shape[:-1].numel()))
        for block, seen in zip(model.layers, rows, strict=True)]
    try:
        yield rows
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def cpu_step_seconds(model):
    """Time every forward pass of `model` on this process's CPU clock (`time.process_time`): the
    list it yields gets one entry a pass. On a machine shared with other busy programs, wall time
    also counts the time they held the cores; CPU time does not. (CPU only: a GPU's work is not
    CPU time; `generate` times GPU steps with CUDA events.)"""
    import time

    seconds: list[float] = []
    started: list[float] = []
    hooks = [model.register_forward_pre_hook(lambda _module, _args: started.append(time.process_time())),
             model.register_forward_hook(
                 lambda _module, _args, _output: seconds.append(time.process_time() - started.pop()))]
    try:
        yield seconds
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def explicit_attention(model):
    """Inside this block `model` computes attention with the written-out `naive_attention`
    (Q·Kᵀ, softmax, ·V: matrix products `torch.utils.flop_counter` sees) instead of PyTorch's fused
    kernel, which the counter cannot look inside on the CPU. Same maths, up to float rounding. It
    swaps the model's attention at its seam (`kvlab.model.attend_with`)."""
    from ..attention import naive_attention
    from ..model import attend_with

    with attend_with(model, lambda _layer, q, k, v, mask: naive_attention(q, k, v, mask)):
        yield


def plot_step_costs(steps, panels):
    """Side-by-side panels of per-step costs, measured (markers) against theory (line).

    panels: list of (title, ylabel, measured values, theory, theory label), each optionally followed
    by its own step numbers (otherwise `steps`). theory: values, None, or a dict label -> values
    for several lines (then the theory label is unused).
    """
    import numpy as np

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), layout="constrained")
    for ax, panel in zip(np.atleast_1d(axes), panels, strict=True):
        title, ylabel, measured, theory, theory_label = panel[:5]
        xs = panel[5] if len(panel) > 5 else steps
        ax.plot(xs, measured, "o", ms=3, color="#C44E52", label="measured")
        lines = theory if isinstance(theory, dict) else {theory_label: theory}
        for (label, values), style in zip(lines.items(), ["-", "--", ":"], strict=False):
            if values is not None:
                ax.plot(xs, values, style, color="#4C72B0", alpha=0.7, label=label)
        ax.set_xlabel("step (new token number)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def plot_step_times(naive_seconds, cached_seconds,
                    title: str = "Per-step time: growing without a cache, nearly flat with one"):
    """Time of each step (as measured: CPU time with `cpu_step_seconds`, or `generate`'s own step
    times): naive grows with the sequence; cached stays nearly flat while its cache is small next to
    the rest of the step (chapter 02 times it at long contexts).

    Dots are single steps; the line is a running median over 9 steps, which a single slow step
    does not move much. Either series may be None.
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


def plot_growth_fit(n, values: dict, fits: dict, scale_at: int | None = None, ylabel: str | None = None):
    """Log-log plot (powers of two along x, as the chapter's other step-cost figures) of cumulative
    costs with their fitted power-law lines and exponents.

    n: the N values (or a dict label -> N values, when the series were measured at different N);
    values: label -> cumulative cost at each N; fits: label -> (exponent, log-intercept) from
    numpy.polyfit(log N, log cost, 1). Every series is scaled to 1 at the same N, `scale_at` (by
    default the largest N all series share), so their slopes compare on one picture.
    """
    import numpy as np

    ns_of = {label: np.asarray(n[label] if isinstance(n, dict) else n, dtype=float) for label in values}
    shared = set.intersection(*(set(ns.tolist()) for ns in ns_of.values()))
    scale_at = max(shared) if scale_at is None else scale_at
    if float(scale_at) not in shared:
        raise ValueError(f"scale_at={scale_at} must be an N every series was measured at; "
                         f"shared: {sorted(int(x) for x in shared)}")
    fig, ax = new_figure(6.0, 3.8)
    colors = ["#C44E52", "#4C72B0", "#55A868", "#8172B2"]
    styles = ["o", "s", "^", "D"]
    for (label, vals), color, marker in zip(values.items(), colors, styles, strict=False):
        ns, vals = ns_of[label], np.asarray(vals, dtype=float)
        unit = vals[list(ns).index(scale_at)]
        ax.plot(ns, vals / unit, marker, ms=5, color=color, alpha=0.8)
        slope, intercept = fits[label]
        ax.plot(ns, np.exp(intercept) * ns ** slope / unit, "-", color=color, alpha=0.6,
                label=f"{label}: exponent {slope:.2f}")
    every = np.concatenate(list(ns_of.values()))
    ref = np.geomspace(every.min(), every.max(), 20)
    ax.plot(ref, (ref / scale_at) ** 2, ":", color="gray", label="∝ N² (reference)")
    ax.plot(ref, ref / scale_at, "--", color="gray", lw=1, label="∝ N (reference)")
    ticks = sorted({int(x) for x in every})
    ylabel = ylabel or f"cumulative cost (1 at N = {int(scale_at)})"
    log_log(ax, "tokens generated, N", ylabel, "Naive decoding: total work grows like N²")
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    return fig


def plot_step_time_vs_length(lengths, seconds, flops):
    """Log-log: measured time of one naive step against the tokens it feeds, beside its FLOPs
    (scaled to meet the time at the longest length): where the two run parallel, time follows work;
    where the time lies above the FLOPs line, a fixed cost per step dominates."""
    import numpy as np

    lengths, seconds, flops = (np.asarray(v, dtype=float) for v in (lengths, seconds, flops))
    fig, ax = new_figure(6.0, 3.8)
    ax.plot(lengths, seconds * 1e3, "o-", color="#C44E52", label="measured time of one step")
    ax.plot(lengths, flops / flops[-1] * seconds[-1] * 1e3, "--", color="#4C72B0",
            label="FLOPs of the step (scaled to the last point)")
    log_log(ax, "tokens fed in the step, t", "time per step (ms, log scale)",
            "One naive step: fixed cost at short t, work at long t")
    return fig


# ---- exercise: K/V rows of the naive and the cached decoder -------------------------------------


KV_WORK_EXERCISE = {"prompt_len": 20, "new_tokens": 50}


def _kv_rows(prompt_len: int, new_tokens: int) -> tuple[int, int]:
    """K/V rows one layer computes, (naive, cached), counted through the K/V projection of a tiny
    model while kvlab.generate runs."""
    import torch

    from ..config import ModelConfig
    from ..generate import generate
    from ..model import Transformer

    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=1, n_kv_heads=1, d_ff=8, vocab_size=2,
                      max_seq_len=prompt_len + new_tokens)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(cfg).eval()
    prompt = [0] * prompt_len
    counted = []
    for cache in (None, "dynamic"):
        with count_kv_rows(model) as rows:
            generate(model, prompt, new_tokens, cache=cache)
        counted.append(sum(rows[0]))
    return counted[0], counted[1]


def check_kv_work(answer, prompt_len: int = KV_WORK_EXERCISE["prompt_len"],
                  new_tokens: int = KV_WORK_EXERCISE["new_tokens"]) -> Verdict:
    """Ch 01: K/V rows one layer computes to generate `new_tokens` tokens after a prompt of
    `prompt_len` tokens; answer = (naive_rows, cached_rows)."""
    p, n = prompt_len, new_tokens
    got = as_numbers(answer, 2)
    if got is None:
        return report(False, "", numbers_hint(answer, ("naive_rows", "cached_rows")))
    naive, cached = got
    want_naive, want_cached = _kv_rows(p, n)
    if naive == want_naive and cached == want_cached:
        return report(True, f"Right: naive {want_naive:,} rows, cached {want_cached:,} rows "
                      f"({want_naive / want_cached:.1f}× less work with the cache).", "")
    if naive != want_naive:
        if naive == n * (n + 1) // 2:
            hint = f"don't forget the prompt: the very first step already feeds all {p} prompt tokens."
        elif naive == sum(p + i for i in range(1, n + 1)):
            hint = ("one step too many: the last new token is picked but never fed back, so step i "
                    f"feeds {p} + i − 1 tokens for i = 1 … {n}.")
        else:
            hint = (f"without a cache step i feeds the whole sequence, {p} + i − 1 tokens, "
                    f"and computes K, V for all of them; add them up for i = 1 … {n}.")
        return report(False, "", hint)
    if cached == p + n:
        hint = "one too many: the last new token is picked but never fed back through the model."
    else:
        hint = (f"with a cache every token's K and V are computed once: the {p} prompt tokens in "
                "prefill, then one row per decode step.")
    return report(False, "", hint)
