"""The quantized cache: K and V stored as int8 (or int4) codes plus scales (`kvlab.quant`).

`QuantizedLayout` works out how one side (K or V) lays out one sequence of one layer;
`QuantizedTensorStore` stores that side for every layer; `QuantizedKVCache` pairs the two behind the
cache contract; `quantized_cache_bytes` counts the bytes of the same layout without building it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import validate
from ..config import ModelConfig, resolve
from ..quant import GRANULARITIES, check_bits, check_scale_dtype, pack_int4, quantize, unpack_int4
from .base import KVCache, allocate, float_dtype


@dataclass(frozen=True)
class QuantizedLayout:
    """How one side (K or V) of a QuantizedKVCache lays out one sequence of one layer: worked out
    once, used by the cache to allocate and by `quantized_cache_bytes` to count."""

    heads: int          # n_kv_heads
    head_dim: int
    bits: int
    granularity: str
    block: int          # tokens that share a scale: 1 per token, else group_size
    max_seq_len: int
    residual: int       # most recent tokens kept in full precision
    rollback: int = 0   # more recent tokens whose exact values are kept beside their codes (for crop)

    @property
    def width(self) -> int:
        return self.heads * self.head_dim  # values per token

    @property
    def code_width(self) -> int:
        return self.width * self.bits // 8  # int4: two codes a byte (width is even)

    @property
    def n_blocks(self) -> int:
        return -(-self.max_seq_len // self.block)  # ceiling division: a partial block has a scale

    @property
    def scale_width(self) -> int:
        return self.width if self.granularity == "channel" else 1

    @property
    def window_capacity(self) -> int:
        # Exact rows: the residual window, an unfinished block of up to block - 1 tokens, and the
        # rollback positions kept beside their codes.
        return min(self.residual + self.block - 1 + self.rollback, self.max_seq_len)

    def quantized_count(self, held):
        """Positions stored as codes once `held` tokens are held (an int or a tensor), however
        they were fed: every complete block older than the residual window."""
        ready = held - self.residual
        ready = ready.clamp(min=0) if isinstance(ready, torch.Tensor) else max(ready, 0)
        return ready // self.block * self.block

    def nbytes(self, scale_bytes: int, window_bytes: int) -> int:
        return (self.max_seq_len * self.code_width + self.n_blocks * self.scale_width * scale_bytes
                + self.window_capacity * self.width * window_bytes)


def quantized_layout(config, max_seq_len: int, granularity: str, bits: int = 8,
                     group_size: int = 32, residual: int = 0, rollback: int = 0) -> QuantizedLayout:
    """The validated layout of one side of a QuantizedKVCache."""
    validate.choice("granularity", granularity, GRANULARITIES)
    bits = check_bits(bits)
    width = config.n_kv_heads * config.head_dim
    if bits == 4 and width % 2:
        raise ValueError(f"bits=4 packs two codes a byte: n_kv_heads × head_dim = {width} must be even")
    block = 1 if granularity == "token" else validate.integer("group_size", group_size)
    return QuantizedLayout(config.n_kv_heads, config.head_dim, bits, granularity, block,
                           validate.integer("max_seq_len", max_seq_len),
                           validate.integer("residual", residual, low=0),
                           validate.integer("rollback", rollback, low=0))


class QuantizedTensorStore:
    """The K (or V) half of a QuantizedKVCache: codes, scales and the full-precision window."""

    def __init__(self, layout: QuantizedLayout, n_layers: int, batch: int, dtype, scale_dtype,
                 device):
        self.layout, self.dtype, self.device = layout, dtype, device
        self.n_layers, self.batch = n_layers, batch
        self.codes = allocate((n_layers, batch, layout.max_seq_len, layout.code_width), torch.int8,
                              device, "the quantized cache's codes")
        self.scales = allocate((n_layers, batch, layout.n_blocks, 1, layout.scale_width), scale_dtype,
                               device, "the quantized cache's scales")
        # The window grows by concatenation; counted at full capacity, as if pre-allocated.
        element = torch.empty((), dtype=dtype).element_size()
        self.window_bytes = n_layers * batch * layout.window_capacity * layout.width * element
        self.reset()

    def reset(self) -> None:
        self.quantized = [0] * self.n_layers  # tokens stored as codes, a multiple of layout.block
        # Exact rows of positions exact_from.. (B, rows, width): every position not yet quantized,
        # and up to `rollback` more before them (already quantized too) so that a crop can undo it.
        self.exact = [torch.zeros(self.batch, 0, self.layout.width, dtype=self.dtype, device=self.device)
                      for _ in range(self.n_layers)]
        self.exact_from = [0] * self.n_layers

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.window_bytes

    def state(self, layer: int) -> tuple:
        return self.quantized[layer], self.exact[layer], self.exact_from[layer]

    def restore(self, layer: int, state: tuple) -> None:
        self.quantized[layer], self.exact[layer], self.exact_from[layer] = state

    def append(self, layer: int, x: torch.Tensor) -> tuple[int, int]:
        """Add x (B, H, T, D); quantize every block that is complete and older than `residual`.
        Returns (bytes written, tensors allocated)."""
        block, width = self.layout.block, self.layout.width
        rows = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], width).to(self.dtype)
        exact, first = torch.cat([self.exact[layer], rows], dim=1), self.exact_from[layer]
        held = first + exact.shape[1]
        q0, q1 = self.quantized[layer], self.layout.quantized_count(held)
        written = 0
        if q1 > q0:
            codes, scales = self._quantize_blocks(exact[:, q0 - first:q1 - first])
            self.codes[layer, :, q0:q1] = codes
            self.scales[layer, :, q0 // block:q1 // block] = scales
            self.quantized[layer] = q1
            written = codes.nbytes + scales.nbytes
        # Keep the exact rows a crop back by `rollback` tokens needs: those a cache of
        # held - rollback tokens would not yet hold as codes (a whole block, for block scales).
        keep = max(first, min(q1, self.layout.quantized_count(held - self.layout.rollback)))
        if keep > first:
            exact = exact[:, keep - first:].clone()
        self.exact[layer], self.exact_from[layer] = exact, keep
        return written + exact.nbytes, 1

    def crop_floor(self, layer: int) -> int:
        """The smallest n > 0 a crop of `layer` can go to: the codes of positions that a cache of
        n tokens would still hold exactly must have their exact copy."""
        first = self.exact_from[layer]
        if first == 0:
            return 0
        block = self.layout.block
        return self.layout.residual + -(-first // block) * block

    def crop(self, layer: int, n: int) -> None:
        """Keep the first n positions of `layer` (n >= crop_floor): positions a cache of n tokens
        would hold exactly get their exact values back; codes beyond are overwritten later."""
        self.exact[layer] = self.exact[layer][:, :n - self.exact_from[layer]]
        self.quantized[layer] = self.layout.quantized_count(n)

    def _quantize_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, n·block, width) -> codes (B, n·block, code width), scales (B, n, 1, scale width)."""
        b, t, w = x.shape
        block, bits, granularity = self.layout.block, self.layout.bits, self.layout.granularity
        blocks = x.reshape(b, t // block, block, w)
        if granularity == "tensor":  # one scale per block: a "token" of block·width values
            q = quantize(blocks.reshape(b, t // block, 1, block * w), "token", bits, self.scales.dtype)
        else:
            q = quantize(blocks, granularity, bits, self.scales.dtype)
        codes = q.data.reshape(b, t, w)
        return (pack_int4(codes) if bits == 4 else codes), q.scale

    def read(self, layer: int) -> torch.Tensor:
        """Everything stored for `layer`, dequantized, as (B, H, S, D) in the cache's dtype."""
        n, block, width = self.quantized[layer], self.layout.block, self.layout.width
        codes = self.codes[layer, :, :n]
        if self.layout.bits == 4:
            codes = unpack_int4(codes)
        b = codes.shape[0]
        scales = self.scales[layer, :, :n // block].float()
        values = codes.float().reshape(b, n // block, block, width) * scales
        window = self.exact[layer][:, n - self.exact_from[layer]:]
        rows = torch.cat([values.reshape(b, n, width).to(self.dtype), window], dim=1)
        return rows.reshape(b, rows.shape[1], self.layout.heads, self.layout.head_dim).transpose(1, 2)


def quantized_cache_bytes(config, seq_len: int, batch_size: int = 1, bits: int = 8,
                          key_granularity: str = "channel", value_granularity: str = "token",
                          group_size: int = 32, residual: int = 0, scale_bytes: int = 2,
                          window_bytes: int = 2, rollback: int = 0) -> int:
    """Bytes of a QuantizedKVCache holding seq_len positions: codes + scales + the full-precision
    window (`window_bytes` per element: 2 for fp16), with the same layout as the cache."""
    config, batch_size = resolve(config), validate.integer("batch_size", batch_size)
    sides = (quantized_layout(config, seq_len, g, bits, group_size, residual, rollback)
             for g in (key_granularity, value_granularity))
    return config.n_layers * batch_size * sum(s.nbytes(scale_bytes, window_bytes) for s in sides)


class QuantizedKVCache(KVCache):
    """K and V stored as int8 codes plus scales (kvlab.quant), dequantized when the model reads them.

    Storage per layer, token-major: codes (B, S_max, H_kv·D) int8 (int4: two codes a byte) and
    one scale (fp16 by default) per group of values. Granularity per side, as in KIVI:
    `value_granularity="token"` gives each token one scale over all its H_kv·D values, so a token
    is quantized the moment it arrives. `key_granularity="channel"` gives each channel one scale
    per *block* of `group_size` tokens; a block can only be scaled once all its tokens are there,
    so the newest, unfinished block of keys stays in full precision (`dtype`, at most
    group_size - 1 tokens) and is quantized when it fills. ("tensor" works the same way with one
    scale per block.) `residual` more of the most recent tokens of both K and V can be kept in
    full precision too (KIVI keeps such a window). Every value read back is within scale / 2 of
    what was stored (scales rounded up to `scale_dtype`: see `kvlab.quant.quantize`), except those
    still in the full-precision window, which are exact. K/V values above 65504 · qmax (8.3e6 for
    int8) need `scale_dtype=torch.float32`: with fp16 scales they are refused (ValueError, and the
    cache is left as it was).

    The same logits however the tokens are fed: a query sees each position as it would have seen it
    with the tokens fed one at a time (as codes once its block is complete and older than the
    residual window, exactly before), also within a long prompt or a speculative verify step
    (see `_with_earlier_views`). `crop(n)` gives back the state of a cache that was fed n tokens:
    the positions such a cache would hold exactly need their exact values, which the window keeps
    for its own positions and `rollback` keeps for that many more (speculative decoding with k
    guesses needs rollback >= k).

    `.nbytes` counts the codes, the scales and the full-precision window at full capacity, all
    pre-allocated for max_seq_len like StaticKVCache (the window is a fixed cost, so the ratio to
    an FP16 cache approaches 0.5 + scales as max_seq_len grows).
    """

    def __init__(self, config: ModelConfig | str, batch_size: int, max_seq_len: int,
                 dtype=torch.float32, device="cpu", *, bits: int = 8, key_granularity: str = "channel",
                 value_granularity: str = "token", group_size: int = 32, residual: int = 0,
                 rollback: int = 0, scale_dtype: torch.dtype = torch.float16):
        self.batch_size = validate.integer("batch_size", batch_size)
        float_dtype(dtype)
        check_scale_dtype(scale_dtype)
        config = resolve(config)
        layouts = [quantized_layout(config, max_seq_len, g, bits, group_size, residual, rollback)
                   for g in (key_granularity, value_granularity)]
        self.config, self.max_seq_len, self.dtype = config, layouts[0].max_seq_len, dtype
        self.bits = layouts[0].bits
        self.scale_dtype, self.residual, self.group_size = scale_dtype, residual, group_size
        self.rollback = rollback
        self.sides = {side: QuantizedTensorStore(layout, config.n_layers, batch_size, dtype,
                                                 scale_dtype, device)
                      for side, layout in zip("kv", layouts, strict=True)}
        self.device = self.sides["k"].codes.device
        self.lengths = [0] * config.n_layers
        self._views: list[tuple[int, int] | None] = [None] * config.n_layers
        self.allocations = 4  # codes and scales for K and V
        self.bytes_copied = 0

    def update(self, layer, k, v):
        t = self._check_update(layer, k, v)
        start = self._reserve(layer, t)
        # The full-precision rows before this update (a query of this pass may still need them).
        before = {side: (store.exact_from[layer], store.exact[layer]) for side, store in self.sides.items()}
        # A refused value (too large for the scales) must not leave K stored without its V: keep
        # each side's state (its window tensor is replaced on append, never changed in place).
        saved = [(s, s.state(layer)) for s in self.sides.values()]
        try:
            written = [self.sides[side].append(layer, x) for side, x in (("k", k), ("v", v))]
        except ValueError:
            for store, state in saved:
                store.restore(layer, state)
            raise
        self.bytes_copied += sum(n for n, _ in written)
        self.allocations += sum(a for _, a in written)
        self.lengths[layer] = start + t
        keys, values = self.sides["k"].read(layer), self.sides["v"].read(layer)
        return self._with_earlier_views(layer, start, t, keys, values, before, k, v)

    # --- the same logits however the tokens are fed -------------------------------------------
    # Fed one at a time, the query at position p sees position j as codes once j < Q(p + 1) (Q(n):
    # positions quantized when n tokens are held) and exactly before that. A pass of several
    # tokens (a prompt, a speculative verify step) quantizes blocks at its end, which its earlier
    # queries would not yet have seen quantized. For the positions whose state changes within the
    # pass, the cache hands back their other versions as well (keys exact + values exact, keys exact
    # + values as codes, both as codes) and `visible` shows each query the one it would have seen.

    def _quantized_count(self, side: str, held):
        return self.sides[side].layout.quantized_count(held)

    def _with_earlier_views(self, layer, start, t, keys, values, before, k, v):
        end = start + t
        zones = [(self._quantized_count(s, start + 1), self._quantized_count(s, end)) for s in "kv"]
        zones = [z for z in zones if z[0] < z[1]]  # the positions that become codes within this pass
        if not zones:  # none (always so for one token)
            self._views[layer] = None
            return keys, values
        lo, hi = min(z[0] for z in zones), max(z[1] for z in zones)
        now = {"k": keys[:, :, lo:hi], "v": values[:, :, lo:hi]}
        exact = {}
        for side, new in (("k", k), ("v", v)):
            first, rows = before[side]                           # positions first..start - 1, exact
            held = torch.cat([rows.view(*rows.shape[:2], *new.shape[1::2]).transpose(1, 2),
                              new.to(rows.dtype)], dim=2)        # positions first..end - 1, exact
            # Positions below `first` were codes for every query of this pass: no exact copy needed.
            exact[side] = torch.cat([now[side][:, :, :max(first - lo, 0)],
                                     held[:, :, max(lo - first, 0):hi - first]], dim=2)
        self._views[layer] = (lo, hi)
        return (torch.cat([keys, exact["k"], exact["k"], now["k"]], dim=2),
                torch.cat([values, exact["v"], now["v"], now["v"]], dim=2))

    def key_positions(self, layer: int) -> torch.Tensor | None:
        views = self._views[layer]
        if views is None:
            return None
        lo, hi = views
        return torch.cat([torch.arange(self.lengths[layer], device=self.device),
                          torch.arange(lo, hi, device=self.device).repeat(3)])

    def visible(self, query_positions, key_positions, layer=None):
        causal = super().visible(query_positions, key_positions)
        views = None if layer is None else self._views[layer]
        if views is None:
            return causal
        lo, hi = views
        n = self.lengths[layer]
        m = hi - lo
        version = torch.zeros_like(key_positions)                # 0: as stored now
        version[n:] = torch.arange(1, 4, device=key_positions.device).repeat_interleave(m)
        j, p = key_positions[None, :], query_positions[:, None]
        as_codes_k = j < self._quantized_count("k", p + 1)       # what query p saw, one at a time
        as_codes_v = j < self._quantized_count("v", p + 1)
        seen = torch.where(as_codes_k, 3, torch.where(as_codes_v, 2, 1))
        changing = (j >= lo) & (j < hi)
        return causal & torch.where(version == 0, ~changing, version == seen)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sides.values())

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` as the model sees them (dequantized), each (B, H_kv, S, D)."""
        self._check_layer(layer)
        return self.sides["k"].read(layer), self.sides["v"].read(layer)

    @property
    def key_granularity(self) -> str:
        return self.sides["k"].layout.granularity

    @property
    def value_granularity(self) -> str:
        return self.sides["v"].layout.granularity

    @property
    def crop_floor(self) -> int:
        """The smallest n > 0 that `crop` accepts (0 always works): below it, a cache fed only n
        tokens would hold some positions exactly whose exact values are gone."""
        return max(side.crop_floor(layer) for side in self.sides.values()
                   for layer in range(self.config.n_layers))

    def crop(self, n: int) -> None:
        """Keep the first n positions, as if only n tokens had been fed: the positions such a cache
        would hold exactly get their exact values back (the window and `rollback` keep them)."""
        n = self._crop_length(n)
        if n == 0:
            self.lengths = [0] * self.config.n_layers
            for side in self.sides.values():
                side.reset()
            return
        floor = self.crop_floor
        if n < floor:
            raise ValueError(
                f"crop(n={n}): a cache fed {n} tokens would hold some positions exactly whose exact "
                f"values are gone (they were quantized and the window moved on); this cache can crop "
                f"to n >= {floor} (the last {self.seq_len - floor} positions), or to 0. Build it with "
                "rollback=R to keep the exact values of R more tokens")
        for side in self.sides.values():
            for layer in range(self.config.n_layers):
                side.crop(layer, n)
        self.lengths = [n] * self.config.n_layers
