"""A bounded cache for long streams: a sliding window with attention sinks.

A full cache grows by one row per token for ever. `SlidingWindowKVCache` keeps the first `sinks`
tokens and the most recent `window` ones (Mistral's sliding window with sinks=0; StreamingLLM's
"attention sinks", Xiao et al. 2023, with sinks=4), so its storage (`nbytes`) never grows; the price
is that no query can attend to what was dropped, so the output is no longer exact.

The rule, in stream positions: a query at position p sees the key at position j when j <= p and
(j < sinks or p - j < window) — `window` keys counting itself, plus the sinks. The cache says so
through the contract (`key_positions`, `visible`), so the model's mask is right for a prompt longer
than the window, fed in one pass, and for a left-padded batch.
"""

from __future__ import annotations

import torch

from .. import validate
from ..config import ModelConfig, resolve
from ..model import apply_rope, rope_tables
from .base import KVCache, allocate, float_dtype

POSITIONS = ("original", "cache")


class SlidingWindowKVCache(KVCache):
    """The first `sinks` tokens and the most recent `window` ones, in fixed storage.

    Storage: K and V of shape (L, B, H_kv, sinks + window + rollback, D), oldest first. `rollback`
    more of the newest tokens than the window needs are kept, hidden from the queries, so that
    `crop` can take back up to that many tokens (speculative decoding); with rollback=0 a crop can
    only go back while nothing it needs has been evicted.

    Positions. kvlab's model rotates keys by RoPE before they reach the cache:
    - positions="original" (default) keeps every key at the position it had in the text. With a
      window covering the whole sequence the output is exactly the static cache's; a prompt longer
      than the window goes in one pass, with the band mask above. A stream cannot outgrow the
      model's max_seq_len (its RoPE table).
    - positions="cache" numbers keys by their place among the keys a query sees, as StreamingLLM
      does: sinks at 0..sinks-1, the window after them, the newest token last. Keys are stored
      un-rotated and rotated to those places when read, so relative distances never exceed
      sinks + window and the stream can be longer than max_seq_len. Every query then sees its own
      set of keys at its own numbering, so once the cache is full the model feeds one token a pass
      (`max_chunk`); a padding mask is refused (the numbering would count the padding).
    """

    drops_keys = True

    def __init__(self, config: ModelConfig | str, batch_size: int, window: int, sinks: int = 0,
                 dtype=torch.float32, device="cpu", positions: str = "original", rollback: int = 0):
        config = resolve(config)
        self.batch_size = validate.integer("batch_size", batch_size)
        self.window = validate.integer("window", window)
        self.sinks = validate.integer("sinks", sinks, low=0)
        self.rollback = validate.integer("rollback", rollback, low=0)
        self.positions = validate.choice("positions", positions, POSITIONS)
        self.config, self.capacity = config, self.sinks + self.window
        self.renumbers_positions = positions == "cache"
        shape = (config.n_layers, batch_size, config.n_kv_heads, self.capacity + self.rollback,
                 config.head_dim)
        self.k = allocate(shape, float_dtype(dtype), device, "the window's K")
        self.v = allocate(shape, dtype, device, "the window's V")
        self.dtype, self.device = self.k.dtype, self.k.device
        if positions == "cache":
            cos, sin = rope_tables(config.head_dim, self.capacity, config.rope_theta)
            self.cos, self.sin = cos.to(self.device, dtype), sin.to(self.device, dtype)
        self.allocations, self.bytes_copied = 2, 0
        self._reset_counts()

    # --- bookkeeping: stream positions held, as plain ints -------------------------------------
    # Layer i holds the positions p < seen[i] with p < sinks or p >= low[i], oldest first.

    def _reset_counts(self) -> None:
        L = self.config.n_layers
        self.seen, self.low, self._returned = [0] * L, [0] * L, [None] * L

    def _held(self, seen: int, low: int) -> tuple[int, int]:
        """(sinks held, others held) after `seen` tokens with lowest non-sink position `low`."""
        return min(self.sinks, seen), max(0, seen - max(self.sinks, low))

    @property
    def lengths(self) -> list[int]:
        """Tokens fed so far, per layer (more than are stored once the window is full)."""
        return self.seen

    @property
    def stored(self) -> int:
        """Positions held now in layer 0 (at most sinks + window + rollback)."""
        return sum(self._held(self.seen[0], self.low[0]))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def kept_positions(self, layer: int = 0) -> list[int]:
        """Stream positions of the sinks and the window held now, oldest first (the next token
        pushes the oldest of the window out)."""
        self._check_layer(layer)
        seen = self.seen[layer]
        return list(range(min(self.sinks, seen))) + list(range(max(self.sinks, seen - self.window), seen))

    # --- the contract --------------------------------------------------------------------------

    def max_chunk(self, t: int) -> int:
        if self.positions == "original":
            return t  # the band mask gives every query of a long chunk its own window
        room = self.capacity - self.seen[0]
        return t if t <= room else max(room, 1)

    def rope_positions(self, t: int, device=None) -> torch.Tensor:
        return self._rope_positions(self.seen[0], t, device)

    def _rope_positions(self, seen: int, t: int, device) -> torch.Tensor:
        if self.positions == "cache" and seen + t > self.capacity:  # one token (max_chunk): the last place
            return torch.full((t,), self.capacity - 1, device=device)
        return torch.arange(seen, seen + t, device=device)

    def update(self, layer, k, v):
        t = self._check_update(layer, k, v)
        seen, low = self.seen[layer], self.low[layer]
        if self.positions == "cache":  # undo the model's rotation: store keys without a position
            pos = self._rope_positions(seen, t, k.device)  # what the model rotated this layer's keys by
            k = apply_rope(k, self.cos[pos], -self.sin[pos])
        n_sink, n_tail = self._held(seen, low)
        n = n_sink + n_tail
        all_k = torch.cat([self.k[layer, :, :, :n], k.to(self.dtype)], dim=2)   # oldest first
        all_v = torch.cat([self.v[layer, :, :, :n], v.to(self.dtype)], dim=2)
        all_pos = self._positions(seen, low, seen + t, k.device)
        # Keep the sinks and the newest window + rollback tokens for later queries.
        seen2, low2 = seen + t, max(low, seen + t - self.window - self.rollback)
        keep_sink, keep_tail = self._held(seen2, low2)
        m = keep_sink + keep_tail
        for store, new in ((self.k, all_k), (self.v, all_v)):
            store[layer, :, :, :keep_sink] = new[:, :, :keep_sink]
            store[layer, :, :, keep_sink:m] = new[:, :, new.shape[2] - keep_tail:]
        self.seen[layer], self.low[layer] = seen2, low2
        self.bytes_copied += k.nbytes + v.nbytes
        if self.positions == "original":
            self._returned[layer] = all_pos
            return all_k, all_v
        # Cache positions: only what the newest query sees, rotated to places 0..S-1.
        vis_tail = max(0, seen2 - max(self.sinks, seen2 - self.window))
        idx = torch.cat([torch.arange(keep_sink, device=k.device),
                         torch.arange(all_k.shape[2] - vis_tail, all_k.shape[2], device=k.device)])
        keys, values = all_k[:, :, idx], all_v[:, :, idx]
        self._returned[layer] = all_pos[idx]
        s = keys.shape[2]
        return apply_rope(keys, self.cos[:s], self.sin[:s]), values

    def _positions(self, seen: int, low: int, upto: int, device) -> torch.Tensor:
        """Stream positions of the held keys followed by the new ones (seen..upto-1), oldest first."""
        n_sink, n_tail = self._held(seen, low)
        return torch.cat([torch.arange(n_sink, device=device),
                          torch.arange(seen - n_tail, upto, device=device)])

    def key_positions(self, layer: int) -> torch.Tensor:
        return self._returned[layer]

    def visible(self, query_positions, key_positions, layer=None):
        q, j = query_positions[:, None], key_positions[None, :]
        return (j <= q) & ((j < self.sinks) | (q - j < self.window))

    def crop(self, n: int) -> None:
        """Keep the first n positions. Possible while the window of a query at position n is
        still held: n >= (lowest held position) + window - 1, or n = 0; `rollback` keeps that many
        extra tokens so that crops of up to `rollback` tokens always work."""
        n = self._crop_length(n)
        if n == 0:
            self._reset_counts()
            return
        low = self.low[0]
        if low > max(self.sinks, n - self.window + 1):
            floor = low + self.window - 1
            raise ValueError(
                f"crop(n={n}): positions {self.sinks}..{low - 1} were evicted, and a query at "
                f"position {n} would need position {max(self.sinks, n - self.window + 1)}; this cache "
                f"can crop to n >= {floor} or to 0. Build it with rollback=R to keep R more tokens "
                "for rolling back")
        self.seen = [n] * self.config.n_layers

    def __repr__(self) -> str:
        return (f"SlidingWindowKVCache(sinks={self.sinks}, window={self.window}, "
                f"positions={self.positions!r}, rollback={self.rollback}, stored={self.stored}, "
                f"nbytes={self.nbytes:,})")
