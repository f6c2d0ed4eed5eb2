"""Chapter 08, Scheduling many requests: the packed pass's mask, request timelines and pool usage of a
run (`kvlab.scheduler`), the latency and trade-off figures, the scheduling explorer and the exercise
checkers."""

from __future__ import annotations

import functools
import math
import random
import statistics

import matplotlib.pyplot as plt

from .. import validate
from ..cache.paged import blocks_needed
from ..config import PRESETS
from ..scheduler import Request, Scheduler, poisson_arrivals
from .style import (
    Verdict,
    as_number,
    explorer_plot,
    labelled_slider,
    new_figure,
    numeric,
    report,
    shown,
)

# What a request is doing during a step: its colour and legend label.
PHASES = {"waiting": ("#E8E8E8", "waiting"), "prefill": ("#F2B880", "prefill (prompt chunk)"),
          "decode": ("#4C72B0", "decode (one token)"), "preempt": ("#C44E52", "preempted"),
          "swap-out": ("#8172B2", "swapped out"), "swap-in": ("#8172B2", "swapped out")}


def plot_packed_mask(mask, row_names: list[str], new_tokens: list[int], cached: list[int]):
    """The mask of one packed pass (T new tokens × S keys): which keys each new token may see, with
    the rows marked (a RaggedPagedKVCache's `mask`, as bool)."""
    import numpy as np

    m = np.asarray(mask, dtype=float)
    fig, ax = new_figure(7.5, 3.2)
    ax.imshow(m, cmap="Blues", vmin=0, vmax=1.3, aspect="auto", interpolation="nearest")
    q = k = 0
    for name, n, c in zip(row_names, new_tokens, cached, strict=True):
        ax.add_patch(plt.Rectangle((k - 0.5, q - 0.5), c + n, n, fill=False, lw=1.5, color="#C44E52"))
        ax.text(k + (c + n) / 2 - 0.5, q - 0.7, f"{name}: {c} cached + {n} new", ha="center",
                va="bottom", fontsize=8, color="#C44E52")
        q, k = q + n, k + c + n
    ax.set_xlabel("keys handed back (every row's, end to end)")
    ax.set_ylabel("new tokens (packed)")
    ax.set_title("one forward pass, rows of their own lengths: a token sees its own row only",
                 fontsize=10)
    ax.grid(False)
    ax.set_ylim(m.shape[0] - 0.5, -1.8)
    return fig


def request_segments(run) -> dict[int, list[tuple[float, float, str]]]:
    """For each request: (start, end, phase) bars from its arrival to its last token, from the
    run's step records: "swap-out" while its K/V sit in host memory, "waiting" where no step
    served it otherwise."""
    bars: dict[int, list] = {r.index: [] for r in run.results}
    swaps: dict[int, list[tuple[float, bool]]] = {r.index: [] for r in run.results}
    for step in run.steps:
        for req, kind, _ in step.events:
            if kind in ("swap-out", "swap-in"):   # out from this step on, or back in it
                swaps[req].append((step.start, kind == "swap-out"))
            else:
                bars[req].append((step.start, step.start + step.seconds, kind))
    segs = {}
    for r in run.results:
        served, t, segs[r.index] = sorted(bars[r.index]), r.request.arrival, []
        for start, end, phase in served:
            if start > t:
                segs[r.index].extend(_idle_segments(t, start, swaps[r.index]))
            segs[r.index].append((start, end, phase))
            t = max(t, end)
    return segs


def _idle_segments(t0: float, t1: float, swaps) -> list[tuple[float, float, str]]:
    """The time from t0 to t1 in which a request was not served, cut where it was swapped out or
    back in: "swap-out" pieces while its K/V were in host memory, "waiting" otherwise."""
    out = False
    for when, is_out in swaps:
        if when <= t0:
            out = is_out
    cuts = [(when, is_out) for when, is_out in swaps if t0 < when < t1]
    pieces, start = [], t0
    for when, is_out in cuts + [(t1, out)]:
        if when > start:
            pieces.append((start, when, "swap-out" if out else "waiting"))
        start, out = when, is_out
    return pieces


def plot_timeline(run, ax=None, title: str = "", unit: str = "s", max_requests: int = 40):
    """Each request a row: waiting, prefill chunks, decode steps and preemptions over time."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig = None
    if ax is None:
        fig, ax = new_figure(8.5, 3.6)
    segs = request_segments(run)
    shown_ids = sorted(segs)[:max_requests]
    for row, i in enumerate(shown_ids):
        for phase in ("waiting", "swap-out", "prefill", "decode", "preempt"):
            spans = [(a, b - a) for a, b, p in segs[i] if p == phase]
            if spans:
                ax.broken_barh(spans, (row - 0.4, 0.8), color=PHASES[phase][0], lw=0)
        for r in (run.results[i],):
            ax.plot(r.request.arrival, row, "|", color="black", ms=6)
    for s in run.steps:
        for req, kind, _ in s.events:
            if kind == "preempt" and req in shown_ids:
                ax.plot(s.start, shown_ids.index(req), "x", color="#C44E52", ms=6)
    ax.set_ylim(len(shown_ids) - 0.5, -0.5)
    ax.set_ylabel("request")
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or run.policy, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    phases = {p for i in shown_ids for *_, p in segs[i]}
    handles = [Patch(color=PHASES[p][0], label=PHASES[p][1])
               for p in ("waiting", "prefill", "decode", "swap-out") if p != "swap-out" or p in phases]
    handles.append(Line2D([], [], color="black", marker="|", ls="", ms=6, label="arrival"))
    if "preempt" in phases:
        handles.append(Line2D([], [], color=PHASES["preempt"][0], marker="x", ls="", ms=6,
                              label="preempted (recompute)"))
    ax.legend(handles=handles, fontsize=7, loc="upper right", ncols=3)
    return fig if fig is not None else ax.figure


def plot_pool_usage(runs: dict, num_blocks: int | None = None, ax=None, unit: str = "s"):
    """Blocks in use after every step over time, one line per run (label -> Run); the pool's size
    as a dashed line."""
    fig = None
    if ax is None:
        fig, ax = new_figure(8.5, 3.0)
    for label, run in runs.items():
        ax.step([s.start + s.seconds for s in run.steps], [s.blocks_used for s in run.steps],
                where="post", label=label, lw=1.5)
    if num_blocks:
        ax.axhline(num_blocks, color="gray", ls="--", lw=1)
        ax.text(0, num_blocks, " pool size", va="bottom", fontsize=8, color="dimgray")
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("KV blocks in use")
    ax.legend(fontsize=8)
    return fig if fig is not None else ax.figure


def plot_latency_bars(table, metrics=(("throughput", "output tokens / CPU s"),
                                      ("ttft_median", "TTFT, median (s)"),
                                      ("tpot_median", "TPOT, median (s)"))):
    """One panel per metric: a bar per policy at the mean over repeats, the standard error as an
    error bar (table: a pandas DataFrame with columns policy, metric, metric_se)."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(10, 3.3), layout="constrained")
    colors = ["#8C8C8C", "#4C72B0", "#55A868", "#C44E52", "#8172B2"]
    for ax, (col, label) in zip(axes, metrics, strict=True):
        ax.bar(table["policy"], table[col], yerr=table[f"{col}_se"], capsize=3,
               color=colors[:len(table)])
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    return fig


def plot_chunked_tradeoff(budgets, long_ttft, decode_gap, labels=None):
    """Left: the long prompt's TTFT per budget; right: the decoders' longest gap between two tokens."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.4), layout="constrained")
    names = labels or [str(x) for x in budgets]
    a.bar(names, [t * 1e3 for t in long_ttft], color="#F2B880")
    a.set_title("TTFT of the long prompt (ms)", fontsize=10)
    b.bar(names, [t * 1e3 for t in decode_gap], color="#4C72B0")
    b.set_title("decoders' longest gap between tokens (ms)", fontsize=10)
    for ax in (a, b):
        ax.set_xlabel("token budget per step")
        ax.grid(True, axis="y", alpha=0.3)
    return fig


def plot_preemption_costs(tokens, recompute_s, swap_s, gpu: str):
    """Seconds to bring back a preempted request of n cached tokens: recomputing them (a prefill)
    or copying their K/V out and back over the host link, on the roofline clock."""
    fig, ax = new_figure(7.0, 3.6)
    ax.plot(tokens, [s * 1e3 for s in recompute_s], "o-", color="#C44E52", label="recompute (prefill again)")
    ax.plot(tokens, [s * 1e3 for s in swap_s], "s-", color="#8172B2", label="swap out + back in (PCIe)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens the preempted request had cached")
    ax.set_ylabel("ms added (lower-bound model)")
    ax.set_title(f"what a preemption costs on a simulated {gpu}", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_scale(rates, rows: dict, ylabel: dict):
    """One panel per metric against the arrival rate, one line per policy (rows: policy -> {metric:
    [value per rate]}; ylabel: metric -> axis label)."""
    metrics = list(ylabel)
    fig, axes = plt.subplots(1, len(metrics), figsize=(11, 3.4), layout="constrained")
    for ax, metric in zip(axes, metrics, strict=True):
        for policy, values in rows.items():
            ax.plot(rates, values[metric], "o-", label=policy)
        ax.set_xlabel("arrivals per second")
        ax.set_ylabel(ylabel[metric])
        ax.grid(True, alpha=0.3)
        if metric.startswith("ttft"):
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    return fig


# ---- the explorer: a simulated stream on the step clock ---------------------------------------------

EXPLORER_REQUESTS = 32
EXPLORER_BLOCK = 8
EXPLORER_BUDGETS = (8, 16, 32, 64, 128, 256)
EXPLORER_BLOCKS = (16, 24, 32, 48, 64, 96, 128, 256)
EXPLORER_RATES = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)


def explorer_stream(arrival_rate: float, n: int = EXPLORER_REQUESTS, seed: int = 0) -> list[Request]:
    """The explorer's requests: prompts of 8–64 tokens, answers of 8–48, Poisson arrivals at
    `arrival_rate` a step (the same lengths at every rate)."""
    rng = random.Random(seed)
    lengths = [(rng.randint(8, 64), rng.randint(8, 48)) for _ in range(n)]
    arrivals = poisson_arrivals(n, arrival_rate, seed)
    return [Request([i % 7] * p, o, a) for i, ((p, o), a) in enumerate(zip(lengths, arrivals, strict=True))]


def plot_schedule(token_budget: int = 64, num_blocks: int = 64, arrival_rate: float = 0.3,
                  preemption: str = "recompute"):
    """The explorer's picture and readout: the stream scheduled (simulated, one step = 1 time unit)
    with these settings: (Figure, text)."""
    validate.choice("token_budget", token_budget, EXPLORER_BUDGETS)
    validate.choice("num_blocks", num_blocks, EXPLORER_BLOCKS)
    validate.choice("arrival_rate", arrival_rate, EXPLORER_RATES)
    requests = explorer_stream(arrival_rate)
    run = Scheduler(None, config=PRESETS["llama-3-8b"], num_blocks=num_blocks, block_size=EXPLORER_BLOCK,
                    token_budget=token_budget, max_batch=64, preemption=preemption,
                    clock="steps").run(requests)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.2), layout="constrained",
                                      gridspec_kw={"height_ratios": [3, 1.2]}, sharex=True)
    plot_timeline(run, top, f"{len(requests)} requests, budget {token_budget} tokens a step, "
                            f"{num_blocks} blocks of {EXPLORER_BLOCK}", unit="steps")
    plot_pool_usage({"blocks in use": run}, num_blocks, bottom, unit="steps")
    s = run.summary()
    text = "\n".join([
        f"{s['steps']} steps for {run.output_tokens} output tokens: "
        f"{run.throughput:.2f} tokens a step; at most {max(st.running for st in run.steps)} requests "
        "running at once",
        f"TTFT median {s['ttft_median']:.1f} steps (mean {s['ttft_mean']:.1f}); TPOT median "
        f"{s['tpot_median']:.2f} steps, worst request {s['tpot_max']:.2f}",
        f"peak {s['peak_blocks']} of {num_blocks} blocks; {s['preemptions']} preemptions "
        f"({run.wasted_tokens} tokens recomputed)",
    ])
    return fig, text


def scheduling_explorer():
    """Token budget × pool size × arrival rate → the timeline of a simulated request stream, the
    pool's use, and the latencies."""
    import ipywidgets as w

    budget = labelled_slider("token budget", EXPLORER_BUDGETS, 64, "{:g}")
    blocks = labelled_slider("KV blocks", EXPLORER_BLOCKS, 64, "{:g}")
    rate = labelled_slider("arrivals/step", EXPLORER_RATES, 0.3, "{:g}")
    readout = w.HTML()
    readout.add_class("kvlab-readout")
    out = explorer_plot(plot_schedule, {"token_budget": budget, "num_blocks": blocks,
                                        "arrival_rate": rate}, readout)
    out.layout = w.Layout(height="540px", overflow="hidden")   # a 5.2-inch figure and margins
    box = w.VBox([budget, blocks, rate, out, readout])
    box.add_class("kvlab-scheduling-explorer")
    return box


# ---- exercises ---------------------------------------------------------------------------------------

TTFT_EXERCISE = {"prompt_len": 120, "decoders": 4, "token_budget": 32}
BLOCKS_EXERCISE = {"prompt_len": 50, "generated": 31, "block_size": 16}


@functools.lru_cache(maxsize=64)
def ttft_steps(prompt_len: int, decoders: int, token_budget: int) -> float:
    """Steps from arrival to first token for a prompt that arrives while `decoders` requests decode
    (they keep decoding throughout), with chunked prefill: measured by running the scheduler."""
    prompt_len = validate.integer("prompt_len", prompt_len)
    decoders = validate.integer("decoders", decoders, low=0)
    token_budget = validate.integer("token_budget", token_budget, low=decoders + 1)
    config = PRESETS["llama-3-8b"]
    # long enough answers that they are still decoding when the prompt's first token comes out
    busy = [Request([1] * 4, prompt_len + 2) for _ in range(decoders)]
    new = Request(list(range(prompt_len)), 1, arrival=1.0)   # after the decoders' own prefill step
    run = Scheduler(None, config=config, num_blocks=10_000, block_size=16, token_budget=token_budget,
                    clock="steps").run(busy + [new])
    return run.results[-1].ttft


def check_ttft_under_budget(answer, prompt_len: int = TTFT_EXERCISE["prompt_len"],
                            decoders: int = TTFT_EXERCISE["decoders"],
                            token_budget: int = TTFT_EXERCISE["token_budget"]) -> Verdict:
    """Steps until a newly arrived prompt's first token, with `decoders` others decoding."""
    expected = ttft_steps(prompt_len, decoders, token_budget)
    value = as_number(answer)
    if value is not None and value == math.ceil(prompt_len / token_budget) and value != expected:
        return report(False, "", f"the {decoders} decoding requests take one token each of every "
                                 "step's budget first: the prompt gets what is left.")
    if value is not None and value == expected + 1:
        return report(False, "", "the step that feeds the last prompt chunk also produces the first "
                                 "token: no extra step after the prefill.")
    if value is not None and value != int(value):
        return report(False, "", f"{value:g} steps: round up, a partial chunk still takes a whole "
                                 "step.")
    return numeric(answer, expected, 1e-9,
                   f"Right: {token_budget - decoders} prompt tokens a step, so {int(expected)} steps "
                   f"for {prompt_len} tokens; the last chunk's step also yields the first token.",
                   "per step the prompt gets the budget minus one token per decoding request; "
                   "round up.")


def check_blocks_freed(answer, prompt_len: int = BLOCKS_EXERCISE["prompt_len"],
                       generated: int = BLOCKS_EXERCISE["generated"],
                       block_size: int = BLOCKS_EXERCISE["block_size"]) -> Verdict:
    """Blocks a request frees when it is preempted after `generated` output tokens."""
    expected = blocks_needed(prompt_len + generated - 1, block_size)
    value = as_number(answer)
    if value is None:
        return report(False, "", f"answer with a number of blocks (got {shown(answer)}).")
    if value == blocks_needed(prompt_len + generated, block_size) != expected:
        return report(False, "", "the newest output token has not been fed yet: its K/V are not in "
                                 "the pool (it is the input of the next step).")
    return numeric(answer, expected, 1e-9,
                   f"Right: {prompt_len} + {generated} − 1 = {prompt_len + generated - 1} positions "
                   f"hold K/V, in {expected} blocks of {block_size}.",
                   "count the positions whose K/V are stored (prompt and every output token but the "
                   "newest), divide by the block size and round up.")


def step_rows(run) -> list[list[tuple[int, int]]]:
    """Each step's rows as (cached positions, new tokens), replayed from the run's events (a
    preemption by recompute sets its request's cached positions back to 0; a run with prefix
    caching, whose hits are not events, is not replayed exactly)."""
    computed: dict[int, int] = {}
    out = []
    for step in run.steps:
        rows = []
        for req, kind, n in step.events:
            if kind in ("prefill", "decode"):
                rows.append((computed.get(req, 0), n))
                computed[req] = computed.get(req, 0) + n
            elif kind == "preempt":
                computed[req] = 0
        out.append(rows)
    return out


def mean_and_se(values) -> tuple[float, float]:
    """The mean of repeated measurements and its standard error (0 for one value)."""
    values = list(values)
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)
