"""KV caches behind one small interface the model calls: `update(layer, k, v) -> (K, V)`.

Every cache stores, for each layer, the keys and values of the tokens seen so far, shaped
(B, H_kv, S, D) per layer, and reports `.seq_len` (positions filled) and `.nbytes` (bytes its
storage holds). A new kind of cache never touches the model.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    """The interface. Subclasses implement `update`, `seq_len` and `nbytes`."""

    config: ModelConfig
    bytes_copied: int = 0  # bytes written into cache storage so far (copies included)
    allocations: int = 0   # tensors allocated for cache storage so far

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (B, H_kv, T, D) for `layer` after its cached positions; return all K, V."""
        raise NotImplementedError

    @property
    def seq_len(self) -> int:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

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
        self._check_layer(layer)
        start, t = self.lengths[layer], k.shape[2]
        if start + t > self.max_seq_len:
            raise ValueError(f"cache is full: {start} of {self.max_seq_len} positions used, "
                             f"{t} more requested")
        self.k[layer, :, :, start:start + t] = k
        self.v[layer, :, :, start:start + t] = v
        self.lengths[layer] = start + t
        self.bytes_copied += k.nbytes + v.nbytes
        return self.k[layer, :, :, :start + t], self.v[layer, :, :, :start + t]

    @property
    def seq_len(self) -> int:
        return self.lengths[0]

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
