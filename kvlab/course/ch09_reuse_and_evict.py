"""Chapter 09, Reuse and evict: the measurements on kvlab-tiny (computed once, then reused by the plots
and the cache-budget explorer), the figures, the two explorers and the exercise checkers."""

from __future__ import annotations

from functools import lru_cache

import matplotlib.pyplot as plt

from .. import validate
from ..config import PRESETS
from ..memory import format_bytes, kv_bytes_per_token
from .style import (
    Verdict,
    as_number,
    close,
    explorer_plot,
    labelled_slider,
    new_figure,
    numeric,
    report,
    shown,
)

POLICY_COLORS = {"full": "#333333", "window": "#C44E52", "sinks + window": "#4C72B0",
                 "heavy hitters": "#55A868"}

# ---- measurements on kvlab-tiny ---------------------------------------------------------------------

STREAM_LEN = 256           # bytes a stream: kvlab-tiny's training windows, so no distance is untrained
BUDGETS = (16, 32, 64, 128)
SINKS = 4
STREAMS = 16               # streams measured (a batch): enough for standard errors, quick on a CPU
POSITIONS = "original"     # every policy keeps keys at their place in the text: a fair comparison


def held_out_streams(length: int = STREAM_LEN, streams: int = STREAMS, device="cpu"):
    """The first `streams` consecutive pieces of `length` bytes of the held-out text: (B, length)."""
    import torch

    from ..generate import encode_bytes
    from ..pretrained import corpus_text

    validate.integer("length", length, low=2)
    ids = torch.tensor(encode_bytes(corpus_text("held_out")), device=device)
    validate.integer("streams", streams)
    n = min(ids.numel() // length, streams)
    if n == 0:
        raise ValueError(f"length={length} is longer than the held-out text ({ids.numel()} bytes)")
    return ids[:n * length].view(n, length)


@lru_cache(maxsize=4)
def budget_measurements(stream_len: int = STREAM_LEN, budgets: tuple = BUDGETS,
                        streams: int = STREAMS) -> dict:
    """Held-out loss of kvlab-tiny for every policy of kvlab.eviction.POLICIES and budget, all with
    keys at their original positions (computed once a session), with the cache bytes a sequence.
    `per_stream[policy][i]`: (B, T - 1) losses; `se[policy][i]`: the paired standard error of the
    policy's loss minus the full cache's, over the streams."""
    import torch

    from ..eviction import loss_vs_budget, paired_difference
    from ..pretrained import load

    model = load("kvlab-tiny")
    ids = held_out_streams(stream_len, streams)
    with torch.inference_mode():
        per_stream = loss_vs_budget(model, ids, list(budgets), sinks=SINKS, positions=POSITIONS,
                                    per_stream=True)
    full = per_stream["full"][0]
    diffs = {p: [paired_difference(c, full) for c in cs] for p, cs in per_stream.items()}
    per_token = kv_bytes_per_token(model.config, "fp32")
    return {"budgets": list(budgets), "stream_len": stream_len, "streams": ids.shape[0],
            "losses": {p: [float(c.mean()) for c in cs] for p, cs in per_stream.items()},
            "curves": {p: [c.mean(0) for c in cs] for p, cs in per_stream.items()},
            "per_stream": per_stream, "se": {p: [d[1] for d in ds] for p, ds in diffs.items()},
            "bytes_per_token": per_token}


def plot_budget_curve(measurements: dict, title: str = "Held-out loss against cache budget (kvlab-tiny)",
                      current: tuple[str, int] | None = None):
    """Loss against budget, one line per policy; "full" as a horizontal line at its one value
    (it holds the whole stream). `current` = (policy, budget) is marked."""
    fig, ax = new_figure(7.5, 3.6)
    budgets, losses = measurements["budgets"], measurements["losses"]
    for policy, values in losses.items():
        color = POLICY_COLORS.get(policy, None)
        if policy == "full":
            ax.axhline(values[0], color=color, ls="--", lw=1.2,
                       label=f"full cache ({measurements['stream_len']} positions)")
        else:
            ax.errorbar(budgets, values, yerr=measurements["se"][policy], fmt="o-", capsize=3,
                        color=color, label=policy)
    if current is not None:
        policy, budget = current
        y = losses[policy][budgets.index(budget)]
        ax.plot([budget], [y], "o", ms=16, mfc="none", mec="black", mew=2, label="current setting")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("cache budget (positions kept per sequence)")
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_title(title + " ± paired standard error", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_budget(policy: str = "sinks + window", budget: int = 64, measurements: dict | None = None):
    """The cache-budget explorer's picture and readout: (Figure, text). `measurements` defaults to
    `budget_measurements()` (computed once, then reused)."""
    from ..eviction import POLICIES

    m = budget_measurements() if measurements is None else measurements
    validate.choice("policy", policy, POLICIES)
    validate.choice("budget", budget, m["budgets"])
    i = m["budgets"].index(budget)
    loss, se = m["losses"][policy][i], m["se"][policy][i]
    full = m["losses"]["full"][0]
    kept = m["stream_len"] if policy == "full" else budget
    llama = PRESETS["llama-3-8b"]
    fig = plot_budget_curve(m, current=(policy, budget))
    text = "\n".join([
        f"{policy}: {kept} of {m['stream_len']} positions kept per sequence"
        + ("" if policy == "full" else " (storage fixed, whatever the stream length)"),
        f"memory a sequence: kvlab-tiny {format_bytes(kept * m['bytes_per_token'])} (fp32); "
        f"Llama-3-8B would hold {format_bytes(kept * kv_bytes_per_token(llama, 'fp16'))} (fp16)",
        f"held-out loss {loss:.3f} nats/byte; full cache {full:.3f} ({loss - full:+.3f} ± {se:.3f}, "
        f"paired standard error over {m['streams']} streams of {m['stream_len']} bytes)",
    ])
    return fig, text


def cache_budget_explorer():
    """Policy × budget → memory and measured held-out loss, on the curve of all budgets."""
    import ipywidgets as w

    from ..eviction import POLICIES

    budgets = budget_measurements()["budgets"]   # measured once, here, before the first draw
    style = {"description_width": "90px"}
    policy = w.Dropdown(options=list(POLICIES), value="sinks + window", description="policy", style=style)
    budget = w.SelectionSlider(options=[(str(b), b) for b in budgets], value=budgets[len(budgets) // 2],
                               description="budget",
                               style=style, layout=w.Layout(width="420px"), continuous_update=False)
    readout = w.HTML()
    readout.add_class("kvlab-readout")
    out = explorer_plot(plot_budget, {"policy": policy, "budget": budget}, readout)
    box = w.VBox([w.HBox([policy, budget]), out, readout])
    box.add_class("kvlab-cache-budget-explorer")
    return box


def plot_first_positions_attention(maps, first: int = 16, skip: int = 64):
    """Mean attention weight each of the first `first` key positions receives from queries at
    positions >= skip, per layer (lines), next to what uniform attention would give."""
    import torch

    fig, ax = new_figure(7.0, 3.8)
    t = maps[0].shape[-1]
    for layer, a in enumerate(maps):
        ax.plot(range(first), a[:, :, skip:, :first].mean(dim=(0, 1, 2)).tolist(), "o-", ms=3,
                label=f"layer {layer}")
    uniform = (1 / torch.arange(skip + 1, t + 1).float()).mean().item()
    ax.axhline(uniform, color="gray", ls="--", label="uniform attention over the context")
    ax.set_yscale("log")
    ax.set_xlabel("key position")
    ax.set_ylabel("mean attention weight received")
    ax.set_title(f"Attention the first positions receive (queries at {skip}..{t - 1})", fontsize=10)
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.18))  # below: off the points
    return fig


def plot_loss_along_stream(curves: dict, window: int | None = None, trained: int | None = None):
    """Per-position loss (smoothed) along the stream, one line per label -> 1-D values."""
    import numpy as np

    fig, ax = new_figure(7.5, 3.8)
    for label, values in curves.items():
        v = np.asarray(values, dtype=float)
        smooth = np.convolve(v, np.ones(16) / 16, mode="valid")
        ax.plot(np.arange(len(smooth)) + 16, smooth, label=label,
                color=POLICY_COLORS.get(label.split(" (")[0]))
    for x, text in ((window, "window full"), (trained, "training context")):
        if x:
            ax.axvline(x, color="gray", ls=":", lw=1)
            ax.text(x, ax.get_ylim()[1], f" {text}", fontsize=8, va="top", color="gray")
    ax.set_xlabel("position in the stream (bytes)")
    ax.set_ylabel("loss (nats/byte, 16-byte mean)")
    ax.legend(fontsize=8)
    return fig


# ---- the real model: SmolLM2-135M-Instruct -----------------------------------------------------

REAL_STREAM = 145     # tokens a stream: the budget's 48 + 1 before the first eviction, then 96 after it
REAL_STREAMS = 2
REAL_BUDGET = 48      # positions kept by every bounded policy
REAL_BLOCK = 16       # positions a unit of the paired standard error


def real_streams(tokenizer, length: int = REAL_STREAM, streams: int = REAL_STREAMS, device="cpu"):
    """Consecutive pieces of `length` tokens of the course's handwritten held-out documents (English
    prose kvlab-tiny never trained on), tokenized by the real model's tokenizer: (B, length)."""
    import torch

    from ..pretrained import corpus_text

    length, streams = validate.integer("length", length, low=2), validate.integer("streams", streams)
    ids = tokenizer(corpus_text("held_out", source="handwritten"))["input_ids"]
    if len(ids) < length * streams:
        raise ValueError(f"{streams} streams of length={length} need {length * streams} tokens; the "
                         f"held-out documents have {len(ids)}")
    return torch.tensor(ids[:length * streams], device=device).view(streams, length)


def sink_mass(maps, skip: int = 16):
    """Mean attention weight the first key (position 0) receives from the queries at positions
    >= skip, per layer and head: (L, H), from kvlab.eviction.attention_maps."""
    import torch

    validate.integer("skip", skip, low=0, high=maps[0].shape[-1] - 1)
    return torch.stack([a[:, :, skip:, 0].mean(dim=(0, 2)) for a in maps]).float()


def plot_sink_heatmap(mass, uniform: float, title: str = "SmolLM2-135M: attention on the first token"):
    """Heat map of `sink_mass` (layers × heads), with the uniform-attention share in the title."""
    fig, ax = new_figure(6.0, 5.2)
    im = ax.imshow(mass.cpu().numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1,
                   origin="lower")
    fig.colorbar(im, ax=ax, label="mean attention weight on token 0")
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(mass.shape[1]))
    ax.grid(False)
    ax.set_title(f"{title}\n(uniform attention would give it {uniform:.1%})", fontsize=10)
    return fig


def streaming_measurements(model, ids, budget: int = REAL_BUDGET, sinks: int = SINKS,
                           block: int = REAL_BLOCK) -> dict:
    """StreamingLLM's comparison on `ids` (B, T): per-position losses of every policy of
    kvlab.eviction.POLICIES at one budget, keys at their original positions, and for each policy the
    mean loss minus the full cache's over the queries at positions >= budget (each of them misses a
    key a bounded cache has evicted), with its paired standard error over blocks of `block` positions."""
    import math

    import torch

    from ..eviction import loss_vs_budget, paired_difference

    budget = validate.integer("budget", budget, low=sinks + 1, high=ids.shape[1] - 2)
    with torch.inference_mode():
        per = {p: v[0] for p, v in loss_vs_budget(model, ids, [budget], sinks=sinks,
                                                   positions="original", per_stream=True).items()}
    # Loss index i is the query at position i, which sees i + 1 keys: all of them while i < budget.
    start = budget
    rows = {}
    for policy, losses in per.items():
        loss = losses[:, start:].mean().item()
        diff, se, units = paired_difference(losses, per["full"], start, block)
        rows[policy] = {"loss": loss, "perplexity": math.exp(loss), "minus full": diff, "se": se,
                        "units": units}
    return {"per_position": per, "rows": rows, "budget": budget, "sinks": sinks, "block": block,
            "start": start, "streams": ids.shape[0], "length": ids.shape[1]}


def plot_streaming(result: dict, title: str = "SmolLM2-135M: loss minus the full cache's"):
    """The paired loss differences of `streaming_measurements`, one bar a bounded policy, ± 2 SE."""
    fig, ax = new_figure(6.5, 3.4)
    names = [p for p in result["rows"] if p != "full"]
    diffs = [result["rows"][p]["minus full"] for p in names]
    errors = [2 * result["rows"][p]["se"] for p in names]
    ax.bar(names, diffs, yerr=errors, capsize=4, color=[POLICY_COLORS[p] for p in names])
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel("nats per token (± 2 SE)")
    ax.set_title(f"{title}, {result['budget']} positions kept", fontsize=10)
    return fig


def chat_prompts(tokenizer, system: str, questions, replies) -> list[list[int]]:
    """The token ids of each turn's prompt of a chat: the chat template rendered over the system
    prompt, every earlier question and reply, and the new question, with the generation prompt.
    `system` may be a function of the turn number (a system prompt that changes every turn)."""
    prompts = []
    for turn, question in enumerate(questions):
        text = system(turn) if callable(system) else system
        messages = [{"role": "system", "content": text}]
        for q, r in zip(questions[:turn], replies[:turn], strict=True):
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": r}]
        messages.append({"role": "user", "content": question})
        prompts.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                          tokenize=True, return_dict=False)))
    return prompts


def chat_hits(prompts, generated, block_size: int = 16, num_blocks: int = 4096) -> list[int]:
    """Prompt tokens each turn finds in a prefix index (block bookkeeping only, as
    kvlab.prefix.run_request does it): a turn looks up its prompt, then indexes the tokens whose K/V
    it computed: the prompt and every generated token but the last (sampled, never fed)."""
    from ..cache.prefix import PrefixBlockManager

    m = PrefixBlockManager(num_blocks, block_size)
    hits = []
    for prompt, new in zip(prompts, generated, strict=True):
        seq = m.new_sequence(prompt)
        hits.append(seq.cached_tokens)
        for token in new[:-1]:
            m.append(seq, token)
        m.register(seq)
        m.free(seq)
    return hits


# ---- prefix sharing -----------------------------------------------------------------------------

SHARING_MODEL = "llama-3-8b"
SHARING_USERS = (1, 2, 4, 8, 16, 32, 64, 128)
SHARING_PREFIX = (0, 256, 512, 1024, 2048, 4096)
SHARING_SUFFIX = (16, 64, 256, 1024)


def plot_sharing(users: int = 16, prefix_len: int = 1024, suffix_len: int = 64, block_size: int = 16,
                 model: str = SHARING_MODEL):
    """Blocks and prefill tokens for `users` requests sharing a prefix, without and with sharing:
    (Figure, text)."""
    from ..prefix import prefill_flops, sharing

    validate.choice("model", model, PRESETS)
    config = PRESETS[model]
    s = sharing(users, prefix_len, suffix_len, block_size, config, "fp16")
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.6), layout="constrained")
    for ax, (title, alone, shared) in zip(axes, (
            ("KV blocks held", s.blocks_alone, s.blocks_shared),
            ("prompt tokens prefilled", s.prefill_tokens_alone, s.prefill_tokens_shared)), strict=True):
        bars = ax.bar(["no sharing", "shared prefix"], [alone, shared], color=["#C44E52", "#4C72B0"])
        for bar, value in zip(bars, (alone, shared), strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{value:,}", ha="center",
                    va="bottom", fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.15)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{users} users × ({prefix_len:,} shared + {suffix_len:,} own tokens), "
                 f"{block_size}-token blocks", fontsize=10)
    saved_tokens = s.prefill_tokens_alone - s.prefill_tokens_shared
    text = "\n".join([
        f"blocks: {s.blocks_alone:,} without sharing, {s.blocks_shared:,} with "
        f"({s.saved_fraction:.0%} fewer)",
        f"{model} KV cache (fp16): {format_bytes(s.bytes_alone)} → {format_bytes(s.bytes_shared)}",
        f"prefill: {saved_tokens:,} of {s.prefill_tokens_alone:,} prompt tokens not recomputed, "
        f"≈ {prefill_flops(config, saved_tokens) / 1e12:,.1f} TFLOP saved (2 × layer weights × tokens)",
    ])
    return fig, text


def prefix_sharing_explorer():
    """Users × shared-prefix length × own suffix → blocks and bytes with and without sharing, and the
    prefill work saved."""
    import ipywidgets as w

    users = labelled_slider("users", SHARING_USERS, 16)
    prefix = labelled_slider("shared prefix", SHARING_PREFIX, 1024)
    suffix = labelled_slider("own suffix", SHARING_SUFFIX, 64)
    readout = w.HTML()
    readout.add_class("kvlab-readout")
    out = explorer_plot(plot_sharing, {"users": users, "prefix_len": prefix, "suffix_len": suffix},
                        readout)
    box = w.VBox([users, prefix, suffix, out, readout])
    box.add_class("kvlab-prefix-sharing-explorer")
    return box


def plot_hit_rate(pool_blocks, hit_rates: dict, best: float | None = None):
    """Hit rate of the prefix index against pool size, one line per label -> rates."""
    fig, ax = new_figure(7.0, 3.8)
    for label, rates in hit_rates.items():
        ax.plot(pool_blocks, [r * 100 for r in rates], "o-", label=label)
    if best is not None:
        ax.axhline(best * 100, color="gray", ls="--", label="every prefix cached (upper bound)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(pool_blocks), [f"{p:,}" for p in pool_blocks])
    ax.minorticks_off()
    ax.set_xlabel("KV pool (blocks of 16 tokens)")
    ax.set_ylabel("prompt tokens found in the index (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8)
    return fig


def plot_offload(tokens, seconds: dict, title: str):
    """Time to bring back (or recompute) the K/V of n tokens, one line per label -> seconds."""
    fig, ax = new_figure(7.0, 3.8)
    for label, values in seconds.items():
        ax.plot(tokens, [s * 1e3 for s in values], "o-", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens whose K/V are needed again")
    ax.set_ylabel("ms (lower bound)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


# ---- exercises ----------------------------------------------------------------------------------

SHARED_BLOCKS_EXERCISE = {"users": 20, "prefix_len": 1000, "suffix_len": 200, "block_size": 16}
WINDOW_BYTES_EXERCISE = {"model": "mistral-7b", "window": 4096, "batch_size": 8, "dtype": "fp16"}
WINDOW_STREAM_TOKENS = 100_000   # each stream's length so far, in the exercise's text


def check_shared_prefix_blocks(answer, users: int = SHARED_BLOCKS_EXERCISE["users"],
                               prefix_len: int = SHARED_BLOCKS_EXERCISE["prefix_len"],
                               suffix_len: int = SHARED_BLOCKS_EXERCISE["suffix_len"],
                               block_size: int = SHARED_BLOCKS_EXERCISE["block_size"]) -> Verdict:
    """Blocks held by `users` requests of prefix_len shared + suffix_len own tokens, with sharing."""
    from ..prefix import sharing

    s = sharing(users, prefix_len, suffix_len, block_size)
    full = prefix_len // block_size
    value = as_number(answer)
    if value is None:
        return report(False, "", f"answer with a whole number of blocks (got {shown(answer)}).")
    if value == s.blocks_alone:
        return report(False, "", "that is without sharing: every user holding its own copy of the prefix.")
    ceil = -(-prefix_len // block_size)
    own = s.blocks_alone // users
    slips = [(ceil + users * (own - ceil),
              f"the prefix's last block is only partly full ({prefix_len % block_size} tokens): it cannot "
              "be shared, because each user's own tokens go on into it."),
             (ceil + users * -(-suffix_len // block_size),
              "each user's own tokens go on in the prefix's partly filled last block (a private copy "
              "of it): count ceil((prefix + suffix) / block_size) − the shared full blocks per user.")]
    for wrong, hint in slips:
        if prefix_len % block_size and value == wrong and value != s.blocks_shared:
            return report(False, "", hint)
    likely = [(own, f"that is one user's blocks; {users} users each hold their own part."),
              (full, "those are only the shared prefix blocks: add each user's own blocks."),
              (ceil, "those are only the prefix's blocks: add each user's own blocks."),
              (prefix_len + users * suffix_len, "that counts tokens: the question asks for blocks of "
               f"{block_size} tokens."),
              (full + users * suffix_len / block_size, "blocks are whole: each user's own part is "
               "ceil((prefix + suffix) / block_size) − the shared full blocks, rounded up."),
              (-(-(prefix_len + users * suffix_len) // block_size), "blocks are not shared between users' "
               "own tokens: each user's own part starts in its own copy of the prefix's last partial "
               "block."),
              (users * (own - full), f"add the {full} shared prefix blocks, held once.")]
    for wrong, hint in likely:
        if value == wrong and value != s.blocks_shared:
            return report(False, "", hint)
    return numeric(answer, s.blocks_shared, 1e-9,
                   f"Right: {full} full prefix blocks held once + {users} × "
                   f"{s.blocks_alone // users - full} blocks of each user's own.",
                   f"only the prefix's full blocks ({prefix_len:,} // {block_size}) are shared; each user "
                   "has the rest: ceil((prefix + suffix) / block_size) − the shared ones.")


def check_window_cache_gib(answer, model: str = WINDOW_BYTES_EXERCISE["model"],
                           window: int = WINDOW_BYTES_EXERCISE["window"],
                           batch_size: int = WINDOW_BYTES_EXERCISE["batch_size"],
                           dtype: str = WINDOW_BYTES_EXERCISE["dtype"]) -> Verdict:
    """The sliding-window cache of `batch_size` sequences of any length, in GiB."""
    from ..memory import GiB, kv_cache_bytes

    config = PRESETS[model]
    expected = kv_cache_bytes(config, window, batch_size, dtype) / GiB
    value = as_number(answer)
    per_head = expected * config.n_heads / config.n_kv_heads
    likely = [(kv_cache_bytes(config, config.max_seq_len, batch_size, dtype) / GiB,
               f"that is the full {config.max_seq_len:,}-token context; a sliding window keeps only the "
               f"last {window:,} tokens."),
              (kv_cache_bytes(config, WINDOW_STREAM_TOKENS, batch_size, dtype) / GiB,
               f"that is the whole {WINDOW_STREAM_TOKENS:,}-token stream; the window keeps only the last "
               f"{window:,} tokens, however long the stream."),
              (expected / batch_size, f"that is one stream: the batch holds {batch_size}."),
              (expected / 2, "K and V are both cached: the factor 2."),
              (expected * 2, "FP16 is 2 bytes a value (that is fp32's 4)."),
              (per_head, f"{config.n_kv_heads} KV heads are cached, not the {config.n_heads} query "
               "heads (grouped-query attention)."),
              (expected * GiB / 1e9, "that is GB (10**9 bytes): the question asks for GiB (1024**3)."),
              (expected * 1024, "that is MiB: divide by 1024 once more.")]
    for wrong, hint in likely:
        if close(value, wrong, 1e-3) and not close(value, expected, 1e-3):
            return report(False, "", hint)
    return numeric(answer, expected, 1e-3,
                   f"Right: {window:,} positions × batch {batch_size}, however long the streams get.",
                   f"2 × layers × KV heads × head_dim × {window:,} (the window, not the stream) × "
                   f"batch {batch_size} × 2 bytes, ÷ 1024**3.",
                   "that looks like bytes: the question asks for GiB (divide by 1024**3).")
