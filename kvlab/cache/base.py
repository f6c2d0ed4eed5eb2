"""The cache contract: what every kind of KV cache does, and all that the model and `generate` use.

A cache holds, for each layer, the keys and values of the tokens fed so far, shaped (B, H_kv, S, D).
Tokens are numbered in the order they were fed: the *stream position* (padding included, so a
left-padded batch shares one numbering). In every forward pass, for every layer, the model calls

    K, V = cache.update(layer, k, v)      # store the new k, v (B, H_kv, T, D); get what attention reads
    cache.key_positions(layer)            # the stream position of each key returned (None: 0..S-1)
    cache.visible(query_pos, key_pos, layer)   # which of them each new query may see

and builds its attention mask from the last two, so a cache that keeps only some keys (a sliding
window, heavy hitters) says itself which keys a query sees. Around that, every kind has

- `seq_len` (tokens fed so far: the stream position of the next one) and `lengths` (one per layer);
- `rope_positions(t)`: the RoPE positions of the next t tokens (their stream positions, unless the
  kind renumbers them, as StreamingLLM does);
- `max_chunk(t)`: how many of t new tokens one forward pass may feed (all, except for kinds that
  must evict between tokens; the model then feeds the rest in several passes);
- `crop(n)`: keep the first n positions, as if the later tokens had never been fed (the rollback of
  speculative decoding and chat editing); `reset()` is crop(0);
- `fork()`: a second, independent cache holding the same positions;
- `nbytes` (bytes its storage holds) and `check_compatible(config, batch, dtype, device)`.

A kind that cannot honour an operation (a crop into positions it has already evicted or quantized)
refuses with a message that says what it can do. `kvlab.oracle` checks any cache against recomputing
everything without one.
"""

from __future__ import annotations

import copy
import math
import operator

import torch

from .. import validate
from ..config import ModelConfig
from ..env import available_memory


class KVCache:
    """The interface. Subclasses implement `update`, `crop` and `nbytes`, keep `lengths` up to date
    and, if they return keys other than 0..S-1 in order, `key_positions` (and `visible`)."""

    config: ModelConfig
    lengths: list[int]             # tokens fed so far, per layer
    max_seq_len: int | None = None  # positions it can hold (None: grows without a bound)
    batch_size: int | None = None  # None: not known yet (a DynamicKVCache before its first update)
    dtype: torch.dtype | None = None  # dtype of the K, V handed back to attention
    device: torch.device | None = None
    bytes_copied: int = 0  # bytes written into cache storage so far (copies included)
    allocations: int = 0   # tensors allocated for cache storage so far
    needs_queries: bool = False  # True: the model hands each layer's queries over before `update`
    drops_keys: bool = False     # True: it keeps only some positions (a window, heavy hitters)
    renumbers_positions: bool = False  # True: rope_positions are not the stream positions

    # --- storing -------------------------------------------------------------------------------

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T, D) of `layer` after its cached positions; return the K, V
        (B, H_kv, S, D) the new queries attend over."""
        raise NotImplementedError

    def receive_queries(self, layer: int, q: torch.Tensor) -> None:
        """The new queries (B, H, T, D) of `layer`, before its `update` (kinds with needs_queries)."""
        raise NotImplementedError(f"{type(self).__name__} does not use the queries")

    # --- what the queries may see ----------------------------------------------------------------

    def key_positions(self, layer: int) -> torch.Tensor | None:
        """Stream position of each key the last `update(layer, …)` returned: (S,), or (B, H_kv, S)
        when sequences and heads keep different keys. None means 0, 1, …, S-1 in order (every
        position so far), which lets the model build one causal mask for all layers."""
        return None

    def visible(self, query_positions: torch.Tensor, key_positions: torch.Tensor,
                layer: int | None = None) -> torch.Tensor:
        """Which keys each new query may see: (T, S) bool, or (B, H_kv, T, S) for per-head keys.
        The default is causal: a key at or before the query. Bounded kinds add their own rule (and
        a kind that hands back some positions twice, the quantized one, says which copy)."""
        return key_positions[..., None, :] <= query_positions[:, None]

    def max_chunk(self, t: int) -> int:
        """How many of t new tokens the next forward pass may feed (every kind but those that must
        evict between tokens takes them all at once)."""
        return t

    # --- positions -----------------------------------------------------------------------------

    @property
    def seq_len(self) -> int:
        """Tokens fed so far (of layer 0; the model fills every layer alike): the stream position
        of the next token."""
        return self.lengths[0]

    def rope_positions(self, t: int, device=None) -> torch.Tensor:
        """RoPE positions (T,) of the next t tokens: their stream positions."""
        return torch.arange(self.seq_len, self.seq_len + t, device=device)

    # --- lifecycle -----------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def crop(self, n: int) -> None:
        """Keep the first n positions of every layer and forget the rest, as if only the first n
        tokens had been fed."""
        raise NotImplementedError(f"{type(self).__name__} cannot crop")

    def reset(self) -> None:
        """Forget every position, ready for a new request (pre-allocated storage stays allocated)."""
        self.crop(0)

    def fork(self) -> KVCache:
        """An independent cache holding the same positions (here: a copy of the storage)."""
        return copy.deepcopy(self)

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
        if self.device is not None and not same_device(self.device, device):
            raise ValueError(f"the cache is on {self.device}, the model on {device}; build the "
                             f"cache with device={str(device)!r}")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={self.config.n_layers}, seq_len={self.seq_len}, "
                f"nbytes={self.nbytes:,})")

    # --- checks the kinds share ----------------------------------------------------------------

    def _check_update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Refuse a layer out of range or k, v that do not fit this cache; return T."""
        self._check_layer(layer)
        cfg = self.config
        for name, x in (("k", k), ("v", v)):
            if isinstance(x, torch.Tensor) and x.dim() == 4 and self.batch_size is not None \
                    and x.shape[0] != self.batch_size:
                raise ValueError(f"{name} has batch {x.shape[0]}; this cache was built for "
                                 f"batch_size={self.batch_size}")
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
                raise ValueError(f"{name} must be a float tensor (batch, kv_heads, tokens, head_dim); got "
                                 f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype} "
                                 f"of shape {tuple(getattr(x, 'shape', ()))}")
            want_batch = self.batch_size if self.batch_size is not None else x.shape[0]
            want = (want_batch, cfg.n_kv_heads, x.shape[2], cfg.head_dim)
            if tuple(x.shape) != want or x.shape[2] == 0:
                raise ValueError(f"{name} has shape {tuple(x.shape)}; this cache takes (batch, kv_heads, "
                                 f"tokens >= 1, head_dim) = ({want_batch}, {cfg.n_kv_heads}, T, "
                                 f"{cfg.head_dim})")
        if k.shape != v.shape:
            raise ValueError(f"k has shape {tuple(k.shape)} but v {tuple(v.shape)}: they must match "
                             "(one value per key)")
        return k.shape[2]

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.config.n_layers:
            raise IndexError(f"layer={layer!r} out of range: the model has "
                             f"{self.config.n_layers} layers (0..{self.config.n_layers - 1})")

    def _reserve(self, layer: int, t: int) -> int:
        """First free position of `layer` for t new ones (pre-allocated caches refuse to overflow)."""
        start = self.lengths[layer]
        if start + t > self.max_seq_len:
            raise ValueError(f"cache is full: {start} of {self.max_seq_len} positions used, "
                             f"{t} more requested")
        return start

    def _crop_length(self, n) -> int:
        """n as an int in [0, seq_len], or a clear error."""
        held = min(self.lengths)
        return validate.integer("n", n, low=0, high=held)


def same_device(a, b) -> bool:
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def float_dtype(dtype) -> torch.dtype:
    """A floating-point dtype for K/V storage, or a clear error (an integer dtype would truncate)."""
    return validate.float_dtype("dtype", dtype, "hold keys and values")


# No device holds 2**62 bytes (4 EiB): a size beyond it is refused even where free memory cannot be
# read (the meta device), before torch.Size overflows int64.
MAX_BYTES = 2**62


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device, what: str = "the cache") -> torch.Tensor:
    """torch.zeros(shape) on `device` after checking the device (kvlab.validate.device) and that the
    size fits in the memory it has free, so a size typed wrong is refused with its byte count
    instead of reaching the allocator. The size is counted in Python integers (no overflow)."""
    device = validate.device("device", device)
    shape = tuple(operator.index(d) for d in shape)  # NumPy ints would overflow in the product
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    free = available_memory(device)
    if size > MAX_BYTES or (free is not None and size > free):
        free_text = "cannot tell how much is free" if free is None else f"has {free / 2**30:.2f} GiB free"
        raise MemoryError(f"{what} needs {_bytes(size)} for shape {_dims(shape)} "
                          f"but {device or 'cpu'} {free_text}; use a smaller batch_size or "
                          "max_seq_len (kvlab.memory.kv_cache_bytes gives the size beforehand)")
    return torch.zeros(shape, dtype=dtype, device=device)


def _dims(shape) -> str:
    return "(" + ", ".join(f"{d:,}" if d < 10**30 else validate.shown(d) for d in shape) + ")"


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.4g} GiB)" if n < 10**30 else f"{validate.shown(n)} bytes"
