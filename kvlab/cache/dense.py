"""Dense caches: every position kept, in full precision. Two ways to store them.

- `DynamicKVCache` grows by concatenation: simple, but every step copies the whole cache into a
  new tensor (transformers' DynamicCache works this way).
- `StaticKVCache` pre-allocates (L, B, H_kv, S_max, D) and writes each step in place (transformers'
  StaticCache, gpt-fast).

Both return keys 0..S-1 in order, so the model's causal mask is all they need.
"""

from __future__ import annotations

import torch

from .. import validate
from ..config import ModelConfig, resolve
from .base import KVCache, allocate, float_dtype


class DynamicKVCache(KVCache):
    """Grows by concatenation: every step copies the whole cache into a new tensor.
    Its batch, dtype and device are those of the first K, V it receives."""

    def __init__(self, config: ModelConfig | str):
        self.config = config = resolve(config)
        self.keys: list[torch.Tensor | None] = [None] * config.n_layers
        self.values: list[torch.Tensor | None] = [None] * config.n_layers
        self.lengths = [0] * config.n_layers
        self.bytes_copied = 0
        self.allocations = 0

    def update(self, layer, k, v):
        self._check_update(layer, k, v)
        if self.keys[layer] is None:
            if self.dtype is not None and k.dtype != self.dtype:
                raise ValueError(f"k is {k.dtype}; this cache holds {self.dtype}")
            self.keys[layer], self.values[layer] = k, v
            self.batch_size, self.dtype, self.device = k.shape[0], k.dtype, k.device
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        self.allocations += 2
        self.bytes_copied += self.keys[layer].nbytes + self.values[layer].nbytes
        self.lengths[layer] = self.keys[layer].shape[2]
        return self.keys[layer], self.values[layer]

    def crop(self, n: int) -> None:
        """Keep the first n positions (views of the stored tensors); 0 empties the cache."""
        n = self._crop_length(n)
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
        self.k = allocate(shape, float_dtype(dtype), device, "the K cache")
        self.v = allocate(shape, dtype, device, "the V cache")
        self.dtype, self.device = self.k.dtype, self.k.device
        self.lengths = [0] * config.n_layers
        self.allocations = 2
        self.bytes_copied = 0

    def update(self, layer, k, v):
        t = self._check_update(layer, k, v)
        start = self._reserve(layer, t)
        self.k[layer, :, :, start:start + t] = k
        self.v[layer, :, :, start:start + t] = v
        self.lengths[layer] = start + t
        self.bytes_copied += k.nbytes + v.nbytes
        return self.k[layer, :, :, :start + t], self.v[layer, :, :, :start + t]

    def crop(self, n: int) -> None:
        """Keep the first n positions: later ones are hidden now and overwritten by the next tokens."""
        self.lengths = [self._crop_length(n)] * self.config.n_layers

    def set_length(self, n: int) -> None:
        """Declare that the first n positions of every layer are filled: whatever the storage holds
        there is what attention reads (a benchmark can 'pretend' n tokens are cached this way)."""
        n = validate.integer("n", n, low=0, high=self.max_seq_len)
        self.lengths = [n] * self.config.n_layers

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
