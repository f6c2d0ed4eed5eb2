"""Scheduling many requests: continuous batching, chunked prefill and preemption on a paged pool.

A serving engine runs a loop of *steps*. Each step it picks, within a **token budget**, which
requests advance: one new token for each decoding request and a chunk of the prompt of requests
being prefilled; then it runs them all in one forward pass. Requests join between steps as they
arrive and leave as soon as they finish (**continuous batching**, Orca's iteration-level
scheduling), instead of waiting for a whole batch to end (**static batching**). A long prompt cut
into chunks (**chunked prefill**) shares its steps with the decoders instead of stalling them.
When the pool of KV blocks runs out, the newest running request is **preempted**: its blocks are
freed and it is either recomputed later from its tokens ("recompute") or its K/V are copied to CPU
memory and back ("swap").

    sched = Scheduler(model, num_blocks=64, block_size=8, token_budget=32)
    run = sched.run([Request(prompt, 20, arrival=0.0), ...])
    run.results[0].output            # the same tokens as generating that request alone (greedy)
    run.ttft, run.tpot, run.throughput, run.steps   # per-request latencies, per-step records

How it works, in the order of one step (`Scheduler._schedule`):
1. running requests, oldest first: each gets min(tokens still to compute, budget left) tokens
   (1 when decoding). A request that needs a new block when none is free preempts the newest
   running request (vLLM's rule), itself if it is the newest.
2. if nothing was preempted: swapped-out requests come back first (their blocks copied in), then
   waiting requests are admitted in arrival order while blocks for their whole prompt, a place in
   the batch (`max_batch`) and budget remain. Without chunked prefill a prompt goes in one step.
3. the chosen tokens of every row are packed into one sequence and run through the model with a
   `kvlab.cache.RaggedPagedKVCache` (each row sees only its own keys); a row whose last token was
   fed gets its next token by argmax.
With `prefix_caching=True` the pool is indexed by `kvlab.cache.prefix.PrefixBlockManager`: a
prompt reuses the blocks of the longest prefix already computed (and a recomputed request its own).

Identical outputs: every request's tokens are the greedy tokens of running it alone through
`kvlab.generate.generate`, whatever the arrival times, budget, pool size or policy (property-tested
in float64; in float32 a pass over another mix of rows multiplies matrices of another shape, so
logits can differ in the last bits and an exact tie could break the other way).

Clocks: `clock="cpu"` (default) advances by the CPU time each step takes (`time.process_time`;
on a GPU this misses the kernels still running asynchronously), "wall" by its wall time (after
`torch.cuda.synchronize` on a GPU: use it there), "steps" by 1 a step; a `RooflineClock` charges
each step what the roofline of `kvlab.roofline` says it costs on a GPU, without running any model
(`model=None`): the scheduler then only counts blocks and tokens, which is how it shows hundreds
of users of an 8B model on an H100 (see `RooflineClock` for the model and its assumptions).
Arrival times are in the clock's unit; when nothing can run, the clock jumps to the next arrival.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from . import memory, roofline, validate
from .cache.paged import OutOfBlocksError, blocks_needed
from .cache.prefix import PrefixBlockManager, PrefixKVStore, Sequence, token_list
from .cache.ragged import RaggedPagedKVCache
from .config import ModelConfig, resolve

PREEMPTIONS = ("recompute", "swap")
CLOCKS = ("cpu", "wall", "steps")


@dataclass
class Request:
    """A prompt (token ids), how many tokens to generate, and when it arrives (clock units)."""

    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0


@dataclass
class RequestResult:
    """What happened to one request: its output and when each of its tokens came out."""

    request: Request
    index: int
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # clock when each output token came out
    preemptions: int = 0
    cached_tokens: int = 0      # prompt tokens found in the prefix cache (not computed)
    recomputed_tokens: int = 0  # tokens fed again after a preemption by recompute

    @property
    def ttft(self) -> float:
        """Time to first token: from arrival to the end of the step that produced it."""
        return self.token_times[0] - self.request.arrival

    @property
    def tpot(self) -> float:
        """Time per output token after the first (nan for a one-token answer)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else math.nan

    @property
    def finish(self) -> float:
        return self.token_times[-1]

    @property
    def gaps(self) -> list[float]:
        """Time between consecutive output tokens (inter-token latency)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass
class StepRecord:
    """One step: when it started, what it cost, what it fed and what the pool held after it.
    events: (request index, kind, tokens) with kind "prefill", "decode", "preempt", "swap-out",
    "swap-in". running: requests in the batch (decoding or prefilling); waiting: requests that
    have arrived and wait for admission (not those still to arrive); swapped: swapped out."""

    index: int
    start: float
    seconds: float
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    swapped: int
    blocks_used: int
    blocks_cached: int
    events: list[tuple[int, str, int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass
class Run:
    """The results of serving a stream of requests: one RequestResult each, one StepRecord a step."""

    results: list[RequestResult]
    steps: list[StepRecord]
    policy: str
    num_blocks: int
    fed_tokens: int          # tokens the forward passes fed (padding and recomputation included)

    @property
    def outputs(self) -> list[list[int]]:
        return [r.output for r in self.results]

    @property
    def makespan(self) -> float:
        """From the first arrival to the last token."""
        return max(r.finish for r in self.results) - min(r.request.arrival for r in self.results)

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output) for r in self.results)

    @property
    def throughput(self) -> float:
        """Output tokens per clock unit (tokens/s with a seconds clock), over the makespan."""
        return self.output_tokens / self.makespan

    @property
    def ttft(self) -> list[float]:
        return [r.ttft for r in self.results]

    @property
    def tpot(self) -> list[float]:
        return [r.tpot for r in self.results if len(r.output) > 1]

    @property
    def useful_tokens(self) -> int:
        """Tokens a request needs fed at least once: its prompt and all outputs but the last."""
        return sum(len(r.request.prompt) + len(r.output) - 1 for r in self.results)

    @property
    def wasted_tokens(self) -> int:
        """Tokens fed beyond the useful ones: padding (static batching), recomputation
        (preemption by recompute); prefix-cache hits count as fed for free, so they can make it < 0."""
        return self.fed_tokens - self.useful_tokens

    @property
    def waste(self) -> float:
        """wasted_tokens as a share of the tokens fed."""
        return self.wasted_tokens / self.fed_tokens if self.fed_tokens else 0.0

    @property
    def preemptions(self) -> int:
        return sum(r.preemptions for r in self.results)

    def summary(self) -> dict:
        """Medians and means of the latencies, throughput, waste and preemptions, as one dict."""
        tpot = self.tpot
        return {"policy": self.policy, "requests": len(self.results), "steps": len(self.steps),
                "makespan": self.makespan, "throughput": self.throughput,
                "ttft_median": statistics.median(self.ttft), "ttft_mean": statistics.fmean(self.ttft),
                "tpot_median": statistics.median(tpot) if tpot else math.nan,
                "tpot_max": max(tpot) if tpot else math.nan,
                "waste": self.waste, "preemptions": self.preemptions,
                "peak_blocks": max((s.blocks_used for s in self.steps), default=0)}


# ---- the cost of a step on a GPU, from the roofline ------------------------------------------------

# PCIe links between host and GPU (PCI-SIG): 16 GT/s (gen 4) or 32 GT/s (gen 5) a lane, 16 lanes,
# 128b/130b encoding, one direction; the A100 has gen 4, the H100 SXM and H200 gen 5.
PCIE_GEN4_X16 = 16e9 * 16 * 128 / 130 / 8    # ≈ 31.5 GB/s
PCIE_GEN5_X16 = 32e9 * 16 * 128 / 130 / 8    # ≈ 63.0 GB/s


class RooflineClock:
    """Charges each step what the roofline says it costs on `gpu` (a `kvlab.memory.GPUS` name).

    The model (a lower bound, stated): a step takes max(bytes ÷ bandwidth, FLOPs ÷ peak FP16 FLOP/s),
    where bytes = every weight once (`roofline.decode_step_bytes` at context 0) + the K/V each row
    reads (all its positions, the new ones included) and writes, and FLOPs = 2 per weight of the
    layers per fed token + 2 per LM-head weight once per row (an engine computes logits only for each
    row's last token) + attention over the causal pairs only (a new token at position p sees p + 1
    keys: what a causal kernel computes; `roofline.forward_flops` counts the whole rectangle, as a
    dense kernel does). Assumed: no per-step overhead (kernel launches, the scheduler's own CPU
    time), both roofs reached, no activations in memory; a swap moves its bytes over the host link
    (PCIe, one direction) while nothing else runs. Real engines are slower than this; the *shape* of
    the results (what fits, where the latency goes) is what it shows.
    """

    def __init__(self, config: ModelConfig | str, gpu: str = "H100 80GB", dtype: str = "fp16",
                 host_bytes_per_s: float | None = None):
        self.config = config = resolve(config)
        self.gpu = memory.gpu(gpu)
        self.peak = roofline.PEAK_FP16_FLOPS.get(self.gpu.name)
        self.host_bytes_per_s = (validate.number("host_bytes_per_s", host_bytes_per_s, low=0,
                                                 low_inclusive=False) if host_bytes_per_s is not None
                                 else PCIE_GEN4_X16 if self.gpu.name.startswith(("A100", "T4"))
                                 else PCIE_GEN5_X16)
        self.weight_bytes = roofline.decode_step_bytes(config, 0, 1, dtype)
        self.kv_bytes_per_token = memory.kv_bytes_per_token(config, dtype)
        one = roofline.forward_flops(config, 1, 1)
        self.head_flops = 2 * config.d_model * config.vocab_size        # the LM head, per row
        self.linear_flops = one.linear - self.head_flops                # the layers, per fed token
        self.pair_flops = one.attention                                  # per (query, key) pair

    def step_seconds(self, rows) -> float:
        """Seconds for one pass over rows of (cached positions, new tokens)."""
        fed = sum(n for _, n in rows)
        keys = sum(c + n for c, n in rows)
        # causal: the new tokens of a row at positions c .. c+n-1 see c+1 .. c+n keys
        pairs = sum(n * c + n * (n + 1) // 2 for c, n in rows)
        bytes_ = self.weight_bytes + self.kv_bytes_per_token * (keys + fed)
        flops = self.linear_flops * fed + self.head_flops * len(rows) + self.pair_flops * pairs
        return max(bytes_ / self.gpu.bandwidth_bytes_per_s, flops / self.peak if self.peak else 0.0)

    def swap_seconds(self, tokens: int) -> float:
        """Seconds to copy the K/V of `tokens` positions over the host link."""
        return tokens * self.kv_bytes_per_token / self.host_bytes_per_s

    def __repr__(self) -> str:
        return f"RooflineClock({self.config.name or 'model'}, {self.gpu.name})"


def gpu_pool_blocks(config: ModelConfig | str, gpu: str = "H100 80GB", block_size: int = 16,
                    dtype: str = "fp16", utilization: float = 0.9) -> int:
    """KV blocks that fit on `gpu` beside the weights: utilization × its memory (vLLM's
    gpu_memory_utilization, 0.9 by default) − the weights, in blocks of block_size tokens
    (activations and the CUDA context are not counted)."""
    config, block_size = resolve(config), validate.integer("block_size", block_size)
    utilization = validate.number("utilization", utilization, low=0, high=1, low_inclusive=False)
    free = memory.gpu(gpu).memory_bytes * utilization - memory.weight_bytes(config, dtype)
    if free <= 0:
        raise ValueError(f"{config.name or 'the model'}'s {dtype} weights do not fit in "
                         f"{utilization:.0%} of the {gpu}")
    return int(free // (block_size * memory.kv_bytes_per_token(config, dtype)))


# ---- requests in flight ------------------------------------------------------------------------------

@dataclass
class _Live:
    """A request being served: its tokens so far, how many have K/V in the pool, its blocks."""

    result: RequestResult
    tokens: list[int]
    computed: int = 0
    seq: Sequence | None = None     # its blocks while running
    swapped: tuple | None = None    # its K/V in CPU memory while swapped out
    prompt_indexed: bool = False

    @property
    def todo(self) -> int:
        return len(self.tokens) - self.computed

    @property
    def done(self) -> bool:
        return len(self.result.output) == self.result.request.max_new_tokens


def check_requests(requests, vocab_size: int | None, max_seq_len: int | None) -> list[Request]:
    """The requests as a list of Request, or a clear error naming the bad one."""
    if isinstance(requests, Request) or not hasattr(requests, "__iter__"):
        raise ValueError(f"requests must be a list of kvlab.scheduler.Request; got {requests!r:.60}")
    out = []
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise ValueError(f"requests[{i}] is a {type(r).__name__}, not a Request(prompt, "
                             "max_new_tokens, arrival)")
        prompt = token_list(f"requests[{i}].prompt", r.prompt)
        if not prompt:
            raise ValueError(f"requests[{i}].prompt is empty: a request needs at least one token")
        if vocab_size is not None and max(prompt) >= vocab_size:
            raise ValueError(f"requests[{i}].prompt holds token {max(prompt)}, outside the "
                             f"vocabulary (0..{vocab_size - 1})")
        new = validate.integer(f"requests[{i}].max_new_tokens", r.max_new_tokens)
        arrival = validate.number(f"requests[{i}].arrival", r.arrival, low=0)
        if max_seq_len is not None and len(prompt) + new > max_seq_len:
            raise ValueError(f"requests[{i}] needs {len(prompt)} + {new} = {len(prompt) + new} "
                             f"positions; the model holds max_seq_len={max_seq_len}")
        out.append(Request(prompt, new, float(arrival)))
    if not out:
        raise ValueError("requests is empty: give at least one Request")
    return out


class Scheduler:
    """Continuous batching over a paged pool of `num_blocks` blocks of `block_size` tokens (see the
    module). model=None runs the schedule alone (no tokens computed, outputs are zeros): give
    `config` and a RooflineClock (or clock="steps")."""

    def __init__(self, model=None, num_blocks: int = 64, block_size: int = 16, token_budget: int = 256,
                 max_batch: int = 64, chunked_prefill: bool = True, preemption: str = "recompute",
                 prefix_caching: bool = False, clock="cpu", config: ModelConfig | str | None = None):
        self.model = model
        self.num_blocks = validate.integer("num_blocks", num_blocks)
        self.block_size = validate.integer("block_size", block_size)
        self.token_budget = validate.integer("token_budget", token_budget)
        self.max_batch = validate.integer("max_batch", max_batch)
        self.chunked_prefill = validate.boolean("chunked_prefill", chunked_prefill)
        self.preemption = validate.choice("preemption", preemption, PREEMPTIONS)
        self.prefix_caching = validate.boolean("prefix_caching", prefix_caching)
        if not (isinstance(clock, RooflineClock) or (isinstance(clock, str) and clock in CLOCKS)):
            raise ValueError(f"clock={clock!r} is not known; allowed: {', '.join(map(repr, CLOCKS))} "
                             "or a RooflineClock")
        self.clock = clock
        if model is not None:
            from .sampling import check_model

            self.config = check_model(model).config
            if config is not None and resolve(config) != self.config:
                raise ValueError("config differs from model.config: give one or the other")
        elif config is None:
            raise ValueError("without a model the scheduler only simulates: give config= (a "
                             "ModelConfig or a preset name) and a RooflineClock or clock='steps'")
        else:
            self.config = resolve(config)
            if clock in ("cpu", "wall"):
                raise ValueError(f"clock={clock!r} measures the model's steps, and there is no model: "
                                 "use clock='steps' or a RooflineClock")

    @property
    def policy(self) -> str:
        parts = ["continuous", "chunked" if self.chunked_prefill else "whole prompts", self.preemption]
        return ", ".join(parts + (["prefix cache"] if self.prefix_caching else []))

    # --- the loop ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, requests) -> Run:
        """Serve every request; return their results and a record of every step."""
        model = self.model
        requests = check_requests(requests, self.config.vocab_size if model else None,
                                  self.config.max_seq_len if model else None)
        self._check_fits(requests)
        if model is not None:
            param = next(model.parameters())
            self.store = PrefixKVStore(self.config, self.num_blocks, self.block_size, param.dtype,
                                       param.device)
            self.manager, self.view = self.store.manager, RaggedPagedKVCache(self.store)
        else:
            self.store, self.manager = None, PrefixBlockManager(self.num_blocks, self.block_size)
        lives = [_Live(RequestResult(r, i), list(r.prompt)) for i, r in enumerate(requests)]
        pending = deque(sorted(lives, key=lambda x: (x.result.request.arrival, x.result.index)))
        self.waiting, self.running, self.swapped = deque(), [], deque()
        steps, now, fed = [], 0.0, 0
        while pending or self.waiting or self.running or self.swapped:
            while pending and pending[0].result.request.arrival <= now:
                self.waiting.append(pending.popleft())
            if not (self.waiting or self.running or self.swapped):
                now = pending[0].result.request.arrival   # idle until the next arrival
                continue
            events: list[tuple[int, str, int]] = []
            started = self._timer()
            plan, swap_tokens = self._schedule(events)
            if not plan:
                raise RuntimeError("the scheduler planned an empty step (a bug): "
                                   f"{len(self.waiting)} waiting, {len(self.swapped)} swapped")
            new = self._execute(plan)
            seconds = self._elapsed(started, plan, swap_tokens)
            now += seconds
            fed += sum(n for _, n in plan)
            prefill = self._finish_step(plan, new, now, events)
            steps.append(StepRecord(len(steps), now - seconds, seconds, prefill,
                                    sum(n for _, n in plan) - prefill, len(self.running),
                                    len(self.waiting), len(self.swapped),
                                    self.manager.num_in_use, self.manager.num_cached, events))
        return Run([x.result for x in lives], steps, self.policy, self.num_blocks, fed)

    def _check_fits(self, requests: list[Request]) -> None:
        """Refuse a request that could never run: more blocks than the pool, or (without chunked
        prefill) a prompt larger than the budget. A request recomputed after preemption is
        prefilled again with its output so far, so then its prompt + output - 1 must fit (vLLM
        likewise asks max_num_batched_tokens >= max_model_len without chunked prefill)."""
        for i, r in enumerate(requests):
            positions = len(r.prompt) + r.max_new_tokens - 1   # the last token is never fed
            if blocks_needed(positions, self.block_size) > self.num_blocks:
                raise ValueError(f"requests[{i}] needs {blocks_needed(positions, self.block_size)} "
                                 f"blocks of {self.block_size} for {positions} positions; the pool "
                                 f"has num_blocks={self.num_blocks}")
            swap = self.preemption == "swap"
            whole = len(r.prompt) if swap else positions
            if not self.chunked_prefill and whole > self.token_budget:
                what = "" if swap else ", its output included after a recompute"
                raise ValueError(f"requests[{i}] must be prefilled in one step ({whole} tokens{what}) "
                                 f"but token_budget={self.token_budget}: raise the budget or use "
                                 "chunked_prefill=True")

    # --- choosing a step ---------------------------------------------------------------------------

    def _free_blocks(self) -> int:
        return self.manager.allocator.num_free + self.manager.num_cached  # cached ones are evictable

    def _schedule(self, events) -> tuple[list[tuple[_Live, int]], int]:
        """The rows of the next pass, (request, tokens to feed), and the positions swapped."""
        budget, plan, preempted, swapped = self.token_budget, [], False, 0
        i = 0
        while i < len(self.running) and budget > 0:
            live = self.running[i]
            n = min(live.todo, budget)
            while self._grow_need(live, n) > self._free_blocks():   # out of blocks: preempt the newest
                victim = self.running[-1]
                swapped += self._preempt(victim, events)
                preempted = True
                if victim is live:
                    break
            if live.seq is None:   # it preempted itself
                break
            self._grow(live, n)
            plan.append((live, n))
            budget -= n
            i += 1
        if not preempted:
            swapped += self._swap_in(events)
            for live in self.running[len(plan):]:      # swapped back in: they run this step too
                n = min(live.todo, budget)
                if n == 0 or self._grow_need(live, n) > self._free_blocks():
                    break
                self._grow(live, n)
                plan.append((live, n))
                budget -= n
            if not self.swapped:
                plan += self._admit(budget, events)
        return plan, swapped

    def _grow_need(self, live: _Live, n: int) -> int:
        """Blocks `live` must take to feed n more tokens (its prompt's were taken on admission)."""
        return max(0, blocks_needed(live.computed + n, self.block_size) - len(live.seq.table))

    def _grow(self, live: _Live, n: int) -> None:
        for p in range(len(live.seq.tokens), live.computed + n):  # output tokens get slots one by one
            self.manager.append(live.seq, live.tokens[p])

    def _admit(self, budget: int, events) -> list[tuple[_Live, int]]:
        """Waiting requests, in arrival order, while the batch, the budget and the blocks allow."""
        plan = []
        while self.waiting and len(self.running) < self.max_batch and budget > 0:
            live = self.waiting[0]
            shared = self.manager.match(live.tokens) if self.prefix_caching else []
            cached = min(len(shared), (len(live.tokens) - 1) // self.block_size) * self.block_size
            if not self.chunked_prefill and len(live.tokens) - cached > budget:
                break   # the whole prompt must go in one step: wait for a step with room
            try:
                live.seq = self.manager.new_sequence(live.tokens, reuse=self.prefix_caching)
            except OutOfBlocksError:
                break   # first come, first served: later requests wait behind it
            self.waiting.popleft()
            live.computed = live.seq.cached_tokens
            if live.result.preemptions == 0:
                live.result.cached_tokens = live.computed
            self.running.append(live)
            n = min(live.todo, budget)
            plan.append((live, n))
            budget -= n
        return plan

    def _preempt(self, live: _Live, events) -> int:
        """Free `live`'s blocks: by recompute (back to the head of the queue, its K/V forgotten) or
        by swap (its K/V copied to CPU memory first). Returns the positions swapped out."""
        self.running.remove(live)
        self.manager.truncate(live.seq, live.computed)   # blocks reserved for the prompt not yet fed
        live.result.preemptions += 1
        moved = 0
        if self.preemption == "swap" and live.computed > 0:
            if self.store is not None:
                table = torch.tensor(live.seq.table, device=self.store.k.device)
                live.swapped = (self.store.k[:, table].to("cpu", copy=True),
                                self.store.v[:, table].to("cpu", copy=True))
            else:
                live.swapped = ()
            moved = live.computed
            self.swapped.append(live)
            events.append((live.result.index, "swap-out", moved))
        else:
            live.result.recomputed_tokens += live.computed
            if self.prefix_caching:
                self.manager.register(live.seq)   # its blocks stay cached: a recompute may reuse them
            live.computed = 0
            self.waiting.appendleft(live)
            events.append((live.result.index, "preempt", 0))
        self.manager.free(live.seq)
        live.seq = None
        return moved

    def _swap_in(self, events) -> int:
        """Swapped-out requests back into the pool, oldest first, while blocks and the batch allow."""
        moved = 0
        while self.swapped and len(self.running) < self.max_batch:
            live = self.swapped[0]
            if blocks_needed(live.computed, self.block_size) > self._free_blocks():
                break
            self.swapped.popleft()
            live.seq = self.manager.new_sequence(live.tokens[:live.computed], reuse=False)
            if self.store is not None:
                table = torch.tensor(live.seq.table, device=self.store.k.device)
                self.store.k[:, table] = live.swapped[0].to(self.store.k.device)
                self.store.v[:, table] = live.swapped[1].to(self.store.v.device)
            live.swapped = None
            self.running.append(live)
            moved += live.computed
            events.append((live.result.index, "swap-in", live.computed))
        return moved

    # --- running a step ------------------------------------------------------------------------------

    def _execute(self, plan) -> list[int | None]:
        """One forward pass over every row of the plan; the next token of each row that needs one."""
        wants = [live.computed + n == len(live.tokens) for live, n in plan]
        if self.model is None:
            return [0 if w else None for w in wants]
        self.view.plan([(live.seq.table, live.computed, n) for live, n in plan])
        ids = [t for live, n in plan for t in live.tokens[live.computed:live.computed + n]]
        device = self.store.k.device
        logits = self.model(torch.tensor([ids], device=device), cache=self.view)[0]
        ends = torch.tensor([n for _, n in plan], device=device).cumsum(0) - 1
        picked = logits[ends].argmax(-1).tolist()   # greedy, at the last fed token of each row
        return [p if w else None for p, w in zip(picked, wants, strict=True)]

    def _timer(self):
        if self.clock == "cpu":
            return time.process_time()
        if self.store is not None:
            _sync(self.store.k.device)   # a GPU runs asynchronously: wait for the step's kernels
        return time.perf_counter()

    def _elapsed(self, started: float, plan, swap_tokens: int) -> float:
        if isinstance(self.clock, RooflineClock):
            return (self.clock.step_seconds([(live.computed, n) for live, n in plan])
                    + self.clock.swap_seconds(swap_tokens))
        if self.clock == "steps":
            return 1.0
        return self._timer() - started

    def _finish_step(self, plan, new, now: float, events) -> int:
        """Record the step's tokens; index finished prompts; let finished requests go. Returns the
        prefill tokens fed (those of rows that were not decoding one output token)."""
        prefill = 0
        for (live, n), token in zip(plan, new, strict=True):
            decoding = live.computed >= len(live.result.request.prompt) and n == 1
            prefill += 0 if decoding else n
            events.append((live.result.index, "decode" if decoding else "prefill", n))
            live.computed += n
            if token is not None:
                live.tokens.append(token)
                live.result.output.append(token)
                live.result.token_times.append(now)
            if self.prefix_caching and not live.prompt_indexed and live.computed == len(live.seq.tokens):
                self.manager.register(live.seq)   # the whole prompt's K/V are written: share them
                live.prompt_indexed = True
            if live.done:
                if self.prefix_caching:
                    self.manager.register(live.seq)
                self.manager.free(live.seq)
                live.seq = None
                self.running.remove(live)
        return prefill


# ---- static batching, for comparison -------------------------------------------------------------------

@torch.inference_mode()
def static_batching(requests, model=None, batch_size: int = 8, clock="cpu",
                    config: ModelConfig | str | None = None, block_size: int = 16) -> Run:
    """Serve requests in fixed batches, as `generate` does with a left-padded batch: a batch starts
    when the previous one has finished, with up to batch_size requests that have arrived; every
    row is padded to the longest prompt and decoded for the longest output. Tokens stream out as
    they are made (TTFT is at the end of the batch's prefill); blocks_used counts what a static
    cache reserves (every row at the batch's full length). model=None simulates (as Scheduler)."""
    batch_size = validate.integer("batch_size", batch_size)
    if model is not None:
        from .sampling import check_model

        cfg = check_model(model).config
    elif config is None:
        raise ValueError("without a model static_batching only simulates: give config= and a "
                         "RooflineClock or clock='steps'")
    else:
        cfg = resolve(config)
    if not (isinstance(clock, RooflineClock) or (isinstance(clock, str) and clock in CLOCKS)):
        raise ValueError(f"clock={clock!r} is not known; allowed: {', '.join(map(repr, CLOCKS))} "
                         "or a RooflineClock")
    if model is None and clock in ("cpu", "wall"):
        raise ValueError(f"clock={clock!r} measures the model's steps, and there is no model: use "
                         "clock='steps' or a RooflineClock")
    requests = check_requests(requests, cfg.vocab_size if model else None,
                              cfg.max_seq_len if model else None)
    results = [RequestResult(r, i) for i, r in enumerate(requests)]
    queue = deque(sorted(results, key=lambda x: (x.request.arrival, x.index)))
    steps, now, fed = [], 0.0, 0
    while queue:
        now = max(now, queue[0].request.arrival)
        batch = [queue.popleft() for _ in range(batch_size) if queue and queue[0].request.arrival <= now]
        prompt_len = max(len(r.request.prompt) for r in batch)
        new = max(r.request.max_new_tokens for r in batch)
        times = _static_step_times(batch, model, prompt_len, new, clock)
        blocks = len(batch) * blocks_needed(prompt_len + new, block_size)
        for j, (seconds, tokens) in enumerate(times):
            start, now = now, now + seconds
            events = []
            for r, token in zip(batch, tokens, strict=True):
                if len(r.output) < r.request.max_new_tokens:
                    r.output.append(token)
                    r.token_times.append(now)
                    events.append((r.index, "prefill" if j == 0 else "decode",
                                   len(r.request.prompt) if j == 0 else 1))
            fed_now = len(batch) * (prompt_len if j == 0 else 1)
            fed += fed_now
            steps.append(StepRecord(len(steps), start, seconds, fed_now if j == 0 else 0,
                                    0 if j == 0 else fed_now, len(batch),
                                    sum(1 for q in queue if q.request.arrival <= now), 0, blocks, 0, events))
    return Run(results, steps, f"static, batches of {batch_size}", 0, fed)


def _static_step_times(batch: list[RequestResult], model, prompt_len: int, new: int,
                       clock) -> list[tuple[float, list[int]]]:
    """(seconds, each row's token) for every step of one padded batch: measured through
    `generate` (a left-padded batch, static cache), or charged by the clock."""
    rows = len(batch)
    if model is None:
        costs = ([clock.step_seconds([(0, prompt_len)] * rows)]
                 + [clock.step_seconds([(prompt_len + j, 1)] * rows) for j in range(new - 1)]
                 if isinstance(clock, RooflineClock) else [1.0] * new)
        return [(c, [0] * rows) for c in costs]
    from .generate import generate

    device = next(model.parameters()).device
    ids = torch.zeros(rows, prompt_len, dtype=torch.long, device=device)
    mask = torch.zeros(rows, prompt_len, dtype=torch.long, device=device)
    for i, r in enumerate(batch):
        p = r.request.prompt
        ids[i, prompt_len - len(p):] = torch.tensor(p)
        mask[i, prompt_len - len(p):] = 1
    def timer():
        if clock == "cpu":
            return time.process_time()
        _sync(device)   # a GPU runs asynchronously: wait for the step's kernels
        return time.perf_counter()

    marks = [timer()]
    out = generate(model, ids, new, cache="static", attention_mask=mask,
                   on_token=lambda step, ids_: marks.append(timer()))
    seconds = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    if clock == "steps":
        seconds = [1.0] * new
    elif isinstance(clock, RooflineClock):
        seconds = [clock.step_seconds([(0, prompt_len)] * rows)] + [
            clock.step_seconds([(prompt_len + j, 1)] * rows) for j in range(new - 1)]
    tokens = out.new_tokens.tolist()
    return [(seconds[j], [row[j] for row in tokens]) for j in range(new)]


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock reading includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alone(model, request: Request) -> list[int]:
    """The request's greedy output generated by itself (`kvlab.generate.generate`, static cache):
    the reference every schedule must reproduce."""
    from .generate import generate

    (request,) = check_requests([request], model.config.vocab_size, model.config.max_seq_len)
    out = generate(model, [request.prompt], request.max_new_tokens, cache="static")
    return out.new_tokens[0].tolist()


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """n arrival times of a Poisson process of `rate` requests per clock unit, from 0."""
    n = validate.integer("n", n)
    rate = validate.number("rate", rate, low=0, low_inclusive=False)
    g = torch.Generator().manual_seed(validate.integer("seed", seed, low=0))
    gaps = torch.empty(n, dtype=torch.float64).exponential_(rate, generator=g)
    gaps[0] = 0.0
    return gaps.cumsum(0).tolist()


__all__ = ["CLOCKS", "PREEMPTIONS", "Request", "RequestResult", "RooflineClock", "Run", "Scheduler",
           "StepRecord", "alone", "check_requests", "gpu_pool_blocks", "poisson_arrivals",
           "static_batching"]
