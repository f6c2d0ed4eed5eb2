"""Why paging: serve a stated mix of requests from one KV memory budget, step by step.

`sample_requests` draws prompt and output lengths from a chat-like `RequestMix`; `simulate` serves
them first come, first served under a reservation policy (`POLICIES`: reserve the maximum, the
prompt plus the output rounded up to a power of two, the exact length, or pages of `block_size` from
a `kvlab.cache.paged.BlockAllocator`) and reports how the memory was spent (`SimResult`): tokens,
reserved-but-future slots, internal and external fragmentation. It reproduces the 60–80 % waste
reported for pre-paging systems.
`paged_waste` is the share of slots paging itself leaves empty (each sequence's last block).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from . import validate
from .cache.paged import BlockAllocator, blocks_needed


def paged_waste(seq_lens, block_size: int) -> float:
    """Share of the slots in handed-out blocks that hold no token, for sequences of these lengths
    (only each sequence's last block is partly empty)."""
    lens = token_counts("seq_lens", seq_lens)
    block_size = validate.integer("block_size", block_size)
    held = (-(-lens // block_size) * block_size).sum()
    return float((held - lens.sum()) / held)


MAX_TOKENS = validate.MAX_TOKENS  # a bound on any length, far above any context, far below int64 overflow


def token_counts(name: str, values) -> np.ndarray:
    """`values` as a non-empty 1-D int64 array of whole token counts in [1, MAX_TOKENS]; refuses
    fractions, NaN, booleans and strings instead of truncating them."""
    arr = np.asarray(values)
    if arr.size == 0 or arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be a non-empty list of token counts; got {values!r:.80}")
    arr = arr.ravel()
    bad = ~np.isfinite(arr) | (arr != np.round(arr)) | (arr < 1) | (arr > MAX_TOKENS)
    if bad.any():
        raise ValueError(f"{name} holds {arr[bad][0].item()!r}; every length must be a whole "
                         f"number of tokens >= 1 (and <= 2**40)")
    return arr.astype(np.int64)


@dataclass(frozen=True)
class RequestMix:
    """A chat-like mix of request lengths, in tokens: prompt and output lengths are drawn
    independently from log-normal distributions (a few long requests, many short ones), rounded
    to whole tokens and cut so that prompt + output <= max_len. The medians and spreads are this
    course's assumption, not measurements of a real service."""

    prompt_median: float = 200.0
    prompt_sigma: float = 1.0     # of log(length)
    output_median: float = 150.0
    output_sigma: float = 0.8
    max_len: int = 2048

    def describe(self) -> str:
        return (f"prompt ~ LogNormal(median {self.prompt_median:g}, σ {self.prompt_sigma:g}), "
                f"output ~ LogNormal(median {self.output_median:g}, σ {self.output_sigma:g}), "
                f"prompt + output <= {self.max_len:,} tokens")


def sample_requests(n: int, mix: RequestMix = RequestMix(), seed: int = 0
                    ) -> tuple[np.ndarray, np.ndarray]:
    """n (prompt_len, output_len) pairs from `mix`, each >= 1, summing to <= mix.max_len."""
    n = validate.integer("n", n, low=0)
    max_len = validate.integer("max_len", mix.max_len, low=2)  # one prompt and one output token
    for name in ("prompt_median", "output_median"):
        validate.number(name, getattr(mix, name), low=0, low_inclusive=False)
    for name in ("prompt_sigma", "output_sigma"):
        validate.number(name, getattr(mix, name), low=0)
    rng = np.random.default_rng(seed)
    # Cut to max_len while still floats: an absurd median would overflow int64 (or be inf).
    prompt = np.clip(rng.lognormal(math.log(mix.prompt_median), mix.prompt_sigma, n), 1, max_len - 1)
    output = np.clip(rng.lognormal(math.log(mix.output_median), mix.output_sigma, n), 1, max_len)
    prompt = np.rint(prompt).astype(np.int64)
    output = np.minimum(np.rint(output).astype(np.int64), max_len - prompt)
    return prompt, output


# How much memory a request reserves when it is admitted (contiguous policies), in tokens:
#   "max":   max_len for everyone (the engine cannot know how long the answer will be);
#   "pow2":  its prompt plus its output length rounded up to a power of two (the vLLM paper's
#            Orca (Pow2): it knows the answer's length within 2×), at most max_len;
#   "exact": exactly its final length (an oracle: an upper bound for contiguous reservation);
#   "paged": nothing reserved; blocks of block_size taken as the sequence grows.
POLICIES = ("max", "pow2", "exact", "paged")

# What a slot holds in a recorded layout ("gap": free, between or outside chunks / a free block).
LAYOUT_KINDS = ("prompt", "generated", "future", "internal", "gap")


@dataclass
class SimResult:
    """Time-averaged share of the KV memory, over the steps while requests wait in the queue.

    used: holds K/V of a token; future: reserved for tokens not generated yet; internal:
    reserved but never going to be used (or the empty tail of a paged block); external: free,
    enough in total for the next waiting request, but no single gap is big enough; free: the
    rest (too little even in total for the next request). The five add up to 1.
    """

    policy: str
    capacity: int          # KV memory in token slots
    block_size: int | None
    used: float
    future: float
    internal: float
    external: float
    free: float
    mean_running: float    # sequences decoded at once (averaged over the same steps)
    steps: int             # steps until every request finished
    finished: int
    preemptions: int = 0
    layout: list[tuple[int, int, str, int]] = field(default_factory=list)

    @property
    def waste(self) -> float:
        """Share of the memory that holds no token's K/V."""
        return 1.0 - self.used

    @property
    def reserved_unused(self) -> float:
        """Share of the memory handed to requests that holds no token's K/V."""
        held = self.used + self.future + self.internal
        return (self.future + self.internal) / held if held else 0.0

    def fractions(self) -> dict[str, float]:
        return {"used": self.used, "future": self.future, "internal": self.internal,
                "external": self.external, "free": self.free}


def simulate(prompt_lens, output_lens, policy: str = "max", capacity: int = 65536,
             max_len: int = 2048, block_size: int = 16, layout_step: int | None = None,
             headroom: float = 0.0) -> SimResult:
    """Serve every request from `capacity` token slots of KV memory, one decode step at a time.

    All requests wait in one first-come-first-served queue from step 0 (a busy server). A
    request is admitted when its reservation fits (contiguous policies: first fit into a gap of
    the address space, where the vLLM paper's Orca baselines use a buddy allocator; "paged": enough
    free blocks for its prompt); each step every running request adds one token and leaves when
    its output is complete. "paged" takes a block when a
    sequence grows into it and, when none is free, preempts the newest request (its blocks are
    freed and it is queued again to recompute its tokens), as vLLM does; `headroom` (paged only)
    admits a request only if headroom × (running requests) blocks stay free after its prompt,
    trading idle blocks for fewer preemptions. `layout_step` records the memory layout at that
    step as (start slot, length, kind, request) for plotting.
    """
    prompt = token_counts("prompt_lens", prompt_lens)
    output = token_counts("output_lens", output_lens)
    capacity = validate.integer("capacity", capacity)
    max_len = validate.integer("max_len", max_len)
    block_size = validate.integer("block_size", block_size)
    _check_sim_args(prompt, output, policy, max_len)
    reserve = _reservations(prompt, output, policy, max_len, block_size)
    if int(reserve.max()) > capacity:
        raise ValueError(f"capacity={capacity} slots cannot hold even one request of "
                         f"{int(reserve.max())} slots ({policy!r} policy); allowed: capacity >= "
                         f"{int(reserve.max())}")
    headroom = validate.number("headroom", headroom, low=0)  # free blocks kept per running request
    if layout_step is not None:
        layout_step = validate.integer("layout_step", layout_step, low=0)
    if policy == "paged":
        return _simulate_paged(prompt, output, capacity, block_size, layout_step, headroom)
    total = prompt + output
    queue = deque(range(len(prompt)))
    running: dict[int, int] = {}          # request -> start slot
    generated = np.zeros_like(prompt)
    acc = np.zeros(5)
    steps = counted = running_sum = finished = 0
    layout = []
    while queue or running:
        while queue:                       # admit first come, first served
            r = queue[0]
            start = _first_fit(running, reserve, int(reserve[r]), capacity)
            if start is None:
                break
            running[queue.popleft()] = start
        ids = np.fromiter(running, dtype=np.int64)
        # Nothing changes but the token counts until the next request finishes: take those k
        # steps at once (nobody can be admitted before memory is freed).
        k = int((output[ids] - generated[ids]).min())
        if layout_step is not None and steps <= layout_step < steps + k:
            at = generated.copy()
            at[ids] += layout_step - steps
            layout = _contiguous_layout(running, prompt, at, total, reserve, capacity)
        if queue:                          # memory is the bottleneck: account these steps
            n, ramp = len(ids), len(ids) * k * (k - 1) // 2   # n tokens more each step
            held = int((prompt[ids] + generated[ids]).sum())
            future = int((total[ids]).sum()) - held
            internal = int((reserve[ids] - total[ids]).sum())
            free = capacity - int(reserve[ids].sum())
            fits_in_total = free >= reserve[queue[0]]
            acc += [k * held + ramp, k * future - ramp, k * internal,
                    k * free if fits_in_total else 0, 0 if fits_in_total else k * free]
            counted += k
            running_sum += k * n
        generated[ids] += k
        for r in ids[generated[ids] >= output[ids]]:
            del running[int(r)]
            finished += 1
        steps += k
    return _result(policy, capacity, None, acc, counted, running_sum, steps, finished, 0, layout)


def _first_fit(running: dict[int, int], reserve: np.ndarray, size: int, capacity: int):
    """Lowest start slot of a gap of `size` slots between the running chunks, or None."""
    pos = 0
    for start, r in sorted((s, r) for r, s in running.items()):
        if start - pos >= size:
            return pos
        pos = start + int(reserve[r])
    return pos if capacity - pos >= size else None


def _contiguous_layout(running, prompt, generated, total, reserve, capacity):
    layout, pos = [], 0
    for start, r in sorted((s, r) for r, s in running.items()):
        if start > pos:
            layout.append((pos, start - pos, "gap", -1))
        p, g = int(prompt[r]), int(generated[r])
        for kind, n in (("prompt", p), ("generated", g), ("future", int(total[r]) - p - g),
                        ("internal", int(reserve[r] - total[r]))):
            if n:
                layout.append((start, n, kind, int(r)))
                start += n
        pos = start
    if pos < capacity:
        layout.append((pos, capacity - pos, "gap", -1))
    return layout


def _simulate_paged(prompt, output, capacity, block_size, layout_step, headroom):
    alloc = BlockAllocator(max(capacity // block_size, 1))
    prompt, output = prompt.copy(), output.copy()   # a preempted request's tokens become prompt
    queue = deque(range(len(prompt)))
    tables: dict[int, list[int]] = {}                # running request -> its block table
    generated = np.zeros_like(prompt)
    acc = np.zeros(5)
    steps = counted = running_sum = finished = preemptions = 0
    layout = []
    while queue or tables:
        while queue:
            r = queue[0]
            need = blocks_needed(int(prompt[r]), block_size)
            if need + headroom * len(tables) > alloc.num_free:
                break
            tables[queue.popleft()] = alloc.allocate(need)
        if queue:
            ids = np.fromiter(tables, dtype=np.int64)
            used = (prompt[ids] + generated[ids]).sum()
            held = alloc.num_used * block_size
            # Any free block serves any sequence, so nothing is external fragmentation: the queue
            # waits only because there are too few free blocks in total.
            acc += [used, 0, held - used, 0, capacity - held]
            counted += 1
            running_sum += len(ids)
        if layout_step == steps:
            layout = _paged_layout(tables, prompt, generated, alloc, block_size)
        ids = np.fromiter(tables, dtype=np.int64)   # admission order: oldest first
        grows = (prompt[ids] + generated[ids]) % block_size == 0  # next token opens a block
        while grows.sum() > alloc.num_free:          # too few blocks: preempt the newest
            victim = int(ids[-1])
            alloc.free(tables.pop(victim))
            prompt[victim] += generated[victim]      # recompute its tokens when readmitted
            output[victim] -= generated[victim]
            generated[victim] = 0
            queue.appendleft(victim)
            preemptions += 1
            ids, grows = ids[:-1], grows[:-1]
        for r in ids[grows]:
            tables[int(r)].extend(alloc.allocate(1))
        generated[ids] += 1
        for r in ids[generated[ids] >= output[ids]]:
            alloc.free(tables.pop(int(r)))
            finished += 1
        steps += 1
    return _result("paged", capacity, block_size, acc, counted, running_sum, steps, finished,
                   preemptions, layout)


def _paged_layout(tables, prompt, generated, alloc, block_size):
    layout = []
    for r, table in tables.items():
        p, n = int(prompt[r]), int(prompt[r] + generated[r])
        for i, b in enumerate(table):
            lo, hi = i * block_size, min((i + 1) * block_size, n)
            n_prompt = max(0, min(hi, p) - lo)
            n_gen = max(0, hi - max(lo, p))
            start = b * block_size
            for kind, k in (("prompt", n_prompt), ("generated", n_gen),
                            ("internal", block_size - n_prompt - n_gen)):
                if k > 0:
                    layout.append((start, k, kind, int(r)))
                    start += k
    for b in alloc.free_blocks:
        layout.append((b * block_size, block_size, "gap", -1))
    return sorted(layout)


def _result(policy, capacity, block_size, acc, counted, running_sum, steps, finished,
            preemptions, layout) -> SimResult:
    frac = acc / (counted * capacity) if counted else np.zeros(5)
    return SimResult(policy, capacity, block_size, *map(float, frac),
                     mean_running=running_sum / counted if counted else 0.0, steps=steps,
                     finished=finished, preemptions=preemptions, layout=layout)


def _reservations(prompt, output, policy, max_len, block_size) -> np.ndarray:
    """Slots each request takes at once (see POLICIES); "paged": the blocks of its whole length,
    the most it ever holds."""
    total = prompt + output
    if policy == "max":
        return np.full_like(total, max_len)
    if policy == "pow2":   # the vLLM paper, §6.1: an output of 25 tokens reserves 32 positions
        return np.minimum(prompt + 2 ** np.ceil(np.log2(output)).astype(np.int64), max_len)
    if policy == "paged":
        return -(-total // block_size) * block_size
    return total


def _check_sim_args(prompt, output, policy, max_len) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not known; allowed: {', '.join(POLICIES)}")
    if prompt.shape != output.shape:  # each is non-empty and >= 1 already (token_counts)
        raise ValueError(f"prompt_lens and output_lens must be of equal length; "
                         f"got {prompt.size} and {output.size}")
    longest = int((prompt + output).max())
    if longest > max_len:
        raise ValueError(f"a request of {longest} tokens exceeds max_len={max_len}")
