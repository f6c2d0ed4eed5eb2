"""Paging the KV cache: fixed-size blocks, a free list and one block table per sequence.

Reserving the maximum length for every request wastes most of the KV memory: slots held for
tokens not generated yet, slots never used because the answer ended early (internal
fragmentation), and gaps between variable-size chunks too small for the next request (external
fragmentation). PagedAttention (vLLM, Kwon et al. 2023) instead cuts the memory into blocks of
`block_size` tokens handed out on demand from a free list; a block table maps block i of a
sequence to a physical block anywhere in the pool, so only the last block of each sequence is
partly empty.

Here:
- `BlockAllocator`, `blocks_needed`, `wasted_slots`: the free list and its arithmetic.
- `PagedKVCache`: a KV cache whose storage is a pool of blocks; the K and V the attention reads are
  gathered through the block table. `generate(..., cache="paged")` uses it.
How much memory paging saves over reserving the maximum (`paged_waste`, the simulation) is measured
in `kvlab.fragmentation`; prefix sharing over the same blocks is `kvlab.cache.prefix`.
"""

from __future__ import annotations

import numbers

import torch

from .. import validate
from ..config import ModelConfig, resolve
from .base import KVCache, allocate, float_dtype


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


def blocks_needed(n_tokens: int, block_size: int) -> int:
    """Blocks that hold n_tokens tokens: ceil(n_tokens / block_size)."""
    n_tokens = validate.integer("n_tokens", n_tokens, low=0)
    block_size = validate.integer("block_size", block_size)
    return -(-n_tokens // block_size)  # ceiling division: floor division of the negated count


def wasted_slots(n_tokens: int, block_size: int) -> int:
    """Empty slots in the last, partly filled block of a sequence of n_tokens tokens."""
    return blocks_needed(n_tokens, block_size) * block_size - n_tokens


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1 from a free list and takes them back.

    The free list is a stack: a freed block is the next one handed out, so memory is reused
    at once and a sequence's blocks end up scattered over the pool (the block table says where).
    Blocks never handed out are 0, 1, 2, … in order after the freed ones; they are counted, not
    listed, so a pool of 10**12 blocks costs nothing until its blocks are used.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = validate.integer("num_blocks", num_blocks)
        self._freed: list[int] = []   # blocks given back, the last one handed out first
        self._untouched = 0           # blocks _untouched .. num_blocks - 1 were never handed out
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._freed) + self.num_blocks - self._untouched

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def free_blocks(self) -> list[int]:
        """The free block ids, the next one handed out last."""
        return list(range(self.num_blocks - 1, self._untouched - 1, -1)) + self._freed

    def allocate(self, n: int = 1) -> list[int]:
        """Take n free blocks (all or none)."""
        n = validate.integer("n", n, low=0)
        if n > self.num_free:
            raise OutOfBlocksError(
                f"out of KV blocks: {self.num_used} of {self.num_blocks} blocks in use, {n} more "
                f"needed; free some sequences or build the pool with more blocks")
        reused = [self._freed.pop() for _ in range(min(n, len(self._freed)))]
        fresh = list(range(self._untouched, self._untouched + n - len(reused)))
        self._untouched += len(fresh)
        blocks = reused + fresh
        self._used.update(blocks)
        return blocks

    def free(self, blocks) -> None:
        """Give blocks back to the free list: one block id or an iterable of them (all or none)."""
        if isinstance(blocks, numbers.Integral):
            blocks = [blocks]
        elif isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__"):
            raise ValueError(f"blocks={blocks!r} must be a block id or a list of block ids "
                             f"(0..{self.num_blocks - 1})")
        ids = [validate.integer("block", b, low=0) for b in blocks]
        for b in ids:
            if b not in self._used:
                raise ValueError(f"block {b!r} is not in use (allowed: the {self.num_used} blocks "
                                 f"handed out and not yet freed); a double free?")
        if len(set(ids)) != len(ids):
            twice = next(b for b in ids if ids.count(b) > 1)
            raise ValueError(f"block {twice} appears {ids.count(twice)} times in one free() call; "
                             "each block can be freed once")
        for b in ids:
            self._used.remove(b)
            self._freed.append(b)

    def __repr__(self) -> str:
        return f"BlockAllocator({self.num_used} of {self.num_blocks} blocks in use)"


class PagedKVCache(KVCache):
    """K and V in a pool of blocks, (L, num_blocks, block_size, H_kv, D) each, read through
    one block table per sequence.

    All layers share the block tables (block i of a sequence sits at the same pool index in
    every layer). Blocks are taken from the free list only when a sequence grows into them, so
    the pool can be smaller than batch_size × max_seq_len; a sequence never grows past
    max_seq_len, whatever blocks are free. num_blocks defaults to what batch_size sequences of
    max_seq_len tokens need (the same memory as a StaticKVCache).
    """

    def __init__(self, config: ModelConfig | str, batch_size: int, max_seq_len: int,
                 dtype=torch.float32, device="cpu", block_size: int = 16,
                 num_blocks: int | None = None):
        self.batch_size = validate.integer("batch_size", batch_size)
        self.max_seq_len = validate.integer("max_seq_len", max_seq_len)
        self.block_size = validate.integer("block_size", block_size)
        if num_blocks is None:
            num_blocks = batch_size * blocks_needed(max_seq_len, block_size)
        self.config = config = resolve(config)
        self.allocator = BlockAllocator(num_blocks)
        shape = (config.n_layers, self.allocator.num_blocks, block_size, config.n_kv_heads,
                 config.head_dim)
        self.k = allocate(shape, float_dtype(dtype), device, "the paged K pool")
        self.v = allocate(shape, dtype, device, "the paged V pool")
        self.dtype, self.device = self.k.dtype, self.k.device
        self.block_tables: list[list[int]] = [[] for _ in range(batch_size)]
        self.lengths = [0] * config.n_layers
        self._slots = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        self.allocations = 2
        self.bytes_copied = 0

    def update(self, layer, k, v):
        t = self._check_update(layer, k, v)
        b, h, _, d = k.shape
        start = self._reserve(layer, t)
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
        n_tokens = validate.integer("n_tokens", n_tokens, low=0, high=self.max_seq_len)
        self._grow(n_tokens)
        if self._slots.shape[1] < n_tokens:
            table = torch.tensor(self.block_tables, dtype=torch.long, device=self._slots.device)
            pos = torch.arange(n_tokens, device=table.device)
            self._slots = table[:, pos // self.block_size] * self.block_size + pos % self.block_size
        return self._slots[:, :n_tokens]

    def _grow(self, n_tokens: int) -> None:
        need = blocks_needed(n_tokens, self.block_size)
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

    def crop(self, n: int) -> None:
        """Keep the first n positions of every sequence: the blocks after them go back to the free
        list (the last kept block may stay partly filled; the next token writes after position n)."""
        self.set_length(self._crop_length(n))

    def set_length(self, n: int) -> None:
        """Declare the first n positions of every sequence filled: blocks past them go back to the
        free list, blocks up to them are taken from it (a benchmark can 'pretend' n tokens are
        cached this way)."""
        n = validate.integer("n", n, low=0, high=self.max_seq_len)
        keep = blocks_needed(n, self.block_size)
        for table in self.block_tables:
            self.allocator.free(table[keep:])
            del table[keep:]
        self._slots = self._slots[:, :0]   # rebuilt from the tables on the next read
        self._grow(n)
        self.lengths = [n] * self.config.n_layers

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.config.n_layers}, seq_len={self.seq_len}, "
                f"block_size={self.block_size}, blocks in use={self.blocks_in_use} of "
                f"{self.num_blocks}, nbytes={self.nbytes:,})")
