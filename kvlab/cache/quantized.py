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
        # Not yet quantized: the residual window plus an unfinished block of up to block - 1 tokens.
        return min(self.residual + self.block - 1, self.max_seq_len)

    def nbytes(self, scale_bytes: int, window_bytes: int) -> int:
        return (self.max_seq_len * self.code_width + self.n_blocks * self.scale_width * scale_bytes
                + self.window_capacity * self.width * window_bytes)


def quantized_layout(config, max_seq_len: int, granularity: str, bits: int = 8,
                     group_size: int = 32, residual: int = 0) -> QuantizedLayout:
    """The validated layout of one side of a QuantizedKVCache."""
    validate.choice("granularity", granularity, GRANULARITIES)
    bits = check_bits(bits)
    width = config.n_kv_heads * config.head_dim
    if bits == 4 and width % 2:
        raise ValueError(f"bits=4 packs two codes a byte: n_kv_heads × head_dim = {width} must be even")
    block = 1 if granularity == "token" else validate.integer("group_size", group_size)
    return QuantizedLayout(config.n_kv_heads, config.head_dim, bits, granularity, block,
                           validate.integer("max_seq_len", max_seq_len),
                           validate.integer("residual", residual, low=0))


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
        self.window = [torch.zeros(self.batch, 0, self.layout.width, dtype=self.dtype,
                                   device=self.device) for _ in range(self.n_layers)]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.window_bytes

    def append(self, layer: int, x: torch.Tensor) -> tuple[int, int]:
        """Add x (B, H, T, D); quantize every block that is complete and older than `residual`.
        Returns (bytes written, tensors allocated)."""
        block, width = self.layout.block, self.layout.width
        rows = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], width).to(self.dtype)
        window = torch.cat([self.window[layer], rows], dim=1)
        ready = max(window.shape[1] - self.layout.residual, 0) // block * block
        written = 0
        if ready:
            codes, scales = self._quantize_blocks(window[:, :ready])
            q0, b0 = self.quantized[layer], self.quantized[layer] // block
            self.codes[layer, :, q0:q0 + ready] = codes
            self.scales[layer, :, b0:b0 + ready // block] = scales
            self.quantized[layer] = q0 + ready
            written = codes.nbytes + scales.nbytes
            window = window[:, ready:].clone()
        self.window[layer] = window
        return written + window.nbytes, 1

    def crop(self, layer: int, n: int) -> None:
        """Keep the first n positions of `layer`; only positions still in full precision can go."""
        self.window[layer] = self.window[layer][:, :n - self.quantized[layer]]

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
        rows = torch.cat([values.reshape(b, n, width).to(self.dtype), self.window[layer]], dim=1)
        return rows.reshape(b, rows.shape[1], self.layout.heads, self.layout.head_dim).transpose(1, 2)


def quantized_cache_bytes(config, seq_len: int, batch_size: int = 1, bits: int = 8,
                          key_granularity: str = "channel", value_granularity: str = "token",
                          group_size: int = 32, residual: int = 0, scale_bytes: int = 2,
                          window_bytes: int = 2) -> int:
    """Bytes of a QuantizedKVCache holding seq_len positions: codes + scales + the full-precision
    window (`window_bytes` per element: 2 for fp16), with the same layout as the cache."""
    config, batch_size = resolve(config), validate.integer("batch_size", batch_size)
    sides = (quantized_layout(config, seq_len, g, bits, group_size, residual)
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
    cache is left as it was). `crop(n)` can drop only the positions still in full precision.

    `.nbytes` counts the codes, the scales and the full-precision window at full capacity, all
    pre-allocated for max_seq_len like StaticKVCache (the window is a fixed cost, so the ratio to
    an FP16 cache approaches 0.5 + scales as max_seq_len grows).
    """

    def __init__(self, config: ModelConfig | str, batch_size: int, max_seq_len: int,
                 dtype=torch.float32, device="cpu", *, bits: int = 8, key_granularity: str = "channel",
                 value_granularity: str = "token", group_size: int = 32, residual: int = 0,
                 scale_dtype: torch.dtype = torch.float16):
        self.batch_size = validate.integer("batch_size", batch_size)
        float_dtype(dtype)
        check_scale_dtype(scale_dtype)
        config = resolve(config)
        layouts = [quantized_layout(config, max_seq_len, g, bits, group_size, residual)
                   for g in (key_granularity, value_granularity)]
        self.config, self.max_seq_len, self.dtype = config, layouts[0].max_seq_len, dtype
        self.bits = layouts[0].bits
        self.scale_dtype, self.residual, self.group_size = scale_dtype, residual, group_size
        self.sides = {side: QuantizedTensorStore(layout, config.n_layers, batch_size, dtype,
                                                 scale_dtype, device)
                      for side, layout in zip("kv", layouts, strict=True)}
        self.device = self.sides["k"].codes.device
        self.lengths = [0] * config.n_layers
        self.allocations = 4  # codes and scales for K and V
        self.bytes_copied = 0

    def update(self, layer, k, v):
        t = self._check_update(layer, k, v)
        start = self._reserve(layer, t)
        # A refused value (too large for the scales) must not leave K stored without its V: keep
        # each side's state (its window tensor is replaced on append, never changed in place).
        saved = [(s, s.quantized[layer], s.window[layer]) for s in self.sides.values()]
        try:
            written = [self.sides[side].append(layer, x) for side, x in (("k", k), ("v", v))]
        except ValueError:
            for store, quantized, window in saved:
                store.quantized[layer], store.window[layer] = quantized, window
            raise
        self.bytes_copied += sum(n for n, _ in written)
        self.allocations += sum(a for _, a in written)
        self.lengths[layer] = start + t
        return self.sides["k"].read(layer), self.sides["v"].read(layer)

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

    def quantized_positions(self) -> int:
        """Positions already stored as codes (in every layer and on both sides): a crop cannot go
        below it, since a block of codes shares scales computed from all its tokens."""
        return max(max(s.quantized) for s in self.sides.values())

    def crop(self, n: int) -> None:
        """Keep the first n positions. Only the positions still in full precision can be dropped
        (the newest, unfinished block of keys and the `residual` window): positions already
        quantized share their block's scales. Keep a `residual` at least as long as the rollback
        you need (speculative decoding verifies a few tokens at a time)."""
        n = self._crop_length(n)
        if n == 0:
            self.lengths = [0] * self.config.n_layers
            for side in self.sides.values():
                side.reset()
            return
        floor = self.quantized_positions()
        if n < floor:
            raise ValueError(
                f"crop(n={n}): positions 0..{floor - 1} are already quantized in blocks whose scales "
                f"were computed from all their tokens; this cache can crop to n >= {floor} (its last "
                f"{self.seq_len - floor} positions are still in full precision), or to 0. Build it with "
                "residual=R to keep the R newest tokens in full precision")
        for side in self.sides.values():
            for layer in range(self.config.n_layers):
                side.crop(layer, n)
        self.lengths = [n] * self.config.n_layers
