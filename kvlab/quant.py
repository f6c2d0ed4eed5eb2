"""Absmax (symmetric) integer quantization of K and V, and how to measure what it costs.

One float `scale` is shared by a group of values: scale = max|x| / qmax (qmax = 127 for int8,
7 for int4). Each value is stored as the integer q = clamp(round(x / scale), -qmax, qmax) and read
back as q · scale, so the error of any value is at most scale / 2. Which values share a scale is
the *granularity*; for a tensor laid out (..., tokens, channels), as K and V are:

- "tensor":  one scale for the whole tensor (an outlier anywhere coarsens every value);
- "token":   one scale per token (row), shared by its channels (what KIVI does for V);
- "channel": one scale per channel (column), shared by the tokens (what KIVI does for K, whose
  few large "outlier" channels would otherwise blow up every token's scale).

int4 codes are kept one per int8 element here; `Quantized.nbytes` counts them packed two per byte
(see `pack_int4`), as a real kernel would store them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GRANULARITIES = ("tensor", "token", "channel")
BITS = (8, 4)


def qmax(bits: int = 8) -> int:
    """Largest code of a symmetric signed `bits`-bit integer: 127 for int8, 7 for int4."""
    check_bits(bits)
    return 2 ** (bits - 1) - 1


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

    The scales are stored in `scale_dtype` (default: x's dtype; fp16 halves their bytes) and the
    codes are computed with the stored scales, so dequantize(quantize(x)) is within scale / 2.
    """
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor; got dtype {x.dtype}")
    scale = absmax_scale(x, granularity, bits).to(scale_dtype or x.dtype)
    s = scale.float()
    # A group of zeros has scale 0: divide by 1 instead (its codes are 0 either way).
    q = torch.round(x.float() / torch.where(s > 0, s, torch.ones_like(s)))
    q = q.clamp(-qmax(bits), qmax(bits)).to(torch.int8)
    return Quantized(q, scale, bits, granularity)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes × scales, as `dtype`."""
    return (q.data.float() * q.scale.float()).to(dtype)


def fake_quantize(x: torch.Tensor, granularity: str = "tensor", bits: int = 8,
                  scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: the values a quantized cache gives back."""
    return dequantize(quantize(x, granularity, bits, scale_dtype), x.dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two int4 codes (in [-8, 7]) a byte, along the last dim (which must be even)."""
    if codes.dtype != torch.int8 or codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs int8 codes with an even last dim; got {codes.dtype}, "
                         f"shape {tuple(codes.shape)}")
    if codes.numel() and (codes.min() < -8 or codes.max() > 7):
        raise ValueError("pack_int4 needs codes in [-8, 7]")
    return (codes[..., 0::2] & 0x0F) | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4 (arithmetic shifts restore the sign)."""
    low, high = (packed << 4) >> 4, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


# --- error metrics: `x` is the original, `y` its reconstruction ---------------------------------

def max_abs_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest |x - y| over all elements."""
    return (x.float() - y.float()).abs().max().item()


def relative_rms_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """‖x - y‖ / ‖x‖ (root-mean-square error relative to the signal); 0 is perfect."""
    x, y = x.float(), y.float()
    err, norm = (x - y).norm().item(), x.norm().item()
    if norm == 0:
        return 0.0 if err == 0 else float("inf")
    return err / norm


def snr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-noise ratio 10·log10(‖x‖² / ‖x - y‖²) in decibels; higher is better (inf: exact)."""
    x, y = x.float(), y.float()
    noise = (x - y).pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * torch.log10(x.pow(2).sum() / noise).item()


def cosine_similarity(x: torch.Tensor, y: torch.Tensor) -> float:
    """Cosine of the angle between x and y flattened; 1 is the same direction."""
    return torch.nn.functional.cosine_similarity(x.float().flatten(), y.float().flatten(), dim=0).item()


def error_report(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """All the metrics above, as a dict (one row of a table)."""
    return {"max_abs_error": max_abs_error(x, y), "relative_rms_error": relative_rms_error(x, y),
            "snr_db": snr_db(x, y), "cosine_similarity": cosine_similarity(x, y)}


def check_bits(bits) -> None:
    """Refuse a bit width kvlab cannot store."""
    if bits not in BITS or isinstance(bits, bool):
        raise ValueError(f"bits={bits!r} is not supported; allowed: {', '.join(map(str, BITS))}")


def _check_granularity(granularity, x: torch.Tensor) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not known; allowed: "
                         + ", ".join(map(repr, GRANULARITIES)))
    if granularity != "tensor" and x.dim() < 2:
        raise ValueError(f"granularity={granularity!r} needs a (..., tokens, channels) tensor; "
                         f"got shape {tuple(x.shape)}")


# --- what a quantized cache costs: bytes, and errors measured on a model -------------------------

def quantized_cache_bytes(config, seq_len: int, batch_size: int = 1, bits: int = 8,
                          key_granularity: str = "channel", value_granularity: str = "token",
                          group_size: int = 32, residual: int = 0, scale_bytes: int = 2,
                          window_bytes: int = 2) -> int:
    """Bytes of a QuantizedKVCache holding seq_len positions: codes + scales + the full-precision
    window (`window_bytes` per element: 2 for fp16), with the same layout as the cache."""
    check_bits(bits)
    width = config.n_kv_heads * config.head_dim
    total = 0
    for granularity in (key_granularity, value_granularity):
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity={granularity!r} is not known; allowed: "
                             + ", ".join(map(repr, GRANULARITIES)))
        block = 1 if granularity == "token" else group_size
        n_scales = -(-seq_len // block) * (width if granularity == "channel" else 1)
        window = min(residual + block - 1, seq_len)
        total += seq_len * width * bits // 8 + n_scales * scale_bytes + window * width * window_bytes
    return config.n_layers * batch_size * total


STORAGE = ("fp32", "fp16", "int8", "int4")


def measure_cache_error(model, tokens: torch.Tensor, prompt_len: int = 1, storage: str = "int8",
                        **cache_options) -> dict:
    """Errors of one storage format against the exact cache: `compare_caches` for one setting."""
    setting = {storage: dict(storage=storage, **cache_options)}
    return compare_caches(model, tokens, prompt_len, setting)[storage]


@torch.inference_mode()
def compare_caches(model, tokens: torch.Tensor, prompt_len: int, settings: dict[str, dict]) -> dict:
    """Run `tokens` (B, T) through `model` teacher-forced (a prefill of prompt_len tokens, then one
    token a step, as in decoding) with an exact StaticKVCache in the model's dtype, then once per
    setting with a cache that stores K and V as setting["storage"]: "int8" / "int4" (a
    QuantizedKVCache built with the setting's other options), "fp16" (rounded to fp16) or "fp32".

    Returns {label: metrics}: the relative RMS errors of K, V (all layers), the attention outputs
    (all layers) and the logits; the logits' max abs error; the fraction of positions whose greedy
    (arg-max) token agrees; the next-token loss (nats per token) of the exact and of this run; the
    cache's nbytes and the number of predictions.
    """
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 2 or not 1 <= prompt_len < tokens.shape[1]:
        raise ValueError(f"tokens must be (batch, T) with T > prompt_len={prompt_len} >= 1; "
                         f"got shape {tuple(tokens.shape)}")
    caches = {label: _storage_cache(model, tokens, **dict(options)) for label, options in settings.items()}
    la, aa, exact = _teacher_forced(model, tokens, prompt_len, _storage_cache(model, tokens, "fp32"))
    targets = tokens[:, 1:].reshape(-1)
    ce = torch.nn.functional.cross_entropy
    k_exact, v_exact = _all_layers(exact)
    out = {}
    for label, cache in caches.items():
        lb, ab, cache = _teacher_forced(model, tokens, prompt_len, cache)
        k_quant, v_quant = _all_layers(cache)
        out[label] = {
            "k_relative_rms_error": relative_rms_error(k_exact, k_quant),
            "v_relative_rms_error": relative_rms_error(v_exact, v_quant),
            "attention_relative_rms_error": relative_rms_error(aa, ab),
            "logits_relative_rms_error": relative_rms_error(la, lb),
            "logits_max_abs_error": max_abs_error(la, lb),
            "top1_agreement": (la.argmax(-1) == lb.argmax(-1)).float().mean().item(),
            "loss_exact": ce(la.reshape(-1, la.shape[-1]), targets).item(),
            "loss_quant": ce(lb.reshape(-1, lb.shape[-1]), targets).item(),
            "cache_nbytes": cache.nbytes,
            "tokens": targets.numel(),
        }
    return out


def _storage_cache(model, tokens, storage: str = "int8", **cache_options):
    """An empty cache for `tokens` that stores K and V as `storage` (see compare_caches)."""
    from .cache import QuantizedKVCache, StaticKVCache  # the cache module imports this one

    class RoundedKVCache(StaticKVCache):
        """Stores K and V in a float dtype; hands them back in the model's dtype."""

        def update(self, layer, k, v):
            k_all, v_all = super().update(layer, k.to(self.k.dtype), v.to(self.v.dtype))
            return k_all.to(k.dtype), v_all.to(v.dtype)

        def read(self, layer):
            n = self.lengths[layer]
            return self.k[layer, :, :, :n], self.v[layer, :, :, :n]

    if storage not in STORAGE:
        raise ValueError(f"storage={storage!r} is not known; allowed: {', '.join(map(repr, STORAGE))}")
    if cache_options and storage not in ("int8", "int4"):
        raise ValueError(f"cache options {sorted(cache_options)} only apply to int8 / int4 storage")
    cfg, (batch, total) = model.config, tokens.shape
    dtype = next(model.parameters()).dtype
    if storage in ("int8", "int4"):
        return QuantizedKVCache(cfg, batch, total, dtype=dtype, device=tokens.device,
                                bits=8 if storage == "int8" else 4, **cache_options)
    store = torch.float16 if storage == "fp16" else torch.float32
    return RoundedKVCache(cfg, batch, total, dtype=store, device=tokens.device)


def _teacher_forced(model, tokens, prompt_len, cache):
    """(logits of every prediction, attention outputs of all layers, the filled cache)."""
    attn_out: list[list[torch.Tensor]] = [[] for _ in model.layers]
    hooks = [layer.attn.register_forward_hook(lambda _m, _i, out, store=attn_out[i]: store.append(out))
             for i, layer in enumerate(model.layers)]
    try:
        logits = [model(tokens[:, :prompt_len], cache=cache)]
        logits += [model(tokens[:, t:t + 1], cache=cache) for t in range(prompt_len, tokens.shape[1])]
    finally:
        for h in hooks:
            h.remove()
    return (torch.cat(logits, dim=1)[:, :-1].float(),
            torch.cat([torch.cat(a, dim=1) for a in attn_out], dim=-1).float(), cache)


def _all_layers(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every layer as the model read them, concatenated along the channel dim."""
    layers = [cache.read(i) for i in range(cache.config.n_layers)]
    return (torch.cat([k.float() for k, _ in layers], dim=-1),
            torch.cat([v.float() for _, v in layers], dim=-1))
