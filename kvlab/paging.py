"""Paging the KV cache: fixed-size blocks, a free list and one block table per sequence.

Reserving the maximum length for every request wastes most of the KV memory: slots held for
tokens not generated yet, slots never used because the answer ended early (internal
fragmentation), and gaps between variable-size chunks too small for the next request (external
fragmentation). PagedAttention (vLLM, Kwon et al. 2023) instead cuts the memory into blocks of
`block_size` tokens handed out on demand from a free list; a block table maps block i of a
sequence to a physical block anywhere in the pool, so only the last block of each sequence is
partly empty.

Three parts:
- `BlockAllocator`, `blocks_needed`, `wasted_slots`: the free list and its arithmetic.
- `PagedKVCache`: a `kvlab.cache.KVCache` whose storage is a pool of blocks; the K and V the
  attention reads are gathered through the block table. `generate(..., cache="paged")` uses it.
- A fragmentation simulation: `sample_requests` draws a stated mix of request lengths and
  `simulate` serves them from one memory budget under a reservation policy (`POLICIES`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .cache import CACHE_KINDS, KVCache, _check_size
from .config import ModelConfig


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


def blocks_needed(n_tokens: int, block_size: int) -> int:
    """Blocks that hold n_tokens tokens: ceil(n_tokens / block_size)."""
    _check_count("n_tokens", n_tokens)
    _check_size("block_size", block_size)
    return -(-n_tokens // block_size)


def wasted_slots(n_tokens: int, block_size: int) -> int:
    """Empty slots in the last, partly filled block of a sequence of n_tokens tokens."""
    return blocks_needed(n_tokens, block_size) * block_size - n_tokens


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1 from a free list and takes them back.

    The free list is a stack: a freed block is the next one handed out, so memory is reused
    at once and a sequence's blocks end up scattered over the pool (the block table says where).
    """

    def __init__(self, num_blocks: int):
        _check_size("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, 2, … first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int = 1) -> list[int]:
        """Take n free blocks (all or none)."""
        _check_count("n", n)
        if n > self.num_free:
            raise OutOfBlocksError(
                f"out of KV blocks: {self.num_used} of {self.num_blocks} blocks in use, {n} more "
                f"needed; free some sequences or build the pool with more blocks")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks) -> None:
        """Give blocks back to the free list."""
        blocks = [blocks] if isinstance(blocks, int) else list(blocks)
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b!r} is not in use (allowed: the {self.num_used} blocks "
                                 f"handed out and not yet freed); a double free?")
        for b in blocks:
            self._used.remove(b)
            self._free.append(b)

    def __repr__(self) -> str:
        return f"BlockAllocator({self.num_used} of {self.num_blocks} blocks in use)"


class PagedKVCache(KVCache):
    """K and V in a pool of blocks, (L, num_blocks, block_size, H_kv, D) each, read through
    one block table per sequence.

    All layers share the block tables (block i of a sequence sits at the same pool index in
    every layer). Blocks are taken from the free list only when a sequence grows into them, so
    the pool can be smaller than batch_size × max_seq_len. num_blocks defaults to what
    batch_size sequences of max_seq_len tokens need (the same memory as a StaticKVCache).
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype=torch.float32, device="cpu", block_size: int = 16,
                 num_blocks: int | None = None):
        _check_size("batch_size", batch_size)
        _check_size("max_seq_len", max_seq_len)
        _check_size("block_size", block_size)
        if num_blocks is None:
            num_blocks = batch_size * blocks_needed(max_seq_len, block_size)
        _check_size("num_blocks", num_blocks)
        self.config = config
        self.batch_size, self.max_seq_len, self.block_size = batch_size, max_seq_len, block_size
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: list[list[int]] = [[] for _ in range(batch_size)]
        self.lengths = [0] * config.n_layers
        self._slots = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        self.allocations = 2
        self.bytes_copied = 0

    def update(self, layer, k, v):
        self._check_layer(layer)
        b, h, t, d = k.shape
        if b != self.batch_size:
            raise ValueError(f"k has batch {b}; this cache was built for batch_size={self.batch_size}")
        start = self.lengths[layer]
        end = start + t
        slots = self.slots(end)                       # (B, end) physical slot of each position
        k_flat = self.k[layer].view(-1, h, d)         # (num_blocks * block_size, H_kv, D)
        v_flat = self.v[layer].view(-1, h, d)
        new = slots[:, start:end].reshape(-1)
        k_flat[new] = k.transpose(1, 2).reshape(-1, h, d).to(k_flat.dtype)
        v_flat[new] = v.transpose(1, 2).reshape(-1, h, d).to(v_flat.dtype)
        self.lengths[layer] = end
        self.bytes_copied += k.nbytes + v.nbytes
        # Attention reads K and V through the block table: gather, (B, end, H, D) -> (B, H, end, D).
        return k_flat[slots].transpose(1, 2), v_flat[slots].transpose(1, 2)

    def slots(self, n_tokens: int) -> torch.Tensor:
        """Physical slot (block * block_size + offset) of positions 0..n_tokens-1, (B, n_tokens);
        takes blocks from the free list for every sequence that grows into a new block."""
        self._grow(n_tokens)
        if self._slots.shape[1] < n_tokens:
            table = torch.tensor(self.block_tables, dtype=torch.long, device=self._slots.device)
            pos = torch.arange(n_tokens, device=table.device)
            self._slots = table[:, pos // self.block_size] * self.block_size + pos % self.block_size
        return self._slots[:, :n_tokens]

    def _grow(self, n_tokens: int) -> None:
        need = blocks_needed(n_tokens, self.block_size) if n_tokens else 0
        missing = sum(max(0, need - len(table)) for table in self.block_tables)
        if missing > self.allocator.num_free:  # check first: a failed step changes nothing
            raise OutOfBlocksError(
                f"out of KV blocks: {self.allocator.num_used} of {self.allocator.num_blocks} "
                f"blocks in use, {missing} more needed for {n_tokens} tokens × "
                f"{self.batch_size} sequences (block_size={self.block_size}); "
                f"pass a larger num_blocks")
        for table in self.block_tables:
            if need > len(table):
                table.extend(self.allocator.allocate(need - len(table)))

    @property
    def nbytes(self) -> int:
        """Bytes of the block pool (K and V), whether blocks are in use or free."""
        return self.k.nbytes + self.v.nbytes

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def blocks_in_use(self) -> int:
        return self.allocator.num_used

    @property
    def wasted_slots(self) -> int:
        """Slots in blocks handed out that hold no token (the last block of each sequence)."""
        return self.blocks_in_use * self.block_size - self.batch_size * self.seq_len

    def reset(self) -> None:
        """Give every block back to the free list (the pool stays allocated)."""
        for table in self.block_tables:
            self.allocator.free(table)
            table.clear()
        self.lengths = [0] * self.config.n_layers
        self._slots = self._slots[:, :0]

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.config.n_layers}, seq_len={self.seq_len}, "
                f"block_size={self.block_size}, blocks in use={self.blocks_in_use} of "
                f"{self.num_blocks}, nbytes={self.nbytes:,})")


CACHE_KINDS["paged"] = PagedKVCache  # generate(..., cache="paged")


# ---------------------------------------------------------------------------------------------
# Fragmentation simulation
# ---------------------------------------------------------------------------------------------

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
    _check_count("n", n)
    if mix.max_len < 2:
        raise ValueError(f"max_len={mix.max_len} must be >= 2 (one prompt and one output token)")
    for name in ("prompt_median", "output_median"):
        if not getattr(mix, name) > 0:
            raise ValueError(f"{name}={getattr(mix, name)} must be > 0")
    for name in ("prompt_sigma", "output_sigma"):
        if not getattr(mix, name) >= 0:
            raise ValueError(f"{name}={getattr(mix, name)} must be >= 0")
    rng = np.random.default_rng(seed)
    prompt = np.rint(rng.lognormal(math.log(mix.prompt_median), mix.prompt_sigma, n)).astype(int)
    output = np.rint(rng.lognormal(math.log(mix.output_median), mix.output_sigma, n)).astype(int)
    prompt = np.clip(prompt, 1, mix.max_len - 1)
    output = np.clip(output, 1, mix.max_len - prompt)
    return prompt, output


# How much memory a request reserves when it is admitted (contiguous policies), in tokens:
#   "max":   max_len for everyone (the engine cannot know how long the answer will be);
#   "pow2":  the next power of two >= its final length (the length known within 2×);
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
    the address space; "paged": enough free blocks for its prompt); each step every running
    request adds one token and leaves when its output is complete. "paged" takes a block when a
    sequence grows into it and, when none is free, preempts the newest request (its blocks are
    freed and it is queued again to recompute its tokens), as vLLM does; `headroom` (paged only)
    admits a request only if headroom × (running requests) blocks stay free after its prompt,
    trading idle blocks for fewer preemptions. `layout_step` records the memory layout at that
    step as (start slot, length, kind, request) for plotting.
    """
    prompt = np.asarray(prompt_lens, dtype=np.int64).ravel()
    output = np.asarray(output_lens, dtype=np.int64).ravel()
    _check_sim_args(prompt, output, policy, capacity, max_len, block_size)
    if not headroom >= 0:
        raise ValueError(f"headroom={headroom!r} must be >= 0 (free blocks kept per running request)")
    if policy == "paged":
        return _simulate_paged(prompt, output, capacity, block_size, layout_step, headroom)
    total = prompt + output
    reserve = {"max": np.full_like(total, max_len),
               "pow2": np.minimum(2 ** np.ceil(np.log2(total)).astype(np.int64), max_len),
               "exact": total}[policy]
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
    for b in alloc._free:
        layout.append((b * block_size, block_size, "gap", -1))
    return sorted(layout)


def _result(policy, capacity, block_size, acc, counted, running_sum, steps, finished,
            preemptions, layout) -> SimResult:
    frac = acc / (counted * capacity) if counted else np.zeros(5)
    return SimResult(policy, capacity, block_size, *map(float, frac),
                     mean_running=running_sum / counted if counted else 0.0, steps=steps,
                     finished=finished, preemptions=preemptions, layout=layout)


def paged_waste(seq_lens, block_size: int) -> float:
    """Share of the slots in handed-out blocks that hold no token, for sequences of these lengths
    (only each sequence's last block is partly empty)."""
    lens = np.asarray(seq_lens, dtype=np.int64).ravel()
    if lens.size == 0 or lens.min() < 1:
        raise ValueError("seq_lens must be a non-empty list of lengths >= 1")
    _check_size("block_size", block_size)
    held = (-(-lens // block_size) * block_size).sum()
    return float((held - lens.sum()) / held)


def _check_sim_args(prompt, output, policy, capacity, max_len, block_size) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not known; allowed: {', '.join(POLICIES)}")
    _check_size("capacity", capacity)
    _check_size("max_len", max_len)
    _check_size("block_size", block_size)
    if prompt.shape != output.shape or prompt.size == 0:
        raise ValueError(f"prompt_lens and output_lens must be non-empty and of equal length; "
                         f"got {prompt.size} and {output.size}")
    if prompt.min() < 1 or output.min() < 1:
        raise ValueError("every prompt and output length must be >= 1")
    longest = int((prompt + output).max())
    if longest > max_len:
        raise ValueError(f"a request of {longest} tokens exceeds max_len={max_len}")
    biggest = max_len if policy == "max" else longest
    if policy == "paged":
        biggest = blocks_needed(longest, block_size) * block_size
    if biggest > capacity:
        raise ValueError(f"capacity={capacity} slots cannot hold even one request of "
                         f"{biggest} slots ({policy!r} policy); allowed: capacity >= {biggest}")


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")
