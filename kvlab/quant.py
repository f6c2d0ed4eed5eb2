"""Absmax (symmetric) integer quantization of K and V, and how a quantized cache stores them.

One float `scale` is shared by a group of values: scale = max|x| / qmax (qmax = 127 for int8,
7 for int4). Each value is stored as the integer q = clamp(round(x / scale), -qmax, qmax) and read
back as q · scale, so the error of any value is at most scale / 2. Which values share a scale is
the *granularity*; for a tensor laid out (..., tokens, channels), as K and V are:

- "tensor":  one scale for the whole tensor (an outlier anywhere coarsens every value);
- "token":   one scale per token (row), shared by its channels (what KIVI does for V);
- "channel": one scale per channel (column), shared by the tokens (what KIVI does for K, whose
  few large "outlier" channels would otherwise blow up every token's scale).

int4 codes are kept one per int8 element here; `Quantized.nbytes` counts them packed two per byte
(see `pack_int4`), as a real kernel would store them. The quantized cache built on these functions
is `kvlab.cache.QuantizedKVCache`; what quantization costs in model quality is measured by
`kvlab.quality`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from . import validate

GRANULARITIES = ("tensor", "token", "channel")
BITS = (8, 4)


def qmax(bits: int = 8) -> int:
    """Largest code of a symmetric signed `bits`-bit integer: 127 for int8, 7 for int4."""
    return 2 ** (check_bits(bits) - 1) - 1


@dataclass
class Quantized:
    """Integer codes (int8 tensor, same shape as the input) and the scales that read them back."""

    data: torch.Tensor    # int8 codes in [-qmax, qmax]
    scale: torch.Tensor   # broadcastable to data: one float per group of values
    bits: int
    granularity: str

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the codes (int4 counted packed, two a byte) plus the scales."""
        return (self.data.numel() * self.bits + 7) // 8 + self.scale.nbytes


def absmax_scale(x: torch.Tensor, granularity: str = "tensor", bits: int = 8) -> torch.Tensor:
    """max|x| / qmax over each group of `granularity`, with dims kept so it broadcasts against x."""
    validate.tensor("x", x, floating=True, non_empty=True)
    _check_granularity(granularity, x)
    a = x.detach().abs().float()
    if granularity == "tensor":
        amax = a.amax().reshape([1] * x.dim())
    elif granularity == "token":
        amax = a.amax(dim=-1, keepdim=True)      # reduce over channels: one scale per token
    else:
        amax = a.amax(dim=-2, keepdim=True)      # reduce over tokens: one scale per channel
    return amax / qmax(bits)


def quantize(x: torch.Tensor, granularity: str = "tensor", bits: int = 8,
             scale_dtype: torch.dtype | None = None) -> Quantized:
    """Absmax-quantize x to `bits`-bit integer codes with one scale per `granularity` group.

    The scales are stored in `scale_dtype` (a float dtype; default: x's dtype; fp16 halves their
    bytes), rounded *up* to it, and the codes are computed with the stored scales, so every value
    of dequantize(quantize(x)) is within stored scale / 2 of x. With fp16 scales that is
    max|x| / qmax / 2 to within 0.1 %, plus at most 3e-8 where the scale falls below fp16's normal
    range (max|x| < 6.1e-5 · qmax). A scale beyond the dtype's range (fp16: max|x| > 65504 · qmax,
    about 8.3e6 for int8) cannot be stored: refused, asking for scale_dtype=torch.float32.
    """
    validate.tensor("x", x, floating=True, non_empty=True)
    bits = check_bits(bits)
    scale = stored_scale(absmax_scale(x, granularity, bits), scale_dtype or x.dtype)
    s = scale.float()
    # A group of zeros has scale 0: divide by 1 instead (its codes are 0 either way).
    q = torch.round(x.float() / torch.where(s > 0, s, torch.ones_like(s)))
    q = q.clamp(-qmax(bits), qmax(bits)).to(torch.int8)
    return Quantized(q, scale, bits, granularity)


SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_scale_dtype(scale_dtype) -> torch.dtype:
    """Refuse a dtype that cannot hold a scale (an integer dtype would read back zeros)."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype={scale_dtype!r} cannot hold a scale; allowed: "
                         + ", ".join(map(str, SCALE_DTYPES)))
    return scale_dtype


def stored_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`scale` (float32) as stored in `dtype`, rounded up (rounding down could need a code above
    qmax, clamped: an error over scale / 2); refused when it is not finite there."""
    check_scale_dtype(dtype)
    stored = scale.to(dtype)
    up = torch.nextafter(stored, torch.full_like(stored, torch.finfo(dtype).max))
    stored = torch.where(stored.float() < scale, up, stored)
    if not bool(torch.isfinite(stored).all()):
        raise ValueError(f"a scale of {scale.max().item():.4g} (max |x| / qmax) does not fit in "
                         f"{dtype} (largest {torch.finfo(dtype).max:.6g}), or x is not finite; "
                         "store the scales with scale_dtype=torch.float32")
    return stored


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes × scales, as `dtype` (a float dtype: an integer one would truncate the values)."""
    validate.float_dtype("dtype", dtype, "hold dequantized values")
    return (q.data.float() * q.scale.float()).to(dtype)


def fake_quantize(x: torch.Tensor, granularity: str = "tensor", bits: int = 8,
                  scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: the values a quantized cache gives back."""
    return dequantize(quantize(x, granularity, bits, scale_dtype), x.dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two int4 codes (in [-8, 7]) a byte, along the last dim (which must be even)."""
    validate.tensor("codes", codes)
    if codes.dtype != torch.int8 or codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs int8 codes with an even last dim; got {codes.dtype}, "
                         f"shape {tuple(codes.shape)}")
    if codes.numel() and (codes.min() < -8 or codes.max() > 7):
        raise ValueError("pack_int4 needs codes in [-8, 7]")
    return (codes[..., 0::2] & 0x0F) | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4 (arithmetic shifts restore the sign)."""
    validate.tensor("packed", packed)
    if packed.dtype != torch.int8:
        raise ValueError(f"packed must be int8 (two int4 codes a byte, from pack_int4); got {packed.dtype}")
    low, high = (packed << 4) >> 4, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


# --- error metrics: `x` is the original, `y` its reconstruction ---------------------------------

def _pair(x, y) -> tuple[torch.Tensor, torch.Tensor]:
    """x and y as float32 when both are non-empty tensors of one shape: broadcasting (3, 1) against
    (3,) would compare every value with every other and report an error where there is none."""
    validate.tensor("x", x, non_empty=True)
    validate.tensor("y", y, non_empty=True)
    if x.shape != y.shape:
        raise ValueError(f"x has shape {tuple(x.shape)} but y {tuple(y.shape)}: compare a tensor with "
                         "its reconstruction, of the same shape")
    return x.float(), y.float()


def max_abs_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest |x - y| over all elements."""
    x, y = _pair(x, y)
    return (x.float() - y.float()).abs().max().item()


def relative_rms_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """‖x - y‖ / ‖x‖ (root-mean-square error relative to the signal); 0 is perfect."""
    x, y = _pair(x, y)
    err, norm = (x - y).norm().item(), x.norm().item()
    if norm == 0:
        return 0.0 if err == 0 else float("inf")
    return err / norm


def snr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-noise ratio 10·log10(‖x‖² / ‖x - y‖²) in decibels; higher is better (inf: exact)."""
    x, y = _pair(x, y)
    noise = (x - y).pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * torch.log10(x.pow(2).sum() / noise).item()


def cosine_similarity(x: torch.Tensor, y: torch.Tensor) -> float:
    """Cosine of the angle between x and y flattened; 1 is the same direction."""
    x, y = _pair(x, y)
    return torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0).item()


def error_report(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """All the metrics above, as a dict (one row of a table)."""
    return {"max_abs_error": max_abs_error(x, y), "relative_rms_error": relative_rms_error(x, y),
            "snr_db": snr_db(x, y), "cosine_similarity": cosine_similarity(x, y)}


def check_bits(bits) -> int:
    """`bits` as an int when kvlab can store that width; refused otherwise (8.0 and "8" too)."""
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or int(bits) not in BITS:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {', '.join(map(str, BITS))}")
    return int(bits)


def _check_granularity(granularity, x: torch.Tensor) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not known; allowed: "
                         + ", ".join(map(repr, GRANULARITIES)))
    if granularity != "tensor" and x.dim() < 2:
        raise ValueError(f"granularity={granularity!r} needs a (..., tokens, channels) tensor; "
                         f"got shape {tuple(x.shape)}")
