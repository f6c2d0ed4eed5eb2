"""The decode roofline: the fastest a decode step can be, from the bytes it reads and the FLOPs it does.

One decode step reads every weight once (of the input embedding only the one row each token looks
up) and, for each sequence of the batch, the K and V of every cached token. Whatever the
implementation, it cannot finish before those bytes have crossed the memory bus, so
`bytes ÷ bandwidth` is a floor under its time: the **memory roof**. It also multiplies and adds:
about 2 FLOPs per weight per token (one multiply, one add), plus attention over the cache, so
`FLOPs ÷ peak FLOP/s` is a second floor: the **compute roof**.

Which roof binds is set by the step's *arithmetic intensity*, FLOPs per byte read. A GPU's *ridge
point* is peak FLOP/s ÷ bandwidth (about 153 FLOPs per byte for an A100 80GB in FP16). At batch 1 with
FP16 weights a decode step does about 1 FLOP per byte, far below any ridge: decoding is memory-bound,
and the way to use the arithmetic the GPU has is to decode many sequences at once, since the weights
are read once for the whole batch. `memory_bound_batch` gives the batch at which that stops paying.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import memory, validate
from .config import ModelConfig, resolve

# Dense (no sparsity) FP16 tensor-core peaks in FLOP/s, from NVIDIA's data sheets, which quote the
# sparse figure (twice these) with an asterisk. GPUs not listed here have no peak in kvlab.
# T4:         https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf
# A100:       https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
# H100 (SXM): https://www.nvidia.com/en-us/data-center/h100/  (FP16 Tensor Core 1,979 TFLOPS with sparsity)
PEAK_FP16_FLOPS: dict[str, float] = {
    "T4 16GB": 65e12,
    "A100 40GB": 312e12,
    "A100 80GB": 312e12,
    "H100 80GB": 989.5e12,
}


@dataclass(frozen=True)
class Roofline:
    """The floors under one decode step's time: bytes ÷ bandwidth and, when the peak FLOP/s is
    known, FLOPs ÷ peak. The step takes at least the larger of the two."""

    bytes_per_step: int
    bandwidth_bytes_per_s: float
    batch_size: int
    flops_per_step: int = 0
    peak_flops_per_s: float | None = None

    @property
    def memory_seconds(self) -> float:
        return self.bytes_per_step / self.bandwidth_bytes_per_s

    @property
    def compute_seconds(self) -> float:
        """FLOPs ÷ peak FLOP/s; 0 when the peak is not known (then only the memory roof applies)."""
        return self.flops_per_step / self.peak_flops_per_s if self.peak_flops_per_s else 0.0

    @property
    def seconds_per_step(self) -> float:
        return max(self.memory_seconds, self.compute_seconds)

    @property
    def tokens_per_s(self) -> float:
        """Upper bound on tokens/s for the whole batch (each step yields batch_size tokens)."""
        return self.batch_size / self.seconds_per_step

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte read."""
        return self.flops_per_step / self.bytes_per_step

    @property
    def bound(self) -> str:
        """"memory" or "compute": which roof sets the floor."""
        return "compute" if self.compute_seconds > self.memory_seconds else "memory"


def embedding_table_params(config: ModelConfig | str) -> int:
    """Parameters of the input embedding that a decode step does *not* read: it looks up one row
    a token, not the whole table. With tied embeddings the table is also the output layer, which
    multiplies every row, so then none is skipped. (A published n_params is assumed to include
    the table, as Llama's do.)"""
    config = resolve(config)
    return 0 if config.tie_embeddings else config.vocab_size * config.d_model


def decode_step_bytes(config: ModelConfig | str, context: int, batch_size: int = 1,
                      dtype: str = "fp16") -> int:
    """Bytes one decode step reads: every weight once, except that the input embedding gives only
    one row per sequence, plus the K/V of `context` cached tokens for each sequence in the batch."""
    config = resolve(config)
    context = validate.integer("context", context, low=0, high=validate.MAX_TOKENS)
    batch_size = validate.integer("batch_size", batch_size, high=validate.MAX_TOKENS)
    table = embedding_table_params(config)
    rows_read = min(table, batch_size * config.d_model) if table else 0
    skipped_bytes = (table - rows_read) * memory.dtype_bits(dtype) // 8
    return (memory.weight_bytes(config, dtype) - skipped_bytes
            + memory.kv_cache_bytes(config, context, batch_size, dtype))


def decode_step_flops(config: ModelConfig | str, context: int, batch_size: int = 1) -> int:
    """FLOPs of one decode step: 2 per parameter per sequence (a multiply and an add) for every
    weight matrix the token goes through (not the input embedding: a lookup does no arithmetic),
    plus attention over the cache: q·Kᵀ and the weighted sum of V, 2 FLOPs per element each, for
    every layer, query head and cached position."""
    config = resolve(config)
    context = validate.integer("context", context, low=0, high=validate.MAX_TOKENS)
    batch_size = validate.integer("batch_size", batch_size, high=validate.MAX_TOKENS)
    attention = 4 * config.n_layers * config.n_heads * config.head_dim * context
    matmuls = memory.param_count(config) - embedding_table_params(config)
    return batch_size * (2 * matmuls + attention)


@dataclass(frozen=True)
class ForwardFlops:
    """FLOPs of one forward pass, split into the matrix products with weights (`linear`) and the
    attention products over the visible positions (`attention`)."""

    linear: int
    attention: int

    @property
    def total(self) -> int:
        return self.linear + self.attention


def forward_flops(config, fed: int, context: int | None = None) -> ForwardFlops:
    """FLOPs of one forward pass of a kvlab model that feeds `fed` tokens, each attending over
    `context` positions (default `fed`: no cache, the naive decoder's step; 1 token over a cache of
    t positions: a cached decode step).

    linear: 2 per weight of every linear layer (Q/K/V, output, feed-forward, lm_head) per fed token;
    attention: Q·Kᵀ and weights·V, 2 FLOPs per multiply-add each, over the whole fed × context
    rectangle per layer and query head (a causal mask hides the upper triangle, but dense kernels
    multiply it too). Norms, RoPE, softmax and the embedding lookup are not matrix products and are
    left out, as `torch.utils.flop_counter` leaves them out.
    """
    config, fed = resolve(config), validate.integer("fed", fed, low=1)
    context = fed if context is None else validate.integer("context", context, low=fed)
    d, q, kv = config.d_model, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * config.d_ff
    weights = config.n_layers * per_layer + d * config.vocab_size
    return ForwardFlops(2 * weights * fed, 4 * config.n_layers * q * fed * context)


def roofline(config: ModelConfig | str, bandwidth_bytes_per_s: float, context: int = 0,
             batch_size: int = 1, dtype: str = "fp16",
             peak_flops_per_s: float | None = None) -> Roofline:
    """The roofline of a model on a device (bandwidth, and optionally peak FLOP/s) at a context
    length and batch size."""
    bandwidth_bytes_per_s = validate.number("bandwidth_bytes_per_s", bandwidth_bytes_per_s, low=0,
                                            low_inclusive=False)
    if peak_flops_per_s is not None:
        peak_flops_per_s = validate.number("peak_flops_per_s", peak_flops_per_s, low=0, low_inclusive=False)
    step_bytes = decode_step_bytes(config, context, batch_size, dtype)  # checks context and batch_size
    return Roofline(step_bytes, bandwidth_bytes_per_s, int(batch_size),
                    decode_step_flops(config, context, batch_size), peak_flops_per_s)


def ridge_point(peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """FLOPs per byte at which a device's two roofs meet: below it a step is memory-bound."""
    peak_flops_per_s = validate.number("peak_flops_per_s", peak_flops_per_s, low=0, low_inclusive=False)
    bandwidth_bytes_per_s = validate.number("bandwidth_bytes_per_s", bandwidth_bytes_per_s, low=0,
                                            low_inclusive=False)
    return peak_flops_per_s / bandwidth_bytes_per_s


def memory_bound_batch(config: ModelConfig | str, peak_flops_per_s: float, bandwidth_bytes_per_s: float,
                       context: int = 0, dtype: str = "fp16") -> int | None:
    """The smallest batch at which a decode step stops being memory-bound (its intensity reaches the
    ridge point), or None if it never does.

    FLOPs grow as batch × f (f per sequence) and bytes as W + batch × k (weights once, each
    sequence's cache and embedding row), so intensity b·f / (W + b·k) reaches the ridge R at
    b = R·W / (f − R·k). When a sequence's cache costs more bytes than its FLOPs can cover
    (f ≤ R·k, long contexts), no batch gets there.
    """
    ridge = ridge_point(peak_flops_per_s, bandwidth_bytes_per_s)
    one, two = (decode_step_bytes(config, context, b, dtype) for b in (1, 2))
    per_seq_bytes = two - one             # its cache (and its embedding row)
    weights = one - per_seq_bytes         # read once for the whole batch
    per_seq_flops = decode_step_flops(config, context, 1)
    if per_seq_flops <= ridge * per_seq_bytes:
        return None
    return max(1, math.ceil(ridge * weights / (per_seq_flops - ridge * per_seq_bytes)))


def achieved_fraction(config: ModelConfig | str, tokens_per_s: float, bandwidth_bytes_per_s: float,
                      context: int, batch_size: int = 1, dtype: str = "fp16") -> float:
    """The share of the bandwidth a measured decode rate uses: bytes per step × steps per second
    ÷ bandwidth (1.0 would be the memory roof itself)."""
    tokens_per_s = validate.number("tokens_per_s", tokens_per_s, low=0)
    bound = roofline(config, bandwidth_bytes_per_s, context, batch_size, dtype)
    return bound.bytes_per_step * tokens_per_s / batch_size / bandwidth_bytes_per_s
