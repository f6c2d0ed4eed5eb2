"""Bounded KV caches for long streams: a sliding window (with attention sinks) and heavy hitters.

A full cache grows by one row per token for ever. These caches keep a fixed budget of positions
and drop the rest, so their storage (`nbytes`) never grows; the price is that the model can no
longer attend to what was dropped, so the output is no longer exact.

- `SlidingWindowKVCache`: the first `sinks` tokens and the last `window` ones (Mistral's sliding
  window with sinks=0; StreamingLLM's "attention sinks", Xiao et al. 2023, with sinks=4).
- `HeavyHitterKVCache`: a budget of positions chosen by the attention they have received so far,
  plus the most recent ones (the idea of H2O, Zhang et al. 2023; SnapKV, Li et al. 2024, picks
  by attention too, once, after the prompt).

Both implement `kvlab.cache.KVCache.update(layer, k, v) -> (K, V)`. The model builds its causal
mask for `seq_len + T` keys, which only matches what a bounded cache returns while nothing has
been evicted; so a prompt is fed in one pass up to the cache's capacity and one token at a time
after that (`feed` does this; on the one-token decode path the model uses no mask at all).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import validate
from .cache import KVCache
from .config import ModelConfig
from .model import apply_rope, rope_tables

POSITIONS = ("original", "cache")


class _BoundedCache(KVCache):
    """What both bounded caches share: per-layer counts, the capacity and the overflow message."""

    capacity: int

    def _refuse_chunk(self, layer: int, t: int, stored: int) -> None:
        if t > 1 and stored + t > self.capacity:
            raise ValueError(
                f"{type(self).__name__} holds {self.capacity} positions: {stored} stored + {t} new "
                "would evict inside one forward pass, where the model's causal mask cannot say which "
                "keys each query may see; feed the rest one token at a time (kvlab.window.feed does)")

    @property
    def stored(self) -> int:
        """Positions held now (at most `capacity`)."""
        return self.n[0]

    @property
    def lengths(self) -> list[int]:
        """Tokens seen so far, per layer (more than are stored once the cache is full)."""
        return self.seen

    def reset(self) -> None:
        """Forget every position (the storage stays allocated)."""
        L = self.config.n_layers
        self.n, self.seen = [0] * L, [0] * L

    def set_length(self, n: int) -> None:
        """Only 0 (= reset): which positions a bounded cache holds depends on how it got there."""
        if n != 0:
            raise ValueError(f"n={n!r}: a {type(self).__name__} can only be reset to 0 positions")
        self.reset()

    def _storage(self, config, batch_size, dtype, device) -> tuple[int, ...]:
        self.batch_size, self.dtype, self.device = batch_size, dtype, torch.device(device)
        return (config.n_layers, batch_size, config.n_kv_heads, self.capacity, config.head_dim)


class SlidingWindowKVCache(_BoundedCache):
    """The first `sinks` tokens and the most recent `window` ones, in a fixed buffer.

    Storage: K and V of shape (L, B, H_kv, sinks + window, D), written in place; slots after the
    sinks form a ring (token i >= sinks goes to slot sinks + (i - sinks) % window), so `nbytes`
    never changes.

    Positions. kvlab's model rotates keys by RoPE *before* they reach the cache:
    - positions="original" (default) keeps every key at the position it had in the text; the
      model numbers the next token `seq_len` = tokens seen so far. The cached keys are stored as
      given, so with a window covering the whole sequence the output is exactly the static
      cache's. A stream cannot outgrow the model's max_seq_len (its RoPE table).
    - positions="cache" numbers keys by their slot in the cache, as StreamingLLM does: sinks at
      0..sinks-1, the window after them, the newest token last. Keys are stored un-rotated and
      rotated to their cache positions when read, so relative distances never exceed the
      capacity and the stream can be longer than max_seq_len (`seq_len` then stops growing at
      capacity - 1, the position the next token takes).
    """

    def __init__(self, config: ModelConfig, batch_size: int, window: int, sinks: int = 0,
                 dtype=torch.float32, device="cpu", positions: str = "original"):
        validate.integer("batch_size", batch_size)
        validate.integer("window", window)
        validate.integer("sinks", sinks, low=0)
        validate.choice("positions", positions, POSITIONS)
        self.config, self.window, self.sinks, self.positions = config, window, sinks, positions
        self.capacity = sinks + window
        shape = self._storage(config, batch_size, dtype, device)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        if positions == "cache":
            cos, sin = rope_tables(config.head_dim, self.capacity, config.rope_theta)
            self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
        self.allocations, self.bytes_copied = 2, 0
        self.reset()

    @property
    def seq_len(self) -> int:
        """The position the model gives the next token."""
        return self._next_position(self.seen[0])

    def _next_position(self, seen: int) -> int:
        return seen if self.positions == "original" else min(seen, self.capacity - 1)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(self, layer, k, v):
        self._check_layer(layer)
        t, n, seen = k.shape[2], self.n[layer], self.seen[layer]
        self._refuse_chunk(layer, t, n)
        if self.positions == "cache":  # undo the model's rotation: store keys without a position
            pos = self._next_position(seen) + torch.arange(t, device=k.device)
            k = apply_rope(k, self.cos[pos], -self.sin[pos])
        if seen + t <= self.capacity:   # nothing evicted yet: token i sits in slot i
            self.k[layer, :, :, seen:seen + t] = k.to(self.k.dtype)
            self.v[layer, :, :, seen:seen + t] = v.to(self.v.dtype)
        else:                            # one token (checked above) over the oldest in the ring
            slot = self._slot(seen)
            self.k[layer, :, :, slot] = k[:, :, 0].to(self.k.dtype)
            self.v[layer, :, :, slot] = v[:, :, 0].to(self.v.dtype)
        self.seen[layer], self.n[layer] = seen + t, min(n + t, self.capacity)
        self.bytes_copied += k.nbytes + v.nbytes
        keys, values = self._chronological(self.k[layer], layer), self._chronological(self.v[layer], layer)
        if self.positions == "cache":  # rotate to positions 0..n-1 in the cache
            n = keys.shape[2]
            keys = apply_rope(keys, self.cos[:n], self.sin[:n])
        return keys, values

    def _slot(self, i: int) -> int:
        return i if i < self.sinks else self.sinks + (i - self.sinks) % self.window

    def _chronological(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """The stored tokens of x (B, H, capacity, D), oldest first: the sinks, then the ring
        read from its oldest slot on."""
        seen = self.seen[layer]
        if seen <= self.capacity:
            return x[:, :, :seen]
        oldest = self._slot(seen - self.window)
        s = self.sinks
        return torch.cat([x[:, :, :s], x[:, :, oldest:], x[:, :, s:oldest]], dim=2)

    def kept_positions(self, layer: int = 0) -> list[int]:
        """Positions in the text of the tokens held now, oldest first."""
        seen = self.seen[layer]
        return list(range(min(self.sinks, seen))) + list(range(max(self.sinks, seen - self.window), seen))

    def __repr__(self) -> str:
        return (f"SlidingWindowKVCache(sinks={self.sinks}, window={self.window}, "
                f"positions={self.positions!r}, stored={self.stored}, nbytes={self.nbytes:,})")


class HeavyHitterKVCache(_BoundedCache):
    """A budget of `budget` positions per KV head: the `recent` newest ones and the `sinks` first
    ones always, the rest chosen by the attention they have received so far (accumulated softmax
    weight, summed over the query heads that share the KV head), as in H2O.

    The cache needs each step's queries, which `update` does not receive: `watch(model)` hooks
    the model's attention modules so that their queries reach the cache first (`feed` does this).
    Keys keep their original positions. When a new token arrives and the budget is full, the new
    token's attention over all budget + 1 keys is added to the scores, and the lowest-scoring
    unprotected key of each (sequence, KV head) is dropped, before the model attends: the model
    always sees exactly `budget` keys.
    """

    def __init__(self, config: ModelConfig, batch_size: int, budget: int, recent: int = 1,
                 sinks: int = 0, dtype=torch.float32, device="cpu"):
        validate.integer("batch_size", batch_size)
        validate.integer("budget", budget, low=2)
        validate.integer("recent", recent, low=1, high=budget - 1)
        validate.integer("sinks", sinks, low=0, high=budget - recent - 1)
        self.config, self.budget, self.recent, self.sinks = config, budget, recent, sinks
        self.capacity = budget
        shape = self._storage(config, batch_size, dtype, device)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.score = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        self.pos = torch.zeros(shape[:-1], dtype=torch.long, device=device)  # position in the text
        self.allocations, self.bytes_copied = 2, 0
        self.reset()

    @property
    def seq_len(self) -> int:
        return self.seen[0]

    @property
    def nbytes(self) -> int:
        """K and V storage (the scores and positions, bookkeeping, are not counted)."""
        return self.k.nbytes + self.v.nbytes

    def watch(self, model) -> _QueryHooks:
        """`with cache.watch(model): …`: hand every attention layer's queries to this cache."""
        return _QueryHooks(model, self)

    def update(self, layer, k, v):
        self._check_layer(layer)
        q = self.queries[layer]
        if q is None:
            raise ValueError("HeavyHitterKVCache needs the queries to score keys: run the model "
                             "inside `with cache.watch(model):` (kvlab.window.feed does)")
        self.queries[layer] = None
        t, n, seen = k.shape[2], self.n[layer], self.seen[layer]
        self._refuse_chunk(layer, t, n)
        K = torch.cat([self.k[layer, :, :, :n], k.to(self.k.dtype)], dim=2)
        V = torch.cat([self.v[layer, :, :, :n], v.to(self.v.dtype)], dim=2)
        pos = torch.cat([self.pos[layer, :, :, :n],
                         (seen + torch.arange(t, device=k.device)).expand(*K.shape[:2], t)], dim=2)
        score = F.pad(self.score[layer, :, :, :n], (0, t)) + _received(q, K, pos, seen)
        if n + t > self.budget:  # one too many: drop the least attended unprotected key
            protected = (pos < self.sinks) | (pos >= seen + t - self.recent)
            victim = score.masked_fill(protected, float("inf")).argmin(-1, keepdim=True)
            keep = torch.ones_like(score, dtype=torch.bool).scatter_(-1, victim, False)
            b, h, _, d = K.shape
            K, V = K[keep].view(b, h, -1, d), V[keep].view(b, h, -1, d)
            pos, score = pos[keep].view(b, h, -1), score[keep].view(b, h, -1)
        m = K.shape[2]
        self.k[layer, :, :, :m], self.v[layer, :, :, :m] = K, V
        self.pos[layer, :, :, :m], self.score[layer, :, :, :m] = pos, score
        self.n[layer], self.seen[layer] = m, seen + t
        self.bytes_copied += k.nbytes + v.nbytes
        return self.k[layer, :, :, :m], self.v[layer, :, :, :m]

    def reset(self) -> None:
        super().reset()
        self.queries = [None] * self.config.n_layers

    def kept_positions(self, layer: int = 0, batch: int = 0, head: int = 0) -> list[int]:
        """Positions in the text of the keys one (sequence, KV head) holds now, oldest first."""
        return sorted(self.pos[layer, batch, head, :self.n[layer]].tolist())

    def __repr__(self) -> str:
        return (f"HeavyHitterKVCache(budget={self.budget}, recent={self.recent}, sinks={self.sinks}, "
                f"stored={self.stored}, nbytes={self.nbytes:,})")


def _received(q: torch.Tensor, K: torch.Tensor, key_pos: torch.Tensor, start: int) -> torch.Tensor:
    """Attention weight each key receives from the new queries q (B, H, T, D), summed over the
    queries and over the query heads sharing a KV head: (B, H_kv, S). Queries see keys up to their
    own position (causal)."""
    b, h_q, t, d = q.shape
    h_kv = K.shape[1]
    qg = q.view(b, h_kv, h_q // h_kv, t, d).float()
    scores = qg @ K.float()[:, :, None].transpose(-2, -1) / math.sqrt(d)  # (B, H_kv, G, T, S)
    q_pos = start + torch.arange(t, device=q.device)
    visible = key_pos[:, :, None, None, :] <= q_pos[:, None]               # (B, H_kv, 1, T, S)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return weights.sum(dim=(2, 3))


def queries(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The RoPE-rotated queries (B, H, T, D) that kvlab.model.Attention computes from its input x."""
    b, t, _ = x.shape
    q = attn.qkv(x).split(attn.split, dim=-1)[0]
    return apply_rope(q.view(b, t, attn.n_heads, attn.head_dim).transpose(1, 2), cos, sin)


class _QueryHooks:
    """Forward pre-hooks on every attention module: queries go to `cache.queries[layer]`."""

    def __init__(self, model, cache):
        self.model, self.cache, self.handles = model, cache, []

    def __enter__(self):
        def hook(attn, args, kwargs):
            x, cos, sin, _mask, cache, layer = (list(args) + [None] * 6)[:6]
            cache, layer = kwargs.get("cache", cache), kwargs.get("layer", layer)
            if cache is self.cache:
                self.cache.queries[layer] = queries(attn, x, cos, sin)
        self.handles = [blk.attn.register_forward_pre_hook(hook, with_kwargs=True)
                        for blk in self.model.layers]
        return self.cache

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []


@torch.inference_mode()
def feed(model, input_ids, cache: KVCache) -> torch.Tensor:
    """Run input_ids (B, T) through the model with `cache`; return the logits (B, T, vocab).

    A bounded cache gets one forward pass for as many tokens as it can hold without evicting,
    then one token at a time; any other cache gets the whole input in one pass.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=next(model.parameters()).device)
    if ids.dim() == 1:
        ids = ids[None]
    watch = cache.watch(model) if isinstance(cache, HeavyHitterKVCache) else _Nothing()
    out = []
    with watch:
        if not isinstance(cache, _BoundedCache):
            return model(ids, cache=cache)
        first = max(1, min(ids.shape[1], cache.capacity - cache.stored))
        out.append(model(ids[:, :first], cache=cache))
        for i in range(first, ids.shape[1]):
            out.append(model(ids[:, i:i + 1], cache=cache))
    return torch.cat(out, dim=1)


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def token_losses(model, input_ids, cache: KVCache | None = None) -> torch.Tensor:
    """Next-token cross-entropy (nats) at every position of input_ids (B, T): (B, T - 1).
    Without a cache the whole sequence goes through the model in one pass (full attention)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=next(model.parameters()).device)
    if ids.dim() == 1:
        ids = ids[None]
    with torch.inference_mode():
        logits = model(ids) if cache is None else feed(model, ids, cache)
    logits = logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                           reduction="none").view(ids.shape[0], -1)


@torch.inference_mode()
def attention_maps(model, input_ids) -> list[torch.Tensor]:
    """Attention weights of every layer for input_ids (B, T) with full causal attention:
    one (B, H, T, T) tensor a layer (row: query, column: key)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=next(model.parameters()).device)
    if ids.dim() == 1:
        ids = ids[None]
    maps = []

    def hook(attn, args, kwargs):
        x, cos, sin = args[:3]
        q = queries(attn, x, cos, sin)
        k = attn.qkv(x).split(attn.split, dim=-1)[1]
        b, t, _ = x.shape
        k = apply_rope(k.view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2), cos, sin)
        k = k.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)
        scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(attn.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        maps.append(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1))

    handles = [blk.attn.register_forward_pre_hook(hook, with_kwargs=True) for blk in model.layers]
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return maps


# ---- comparing policies at one budget ------------------------------------------------------------

# "full" keeps everything; the others keep `budget` positions. The window policies number keys by
# their place in the cache (StreamingLLM's choice, positions="cache"); heavy hitters keep half the
# budget for the most recent tokens (as H2O's experiments do) and choose the other half by score.
POLICIES = ("full", "window", "sinks + window", "heavy hitters")


def bounded_cache(policy: str, config: ModelConfig, batch_size: int, budget: int, sinks: int = 4,
                  dtype=torch.float32, device="cpu") -> KVCache | None:
    """The cache of `policy` holding `budget` positions (None for "full": no cache, full attention)."""
    validate.choice("policy", policy, POLICIES)
    validate.integer("budget", budget, low=2)
    if policy == "full":
        return None
    if policy == "window":
        return SlidingWindowKVCache(config, batch_size, budget, 0, dtype, device, positions="cache")
    if policy == "sinks + window":
        validate.integer("sinks", sinks, low=1, high=budget - 1)
        return SlidingWindowKVCache(config, batch_size, budget - sinks, sinks, dtype, device,
                                    positions="cache")
    return HeavyHitterKVCache(config, batch_size, budget, recent=budget // 2, dtype=dtype, device=device)


def loss_vs_budget(model, input_ids, budgets, policies=POLICIES, sinks: int = 4) -> dict[str, list]:
    """Next-token loss (nats) at each position of input_ids (B, T), averaged over the batch, for each
    policy and budget: {policy: [tensor (T - 1,) for each budget]} ("full" is computed once and
    repeated). `.mean()` of one gives the loss over the whole stream."""
    param = next(model.parameters())
    out: dict[str, list] = {}
    for policy in policies:
        if policy == "full":
            out[policy] = [token_losses(model, input_ids).mean(0)] * len(budgets)
            continue
        out[policy] = [token_losses(model, input_ids, bounded_cache(
            policy, model.config, input_ids.shape[0], b, sinks, param.dtype, param.device)).mean(0)
            for b in budgets]
    return out
