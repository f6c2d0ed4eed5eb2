"""How many bytes: the KV cache, the weights, and what fits on a GPU.

KV cache bytes = 2 (K and V) × layers × KV heads × head_dim × tokens × batch × bytes per element.
An MLA model (config.kv_latent_dim) caches one latent per token per layer instead of K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

# Bits per stored element. "int4" packs two values a byte (scales not included here).
DTYPE_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}

GiB = 1024**3
MiB = 1024**2
GB = 10**9


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int          # as sold: decimal gigabytes
    bandwidth_bytes_per_s: float
    note: str = ""


# REFERENCE.md, from the vendors' data sheets.
GPUS: dict[str, GPU] = {
    g.name: g
    for g in [
        GPU("T4 16GB", 16 * GB, 320e9, "Colab free tier; FP16 tensor cores, no fast bf16"),
        GPU("A100 40GB", 40 * GB, 1555e9, "HBM2"),
        GPU("A100 80GB", 80 * GB, 2039e9, "SXM, HBM2e"),
        GPU("H100 80GB", 80 * GB, 3.35e12, "SXM, HBM3"),
        GPU("H200 141GB", 141 * GB, 4.8e12, "HBM3e"),
    ]
}


def dtype_bits(dtype: str) -> int:
    if dtype not in DTYPE_BITS:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(DTYPE_BITS)}")
    return DTYPE_BITS[dtype]


def kv_elements_per_token(config: ModelConfig) -> int:
    """Elements cached for one token across all layers."""
    if config.kv_latent_dim is not None:
        return config.n_layers * config.kv_latent_dim
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch_size: int = 1,
                   dtype: str = "fp16") -> int:
    """Bytes of the KV cache for `batch_size` sequences of `seq_len` tokens."""
    _check_count("seq_len", seq_len, allow_zero=True)
    _check_count("batch_size", batch_size)
    return kv_elements_per_token(config) * seq_len * batch_size * dtype_bits(dtype) // 8


def kv_bytes_per_token(config: ModelConfig, dtype: str = "fp16") -> int:
    return kv_cache_bytes(config, 1, 1, dtype)


def param_count(config: ModelConfig) -> int:
    """Parameters of a Llama-shaped model (or the published count when the config gives one)."""
    if config.n_params is not None:
        return config.n_params
    d, h, kv, hd = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
    attn = d * (h + 2 * kv) * hd + h * hd * d + (((h + 2 * kv) * hd) if config.qkv_bias else 0)
    ffn = 3 * d * config.d_ff
    per_layer = attn + ffn + 2 * d  # + two RMSNorm weight vectors
    embed = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return config.n_layers * per_layer + embed + d  # + final norm


def weight_bytes(config: ModelConfig, dtype: str = "fp16") -> int:
    return param_count(config) * dtype_bits(dtype) // 8


def _check_count(name: str, value, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")


def gpu(name_or_gpu: str | GPU) -> GPU:
    if isinstance(name_or_gpu, GPU):
        return name_or_gpu
    if name_or_gpu not in GPUS:
        raise ValueError(f"gpu={name_or_gpu!r} is not in GPUS; allowed: {', '.join(GPUS)}")
    return GPUS[name_or_gpu]


@dataclass(frozen=True)
class Plan:
    """How a model, a context length and a batch share one GPU's memory."""

    gpu: GPU
    weight_bytes: int
    reserve_bytes: int      # activations, workspace, fragmentation: kept free
    cache_bytes: int        # for the requested seq_len and batch
    free_for_cache: int     # memory left for the cache after weights and reserve (may be < 0)
    max_context: int        # longest seq_len that fits at this batch size (0: none)
    max_batch: int          # most sequences of seq_len that fit (0: none)

    @property
    def fits(self) -> bool:
        return self.cache_bytes <= self.free_for_cache

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.reserve_bytes + self.cache_bytes


def plan(config: ModelConfig, gpu_name: str | GPU, seq_len: int, batch_size: int = 1,
         dtype: str = "fp16", weight_dtype: str = "fp16", reserve_fraction: float = 0.0) -> Plan:
    """Capacity planning: what fits next to the weights. reserve_fraction of the GPU's memory is
    kept for activations and workspace (vLLM, for instance, uses 90 % of memory by default)."""
    g = gpu(gpu_name)
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve_fraction={reserve_fraction} must be in [0, 1)")
    w = weight_bytes(config, weight_dtype)
    reserve = int(g.memory_bytes * reserve_fraction)
    free = g.memory_bytes - w - reserve
    per_token = kv_bytes_per_token(config, dtype)
    cache = kv_cache_bytes(config, seq_len, batch_size, dtype)
    max_context = max(free, 0) // (per_token * batch_size)
    per_seq = kv_cache_bytes(config, seq_len, 1, dtype)
    max_batch = max(free, 0) // per_seq if per_seq else 0
    return Plan(g, w, reserve, cache, free, max_context, max_batch)


class DoesNotFitError(ValueError):
    """A cache (or the weights alone) needs more memory than the GPU has."""


def require_fit(config: ModelConfig, gpu_name: str | GPU, seq_len: int, batch_size: int = 1,
                dtype: str = "fp16", weight_dtype: str = "fp16",
                reserve_fraction: float = 0.0) -> Plan:
    """Like `plan`, but refuse a setting that does not fit, saying by how much."""
    p = plan(config, gpu_name, seq_len, batch_size, dtype, weight_dtype, reserve_fraction)
    if not p.fits:
        name = config.name or "the model"
        raise DoesNotFitError(
            f"{name} at seq_len={seq_len:,}, batch_size={batch_size} needs a {dtype} KV cache of "
            f"{p.cache_bytes / GiB:.2f} GiB, but {p.gpu.name} has {max(p.free_for_cache, 0) / GiB:.2f} "
            f"GiB left after {p.weight_bytes / GiB:.2f} GiB of weights and {p.reserve_bytes / GiB:.2f} "
            f"GiB reserve; longest context at this batch: {p.max_context:,} tokens, "
            f"most sequences of this length: {p.max_batch}"
        )
    return p


def format_bytes(n: int | float) -> str:
    """Bytes in binary units (KiB, MiB, GiB, TiB: powers of 1,024), two decimals: '2.00 GiB'.

    Memory sizes in the course are binary; GPUs are sold in decimal GB (10**9 bytes), which is why
    an "80GB" A100 holds 74.51 GiB.
    """
    if isinstance(n, bool) or not isinstance(n, (int, float)) or n != n:
        raise ValueError(f"n={n!r} must be a number of bytes")
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n:.0f} B" if n == int(n) else f"{sign}{n:.2f} B"
