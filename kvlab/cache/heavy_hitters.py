"""A bounded cache that keeps what attention uses: heavy hitters (the idea of H2O, Zhang et al. 2023).

`HeavyHitterKVCache` holds a budget of positions per KV head: the `recent` newest ones and the
`sinks` first ones always, the rest chosen by the attention they have received so far (accumulated
softmax weight, summed over the query heads that share the KV head). SnapKV (Li et al. 2024) picks by
attention too, once, after the prompt. Each (sequence, KV head) keeps its own keys, so the cache
reports their positions per head (`key_positions`: (B, H_kv, S)) and the model's mask follows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import validate
from ..config import ModelConfig, resolve
from .base import KVCache, allocate, float_dtype


class HeavyHitterKVCache(KVCache):
    """A budget of `budget` positions per KV head: the `recent` newest and the `sinks` first always,
    the rest by the attention they have received so far.

    The cache needs each step's queries (`needs_queries`: the model hands them over before
    `update`). Keys keep their original positions. When a new token arrives and the budget is
    full, the new token's attention over all budget + 1 keys is added to the scores and the
    lowest-scoring unprotected key of each (sequence, KV head) is dropped before the model
    attends: the model always sees exactly `budget` keys. A prompt longer than the budget is fed
    as far as it fits in one pass, then one token a pass (`max_chunk`). Evicted keys cannot be
    brought back, and the scores hold every query's attention, so `crop` can only keep everything
    or empty the cache.
    """

    needs_queries = True
    drops_keys = True

    def __init__(self, config: ModelConfig | str, batch_size: int, budget: int, recent: int = 1,
                 sinks: int = 0, dtype=torch.float32, device="cpu"):
        config = resolve(config)
        self.batch_size = validate.integer("batch_size", batch_size)
        self.budget = validate.integer("budget", budget, low=2)
        self.recent = validate.integer("recent", recent, low=1, high=budget - 1)
        self.sinks = validate.integer("sinks", sinks, low=0, high=budget - recent - 1)
        self.config = config
        shape = (config.n_layers, batch_size, config.n_kv_heads, budget, config.head_dim)
        self.k = allocate(shape, float_dtype(dtype), device, "the heavy-hitter K")
        self.v = allocate(shape, dtype, device, "the heavy-hitter V")
        self.dtype, self.device = self.k.dtype, self.k.device
        self.score = torch.zeros(shape[:-1], dtype=torch.float32, device=self.device)
        self.pos = torch.zeros(shape[:-1], dtype=torch.long, device=self.device)  # stream positions
        self.allocations, self.bytes_copied = 2, 0
        self.reset()

    @property
    def lengths(self) -> list[int]:
        return self.seen

    @property
    def stored(self) -> int:
        """Positions held now (at most `budget`)."""
        return self.n[0]

    @property
    def nbytes(self) -> int:
        """K and V storage (the scores and positions, bookkeeping, are not counted)."""
        return self.k.nbytes + self.v.nbytes

    def max_chunk(self, t: int) -> int:
        room = self.budget - self.seen[0]
        return t if t <= room else max(room, 1)

    def receive_queries(self, layer: int, q: torch.Tensor) -> None:
        self._check_layer(layer)
        self.queries[layer] = q

    def update(self, layer, k, v):
        t = self._check_update(layer, k, v)
        q = self.queries[layer]
        if q is None:
            raise ValueError("HeavyHitterKVCache needs the queries to score keys: pass it to the model "
                             "(model(ids, cache=cache)), which hands them over before each update")
        self.queries[layer] = None
        n, seen = self.n[layer], self.seen[layer]
        K = torch.cat([self.k[layer, :, :, :n], k.to(self.k.dtype)], dim=2)
        V = torch.cat([self.v[layer, :, :, :n], v.to(self.v.dtype)], dim=2)
        pos = torch.cat([self.pos[layer, :, :, :n],
                         (seen + torch.arange(t, device=k.device)).expand(*K.shape[:2], t)], dim=2)
        score = F.pad(self.score[layer, :, :, :n], (0, t)) + _received(q, K, pos, seen)
        if n + t > self.budget:  # one too many (max_chunk): drop the least attended unprotected key
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

    def key_positions(self, layer: int) -> torch.Tensor:
        return self.pos[layer, :, :, :self.n[layer]]

    def crop(self, n: int) -> None:
        """Only n = seq_len (nothing to do) or n = 0 (empty the cache): evicted keys are gone, and
        the scores that chose them hold the attention of every query so far."""
        n = self._crop_length(n)
        if n == 0:
            self.reset()
        elif n != self.seq_len:
            raise ValueError(f"crop(n={n}): a HeavyHitterKVCache cannot roll back: evicted keys are "
                             "gone and its scores hold the attention of the queries after position "
                             f"{n}; it can only keep all {self.seq_len} positions or crop to 0 (reset)")

    def reset(self) -> None:
        L = self.config.n_layers
        self.n, self.seen = [0] * L, [0] * L
        self.queries: list[torch.Tensor | None] = [None] * L

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
