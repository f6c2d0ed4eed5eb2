"""How many bytes: the KV cache, the weights, and what fits on a GPU.

KV cache bytes = 2 (K and V) × layers × KV heads × head_dim × tokens × batch × bytes per element.
An MLA model (config.kv_latent_dim) caches one latent per token per layer instead of K and V.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

from . import validate
from .config import ModelConfig, resolve

# Bits per stored element. "int4" packs two values a byte (scales not included here).
DTYPE_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}

GiB = 1024**3
MiB = 1024**2
GB = 10**9


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int          # total memory as CUDA reports it (PyTorch's total_memory)
    bandwidth_bytes_per_s: float
    note: str = ""
    nvidia_smi_mib: int = 0    # the total nvidia-smi shows, in MiB


# GPU memory is binary: an "80GB" A100 shows 81,920 MiB in nvidia-smi, and PyTorch's total_memory
# (what CUDA hands out, also quoted in its out-of-memory message) is a little less, about 79.2 GiB:
# not 80 decimal GB = 74.5 GiB. memory_bytes is round(x * GiB) for x the low end, in GiB, of the
# total_memory range reported in public logs (it varies a little with driver and ECC): an
# approximation, not a byte count read from a device. See docs/references.md, "GPUs", for the
# sources, and the vendors' data sheets for the bandwidths. On a real GPU use `current_gpu()`.
GPUS: dict[str, GPU] = {
    g.name: g
    for g in [
        GPU("T4 16GB", round(14.56 * GiB), 320e9, "Colab free tier; FP16 tensor cores, no fast bf16",
            15_360),
        GPU("A100 40GB", round(39.4 * GiB), 1555e9, "HBM2", 40_960),
        GPU("A100 80GB", round(79.15 * GiB), 2039e9, "SXM, HBM2e", 81_920),
        GPU("H100 80GB", round(79.1 * GiB), 3.35e12, "SXM, HBM3", 81_559),
        GPU("H200 141GB", round(139.8 * GiB), 4.8e12, "HBM3e", 143_771),
    ]
}

# What the CUDA context (kernels, cuBLAS workspace) takes before any tensor: about 0.3-0.5 GiB
# (docs/references.md); plan() keeps the upper end free.
CUDA_CONTEXT_BYTES = GiB // 2


@dataclass(frozen=True)
class KnownGPU:
    """A GPU model as its data sheet names it, and how its CUDA device name and memory identify it."""

    name: str                   # e.g. "H100 80GB PCIe"
    chip: str                   # the word of the CUDA name that names the chip: "H100"
    forms: frozenset            # form-factor words the name may carry (see _form); None: none named
    sold_gb: int                # memory as sold: "80GB" is 80 GiB of chips, CUDA reports a little less
    bandwidth_bytes_per_s: float
    source: str


# The data sheets' memory bandwidths. The SXM/PCIe/NVL variants of one chip differ (an H100 PCIe has
# 60 % of an H100 SXM's bandwidth), so a name is matched whole, not by its first word. Entries of
# GPUS take their figure from there (sources in docs/references.md, "GPUs"); the others:
#   A100 80GB PCIe 1,935 GB/s, A100 40GB (PCIe and SXM) 1,555 GB/s: NVIDIA A100 data sheet,
#     https://www.nvidia.com/en-us/data-center/a100/
#   H100 PCIe 2.0 TB/s, H100 NVL 3.9 TB/s: NVIDIA H100 data sheet,
#     https://www.nvidia.com/en-us/data-center/h100/
# Not listed, so "unknown" (measured): GH200 (its HBM differs by version), H200 NVL, H800, MIG slices.


def _sheet(name: str) -> float:
    return GPUS[name].bandwidth_bytes_per_s


KNOWN_GPUS: tuple[KnownGPU, ...] = (
    KnownGPU("T4 16GB", "T4", frozenset({None}), 16, _sheet("T4 16GB"),
             "NVIDIA T4 data sheet (kvlab.memory.GPUS)"),
    KnownGPU("A100 40GB", "A100", frozenset({None, "PCIE", "SXM"}), 40, _sheet("A100 40GB"),
             "NVIDIA A100 data sheet: 1,555 GB/s for the PCIe and the SXM 40GB part (kvlab.memory.GPUS)"),
    KnownGPU("A100 80GB SXM", "A100", frozenset({"SXM"}), 80, _sheet("A100 80GB"),
             "NVIDIA A100 data sheet (kvlab.memory.GPUS)"),
    KnownGPU("A100 80GB PCIe", "A100", frozenset({"PCIE"}), 80, 1935e9, "NVIDIA A100 data sheet"),
    # CUDA names the H100 SXM5 part "NVIDIA H100 80GB HBM3": HBM3 without PCIe or NVL means SXM.
    KnownGPU("H100 80GB SXM", "H100", frozenset({"SXM", "HBM3"}), 80, _sheet("H100 80GB"),
             "NVIDIA H100 data sheet (kvlab.memory.GPUS)"),
    KnownGPU("H100 80GB PCIe", "H100", frozenset({"PCIE"}), 80, 2.0e12, "NVIDIA H100 data sheet"),
    KnownGPU("H100 NVL 94GB", "H100", frozenset({"NVL"}), 94, 3.9e12, "NVIDIA H100 data sheet"),
    KnownGPU("H200 141GB SXM", "H200", frozenset({None, "SXM"}), 141, _sheet("H200 141GB"),
             "NVIDIA H200 data sheet (kvlab.memory.GPUS)"),
)

# The memory CUDA reports, as a share of the memory as sold in GiB: a T4 "16GB" reports 14.56 GiB
# (0.91), an A100 "80GB" 79.15 GiB (0.99). Anything outside (a MIG slice, another model) is not a match.
_MEMORY_SHARE = (0.88, 1.01)


def _form(words: set[str]) -> str | None:
    """The form factor a CUDA device name states: PCIE, NVL, SXM (SXM4, SXM5…), HBM3, or None."""
    for form in ("PCIE", "NVL"):
        if form in words:
            return form
    if any(w.startswith("SXM") for w in words):
        return "SXM"
    return "HBM3" if "HBM3" in words else None


def match_gpu(name: str, memory_bytes: int | None = None) -> KnownGPU | None:
    """The data-sheet entry (`KNOWN_GPUS`) for a CUDA device name such as 'NVIDIA A100-SXM4-80GB' and
    its total memory in bytes, or None ("unknown") unless exactly one entry fits: the chip, the form
    factor (PCIe, NVL, SXM), the size in the name ("80GB") and the memory CUDA reports must all agree.
    Without memory_bytes, a chip sold in several sizes needs its size in the name."""
    words = set(re.findall(r"[A-Z0-9]+", name.upper()))
    if "MIG" in words:  # a slice of a GPU has a share of its bandwidth
        return None
    sizes = {int(w[:-2]) for w in words if re.fullmatch(r"\d+GB", w)}
    if not sizes and memory_bytes is None and len({g.sold_gb for g in KNOWN_GPUS if g.chip in words}) > 1:
        return None  # the chip comes in several sizes, and neither the name nor the memory says which
    form = _form(words)
    fits = [g for g in KNOWN_GPUS
            if g.chip in words and form in g.forms and (not sizes or sizes == {g.sold_gb})
            and (memory_bytes is None
                 or _MEMORY_SHARE[0] <= memory_bytes / (g.sold_gb * GiB) <= _MEMORY_SHARE[1])]
    return fits[0] if len(fits) == 1 else None


def current_gpu(device=None) -> GPU:
    """This machine's GPU as a GPUS entry: its memory is what CUDA reports now
    (`torch.cuda.mem_get_info`: the total; the free part is in the note), its bandwidth the data
    sheet's for the model `match_gpu` identifies from its full name and memory (nan when unknown)."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("current_gpu() needs a CUDA GPU and none is available; pick one of "
                         f"memory.GPUS instead: {', '.join(GPUS)}")
    free, total = torch.cuda.mem_get_info(device)
    name = torch.cuda.get_device_name(device)
    known = match_gpu(name, total)
    bandwidth = known.bandwidth_bytes_per_s if known else float("nan")
    return GPU(name, total, bandwidth, f"{free / GiB:.2f} GiB free when read", total // MiB)


def dtype_bits(dtype: str) -> int:
    """Bits per stored element of a dtype name ("fp16": 16)."""
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(DTYPE_BITS)}")
    return DTYPE_BITS[dtype]


def kv_elements_per_token(config: ModelConfig | str) -> int:
    """Elements cached for one token across all layers."""
    config = resolve(config)
    if config.kv_latent_dim is not None:
        return config.n_layers * config.kv_latent_dim
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim


def kv_cache_bytes(config: ModelConfig | str, seq_len: int, batch_size: int = 1,
                   dtype: str = "fp16") -> int:
    """Bytes of the KV cache for `batch_size` sequences of `seq_len` tokens (int4: rounded up to a
    whole byte). `config` may be a preset name."""
    seq_len = validate.integer("seq_len", seq_len, low=0)
    batch_size = validate.integer("batch_size", batch_size)
    bits = kv_elements_per_token(resolve(config)) * seq_len * batch_size * dtype_bits(dtype)
    return -(-bits // 8)  # ceiling division: half a byte still takes a byte


def kv_bytes_per_token(config: ModelConfig | str, dtype: str = "fp16") -> int | float:
    """Bytes one token adds to the cache: an int, or a float when it is not whole (int4 of an odd
    number of elements: 4.5, not 4)."""
    bits = kv_elements_per_token(resolve(config)) * dtype_bits(dtype)
    return bits // 8 if bits % 8 == 0 else bits / 8


def param_count(config: ModelConfig | str) -> int:
    """Parameters of a Llama-shaped model (or the published count when the config gives one)."""
    config = resolve(config)
    if config.n_params is not None:
        return config.n_params
    d, h, kv, hd = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
    attn = d * (h + 2 * kv) * hd + h * hd * d + (((h + 2 * kv) * hd) if config.qkv_bias else 0)
    ffn = 3 * d * config.d_ff
    per_layer = attn + ffn + 2 * d  # + two RMSNorm weight vectors
    embed = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return config.n_layers * per_layer + embed + d  # + final norm


def weight_bytes(config: ModelConfig | str, dtype: str = "fp16") -> int:
    return -(-param_count(config) * dtype_bits(dtype) // 8)


def gpu(name_or_gpu: str | GPU) -> GPU:
    if isinstance(name_or_gpu, GPU):
        return name_or_gpu
    return GPUS[validate.choice("gpu", name_or_gpu, GPUS)]


@dataclass(frozen=True)
class Plan:
    """How a model, a context length and a batch share one GPU's memory."""

    gpu: GPU
    weight_bytes: int
    reserve_bytes: int      # activations, workspace, fragmentation: kept free
    cache_bytes: int        # for the requested seq_len and batch
    free_for_cache: int     # memory left for the cache after context, weights, reserve (may be < 0)
    max_context: int        # longest seq_len that fits at this batch size (0: none)
    max_batch: int          # most sequences of seq_len that fit (0: none)
    context_bytes: int = CUDA_CONTEXT_BYTES  # taken by the CUDA context

    @property
    def fits(self) -> bool:
        return self.cache_bytes <= self.free_for_cache

    @property
    def total_bytes(self) -> int:
        return self.context_bytes + self.weight_bytes + self.reserve_bytes + self.cache_bytes


def plan(config: ModelConfig | str, gpu_name: str | GPU, seq_len: int, batch_size: int = 1,
         dtype: str = "fp16", weight_dtype: str = "fp16", reserve_fraction: float = 0.0,
         context_bytes: int = CUDA_CONTEXT_BYTES) -> Plan:
    """Capacity planning: what fits next to the weights. The GPU's memory (as CUDA reports it) less
    the CUDA context (`context_bytes`) and reserve_fraction of the memory, kept for activations
    and workspace (vLLM, for instance, uses 90 % of memory by default), is left for the cache."""
    config, g = resolve(config), gpu(gpu_name)
    # At least one token (a plan for nothing is no plan), at most validate.MAX_TOKENS (GiB stay floats).
    seq_len = validate.integer("seq_len", seq_len, high=validate.MAX_TOKENS)
    batch_size = validate.integer("batch_size", batch_size, high=validate.MAX_TOKENS)
    reserve_fraction = validate.number("reserve_fraction", reserve_fraction, low=0, high=1,
                                       high_inclusive=False)
    context_bytes = validate.integer("context_bytes", context_bytes, low=0)
    w = weight_bytes(config, weight_dtype)
    reserve = int(g.memory_bytes * reserve_fraction)
    free = g.memory_bytes - context_bytes - w - reserve
    cache = kv_cache_bytes(config, seq_len, batch_size, dtype)
    # In bits, so a fractional bytes-per-token (int4) is not floored into a promise that does not
    # fit; a token of a one-element int4 config is half a byte, never zero.
    bits_per_token = kv_elements_per_token(config) * dtype_bits(dtype)
    max_context = max(free, 0) * 8 // (bits_per_token * batch_size)
    per_seq = kv_cache_bytes(config, seq_len, 1, dtype)
    max_batch = max(free, 0) // per_seq if per_seq else 0
    return Plan(g, w, reserve, cache, free, max_context, max_batch, context_bytes)


class DoesNotFitError(ValueError):
    """A cache (or the weights alone) needs more memory than the GPU has."""


def require_fit(config: ModelConfig | str, gpu_name: str | GPU, seq_len: int, batch_size: int = 1,
                dtype: str = "fp16", weight_dtype: str = "fp16", reserve_fraction: float = 0.0,
                context_bytes: int = CUDA_CONTEXT_BYTES) -> Plan:
    """Like `plan`, but refuse a setting that does not fit, saying by how much."""
    config = resolve(config)
    p = plan(config, gpu_name, seq_len, batch_size, dtype, weight_dtype, reserve_fraction,
             context_bytes)
    if not p.fits:
        name = config.name or "the model"
        raise DoesNotFitError(
            f"{name} at seq_len={seq_len:,}, batch_size={batch_size} needs a {dtype} KV cache of "
            f"{p.cache_bytes / GiB:.2f} GiB, but {p.gpu.name} ({p.gpu.memory_bytes / GiB:.2f} GiB) "
            f"has {max(p.free_for_cache, 0) / GiB:.2f} GiB left after the CUDA context "
            f"({p.context_bytes / GiB:.2f} GiB), {p.weight_bytes / GiB:.2f} GiB of weights and "
            f"{p.reserve_bytes / GiB:.2f} GiB reserve; longest context at this batch: "
            f"{p.max_context:,} tokens, most sequences of this length: {p.max_batch}"
        )
    return p


def format_bytes(n: int | float) -> str:
    """Bytes in binary units (KiB, MiB, GiB, TiB: powers of 1,024), two decimals: '2.00 GiB'.

    Memory sizes in the course are binary, and so is GPU memory: an "80GB" A100 shows 81,920 MiB in
    nvidia-smi (80 GiB), of which CUDA reports about 79.2 GiB.
    """
    validate.number("n", n)  # a finite number of bytes (numpy scalars too), within a float's range
    n = int(n) if isinstance(n, numbers.Integral) else float(n)
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n:.0f} B" if n == int(n) else f"{sign}{n:.2f} B"
