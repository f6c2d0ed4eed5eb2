"""Offloading: keep cold K/V blocks in host (CPU) memory and copy them back when needed, or compute
them again. Copying costs the bytes ÷ the link's bandwidth; recomputing costs a prefill of those tokens
(2 × the layers' weights FLOPs a token: no embedding, no LM head; `kvlab.prefix.prefill_flops`) ÷ the
GPU's FLOP/s. Which one wins depends on the model's bytes per token (GQA makes copying cheaper) and on
the link.
"""

from __future__ import annotations

from . import validate
from .config import ModelConfig
from .memory import kv_bytes_per_token
from .prefix import prefill_flops

# Link bandwidths per direction, from the PCI-SIG and NVIDIA specifications (docs/references.md).
LINKS: dict[str, float] = {
    "PCIe 4.0 x16": 32e9,      # 16 GT/s × 16 lanes, 128b/130b: ~32 GB/s each way
    "PCIe 5.0 x16": 64e9,      # 32 GT/s × 16 lanes: ~64 GB/s each way
    "NVLink-C2C (GH200)": 450e9,  # 900 GB/s total, 450 GB/s each way
}


def offload_seconds(config: ModelConfig, n_tokens: int, bandwidth: float, dtype: str = "fp16") -> float:
    """Time to bring the K/V of n_tokens back from host memory over a link of `bandwidth` bytes/s."""
    n_tokens = validate.integer("n_tokens", n_tokens, low=0, high=validate.MAX_TOKENS)
    bandwidth = validate.number("bandwidth", bandwidth, low=0, low_inclusive=False)
    return kv_bytes_per_token(config, dtype) * n_tokens / bandwidth


def recompute_seconds(config: ModelConfig, n_tokens: int, flops_per_s: float) -> float:
    """Time to compute the K/V of n_tokens again (a prefill of them) at flops_per_s."""
    n_tokens = validate.integer("n_tokens", n_tokens, low=0, high=validate.MAX_TOKENS)
    flops_per_s = validate.number("flops_per_s", flops_per_s, low=0, low_inclusive=False)
    return prefill_flops(config, n_tokens) / flops_per_s
