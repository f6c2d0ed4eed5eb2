"""KV caches behind one small interface the model calls: `update(layer, k, v) -> (K, V)`.

Every cache stores, for each layer, the keys and values of the tokens seen so far, shaped
(B, H_kv, S, D) per layer. The contract every kind keeps (`KVCache`):

- `lengths`: positions filled, one count per layer; `seq_len` is layer 0's;
- `nbytes`: bytes its storage holds;
- `reset()` forgets every position, `set_length(n)` declares how many are filled;
- `check_compatible(config, batch_size, dtype, device)` refuses, up front and naming both sides,
  a cache built for another model or batch (the model calls it on every forward pass).

A new kind of cache never touches the model. `CACHE_KINDS` names every kind `make_cache` builds.
"""

from __future__ import annotations

from functools import partial

import torch

from . import validate
from .config import ModelConfig, resolve
from .quant import QuantizedTensorStore, check_scale_dtype, quantized_layout


class KVCache:
    """The interface. Subclasses implement `update` and `nbytes` and keep `lengths` up to date;
    those that pre-allocate also set `max_seq_len`, `batch_size`, `dtype` and `device`."""

    config: ModelConfig
    lengths: list[int]             # positions filled, per layer
    max_seq_len: int | None = None
    batch_size: int | None = None  # None: not known yet (a DynamicKVCache before its first update)
    dtype: torch.dtype | None = None  # dtype of the K, V handed back to attention
    device: torch.device | None = None
    bytes_copied: int = 0  # bytes written into cache storage so far (copies included)
    allocations: int = 0   # tensors allocated for cache storage so far

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (B, H_kv, T, D) for `layer` after its cached positions; return all K, V."""
        raise NotImplementedError

    @property
    def seq_len(self) -> int:
        """Positions the cache holds (of layer 0; the model fills every layer alike)."""
        return self.lengths[0]

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every position, ready for a new request (pre-allocated storage stays allocated)."""
        self.set_length(0)

    def set_length(self, n: int) -> None:
        """Declare that the first n positions of every layer are filled: whatever the storage holds
        there is what attention reads (a benchmark can 'pretend' n tokens are cached this way)."""
        n = validate.integer("n", n, low=0, high=self.max_seq_len)
        self.lengths = [n] * self.config.n_layers

    def check_compatible(self, config: ModelConfig, batch_size: int, dtype: torch.dtype,
                         device) -> None:
        """Refuse a cache built for another model shape, batch, dtype or device, naming both sides."""
        mine = self.config
        for field in ("n_layers", "n_kv_heads", "head_dim"):
            if getattr(mine, field) != getattr(config, field):
                raise ValueError(f"the cache was built for {field}={getattr(mine, field)}, the model "
                                 f"has {field}={getattr(config, field)}; build it from model.config")
        if self.batch_size is not None and self.batch_size != batch_size:
            raise ValueError(f"the cache holds batch {self.batch_size}, the prompt has batch "
                             f"{batch_size}; build a cache with batch_size={batch_size}")
        if self.dtype is not None and self.dtype != dtype:
            raise ValueError(f"the cache hands back {self.dtype} K/V, the model computes in {dtype}; "
                             f"build the cache with dtype={dtype}")
        if self.device is not None and self.device != device and not _same_device(self.device, device):
            raise ValueError(f"the cache is on {self.device}, the model on {device}; build the "
                             f"cache with device={str(device)!r}")

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

    def _check_batch(self, k: torch.Tensor) -> None:
        if self.batch_size is not None and k.shape[0] != self.batch_size:
            raise ValueError(f"k has batch {k.shape[0]}; this cache was built for "
                             f"batch_size={self.batch_size}")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={self.config.n_layers}, seq_len={self.seq_len}, "
                f"nbytes={self.nbytes:,})")


def _same_device(a, b) -> bool:
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class DynamicKVCache(KVCache):
    """Grows by concatenation: simple, but every step copies the whole cache into a new tensor.
    Its batch, dtype and device are those of the first K, V it receives."""

    def __init__(self, config: ModelConfig | str):
        self.config = config = resolve(config)
        self.keys: list[torch.Tensor | None] = [None] * config.n_layers
        self.values: list[torch.Tensor | None] = [None] * config.n_layers
        self.lengths = [0] * config.n_layers
        self.bytes_copied = 0
        self.allocations = 0

    def update(self, layer, k, v):
        self._check_layer(layer)
        self._check_batch(k)
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
            self.batch_size, self.dtype, self.device = k.shape[0], k.dtype, k.device
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        self.allocations += 2
        self.bytes_copied += self.keys[layer].nbytes + self.values[layer].nbytes
        self.lengths[layer] = self.keys[layer].shape[2]
        return self.keys[layer], self.values[layer]

    def set_length(self, n: int) -> None:
        """Keep the first n positions (a DynamicKVCache can only shrink); 0 empties it."""
        n = validate.integer("n", n, low=0, high=min(self.lengths))
        for layer in range(self.config.n_layers):
            if n == 0:
                self.keys[layer] = self.values[layer] = None
            elif self.keys[layer] is not None:
                self.keys[layer] = self.keys[layer][:, :, :n]
                self.values[layer] = self.values[layer][:, :, :n]
        self.lengths = [n] * self.config.n_layers
        if n == 0:
            self.batch_size = self.dtype = self.device = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values if t is not None)


class StaticKVCache(KVCache):
    """Pre-allocated K and V of shape (L, B, H_kv, S_max, D); each step writes in place."""

    def __init__(self, config: ModelConfig | str, batch_size: int, max_seq_len: int,
                 dtype=torch.float32, device="cpu"):
        self.batch_size = validate.integer("batch_size", batch_size)
        self.max_seq_len = validate.integer("max_seq_len", max_seq_len)
        self.config = config = resolve(config)
        shape = (config.n_layers, batch_size, config.n_kv_heads, max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype, self.device = self.k.dtype, self.k.device
        self.lengths = [0] * config.n_layers
        self.allocations = 2
        self.bytes_copied = 0

    def update(self, layer, k, v):
        self._check_batch(k)
        start, t = self._reserve(layer, k.shape[2]), k.shape[2]
        self.k[layer, :, :, start:start + t] = k
        self.v[layer, :, :, start:start + t] = v
        self.lengths[layer] = start + t
        self.bytes_copied += k.nbytes + v.nbytes
        return self.k[layer, :, :, :start + t], self.v[layer, :, :, :start + t]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


# --- the quantized cache ---------------------------------------------------------------------

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
    cache is left as it was).

    `.nbytes` counts the codes, the scales and the full-precision window at full capacity, all
    pre-allocated for max_seq_len like StaticKVCache (the window is a fixed cost, so the ratio to
    an FP16 cache approaches 0.5 + scales as max_seq_len grows). It can only be emptied
    (`reset()`), not set to another length.
    """

    def __init__(self, config: ModelConfig | str, batch_size: int, max_seq_len: int,
                 dtype=torch.float32, device="cpu", *, bits: int = 8, key_granularity: str = "channel",
                 value_granularity: str = "token", group_size: int = 32, residual: int = 0,
                 scale_dtype: torch.dtype = torch.float16):
        self.batch_size = validate.integer("batch_size", batch_size)
        check_scale_dtype(scale_dtype)
        config = resolve(config)
        layouts = [quantized_layout(config, max_seq_len, g, bits, group_size, residual)
                   for g in (key_granularity, value_granularity)]
        self.config, self.max_seq_len, self.dtype, self.bits = config, max_seq_len, dtype, bits
        self.scale_dtype, self.residual, self.group_size = scale_dtype, residual, group_size
        self.sides = {side: QuantizedTensorStore(layout, config.n_layers, batch_size, dtype,
                                                 scale_dtype, device)
                      for side, layout in zip("kv", layouts, strict=True)}
        self.device = self.sides["k"].codes.device
        self.lengths = [0] * config.n_layers
        self.allocations = 4  # codes and scales for K and V
        self.bytes_copied = 0

    def update(self, layer, k, v):
        self._check_batch(k)
        start, t = self._reserve(layer, k.shape[2]), k.shape[2]
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

    def set_length(self, n: int) -> None:
        """Only 0 (empty the cache): quantized blocks cannot be cut or invented."""
        if validate.integer("n", n, low=0) != 0:
            raise ValueError(f"n={n!r}: a QuantizedKVCache can only be emptied (set_length(0) or "
                             "reset()), not set to another length")
        self.lengths = [0] * self.config.n_layers
        for s in self.sides.values():
            s.reset()


# --- every kind, by name ---------------------------------------------------------------------

def _dynamic(config, batch_size, max_seq_len, dtype=None, device=None) -> DynamicKVCache:
    return DynamicKVCache(config)  # grows to whatever batch, length, dtype and device it is fed


def _paged(config, batch_size, max_seq_len, dtype=torch.float32, device="cpu") -> KVCache:
    from .paging import PagedKVCache  # paging builds on this module: import it when asked for

    return PagedKVCache(config, batch_size, max_seq_len, dtype=dtype, device=device)


# The kinds `generate(..., cache=NAME)` can build: name -> a function
# (config, batch_size, max_seq_len, dtype=..., device=...) -> an empty KVCache.
CACHE_KINDS = {
    "dynamic": _dynamic,
    "static": StaticKVCache,
    "int8": QuantizedKVCache,                     # int8 codes, KIVI-style scales
    "int4": partial(QuantizedKVCache, bits=4),    # the same with int4 codes, two a byte
    "paged": _paged,                              # kvlab.paging.PagedKVCache
}


def make_cache(kind: str, config: ModelConfig | str, batch_size: int, max_seq_len: int,
               dtype=torch.float32, device="cpu") -> KVCache:
    """Build an empty cache by name: one of CACHE_KINDS."""
    if not isinstance(kind, str) or kind not in CACHE_KINDS:
        raise ValueError(f"cache={kind!r} is not a known cache kind; allowed: None, "
                         + ", ".join(repr(k) for k in CACHE_KINDS) + ", or a KVCache object")
    return CACHE_KINDS[kind](config, batch_size, max_seq_len, dtype=dtype, device=device)


# The bounded caches of chapter 09 live in kvlab.window (they subclass KVCache, so they are imported
# after it); not in CACHE_KINDS: their third argument is a window, not a max_seq_len.
from .window import SlidingWindowKVCache  # noqa: E402, F401
