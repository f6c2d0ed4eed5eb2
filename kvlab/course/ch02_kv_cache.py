"""Chapter 02, The KV cache: prefill and decode, the cached decoder's per-step time and speed-up,
growing vs pre-allocated storage, step time against context length, the cost bars (reused by
chapter 06), the position offset of a chunked prefill, and the two exercises (decode step, chunk
positions and mask), whose checkers run the learner's code as kvlab-tiny's cache under kvlab.oracle
so that a wrong answer is located (the first layer and position that differ)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from ..cache import DynamicKVCache
from . import style
from .style import (
    CACHED_FACE,
    MODEL_FACE,
    NEW_FACE,
    PROMPT_FACE,
    Verdict,
    arrow,
    box,
    dense_tensor,
    new_figure,
    report,
)


def plot_prefill_decode(prompt_len: int = 4, decode_steps: int = 3):
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
        box(ax1, 0.7 + i * cw, 5.6, cw * 0.9, 0.8, f"t{i + 1}", PROMPT_FACE)
        arrow(ax1, (0.7 + i * cw + cw * 0.45, 5.55), (0.7 + i * cw + cw * 0.45, 4.45))
    box(ax1, 0.7, 3.4, 8.6 - cw * 0.1, 1.0, f"model: Q, K, V for all {n} tokens\n"
        f"in one matrix product per layer", MODEL_FACE)
    arrow(ax1, (5.0, 3.35), (5.0, 2.25))
    for i in range(n):
        box(ax1, 0.7 + i * cw, 1.2, cw * 0.9, 1.0, f"K{i + 1}\nV{i + 1}", CACHED_FACE)
    ax1.text(5.0, 0.6, f"KV cache after prefill: {n} positions (every layer, every KV head)",
             ha="center", fontsize=9)
    arrow(ax1, (9.35, 3.9), (9.9, 3.9), color="#C0504D")
    ax1.text(9.7, 4.15, "first\ntoken", fontsize=8, color="#C0504D", ha="center")
    # Decode: one token per step.
    ax2.set_title("Decode: one new token per step, in a loop", fontsize=10)
    total = n + decode_steps
    box(ax2, 0.2, 5.6, 1.4, 0.8, "new token", NEW_FACE, edge="#C0504D")
    arrow(ax2, (1.65, 6.0), (2.35, 6.0))
    box(ax2, 2.4, 5.6, 2.6, 0.8, "its Q, K, V\n(one row each)", MODEL_FACE)
    slots = total + 1
    sw = 3.8 / slots
    for i in range(total):
        face = CACHED_FACE if i < n else ("#7FB3E0" if i == total - 1 else CACHED_FACE)
        label = f"{i + 1}" if slots <= 12 else ""
        box(ax2, 6.0 + i * sw, 3.9, sw * 0.9, 1.0, label, face, fontsize=7)
    arrow(ax2, (5.05, 6.0), (6.0 + (total - 0.55) * sw, 4.95), color="#4C72B0", rad=-0.2)
    ax2.text(7.4, 6.1, "append its K, V", fontsize=8, color="#4C72B0")
    ax2.text(6.0, 5.1, f"KV cache: {n} prefilled + {decode_steps} decoded",
             ha="left", fontsize=8, color="#4C72B0")
    arrow(ax2, (3.7, 5.55), (3.7, 3.45))
    ax2.text(3.8, 4.6, "Q of the new token", fontsize=8)
    box(ax2, 2.0, 2.4, 5.4, 1.0, "softmax(Q_new · K_cacheᵀ / √D) · V_cache\nattention over every "
        "cached position", "#E2F0D9")
    arrow(ax2, (6.0 + total * sw / 2, 3.85), (6.6, 3.45), color="#4C72B0")
    ax2.text(6.0 + total * sw / 2 + 0.1, 3.55, "all cached K, V", fontsize=8, color="#4C72B0")
    arrow(ax2, (4.7, 2.35), (4.7, 1.45))
    box(ax2, 3.6, 0.6, 2.2, 0.8, "next token", NEW_FACE, edge="#C0504D")
    arrow(ax2, (3.55, 1.0), (0.9, 5.55), color="#C0504D", rad=-0.3)
    ax2.text(0.3, 2.4, "repeat until\ndone", fontsize=8, color="#C0504D")
    return fig


def plot_speedup_vs_tokens(n_tokens, speedups, rows_ratio=None):
    """Measured total speed-up over the naive decoder vs tokens generated, with, if given, the ratio
    of K/V rows computed (the work the cache removes).

    speedups: label -> ratios, one row per N: either one value each, or the ratios of several
    repeats (then the median is drawn, with a bar from the lowest to the highest repeat).
    """
    import numpy as np

    fig, ax = new_figure(6.0, 3.8)
    n_tokens = [int(n) for n in n_tokens]
    shown = [1.0]  # every value drawn, for the y ticks
    for (label, ratios), color, marker in zip(speedups.items(), ["#4C72B0", "#55A868", "#8172B2"],
                                               "o^D", strict=False):
        ratios = np.asarray(ratios, dtype=float).reshape(len(n_tokens), -1)
        shown += ratios.ravel().tolist()
        mid = np.median(ratios, axis=1)
        spread = np.stack([mid - ratios.min(axis=1), ratios.max(axis=1) - mid])
        ax.errorbar(n_tokens, mid, yerr=spread if ratios.shape[1] > 1 else None, fmt=f"{marker}-",
                    color=color, capsize=3, label=label)
    if rows_ratio is not None:
        ax.plot(n_tokens, rows_ratio, "s--", color="gray", alpha=0.8,
                label="K/V rows: naive ÷ cached")
        shown += [float(r) for r in rows_ratio]
    ax.axhline(1, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(n_tokens, [str(n) for n in n_tokens])
    # Labelled ticks 1, 2, 3, 5, 10, 20, 50, …: a log axis alone labels only the powers of ten,
    # and the speed-ups (a few ×) and row ratios (tens ×) fall between them.
    finite = [v for v in shown if np.isfinite(v) and v > 0]
    ticks = [m * 10**e for e in range(-1, 7) for m in (1, 2, 3, 5)
             if min(finite) / 1.5 <= m * 10**e <= max(finite) * 1.5]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("tokens generated, N")
    ax.set_ylabel("time or rows, ÷ (log scale)")
    ax.set_title("Speed-up over the naive decoder: median of repeats, lowest–highest", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_copy_cost(seq_lens, copied: dict, allocations: dict | None = None):
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


def plot_step_time_vs_context(contexts, seconds: dict, read_bytes=None):
    """Log-log: measured time of one cached decode step against the positions in the cache, one
    line per cache kind; with read_bytes, the K/V bytes the step reads (scaled to meet the first
    series at the longest context), the part of the step that grows."""
    import numpy as np

    fig, ax = new_figure(6.0, 3.8)
    colors = ["#4C72B0", "#C44E52", "#55A868"]
    for (label, values), color in zip(seconds.items(), colors, strict=False):
        ax.plot(contexts, np.asarray(values) * 1e3, "o-", color=color, label=label)
    if read_bytes is not None:
        first = np.asarray(next(iter(seconds.values())), dtype=float)
        scaled = np.asarray(read_bytes, dtype=float) / read_bytes[-1] * first[-1] * 1e3
        ax.plot(contexts, scaled, "--", color="gray", label="K/V bytes read (scaled)")
    style.log_log(ax, "positions in the cache, S", "time of one decode step (ms, log scale)",
            "A cached step is flat only while the cache is small")
    return fig


def plot_offset_mask(start: int, length: int, mask=None):
    """The attention mask of a chunk of `length` tokens fed after `start` cached ones: rows are the
    chunk's queries (their RoPE positions start … start + length − 1), columns every key, cached
    and new. True (dark) where the query may look. `mask` defaults to the right one."""
    import numpy as np

    from ..attention import causal_mask
    from ..validate import integer

    start, length = integer("start", start, low=0), integer("length", length)
    mask = causal_mask(length, start + length) if mask is None else mask
    fig, ax = new_figure(min(9.0, 2.0 + 0.42 * (start + length)), 1.4 + 0.42 * length)
    ax.imshow(np.asarray(mask, dtype=float), cmap="Blues", vmin=-0.25, vmax=1.1, aspect="equal")
    ax.set_xticks(np.arange(start + length + 1) - 0.5, minor=True)  # white lines between the cells
    ax.set_yticks(np.arange(length + 1) - 0.5, minor=True)
    ax.grid(False)
    ax.grid(which="minor", color="white", lw=1.5)
    ax.tick_params(which="minor", length=0)
    ax.axvline(start - 0.5, color="#C0504D", lw=2.5)
    ax.set_xticks(range(start + length), [str(i) for i in range(start + length)], fontsize=8)
    ax.set_yticks(range(length), [str(start + i) for i in range(length)], fontsize=8)
    ax.set_xlabel("key position (left of the red line: already in the cache)")
    ax.set_ylabel("query position")
    ax.set_title(f"Chunk of {length} after {start} cached: mask ({length}, {start + length}); "
                 "dark = may look", fontsize=10)
    return fig


def plot_cost_bars(labels, values, ylabel: str, title: str = "", fmt: str = "{:,.0f}"):
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


# ---- kvlab.oracle on kvlab-tiny: where a learner's cache first goes wrong ----------------------


ORACLE_TEXT = "The KV cache keeps the keys and values of every token."  # kvlab-tiny's bytes to feed


class DecodeStepCache(DynamicKVCache):
    """A cache whose decode steps are a learner's `fn(q_new, k_new, v_new, k_cache, v_cache) ->
    (out, k_cache, v_cache)`: the prefill is stored by kvlab, and every later token's K and V go
    through `fn`, whose returned caches are what the layer attends over and what the cache keeps.
    (The model hands each layer's queries over first: `needs_queries`.)"""

    needs_queries = True

    def __init__(self, config, fn):
        super().__init__(config)
        self.fn, self.queries = fn, {}

    def receive_queries(self, layer: int, q) -> None:
        self.queries[layer] = q

    def update(self, layer, k, v):
        if self.keys[layer] is None or k.shape[2] != 1:  # the prefill: kvlab's own update
            return super().update(layer, k, v)
        result = self.fn(self.queries[layer].clone(), k.clone(), v.clone(), self.keys[layer].clone(),
                         self.values[layer].clone())
        _, self.keys[layer], self.values[layer] = result
        self.lengths[layer] = self.keys[layer].shape[2]
        return self.keys[layer], self.values[layer]


class ChunkCache(DynamicKVCache):
    """A cache fed in chunks whose RoPE positions and attention mask come from a learner's
    `fn(start, length) -> (positions, mask)` instead of kvlab's own rule."""

    def __init__(self, config, fn):
        super().__init__(config)
        self.fn, self.mask = fn, None

    def rope_positions(self, t: int, device=None):
        positions, self.mask = self.fn(self.seq_len, t)
        return positions.to(device=device, dtype=torch.long)

    def key_positions(self, layer: int):
        return torch.arange(self.lengths[layer], device=self.device)  # every key, in order

    def visible(self, query_positions, key_positions, layer=None):
        return self.mask.to(key_positions.device)


def oracle_finding(cache, feeds) -> str:
    """Feed kvlab-tiny the bytes of ORACLE_TEXT through `cache`, `feeds` tokens a pass, under
    kvlab.oracle (after every pass it recomputes the whole stream without a cache and compares keys,
    values and logits, layer by layer); return '' when it finds no difference, else where the first
    one is. An error of the learner's code inside the cache propagates."""
    from .. import oracle
    from ..generate import encode_bytes
    from .ch02_decode_explorer import _tiny

    model = _tiny()
    ids = torch.tensor([encode_bytes(ORACLE_TEXT)[:sum(feeds)]])
    check, start = oracle.Oracle(model, cache), 0
    for n in feeds:
        check.feed(ids[:, start:start + n])
        start += n
        if check.report.first is not None:
            return str(check.report.first)
    return ""


def _after(located: str, hint: str) -> str:
    """The oracle's finding, then the hint as a sentence of its own."""
    return located + (hint[:1].upper() + hint[1:] if located else hint)


# ---- exercise: the decode step of one attention layer -------------------------------------------


DECODE_ORACLE_FEEDS = (12, 1, 1, 1, 1, 1, 1)  # a 12-token prefill, then 6 decode steps


def check_decode_step(fn) -> Verdict:
    """Ch 02: `fn(q_new, k_new, v_new, k_cache, v_cache) -> (out, k_cache, v_cache)`, the decode step
    of one attention layer, compared with kvlab's cache and attention on random inputs; its cache
    part also drives kvlab-tiny under kvlab.oracle, which names the first layer and position where
    the cache differs from recomputing everything without one.

    Shapes: q_new (B, H, 1, D); k_new, v_new (B, H, 1, D); caches (B, H, S, D), S may be 0;
    out (B, H, 1, D); the returned caches hold S + 1 positions.
    """
    if not callable(fn):
        return report(False, "", "pass your function itself: ch02.check_decode_step(decode_step).")
    results = []
    for case in _decode_cases():
        try:
            result = fn(*(t.clone() for t in case[0]))
        except Exception as exc:  # report the learner's error instead of raising it
            return report(False, "", f"your function raised {type(exc).__name__}: {exc}")
        hint = _decode_form_hint(result, case)
        if hint:
            return report(False, "", hint)
        results.append((result, case))
    cache_hint = next(filter(None, (_decode_cache_hint(r, case) for r, case in results)), "")
    try:
        where = oracle_finding(DecodeStepCache(_oracle_config(), fn), DECODE_ORACLE_FEEDS)
    except Exception as exc:  # noqa: BLE001 - a learner's bug is a hint, never a traceback
        cfg = _oracle_config()
        return report(False, "", f"run as kvlab-tiny's cache (B = 1, H = {cfg.n_heads}, D = {cfg.head_dim}), "
                      f"your function raised {type(exc).__name__}: {exc}")
    if where or cache_hint:
        located = (f"kvlab.oracle ran kvlab-tiny with your step as its cache (a {DECODE_ORACLE_FEEDS[0]}-"
                   f"token prefill, then one token a step) and found the first difference: {where}. "
                   ) if where else ""
        return report(False, "", _after(located, cache_hint or _APPEND_HINT))
    for (out, _, _), case in results:
        hint = _decode_output_hint(out, case)
        if hint:
            return report(False, "", hint)
    return report(True, "Your decode step matches kvlab's cache + attention on random inputs, and "
                  "kvlab.oracle finds kvlab-tiny, run with it as its cache, identical to recomputing "
                  "without one at every layer and position.", "")


_APPEND_HINT = ("append the new K and V at the end of the caches (old positions first, the new one "
                "last), K to K and V to V.")


def _oracle_config():
    from .ch02_decode_explorer import _tiny

    return _tiny().config


def _decode_cases():
    """Random decode-step inputs and kvlab's answer: ((q, k, v, k_cache, v_cache), k_all, v_all, out)
    for a few shapes, including an empty cache."""
    from ..attention import naive_attention
    from ..config import ModelConfig

    gen = torch.Generator().manual_seed(0)
    cases = []
    for batch, heads, cached, dim in [(1, 2, 5, 8), (2, 4, 11, 16), (1, 1, 0, 4)]:
        q, k, v = (torch.randn(batch, heads, 1, dim, generator=gen) for _ in range(3))
        kc, vc = (torch.randn(batch, heads, cached, dim, generator=gen) for _ in range(2))
        cache = DynamicKVCache(ModelConfig(n_layers=1, d_model=heads * dim, n_heads=heads,
                                           n_kv_heads=heads, d_ff=8, vocab_size=2, max_seq_len=64))
        if cached:
            cache.update(0, kc, vc)
        k_all, v_all = cache.update(0, k, v)
        cases.append(((q, k, v, kc, vc), k_all, v_all, naive_attention(q, k_all, v_all)))
    return cases


def _decode_form_hint(result, case) -> str:
    """What is wrong with the form of a decode step's result (a triple of dense tensors of the
    inputs' dtype, device and shapes), or ''."""
    (q, *_), k_all, v_all, want = case
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        return "return three things: (out, k_cache, v_cache)."
    if not all(isinstance(t, torch.Tensor) for t in result):
        return "out, k_cache and v_cache must all be tensors."
    if not all(dense_tensor(t) for t in result):
        return "return ordinary dense tensors (not sparse, nested or meta ones)."
    wrong = [t for t in result if t.dtype != q.dtype or t.device != q.device]
    if wrong:
        return (f"keep the inputs' dtype and device ({q.dtype} on {q.device}): got {wrong[0].dtype} on "
                f"{wrong[0].device}; a float64 value (e.g. from numpy) in the arithmetic changes the dtype.")
    out, k_cache, v_cache = result
    if k_cache.shape != k_all.shape or v_cache.shape != v_all.shape:
        return (f"the caches should grow by one position along dim 2: expected {tuple(k_all.shape)}, "
                f"got {tuple(k_cache.shape)}; use torch.cat([k_cache, k_new], dim=2).")
    if out.shape != want.shape:
        return f"out should have the shape of q_new, {tuple(want.shape)}; got {tuple(out.shape)}."
    return ""


def _decode_cache_hint(result, case) -> str:
    """How the returned caches differ from kvlab's (swapped, prepended), or '' when they are equal."""
    (_, k, v, kc, vc), k_all, v_all, _ = case
    _, k_cache, v_cache = result
    if torch.equal(k_cache, k_all) and torch.equal(v_cache, v_all):
        return ""
    if torch.equal(k_cache, v_all) and torch.equal(v_cache, k_all):
        return "K and V are swapped: append k_new to the K cache and v_new to the V cache."
    if torch.equal(k_cache, torch.cat([k, kc], dim=2)):
        return ("the new position went first: append it at the end, torch.cat([k_cache, k_new], dim=2), "
                "so that position i stays row i.")
    return _APPEND_HINT


def _decode_output_hint(out, case) -> str:
    """What is wrong with the attention output, or '' when it matches kvlab's."""
    import math

    (q, *_), k_all, v_all, want = case
    if torch.allclose(out, want, atol=1e-5, rtol=1e-5):
        return ""
    dim = q.shape[-1]
    if torch.allclose(out, v_all[:, :, :1], atol=1e-5):
        return ("your step attends to the first cached position only: that is what "
                "F.scaled_dot_product_attention(q, k, v, is_causal=True) does with one query, because "
                "its causal mask is aligned to the top left (the query counts as position 0). The one new "
                "query may see every cached position: use no mask.")
    if torch.allclose(out, torch.softmax(q @ k_all.transpose(-2, -1), -1) @ v_all, atol=1e-5):
        return f"scale the scores by 1/√D, D = head_dim (here 1/√{dim} = {1 / math.sqrt(dim):.3f})."
    return ("attend with the new query over the whole updated cache: softmax(q_new @ k_cacheᵀ / √D) "
            "@ v_cache, softmax over the last dimension.")


# ---- exercise: the positions and mask of a prefill chunk ----------------------------------------


CHUNK_CASES = [(0, 4), (5, 3), (8, 1), (3, 6)]  # (start, length): cached positions, chunk length
CHUNK_ORACLE_FEEDS = (4, 3, 1, 6)  # kvlab-tiny prefilled in chunks: starts 0, 4, 7, 8


def check_chunk_prefill(fn) -> Verdict:
    """Ch 02: `fn(start, length) -> (positions, mask)` for a chunk of `length` tokens fed after `start`
    cached ones: the chunk's RoPE positions, a 1-D integer tensor (length,), and its attention mask,
    a bool tensor (length, start + length), True where a query may look at a key. Once the form is
    right, kvlab-tiny is prefilled in chunks with it under kvlab.oracle, which names the first
    layer and position that differ from feeding everything at once."""
    from ..attention import causal_mask

    if not callable(fn):
        return report(False, "", "pass your function itself: ch02.check_chunk_prefill(chunk_inputs).")
    value_hint = ""
    for start, length in CHUNK_CASES:
        want_pos, want_mask = torch.arange(start, start + length), causal_mask(length, start + length)
        try:
            result = fn(start, length)
        except Exception as exc:  # report the learner's error instead of raising it
            return report(False, "", f"your function raised {type(exc).__name__}: {exc}")
        hint = _chunk_form_hint(result, start, length)
        if hint:
            return report(False, "", hint)
        positions, mask = result
        try:
            value_hint = value_hint or _position_hint(positions, want_pos, start, length) or _mask_hint(
                mask, want_mask, start, length)
        except Exception as exc:  # unusual tensors the form check let through: a hint, never a traceback
            return report(False, "", f"could not compare your tensors ({type(exc).__name__}); return "
                          "ordinary dense tensors on the CPU or the model's device.")
    try:
        where = oracle_finding(ChunkCache(_oracle_config(), fn), CHUNK_ORACLE_FEEDS)
    except Exception as exc:  # noqa: BLE001 - a learner's bug is a hint, never a traceback
        return report(False, "", value_hint or f"prefilling kvlab-tiny with your positions and masks "
                      f"raised {type(exc).__name__}: {exc}")
    if where or value_hint:
        sizes = ", ".join(map(str, CHUNK_ORACLE_FEEDS[:-1])) + f" and {CHUNK_ORACLE_FEEDS[-1]}"
        located = (f"kvlab.oracle prefilled kvlab-tiny in chunks of {sizes} tokens with your positions "
                   f"and masks and found the first difference: {where}. ") if where else ""
        return report(False, "", _after(located, value_hint or "query start + i sees keys 0 … start + i: "
                                        "causal_mask(length, start + length) builds exactly that."))
    return report(True, "Right: the chunk's positions continue after the cache, and each of its "
                  "tokens sees every cached position, the chunk up to itself, and nothing later; "
                  "kvlab.oracle finds kvlab-tiny prefilled in chunks with them identical to feeding "
                  "everything at once.", "")


def _chunk_form_hint(result, start: int, length: int) -> str:
    """What is wrong with the form of (positions, mask): two dense tensors, integer positions of
    shape (length,), a bool mask of shape (length, start + length); '' when the form is right."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return "return two things: (positions, mask)."
    positions, mask = result
    if mask is None:
        return ("return a mask even when every entry is True: for length 1 it is one row of start + 1 "
                "Trues (kvlab's model skips it on the decode path; the exercise asks for it).")
    if not isinstance(positions, torch.Tensor) or not isinstance(mask, torch.Tensor):
        return ("positions and mask must both be tensors (torch.arange, kvlab.attention.causal_mask or a "
                "comparison of two aranges).")
    if not (dense_tensor(positions) and dense_tensor(mask)):
        return "return ordinary dense tensors (not sparse, nested or meta ones)."
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        return f"positions should be integers (e.g. torch.arange); got dtype {positions.dtype}."
    if positions.shape != (length,):
        return (f"positions should hold one entry per chunk token, shape ({length},); got "
                f"{tuple(positions.shape)}.")
    if mask.dtype != torch.bool:
        return f"the mask should be a bool tensor (True = may look); got dtype {mask.dtype}."
    if mask.shape != (length, start + length):
        extra = (" The keys are the cached positions plus the chunk's, so it needs start + length "
                 "columns.") if mask.shape == (length, length) and start else ""
        return (f"with start={start}, length={length} the mask has shape {(length, start + length)}; got "
                f"{tuple(mask.shape)}.{extra}")
    return ""


def _position_hint(positions, want, start: int, length: int) -> str:
    """A hint about the values of the RoPE positions, or '' when they are right."""
    if torch.equal(positions.cpu(), want - start) and start:
        return (f"the positions restart at 0, as if the chunk were the whole sequence: after {start} "
                f"cached tokens the chunk sits at positions {start} … {start + length - 1}, and RoPE "
                "must rotate its Q and K by those (the classic cache bug).")
    if not torch.equal(positions.cpu(), want):
        return (f"with start={start}, length={length} the positions are {want.tolist()}: the chunk "
                "continues the sequence where the cache ends.")
    return ""


def _mask_hint(mask, want, start: int, length: int) -> str:
    """A hint about the values of the attention mask, or '' when it is right."""
    mask = mask.cpu()
    if torch.equal(mask, ~want):
        return "the mask is inverted: True means a query MAY look at that key."
    if bool(mask.all()) and not bool(want.all()):
        return "a chunk token must not see the tokens after it in the same chunk: mask them out."
    top_left = torch.ones(length, start + length, dtype=torch.bool).tril()
    if start and torch.equal(mask, top_left):
        return ("this causal mask is aligned to the top left, as F.scaled_dot_product_attention(..., "
                "is_causal=True) builds it for a non-square score matrix: the chunk's first query "
                f"would count as position 0 and see key 0 only. Its queries sit at positions {start} … "
                f"{start + length - 1}: align the mask to the bottom right (query start + i sees keys "
                "0 … start + i).")
    diagonal = torch.arange(length)[:, None] + start == torch.arange(start + length)[None, :]
    if torch.equal(mask, want & ~diagonal):
        return "each token may look at itself too (the diagonal of the chunk is True)."
    if not bool(mask[:, :start].all()):
        return "every token of the chunk may look at every cached position (all True left of start)."
    if not torch.equal(mask, want):
        return (f"query start + i sees keys 0 … start + i: causal_mask({length}, {start + length}) "
                "builds exactly that.")
    return ""


# The decode explorer (Play through a cached decode) lives in its own module; the notebook reaches it here.
from .ch02_decode_explorer import (  # noqa: E402, F401
    DECODE_PROMPT,
    DECODE_STEPS,
    OLD_FACE,
    decode_explorer,
    decode_frames,
    decode_readout,
    plot_decode_frame,
)
