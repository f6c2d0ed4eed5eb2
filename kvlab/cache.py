"""KV caches behind one small interface the model calls: `update(layer, k, v) -> (K, V)`.

Every cache stores, for each layer, the keys and values of the tokens seen so far, shaped
(B, H_kv, S, D) per layer, and reports `.seq_len` (positions filled) and `.nbytes` (bytes its
storage holds). A new kind of cache never touches the model.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .quant import GRANULARITIES, check_bits, pack_int4, quantize, unpack_int4


class KVCache:
    """The interface. Subclasses implement `update` and `nbytes`; caches that pre-allocate keep
    `lengths` (positions filled, per layer), which `seq_len` and `_reserve` read."""

    config: ModelConfig
    bytes_copied: int = 0  # bytes written into cache storage so far (copies included)
    allocations: int = 0   # tensors allocated for cache storage so far

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (B, H_kv, T, D) for `layer` after its cached positions; return all K, V."""
        raise NotImplementedError

    @property
    def seq_len(self) -> int:
        return self.lengths[0]

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def _reserve(self, layer: int, t: int) -> int:
        """First free position of `layer` for t new ones (pre-allocated caches refuse to overflow)."""
        self._check_layer(layer)
        start = self.lengths[layer]
        if start + t > self.max_seq_len:
            raise ValueError(f"cache is full: {start} of {self.max_seq_len} positions used, "
                             f"{t} more requested")
        return start

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.n_layers:
            raise IndexError(f"layer={layer} out of range: the model has "
                             f"{self.config.n_layers} layers (0..{self.config.n_layers - 1})")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={self.config.n_layers}, seq_len={self.seq_len}, "
                f"nbytes={self.nbytes:,})")


class DynamicKVCache(KVCache):
    """Grows by concatenation: simple, but every step copies the whole cache into a new tensor."""

    def __init__(self, config: ModelConfig, batch_size: int | None = None,
                 max_seq_len: int | None = None, dtype=None, device=None):
        self.config = config
        self.keys: list[torch.Tensor | None] = [None] * config.n_layers
        self.values: list[torch.Tensor | None] = [None] * config.n_layers
        self.bytes_copied = 0
        self.allocations = 0

    def update(self, layer, k, v):
        self._check_layer(layer)
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        self.allocations += 2
        self.bytes_copied += self.keys[layer].nbytes + self.values[layer].nbytes
        return self.keys[layer], self.values[layer]

    @property
    def seq_len(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values if t is not None)


class StaticKVCache(KVCache):
    """Pre-allocated K and V of shape (L, B, H_kv, S_max, D); each step writes in place."""

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype=torch.float32, device="cpu"):
        _check_size("batch_size", batch_size)
        _check_size("max_seq_len", max_seq_len)
        self.config = config
        self.max_seq_len = max_seq_len
        shape = (config.n_layers, batch_size, config.n_kv_heads, max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * config.n_layers  # positions filled, per layer
        self.allocations = 2
        self.bytes_copied = 0

    def update(self, layer, k, v):
        start, t = self._reserve(layer, k.shape[2]), k.shape[2]
        self.k[layer, :, :, start:start + t] = k
        self.v[layer, :, :, start:start + t] = v
        self.lengths[layer] = start + t
        self.bytes_copied += k.nbytes + v.nbytes
        return self.k[layer, :, :, :start + t], self.v[layer, :, :, :start + t]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        """Forget every position (the storage stays allocated, ready for the next request)."""
        self.lengths = [0] * self.config.n_layers


def _check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")


# The kinds `generate(..., cache=NAME)` can build; each takes
# (config, batch_size, max_seq_len, dtype=..., device=...). Later chapters add theirs here.
CACHE_KINDS: dict[str, type[KVCache]] = {
    "dynamic": DynamicKVCache,
    "static": StaticKVCache,
}


def make_cache(kind: str, config: ModelConfig, batch_size: int, max_seq_len: int,
               dtype=torch.float32, device="cpu") -> KVCache:
    """Build a cache by name: one of CACHE_KINDS."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache={kind!r} is not a known cache kind; allowed: None, "
                         + ", ".join(repr(k) for k in CACHE_KINDS) + ", or a KVCache object")
    return CACHE_KINDS[kind](config, batch_size, max_seq_len, dtype=dtype, device=device)


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
    full precision too (KIVI keeps such a window). Every value read back is within scale / 2 of what
    was stored, except those still in the full-precision window, which are exact.

    `.nbytes` counts the codes, the scales and the full-precision window at full capacity, all
    pre-allocated for max_seq_len like StaticKVCache (the window is a fixed cost, so the ratio to
    an FP16 cache approaches 0.5 + scales as max_seq_len grows).
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype=torch.float32, device="cpu", *, bits: int = 8, key_granularity: str = "channel",
                 value_granularity: str = "token", group_size: int = 32, residual: int = 0,
                 scale_dtype: torch.dtype = torch.float16):
        _check_size("batch_size", batch_size)
        _check_size("max_seq_len", max_seq_len)
        _check_size("group_size", group_size)
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise ValueError(f"residual={residual!r} must be an integer >= 0")
        width = config.n_kv_heads * config.head_dim
        check_bits(bits)
        if bits == 4 and width % 2:
            raise ValueError(f"bits=4 packs two codes a byte: n_kv_heads × head_dim = {width} must be even")
        self.config, self.max_seq_len, self.dtype, self.bits = config, max_seq_len, dtype, bits
        self.scale_dtype, self.residual, self.group_size = scale_dtype, residual, group_size
        self.sides = {"k": _QuantizedSide(config, batch_size, max_seq_len, key_granularity, bits,
                                          group_size, residual, dtype, scale_dtype, device),
                      "v": _QuantizedSide(config, batch_size, max_seq_len, value_granularity, bits,
                                          group_size, residual, dtype, scale_dtype, device)}
        self.lengths = [0] * config.n_layers
        self.allocations = 4  # codes and scales for K and V
        self.bytes_copied = 0

    def update(self, layer, k, v):
        start, t = self._reserve(layer, k.shape[2]), k.shape[2]
        out = []
        for side, x in (("k", k), ("v", v)):
            written, allocated = self.sides[side].append(layer, x)
            self.bytes_copied += written
            self.allocations += allocated
            out.append(self.sides[side].read(layer))
        self.lengths[layer] = start + t
        return out[0], out[1]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sides.values())

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` as the model sees them (dequantized), each (B, H_kv, S, D)."""
        self._check_layer(layer)
        return self.sides["k"].read(layer), self.sides["v"].read(layer)

    @property
    def key_granularity(self) -> str:
        return self.sides["k"].granularity

    @property
    def value_granularity(self) -> str:
        return self.sides["v"].granularity

    def reset(self) -> None:
        """Forget every position (the storage stays allocated)."""
        self.lengths = [0] * self.config.n_layers
        for s in self.sides.values():
            s.reset()


class _QuantizedSide:
    """The K (or V) half of a QuantizedKVCache: codes, scales and the full-precision window."""

    def __init__(self, config, batch, max_seq_len, granularity, bits, group_size, residual, dtype,
                 scale_dtype, device):
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity={granularity!r} is not known; allowed: "
                             + ", ".join(map(repr, GRANULARITIES)))
        self.granularity, self.bits, self.residual, self.dtype = granularity, bits, residual, dtype
        self.heads, self.head_dim = config.n_kv_heads, config.head_dim
        width = self.heads * self.head_dim
        # Tokens that share a scale: per-token scales need no waiting, the others wait for a block.
        self.block = 1 if granularity == "token" else group_size
        n_blocks = -(-max_seq_len // self.block)
        code_width = width // 2 if bits == 4 else width
        scale_width = width if granularity == "channel" else 1
        self.codes = torch.zeros(config.n_layers, batch, max_seq_len, code_width, dtype=torch.int8,
                                 device=device)
        self.scales = torch.zeros(config.n_layers, batch, n_blocks, 1, scale_width, dtype=scale_dtype,
                                  device=device)
        self.window_capacity = min(residual + self.block - 1, max_seq_len)
        self.window_bytes = (config.n_layers * batch * self.window_capacity * width
                             * torch.empty((), dtype=dtype).element_size())
        self.n_layers, self.batch, self.width, self.device = config.n_layers, batch, width, device
        self.reset()

    def reset(self) -> None:
        self.quantized = [0] * self.n_layers  # tokens stored as codes, a multiple of self.block
        self.window = [torch.zeros(self.batch, 0, self.width, dtype=self.dtype, device=self.device)
                       for _ in range(self.n_layers)]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.window_bytes

    def append(self, layer: int, x: torch.Tensor) -> tuple[int, int]:
        """Add x (B, H, T, D); quantize every block that is complete and older than `residual`.
        Returns (bytes written, tensors allocated)."""
        rows = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], self.width).to(self.dtype)
        window = torch.cat([self.window[layer], rows], dim=1)
        ready = max(window.shape[1] - self.residual, 0) // self.block * self.block
        written = 0
        if ready:
            codes, scales = self._quantize_blocks(window[:, :ready])
            q0, b0 = self.quantized[layer], self.quantized[layer] // self.block
            self.codes[layer, :, q0:q0 + ready] = codes
            self.scales[layer, :, b0:b0 + ready // self.block] = scales
            self.quantized[layer] = q0 + ready
            written = codes.nbytes + scales.nbytes
            window = window[:, ready:].clone()
        self.window[layer] = window
        return written + window.nbytes, 1

    def _quantize_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, n·block, width) -> codes (B, n·block, code width), scales (B, n, 1, scale width)."""
        b, t, w = x.shape
        blocks = x.reshape(b, t // self.block, self.block, w)
        if self.granularity == "tensor":  # one scale per block: a "token" of block·width values
            q = quantize(blocks.reshape(b, t // self.block, 1, self.block * w), "token", self.bits,
                         self.scales.dtype)
        else:
            q = quantize(blocks, self.granularity, self.bits, self.scales.dtype)
        codes = q.data.reshape(b, t, w)
        return (pack_int4(codes) if self.bits == 4 else codes), q.scale

    def read(self, layer: int) -> torch.Tensor:
        """Everything stored for `layer`, dequantized, as (B, H, S, D) in the cache's dtype."""
        n = self.quantized[layer]
        codes = self.codes[layer, :, :n]
        if self.bits == 4:
            codes = unpack_int4(codes)
        b = codes.shape[0]
        scales = self.scales[layer, :, :n // self.block].float()
        values = (codes.float().reshape(b, n // self.block, self.block, self.width) * scales)
        rows = torch.cat([values.reshape(b, n, self.width).to(self.dtype), self.window[layer]], dim=1)
        return rows.reshape(b, rows.shape[1], self.heads, self.head_dim).transpose(1, 2)


CACHE_KINDS["int8"] = QuantizedKVCache
