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

Two other formats a practitioner meets, for comparison:

- **FP8** (`to_fp8`, `fake_quantize_fp8`): one byte a number in a float format, E4M3 (4 exponent
  bits, 3 mantissa bits, largest 448) or E5M2 (largest 57,344, one mantissa bit less), with one
  scale per tensor or per KV head fixed in advance (calibrated), as vLLM's FP8 KV cache does;
- **asymmetric min/max** (`fake_quantize_minmax`): codes 0 … 2^bits − 1 spanning [min, max] of a
  group with a zero point, KIVI's 2-bit format.
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

    def __post_init__(self):
        validate.tensor("data", self.data)
        if self.data.dtype != torch.int8:
            raise ValueError(f"Quantized.data must hold int8 codes; got dtype {self.data.dtype}")
        self.bits = check_bits(self.bits)
        _check_granularity(self.granularity, self.data)
        want = scale_shape(self.data.shape, self.granularity)
        check_scale(self.scale, self.data, shape=want)
        if self.data.numel() and int(self.data.abs().max()) > qmax(self.bits):
            raise ValueError(f"codes reach {int(self.data.abs().max())}, beyond ±{qmax(self.bits)} "
                             f"of {self.bits}-bit codes")

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
    if not isinstance(q, Quantized):
        raise ValueError(f"dequantize needs a kvlab.quant.Quantized (from quantize); got "
                         f"{type(q).__name__} {validate.shown(q)}")
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


def scale_shape(shape, granularity: str) -> tuple[int, ...]:
    """The shape of the scales `quantize` gives a tensor of `shape`: (1, …, 1) per tensor,
    (…, tokens, 1) per token, (…, 1, channels) per channel."""
    shape = tuple(shape)
    if granularity == "tensor":
        return (1,) * len(shape)
    if granularity == "token":
        return shape[:-1] + (1,)
    return shape[:-2] + (1, shape[-1])


def check_scale(scale, x: torch.Tensor, name: str = "scale", shape=None) -> torch.Tensor:
    """`scale` as float32 when it can scale x: a real floating-point tensor (or a number) of finite
    values >= 0 (0 only for a group of zeros), on x's device, that broadcasts against x without
    changing x's shape; with `shape`, exactly that shape. Anything else is refused, naming it."""
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        scale = torch.tensor(float(scale), device=x.device)
    validate.tensor(name, scale, non_empty=True)
    if not scale.is_floating_point():  # complex, integer and bool are refused
        raise ValueError(f"{name} must be a real floating-point tensor; got dtype {scale.dtype}")
    if scale.layout != torch.strided or scale.is_meta or scale.device != x.device:
        raise ValueError(f"{name} must be a dense tensor on {x.device}; got layout {scale.layout} "
                         f"on {scale.device}")
    if shape is not None and tuple(scale.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(scale.shape)}; allowed: {tuple(shape)} for x of "
                         f"shape {tuple(x.shape)}")
    try:
        fits = torch.broadcast_shapes(scale.shape, x.shape) == x.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{name} of shape {tuple(scale.shape)} does not broadcast against x of shape "
                         f"{tuple(x.shape)}; allowed: a shape of 1s and x's own sizes, e.g. "
                         f"{scale_shape(x.shape, 'tensor')} (one scale)")
    s = scale.float()
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        raise ValueError(f"{name} must be finite and >= 0; got values from {s.min().item():.4g} to "
                         f"{s.max().item():.4g}")
    return s


# --- FP8: one byte a number, a float format, scales fixed in advance ------------------------------

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_max(fmt: str = "e4m3") -> float:
    """The largest finite value of an FP8 format: 448 for E4M3, 57,344 for E5M2."""
    return float(torch.finfo(FP8_FORMATS[validate.choice("fmt", fmt, FP8_FORMATS)]).max)


def fp8_scale(x: torch.Tensor, fmt: str = "e4m3", per_head: bool = False) -> torch.Tensor:
    """max|x| / fp8_max(fmt): the scale that maps x's largest value onto the format's largest, one
    for the whole tensor or (per_head) one per head of x laid out (…, heads, tokens, head_dim).
    Computed on calibration data, then fixed: a cache must scale a token the moment it arrives."""
    validate.tensor("x", x, floating=True, non_empty=True)
    if per_head and x.dim() < 3:
        raise ValueError(f"per_head=True needs x laid out (…, heads, tokens, head_dim); got shape "
                         f"{tuple(x.shape)}")
    a = x.detach().abs().float()
    if per_head:
        dims = [d for d in range(x.dim()) if d != x.dim() - 3]
        amax = a.amax(dim=dims, keepdim=True)
    else:
        amax = a.amax().reshape([1] * x.dim())
    return amax / fp8_max(fmt)


def to_fp8(x: torch.Tensor, scale, fmt: str = "e4m3") -> torch.Tensor:
    """x / scale as FP8 codes (a torch.float8_* tensor, one byte a value). Values beyond the
    format's largest saturate to it, as vLLM does (a plain cast would give E5M2 inf)."""
    validate.tensor("x", x, floating=True, non_empty=True)
    dtype = FP8_FORMATS[validate.choice("fmt", fmt, FP8_FORMATS)]
    s = check_scale(scale, x)
    if bool((s == 0).any()):
        raise ValueError("scale must be > 0 for FP8 (a fixed scale of 0 would read back nothing)")
    limit = fp8_max(fmt)
    return (x.float() / s).clamp(-limit, limit).to(dtype)


def from_fp8(codes: torch.Tensor, scale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 codes × scale, as `dtype`."""
    validate.tensor("codes", codes)
    if codes.dtype not in FP8_FORMATS.values():
        raise ValueError(f"codes must be an FP8 tensor (from to_fp8); got dtype {codes.dtype}")
    validate.float_dtype("dtype", dtype, "hold dequantized values")
    return (codes.float() * check_scale(scale, codes)).to(dtype)


def fake_quantize_fp8(x: torch.Tensor, scale, fmt: str = "e4m3") -> torch.Tensor:
    """from_fp8(to_fp8(x)) in x's dtype: the values an FP8 cache gives back."""
    return from_fp8(to_fp8(x, scale, fmt), scale, x.dtype)


# --- asymmetric min/max (KIVI's format) ------------------------------------------------------------

MINMAX_BITS = (2, 4, 8)


def fake_quantize_minmax(x: torch.Tensor, bits: int = 2, granularity: str = "token",
                         group_size: int | None = None) -> torch.Tensor:
    """Asymmetric quantization with a zero point, as KIVI does, read back in x's dtype.

    Per group: step = (max - min) / (2^bits - 1), code = round((x - min) / step) in 0 … 2^bits - 1,
    x̂ = min + code × step (min and step stored in fp16, rounded; the codes use the stored ones).
    Groups for x laid out (…, tokens, channels): "token" — `group_size` consecutive channels of one
    token (None: all its channels); "channel" — one channel over all of x's tokens. Every value
    comes back within step / 2 plus the fp16 rounding of min.
    """
    validate.tensor("x", x, floating=True, non_empty=True)
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or int(bits) not in MINMAX_BITS:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {', '.join(map(str, MINMAX_BITS))}")
    validate.choice("granularity", granularity, ("token", "channel"))
    _check_granularity(granularity, x)
    channels = x.shape[-1]
    if group_size is not None and granularity == "channel":
        raise ValueError("group_size applies to granularity='token' (channels of one token); a "
                         "'channel' group spans x's tokens: pass the tokens that share it")
    size = channels if group_size is None else validate.integer("group_size", group_size)
    if channels % size:
        raise ValueError(f"group_size={size} does not divide the {channels} channels; allowed: a "
                         f"divisor of {channels}")
    v = x.float()
    if granularity == "token":
        v = v.reshape(*x.shape[:-1], channels // size, size)
    dim = -1 if granularity == "token" else -2
    lo = v.amin(dim=dim, keepdim=True).half().float()
    hi = v.amax(dim=dim, keepdim=True)
    levels = 2 ** int(bits) - 1
    step = stored_scale((hi - lo) / levels, torch.float16).float()
    codes = torch.round((v - lo) / torch.where(step > 0, step, torch.ones_like(step))).clamp(0, levels)
    return (lo + codes * step).reshape(x.shape).to(x.dtype)


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
