"""KV caches, the subject of the course: one contract, every kind behind it.

    from kvlab.cache import StaticKVCache, make_cache, CACHE_KINDS

- `base`: the contract (`KVCache`): update, which keys each query may see, seq_len, crop, reset,
  fork, nbytes, check_compatible. The model and `generate` use nothing else.
- `dense`: `DynamicKVCache` (grows by concatenation), `StaticKVCache` (pre-allocated, in place).
- `quantized`: `QuantizedKVCache` (int8 / int4 codes and scales), `quantized_cache_bytes`.
- `paged`: `PagedKVCache` (a pool of blocks and block tables), `BlockAllocator`, `blocks_needed`.
- `prefix`: `PrefixKVStore` / `SharedPagedKVCache` (shared prefix blocks, copy-on-write, an index).
- `ragged`: `RaggedPagedKVCache` (rows of their own lengths packed into one pass: `kvlab.scheduler`).
- `window`: `SlidingWindowKVCache` (a window with attention sinks).
- `heavy_hitters`: `HeavyHitterKVCache` (keeps the keys attention used most, H2O).

`CACHE_KINDS` names the kinds `make_cache` (and `generate(..., cache=NAME)`) builds from
(config, batch_size, max_seq_len); the bounded kinds take a window or a budget instead and are
built directly.
"""

from __future__ import annotations

from functools import partial

import torch

from ..config import ModelConfig
from .base import KVCache
from .dense import DynamicKVCache, StaticKVCache
from .heavy_hitters import HeavyHitterKVCache
from .paged import BlockAllocator, OutOfBlocksError, PagedKVCache, blocks_needed
from .prefix import PrefixKVStore, SharedPagedKVCache
from .quantized import QuantizedKVCache, quantized_cache_bytes
from .ragged import RaggedPagedKVCache
from .window import SlidingWindowKVCache


def _dynamic(config, batch_size, max_seq_len, dtype=None, device=None) -> DynamicKVCache:
    return DynamicKVCache(config)  # grows to whatever batch, length, dtype and device it is fed


# The kinds `generate(..., cache=NAME)` can build: name -> a function
# (config, batch_size, max_seq_len, dtype=..., device=...) -> an empty KVCache.
CACHE_KINDS = {
    "dynamic": _dynamic,
    "static": StaticKVCache,
    "int8": QuantizedKVCache,                     # int8 codes, KIVI-style scales
    "int4": partial(QuantizedKVCache, bits=4),    # the same with int4 codes, two a byte
    "paged": PagedKVCache,
}


def make_cache(kind: str, config: ModelConfig | str, batch_size: int, max_seq_len: int,
               dtype=torch.float32, device="cpu") -> KVCache:
    """Build an empty cache by name: one of CACHE_KINDS."""
    if not isinstance(kind, str) or kind not in CACHE_KINDS:
        raise ValueError(f"cache={kind!r} is not a known cache kind; allowed: None, "
                         + ", ".join(repr(k) for k in CACHE_KINDS) + ", or a KVCache object")
    return CACHE_KINDS[kind](config, batch_size, max_seq_len, dtype=dtype, device=device)


__all__ = ["CACHE_KINDS", "BlockAllocator", "DynamicKVCache", "HeavyHitterKVCache", "KVCache",
           "OutOfBlocksError", "PagedKVCache", "PrefixKVStore", "QuantizedKVCache", "RaggedPagedKVCache",
           "SharedPagedKVCache",
           "SlidingWindowKVCache", "StaticKVCache", "blocks_needed", "make_cache",
           "quantized_cache_bytes"]
