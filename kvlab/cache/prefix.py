"""Prefix caching: requests that start with the same tokens share the K/V blocks of that prefix.

Many requests begin with the same system prompt or few-shot examples. Their K and V for those
tokens are identical (a token's K/V depend only on it and the tokens before it), so they can be
computed once and shared, as vLLM's automatic prefix caching and SGLang's RadixAttention do:

- `PrefixBlockManager`: paged blocks with reference counts. A full block is indexed by a hash of
  its tokens and of every token before it (vLLM's hashed blocks), so a new request finds the
  longest cached prefix block by block. A block nobody uses any more stays cached until memory
  runs out; then the least recently used one is evicted. `fork` shares every block of a sequence
  (parallel sampling); the first write into a shared, partly filled block copies it first
  (copy-on-write).
- `PrefixKVStore` / `SharedPagedKVCache`: the same manager over real K/V tensors, behind the
  cache contract, so `kvlab.generate.generate` runs with a reused prefix and gives the same tokens
  as without (tests assert it); `fork()` shares every block, `crop(n)` gives blocks back.

A hash only finds a candidate block: a hit also compares the block's tokens and its parent, so two
prompts whose hashes collide (in CPython `hash(-1) == hash(-2)`) never share K/V. Serving requests
through the store and the arithmetic of what sharing saves are in `kvlab.prefix`.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .. import validate
from ..config import ModelConfig, resolve
from .base import KVCache, allocate, float_dtype
from .paged import BlockAllocator, OutOfBlocksError, blocks_needed

ROOT_HASH = 0  # the "hash" before the first block
ROOT = -1      # the "block" before the first block


def token_list(name: str, tokens) -> list[int]:
    """`tokens` as a list of ints >= 0, refusing text, floats, booleans and negative ids (which a
    prefix index must not mistake for other tokens)."""
    if isinstance(tokens, (str, bytes)):
        raise ValueError(f"{name}={tokens!r:.60} is text, not token ids: encode it first")
    if isinstance(tokens, torch.Tensor):
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer token ids; got dtype {tokens.dtype}")
        tokens = tokens.flatten().tolist()
    try:
        out = list(tokens)
    except TypeError:
        raise ValueError(f"{name}={tokens!r:.60} is not a list of token ids") from None
    for t in out:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(f"{name} holds {t!r}: token ids must be integers >= 0")
    return [int(t) for t in out]


def prefix_hashes(tokens, block_size: int) -> list[int]:
    """One key per full block of `tokens`, in order (a partly filled last block has none): the hash
    of the block's tokens and of its parent's key, so it stands for every token up to the block's
    end. Only a candidate: `PrefixBlockManager.match` also compares the tokens."""
    block_size = validate.integer("block_size", block_size)
    tokens = token_list("tokens", tokens)
    keys, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        keys.append(parent)
    return keys


@dataclass
class Sequence:
    """One request's view of the pool: its tokens so far and its block table."""

    tokens: list[int]
    table: list[int]
    cached_tokens: int = 0   # prompt tokens found in the index (their K/V were not computed)


class PrefixBlockManager:
    """Blocks with reference counts, a prefix index of full blocks, LRU eviction of unused ones.

    A block is in one of three states: free (in the allocator's free list), in use (refcount >= 1)
    or cached (refcount 0 but still indexed: a later request with the same prefix revives it).
    Allocation takes free blocks first and evicts cached ones, least recently used first, only
    when none is free. `on_copy(src, dst)` is called on copy-on-write, so a K/V store can copy the
    block's contents.
    """

    def __init__(self, num_blocks: int, block_size: int, on_copy=None):
        num_blocks = validate.integer("num_blocks", num_blocks)
        self.block_size = validate.integer("block_size", block_size)
        self.allocator = BlockAllocator(num_blocks)
        self.refs: dict[int, int] = {}
        self.index: dict[int, int] = {}       # block hash -> block
        self.key_of: dict[int, int] = {}      # block -> block hash
        self.content: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (parent block, its tokens)
        self.unused: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recent first
        self.on_copy = on_copy
        self.hit_tokens = self.queried_tokens = self.evictions = self.copies = 0

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_in_use(self) -> int:
        return len(self.refs)

    @property
    def num_cached(self) -> int:
        return len(self.unused)

    @property
    def hit_rate(self) -> float:
        """Share of the prompt tokens asked for so far that were found in the index."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def match(self, tokens) -> list[int]:
        """Blocks holding the longest indexed prefix of `tokens` (full blocks only): a block whose
        hash matches counts only if its own tokens and its parent block match too."""
        tokens, bs = token_list("tokens", tokens), self.block_size
        blocks, parent = [], ROOT
        for i, key in enumerate(prefix_hashes(tokens, bs)):
            block = self.index.get(key)
            if block is None or self.content[block] != (parent, tuple(tokens[i * bs:(i + 1) * bs])):
                break
            blocks.append(block)
            parent = block
        return blocks

    def new_sequence(self, prompt, reuse: bool = True) -> Sequence:
        """A sequence for `prompt`: the longest cached prefix shared, new blocks for the rest.

        At least the last prompt token is left to compute (its logits give the first new token),
        so a fully cached prompt reuses all but its last block."""
        prompt = token_list("prompt", prompt)
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        shared = self.match(prompt) if validate.boolean("reuse", reuse) else []
        shared = shared[:(len(prompt) - 1) // self.block_size]
        need = blocks_needed(len(prompt), self.block_size) - len(shared)
        for b in shared:
            self._ref(b)
        try:
            fresh = self._take(need)
        except OutOfBlocksError:
            self._release(shared)
            raise
        self.queried_tokens += len(prompt)
        self.hit_tokens += len(shared) * self.block_size
        return Sequence(prompt, shared + fresh, cached_tokens=len(shared) * self.block_size)

    def append(self, seq: Sequence, token: int) -> None:
        """Add one token: a new block when the last is full, a private copy when it is shared."""
        n = len(seq.tokens)
        if n % self.block_size == 0:
            seq.table.extend(self._take(1))
        else:
            self.make_writable(seq, n // self.block_size)
        seq.tokens.append(int(token))

    def make_writable(self, seq: Sequence, i: int) -> int:
        """Block i of seq, copied first if another sequence shares it (copy-on-write)."""
        block = seq.table[i]
        if self.refs[block] > 1:
            (copy,) = self._take(1)
            if self.on_copy is not None:
                self.on_copy(block, copy)
            self._release([block])
            seq.table[i] = block = copy
            self.copies += 1
        return block

    def register(self, seq: Sequence) -> int:
        """Index every full block of seq (after its K/V are written); returns blocks newly indexed."""
        added, parent, bs = 0, ROOT, self.block_size
        for i, (block, key) in enumerate(zip(seq.table, prefix_hashes(seq.tokens, bs), strict=False)):
            if key not in self.index and block not in self.key_of:
                self.index[key], self.key_of[block] = block, key
                self.content[block] = (parent, tuple(seq.tokens[i * bs:(i + 1) * bs]))
                added += 1
            parent = block
        return added

    def fork(self, seq: Sequence) -> Sequence:
        """A second sequence sharing every block of seq (e.g. two samples of one prompt)."""
        for b in seq.table:
            self._ref(b)
        return Sequence(list(seq.tokens), list(seq.table), seq.cached_tokens)

    def free(self, seq: Sequence) -> None:
        """The sequence is done: its blocks lose a reference (indexed ones stay cached)."""
        self._release(seq.table)
        seq.table = []

    def truncate(self, seq: Sequence, n: int) -> None:
        """Keep the first n tokens of seq: the blocks after them lose a reference."""
        keep = blocks_needed(n, self.block_size)
        self._release(seq.table[keep:])
        del seq.table[keep:]
        del seq.tokens[n:]
        seq.cached_tokens = min(seq.cached_tokens, n)

    # -- reference counts -------------------------------------------------------------------

    def _ref(self, block: int) -> None:
        self.refs[block] = self.refs.get(block, 0) + 1
        self.unused.pop(block, None)

    def _release(self, blocks) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                if b in self.key_of:
                    self.unused[b] = None          # most recently used: evicted last
                else:
                    self.allocator.free(b)

    def _take(self, n: int) -> list[int]:
        """n blocks with one reference each: free ones first, then evict cached ones (LRU)."""
        short = n - self.allocator.num_free
        if short > len(self.unused):
            raise OutOfBlocksError(
                f"out of KV blocks: {self.num_in_use} of {self.num_blocks} in use, "
                f"{self.num_cached} cached, {self.allocator.num_free} free; {n} needed")
        for _ in range(max(short, 0)):
            b, _ = self.unused.popitem(last=False)
            del self.index[self.key_of.pop(b)]
            del self.content[b]
            self.allocator.free(b)
            self.evictions += 1
        blocks = self.allocator.allocate(n)
        for b in blocks:
            self.refs[b] = 1
        return blocks


# ---- real K/V: a pool shared by requests ---------------------------------------------------------

class PrefixKVStore:
    """A pool of K/V blocks, (L, num_blocks, block_size, H_kv, D) each, and a PrefixBlockManager.

    `cache_for(prompt)` returns a `SharedPagedKVCache` for one request whose block table starts
    with the cached prefix's blocks; feed it only the tokens after `cache.seq_len`.
    """

    def __init__(self, config: ModelConfig | str, num_blocks: int, block_size: int = 16,
                 dtype=torch.float32, device="cpu"):
        self.config = config = resolve(config)
        self.manager = PrefixBlockManager(num_blocks, block_size, on_copy=self._copy)
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k = allocate(shape, float_dtype(dtype), device, "the prefix store's K pool")
        self.v = allocate(shape, dtype, device, "the prefix store's V pool")

    @property
    def block_size(self) -> int:
        return self.manager.block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _copy(self, src: int, dst: int) -> None:
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def cache_for(self, prompt, reuse: bool = True) -> SharedPagedKVCache:
        return SharedPagedKVCache(self, self.manager.new_sequence(prompt, reuse))


class SharedPagedKVCache(KVCache):
    """One request (batch 1) in a PrefixKVStore. It starts with `cached_tokens` positions already
    filled (the shared prefix); `update` writes new positions through the block table (copying a
    shared block before writing into it) and returns K, V gathered through the table. `release()`
    gives its blocks back; a released cache refuses any further use (ValueError)."""

    def __init__(self, store: PrefixKVStore, seq: Sequence):
        self.store, self.seq, self.config = store, seq, store.config
        self.lengths = [seq.cached_tokens] * store.config.n_layers
        self.batch_size, self.dtype, self.device = 1, store.k.dtype, store.k.device
        self.allocations = self.bytes_copied = 0
        self.released = False

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this request points at (shared ones included)."""
        per_block = self.store.nbytes // self.store.manager.num_blocks
        return len(self.seq.table) * per_block

    def update(self, layer, k, v):
        self._check_alive()
        t = self._check_update(layer, k, v)
        h, d = k.shape[1], k.shape[3]
        start, bs = self.lengths[layer], self.store.block_size
        if layer == 0:
            self._prepare(start, t)
        pos = torch.arange(start + t, device=k.device)
        table = torch.tensor(self.seq.table, dtype=torch.long, device=k.device)
        slots = table[pos // bs] * bs + pos % bs
        k_flat = self.store.k[layer].view(-1, h, d)
        v_flat = self.store.v[layer].view(-1, h, d)
        k_flat[slots[start:]] = k[0].transpose(0, 1).to(k_flat.dtype)
        v_flat[slots[start:]] = v[0].transpose(0, 1).to(v_flat.dtype)
        self.lengths[layer] = start + t
        self.bytes_copied += k.nbytes + v.nbytes
        return k_flat[slots].transpose(0, 1)[None], v_flat[slots].transpose(0, 1)[None]

    def _prepare(self, start: int, t: int) -> None:
        """Before layer 0 writes positions start..start+t-1: blocks for them, private copies of
        shared ones (all layers share the table, so this happens once a step)."""
        m, bs = self.store.manager, self.store.block_size
        for i in range(start // bs, min(blocks_needed(start + t, bs), len(self.seq.table))):
            m.make_writable(self.seq, i)
        missing = blocks_needed(start + t, bs) - len(self.seq.table)
        if missing > 0:
            self.seq.table.extend(m._take(missing))

    def finish(self, tokens) -> int:
        """Record the sequence's tokens (prompt and generated) and index its full blocks, so later
        requests can reuse them; returns the number of blocks newly indexed."""
        self._check_alive()
        self.seq.tokens = token_list("tokens", tokens)[:self.seq_len]
        return self.store.manager.register(self.seq)

    def crop(self, n: int) -> None:
        """Keep the first n positions: blocks after them lose this request's reference (a shared
        block stays with the others; the next write into a shared block copies it first)."""
        self._check_alive()
        n = self._crop_length(n)
        self.store.manager.truncate(self.seq, n)
        self.lengths = [n] * self.config.n_layers

    def fork(self) -> SharedPagedKVCache:
        """A second request continuing from the same positions, sharing every block."""
        self._check_alive()
        other = SharedPagedKVCache(self.store, self.store.manager.fork(self.seq))
        other.lengths = list(self.lengths)
        return other

    def release(self) -> None:
        """Give this request's blocks back (indexed ones stay cached for later requests)."""
        self._check_alive()
        self.store.manager.free(self.seq)
        self.released = True

    def _check_alive(self) -> None:
        if self.released:  # a ValueError, as Python's own for a closed file
            raise ValueError("this SharedPagedKVCache was released: its blocks belong to the pool "
                               "again; ask the store for a new one (store.cache_for(prompt))")
