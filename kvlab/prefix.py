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
  `update(layer, k, v)` interface, so `kvlab.generate.generate` runs with a reused prefix and
  gives the same tokens as without (tests assert it).
- `simulate_stream`: the index's hit rate on a stream of requests; `sharing` / `prefill_flops`:
  the arithmetic of blocks, bytes and prefill work saved (moving blocks to host memory instead:
  `kvlab.offload`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from . import validate
from .cache import KVCache
from .config import ModelConfig
from .memory import kv_bytes_per_token, param_count
from .paging import BlockAllocator, OutOfBlocksError, blocks_needed

ROOT_HASH = 0  # the "hash" before the first block


def prefix_hashes(tokens, block_size: int) -> list[int]:
    """One key per full block of `tokens`, in order (a partly filled last block has none): the hash
    of the block's tokens and of its parent's key, so it stands for every token up to the block's end."""
    validate.integer("block_size", block_size)
    tokens = list(map(int, tokens))
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
        validate.integer("num_blocks", num_blocks)
        self.block_size = validate.integer("block_size", block_size)
        self.allocator = BlockAllocator(num_blocks)
        self.refs: dict[int, int] = {}
        self.index: dict[int, int] = {}       # block hash -> block
        self.key_of: dict[int, int] = {}      # block -> block hash
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
        """Blocks holding the longest indexed prefix of `tokens` (full blocks only)."""
        blocks = []
        for key in prefix_hashes(tokens, self.block_size):
            if key not in self.index:
                break
            blocks.append(self.index[key])
        return blocks

    def new_sequence(self, prompt, reuse: bool = True) -> Sequence:
        """A sequence for `prompt`: the longest cached prefix shared, new blocks for the rest.

        At least the last prompt token is left to compute (its logits give the first new token),
        so a fully cached prompt reuses all but its last block."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        shared = self.match(prompt) if reuse else []
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
        added = 0
        for block, key in zip(seq.table, prefix_hashes(seq.tokens, self.block_size), strict=False):
            if key not in self.index and block not in self.key_of:
                self.index[key], self.key_of[block] = block, key
                added += 1
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

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype=torch.float32, device="cpu"):
        self.config = config
        self.manager = PrefixBlockManager(num_blocks, block_size, on_copy=self._copy)
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

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
    shared block before writing into it) and returns K, V gathered through the table."""

    def __init__(self, store: PrefixKVStore, seq: Sequence):
        self.store, self.seq, self.config = store, seq, store.config
        self.lengths = [seq.cached_tokens] * store.config.n_layers
        self.batch_size, self.dtype, self.device = 1, store.k.dtype, store.k.device
        self.allocations = self.bytes_copied = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this request points at (shared ones included)."""
        per_block = self.store.nbytes // self.store.manager.num_blocks
        return len(self.seq.table) * per_block

    def update(self, layer, k, v):
        self._check_layer(layer)
        b, h, t, d = k.shape
        if b != 1:
            raise ValueError(f"k has batch {b}; a SharedPagedKVCache holds one sequence (batch 1)")
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
        self.seq.tokens = [int(t) for t in tokens][:self.seq_len]
        return self.store.manager.register(self.seq)

    def fork(self) -> SharedPagedKVCache:
        """A second request continuing from the same positions, sharing every block."""
        other = SharedPagedKVCache(self.store, self.store.manager.fork(self.seq))
        other.lengths = list(self.lengths)
        return other

    def release(self) -> None:
        self.store.manager.free(self.seq)


@dataclass
class Request:
    """What `run_request` did: the new tokens and how many prompt tokens were computed."""

    new_tokens: list[int]
    prompt_len: int
    cached_tokens: int     # prompt tokens whose K/V came from the prefix cache
    computed_tokens: int   # prompt tokens fed through the model (K/V rows computed per layer)
    cache: SharedPagedKVCache


@torch.inference_mode()
def run_request(model, store: PrefixKVStore, prompt, max_new_tokens: int, reuse: bool = True,
                keep: bool = False) -> Request:
    """Greedy decoding of one request through `store`: look up the prompt's longest cached prefix,
    prefill only the tokens after it, decode max_new_tokens, then index the request's full blocks
    for later requests. The request's blocks are released unless `keep` (then call
    `result.cache.release()` when done)."""
    validate.integer("max_new_tokens", max_new_tokens)
    prompt = [int(t) for t in prompt]
    cache = store.cache_for(prompt, reuse)
    device = next(model.parameters()).device
    start = cache.seq_len
    feed = torch.tensor([prompt[start:]], device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model(feed, cache=cache)[0, -1].argmax())
        new.append(nxt)
        feed = torch.tensor([[nxt]], device=device)
    cache.finish(prompt + new)
    if not keep:
        cache.release()
    return Request(new, len(prompt), start, len(prompt) - start, cache)


# ---- arithmetic: blocks, bytes, prefill work -----------------------------------------------------

@dataclass(frozen=True)
class Sharing:
    """Blocks, bytes and prefill work for `users` requests of prefix + suffix tokens."""

    blocks_alone: int
    blocks_shared: int
    bytes_alone: int
    bytes_shared: int
    prefill_tokens_alone: int
    prefill_tokens_shared: int

    @property
    def saved_fraction(self) -> float:
        return 1 - self.blocks_shared / self.blocks_alone


def sharing(users: int, prefix_len: int, suffix_len: int, block_size: int = 16,
            config: ModelConfig | None = None, dtype: str = "fp16") -> Sharing:
    """Without sharing every user holds ceil((prefix + suffix) / block_size) blocks. With it, the
    prefix's full blocks are held once; each user still has its own blocks from the first block
    that is not a full prefix block on. Bytes use `config`'s K/V bytes per token (0 without)."""
    validate.integer("users", users)
    validate.integer("prefix_len", prefix_len, low=0)
    validate.integer("suffix_len", suffix_len)
    validate.integer("block_size", block_size)
    total = blocks_needed(prefix_len + suffix_len, block_size)
    shared_full = prefix_len // block_size
    alone = users * total
    shared = shared_full + users * (total - shared_full)
    per_block = block_size * (kv_bytes_per_token(config, dtype) if config is not None else 0)
    tokens_alone = users * (prefix_len + suffix_len)
    tokens_shared = tokens_alone - (users - 1) * shared_full * block_size
    return Sharing(alone, shared, alone * per_block, shared * per_block, tokens_alone, tokens_shared)


def prefill_flops(config: ModelConfig, n_tokens: int) -> int:
    """About 2 × parameters FLOPs a token (a multiply and an add per weight); attention's own
    score and weighted-sum work, which grows with the context, is left out."""
    validate.integer("n_tokens", n_tokens, low=0)
    return 2 * param_count(config) * n_tokens


# ---- a stream of requests: the index's hit rate --------------------------------------------------

def sample_stream(n_requests: int, n_prefixes: int = 8, prefix_len: int = 512, suffix_len: int = 64,
                  skew: float = 1.0, seed: int = 0, vocab: int = 32000) -> list[list[int]]:
    """Token lists: each request picks one of n_prefixes shared prefixes (system prompts) with a
    Zipf-like popularity (prefix i chosen with weight 1 / (i + 1)**skew) and adds a suffix of
    random tokens of its own. An assumption of this course, not a measured workload."""
    validate.integer("n_requests", n_requests)
    validate.integer("n_prefixes", n_prefixes)
    validate.integer("prefix_len", prefix_len, low=0)
    validate.integer("suffix_len", suffix_len)
    skew = validate.number("skew", skew, low=0)
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, vocab, size=(n_prefixes, prefix_len)).tolist()
    weights = 1 / np.arange(1, n_prefixes + 1) ** skew
    picks = rng.choice(n_prefixes, size=n_requests, p=weights / weights.sum())
    return [prefixes[i] + rng.integers(0, vocab, size=suffix_len).tolist() for i in picks]


@dataclass(frozen=True)
class StreamResult:
    hit_rate: float        # prompt tokens found in the index ÷ prompt tokens
    computed_tokens: int   # prompt tokens whose K/V had to be computed
    prompt_tokens: int
    evictions: int


def simulate_stream(requests, num_blocks: int, block_size: int = 16, output_len: int = 0,
                    concurrent: int = 1) -> StreamResult:
    """Serve `requests` (token lists) in order, `concurrent` at a time, through a
    PrefixBlockManager of num_blocks blocks: each looks up its longest cached prefix, takes
    blocks for the rest, generates output_len tokens (new tokens, never shared), indexes its full
    blocks and ends. Only block bookkeeping: no K/V is computed."""
    validate.integer("concurrent", concurrent)
    validate.integer("output_len", output_len, low=0)
    m = PrefixBlockManager(num_blocks, block_size)
    running: list[Sequence] = []
    fresh = 1 << 40  # generated tokens: ids no prompt uses
    for tokens in requests:
        if len(running) == concurrent:
            m.free(running.pop(0))
        seq = m.new_sequence(tokens)
        m.register(seq)
        for _ in range(output_len):
            m.append(seq, fresh)
            fresh += 1
        m.register(seq)
        running.append(seq)
    prompt = m.queried_tokens
    return StreamResult(m.hit_rate, prompt - m.hit_tokens, prompt, m.evictions)


# ---- offloading: move a block to host memory and back, or compute it again -----------------------
