"""What a quantized KV cache costs in quality, measured on a model.

`compare_caches` runs the same tokens through a model twice or more, teacher-forced (a prefill,
then one token a step, as in decoding): once with an exact cache and once per storage setting, and
reports how far K, V, the attention outputs and the logits moved, how often the greedy token
agrees and how the next-token loss changed. The quantization itself lives in `kvlab.quant`, the
caches in `kvlab.cache`; this module only measures.
"""

from __future__ import annotations

import functools
import math

import torch

from . import validate
from .cache import QuantizedKVCache, StaticKVCache
from .cache.quantized import QuantizedTensorStore
from .quant import (
    FP8_FORMATS,
    fake_quantize_fp8,
    fake_quantize_minmax,
    fp8_max,
    max_abs_error,
    relative_rms_error,
)

STORAGE = ("fp32", "fp16", "int8", "int4")


def measure_cache_error(model, tokens: torch.Tensor, prompt_len: int = 1, storage: str = "int8",
                        **cache_options) -> dict:
    """Errors of one storage format against the exact cache: `compare_caches` for one setting."""
    setting = {storage: dict(storage=storage, **cache_options)}
    return compare_caches(model, tokens, prompt_len, setting)[storage]


@torch.inference_mode()
def compare_caches(model, tokens: torch.Tensor, prompt_len: int, settings: dict[str, dict]) -> dict:
    """Run `tokens` (B, T) through `model` teacher-forced (a prefill of prompt_len tokens, then one
    token a step, as in decoding) with an exact cache in the model's dtype, then once per
    setting with a cache that stores K and V as setting["storage"]: "int8" / "int4" (a
    QuantizedKVCache built with the setting's other options), "fp16" (rounded to fp16) or "fp32".

    Returns {label: metrics}: the relative RMS errors of K, V (all layers) against the exact
    run's ("k_relative_rms_error": its rounding plus what earlier layers' rounding carried into
    it), of K and V against what this run put into its own cache ("k_rounding_error",
    "v_rounding_error": the rounding alone), of the attention outputs (all layers) and of the
    logits; the logits' max abs error; the fraction of positions whose greedy (arg-max) token agrees;
    the next-token loss (nats per token) of the exact and of this run, and
    each sequence's mean loss (tensors of B: "loss_exact_per_sequence", "loss_quant_per_sequence"),
    for a paired standard error; the cache's nbytes and the number of predictions. A setting with
    `key_window=False` measures NoWindowQuantizedKVCache (every key quantized); a setting may also
    be a function (batch, T) -> an empty cache (FixedScaleKVCache, KIVIKVCache, …).
    """
    tokens = torch.as_tensor(tokens)
    prompt_len = validate.integer("prompt_len", prompt_len)
    if tokens.dim() != 2 or not 1 <= prompt_len < tokens.shape[1]:
        raise ValueError(f"tokens must be (batch, T) with T > prompt_len={prompt_len} >= 1; "
                         f"got shape {tuple(tokens.shape)}")
    caches = {label: options(*tokens.shape) if callable(options)
              else _storage_cache(model, tokens, **dict(options)) for label, options in settings.items()}
    exact_logits, exact_attn, exact_cache = _teacher_forced(model, tokens, prompt_len,
                                                            _storage_cache(model, tokens, "fp32"))[:3]
    targets = tokens[:, 1:].reshape(-1)
    cross_entropy = torch.nn.functional.cross_entropy
    k_exact, v_exact = _all_layers(exact_cache)
    vocab = exact_logits.shape[-1]
    out = {}
    for label, cache in caches.items():
        logits, attn, cache, (k_in, v_in) = _teacher_forced(model, tokens, prompt_len, cache, record=True)
        k_stored, v_stored = _all_layers(cache)
        out[label] = {
            "k_relative_rms_error": relative_rms_error(k_exact, k_stored),
            "v_relative_rms_error": relative_rms_error(v_exact, v_stored),
            "k_rounding_error": relative_rms_error(k_in, k_stored),
            "v_rounding_error": relative_rms_error(v_in, v_stored),
            "attention_relative_rms_error": relative_rms_error(exact_attn, attn),
            "logits_relative_rms_error": relative_rms_error(exact_logits, logits),
            "logits_max_abs_error": max_abs_error(exact_logits, logits),
            "top1_agreement": (exact_logits.argmax(-1) == logits.argmax(-1)).float().mean().item(),
            "loss_exact": cross_entropy(exact_logits.reshape(-1, vocab), targets).item(),
            "loss_quant": cross_entropy(logits.reshape(-1, vocab), targets).item(),
            "loss_exact_per_sequence": _per_sequence_loss(exact_logits, tokens),
            "loss_quant_per_sequence": _per_sequence_loss(logits, tokens),
            "cache_nbytes": cache.nbytes,
            "tokens": targets.numel(),
        }
    return out


def _per_sequence_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of each sequence (B,): what a standard error over sequences needs."""
    vocab = logits.shape[-1]
    nats = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1),
                                             reduction="none")
    return nats.view(tokens.shape[0], -1).mean(dim=1).cpu()


class RoundedKVCache(StaticKVCache):
    """Stores K and V in a float `storage_dtype`; hands them back in the model's dtype, so the only
    change from the exact cache is the rounding of the stored values."""

    def __init__(self, config, batch_size, max_seq_len, dtype=torch.float32, device="cpu",
                 storage_dtype=torch.float16):
        super().__init__(config, batch_size, max_seq_len, dtype=storage_dtype, device=device)
        self.dtype = dtype  # what the model reads back

    def update(self, layer, k, v):
        k_all, v_all = super().update(layer, k.to(self.k.dtype), v.to(self.v.dtype))
        return k_all.to(self.dtype), v_all.to(self.dtype)

    def read(self, layer):
        n = self.lengths[layer]
        return self.k[layer, :, :, :n], self.v[layer, :, :, :n]


class NoWindowQuantizedKVCache(StaticKVCache):
    """A simulation: what the model would read if *every* key were quantized, including the newest,
    unfinished block that QuantizedKVCache keeps in full precision (its window). Stores K and V
    exactly and hands back, at each read, K quantized per `key_granularity` in blocks of
    `group_size` tokens (the unfinished block with the scales of the tokens it has so far) and V
    per token over all its H_kv·D values, as QuantizedKVCache does, with fp16 scales. Not a storage
    scheme (it re-scales the unfinished block from exact values): a measurement of the window's effect.
    """

    def __init__(self, config, batch_size, max_seq_len, dtype=torch.float32, device="cpu", *,
                 bits: int = 8, key_granularity: str = "channel", group_size: int = 32):
        super().__init__(config, batch_size, max_seq_len, dtype=dtype, device=device)
        validate.choice("key_granularity", key_granularity, ("channel", "token"))
        self.bits, self.key_granularity = bits, key_granularity
        self.group_size = validate.integer("group_size", group_size) if key_granularity == "channel" else 1
        # What the model reads, kept up to date: a complete block's values never change again, so
        # an update re-rounds only the blocks it touched (the unfinished one from its first token).
        self.k_read, self.v_read = torch.zeros_like(self.k), torch.zeros_like(self.v)

    def update(self, layer, k, v):
        start = self.lengths[layer]
        super().update(layer, k, v)
        n, first = self.lengths[layer], start // self.group_size * self.group_size
        self.k_read[layer, :, :, first:n] = _fake_blocks(self.k[layer, :, :, first:n],
                                                         self.key_granularity, self.group_size, self.bits)
        self.v_read[layer, :, :, start:n] = _fake_blocks(self.v[layer, :, :, start:n], "token", 1,
                                                         self.bits)
        return self.read(layer)

    def read(self, layer):
        n = self.lengths[layer]
        return self.k_read[layer, :, :, :n], self.v_read[layer, :, :, :n]


def _fake_blocks(x: torch.Tensor, granularity: str, block: int, bits: int) -> torch.Tensor:
    """x (B, H, S, D) fake-quantized as QuantizedKVCache lays it out: token rows of H·D values,
    scales per `granularity` within blocks of `block` tokens, a last partial block included."""
    from .quant import fake_quantize

    b, h, n, d = x.shape
    rows = x.transpose(1, 2).reshape(b, n, h * d)
    if block == 1:   # per token: every row has its own scale
        out = [fake_quantize(rows, granularity, bits, torch.float16)]
    else:
        out = [fake_quantize(rows[:, s:s + block], granularity, bits, torch.float16)
               for s in range(0, n, block)]
    return torch.cat(out, dim=1).reshape(b, n, h, d).transpose(1, 2)


def _storage_cache(model, tokens, storage: str = "int8", **cache_options):
    """An empty cache for `tokens` that stores K and V as `storage` (see compare_caches).
    int8 / int4 with `key_window=False` give NoWindowQuantizedKVCache (every key quantized)."""
    validate.choice("storage", storage, STORAGE)
    if cache_options and storage not in ("int8", "int4"):
        raise ValueError(f"cache options {sorted(cache_options)} only apply to int8 / int4 storage")
    config, (batch, total) = model.config, tokens.shape
    dtype = next(model.parameters()).dtype
    if cache_options.pop("key_window", True) is False:
        return NoWindowQuantizedKVCache(config, batch, total, dtype=dtype, device=tokens.device,
                                        bits=8 if storage == "int8" else 4, **cache_options)
    if storage in ("int8", "int4"):
        return QuantizedKVCache(config, batch, total, dtype=dtype, device=tokens.device,
                                bits=8 if storage == "int8" else 4, **cache_options)
    stored = torch.float16 if storage == "fp16" else torch.float32
    return RoundedKVCache(config, batch, total, dtype=dtype, device=tokens.device, storage_dtype=stored)


def _teacher_forced(model, tokens, prompt_len, cache, record: bool = False):
    """(logits of every prediction, attention outputs of all layers, the filled cache, and with
    `record` the K and V this run put into the cache, all layers, laid out as `_all_layers`)."""
    attn_out: list[list[torch.Tensor]] = [[] for _ in model.layers]
    hooks = [layer.attn.register_forward_hook(lambda _m, _i, out, store=attn_out[i]: store.append(out))
             for i, layer in enumerate(model.layers)]
    given: list[list[tuple]] = [[] for _ in model.layers]
    update = cache.update

    def recording(layer, k, v):
        given[layer].append((k.detach(), v.detach()))
        return update(layer, k, v)

    if record:
        cache.update = recording  # on this cache object only: what the model hands it
    try:
        logits = [model(tokens[:, :prompt_len], cache=cache)]
        logits += [model(tokens[:, t:t + 1], cache=cache) for t in range(prompt_len, tokens.shape[1])]
    finally:
        for h in hooks:
            h.remove()
        if record:
            del cache.update
    inputs = None
    if record:  # laid out as _all_layers: each layer's (B, H, S, D), the layers side by side
        inputs = tuple(torch.cat([torch.cat([kv[i] for kv in g], dim=2).float() for g in given], dim=-1)
                       for i in (0, 1))
    return (torch.cat(logits, dim=1)[:, :-1].float(),
            torch.cat([torch.cat(a, dim=1) for a in attn_out], dim=-1).float(), cache, inputs)


def _all_layers(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every layer as the model read them, concatenated along the channel dim."""
    layers = [cache.read(i) for i in range(cache.config.n_layers)]
    return (torch.cat([k.float() for k, _ in layers], dim=-1),
            torch.cat([v.float() for _, v in layers], dim=-1))


# ---- other formats, for the practitioner's comparison: FP8 with fixed scales, KIVI's 2-bit ------------

FIXED_FORMATS = (*FP8_FORMATS, "int8", "int4")
INT_MAX_CODE = {"int8": 127, "int4": 7}   # symmetric absmax codes: -q … q


@torch.inference_mode()
def kv_absmax(model, tokens: torch.Tensor, per_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """max |K| and max |V| of each layer (per_head: of each KV head) over `tokens` run through an
    exact cache: calibration data for fixed scales. Two tensors (n_layers, 1 or H_kv, 1, 1)."""
    tokens = torch.as_tensor(tokens)
    cache = StaticKVCache(model.config, tokens.shape[0], tokens.shape[1],
                          dtype=next(model.parameters()).dtype, device=tokens.device)
    model(tokens, cache=cache)
    dims = (0, 2, 3) if per_head else (0, 1, 2, 3)   # of each layer's (B, H_kv, S, D)
    amax = [[side[layer, :, :, :tokens.shape[1]].abs().float().amax(dims, keepdim=True)[0]
             for layer in range(model.config.n_layers)] for side in (cache.k, cache.v)]
    return torch.stack(amax[0]), torch.stack(amax[1])


class FixedScaleKVCache(StaticKVCache):
    """K and V rounded to `fmt` ("e4m3", "e5m2": FP8; "int8", "int4": absmax codes) with scales fixed in
    advance: per layer, one for the whole tensor or one per KV head (`k_absmax`, `v_absmax` of shape
    (n_layers, 1 or H_kv, 1, 1), from `kv_absmax` on calibration text), as vLLM's FP8 KV cache
    scales. Each token is rounded the moment it arrives, so feeding a prompt at once or token by
    token gives the same values. A value beyond the calibrated range saturates. A simulation for
    measuring quality: it keeps the rounded values in the model's dtype (`format_nbytes` counts
    the bytes the format would take: one a number, half for int4, plus the scales)."""

    def __init__(self, config, batch_size, max_seq_len, dtype=torch.float32, device="cpu", *,
                 fmt: str = "e4m3", k_absmax: torch.Tensor, v_absmax: torch.Tensor):
        super().__init__(config, batch_size, max_seq_len, dtype=dtype, device=device)
        self.fmt = validate.choice("fmt", fmt, FIXED_FORMATS)
        top = float(INT_MAX_CODE[fmt]) if fmt in INT_MAX_CODE else fp8_max(fmt)
        self.scales = []
        for name, amax in (("k_absmax", k_absmax), ("v_absmax", v_absmax)):
            validate.tensor(name, amax, floating=True)
            if amax.dim() != 4 or amax.shape[0] != self.config.n_layers or amax.shape[1] not in (
                    1, self.config.n_kv_heads) or amax.shape[2:] != (1, 1):
                raise ValueError(f"{name} has shape {tuple(amax.shape)}; allowed: "
                                 f"({self.config.n_layers}, 1 or {self.config.n_kv_heads}, 1, 1)")
            self.scales.append(amax.float().clamp(min=1e-12).to(self.k.device) / top)

    def _round(self, x, scale):
        if self.fmt in INT_MAX_CODE:
            q = INT_MAX_CODE[self.fmt]
            return (torch.round(x.float() / scale).clamp(-q, q) * scale).to(x.dtype)
        return fake_quantize_fp8(x, scale, self.fmt)

    def update(self, layer, k, v):
        ks, vs = self.scales[0][layer], self.scales[1][layer]
        return super().update(layer, self._round(k, ks), self._round(v, vs))

    def read(self, layer):
        n = self.lengths[layer]
        return self.k[layer, :, :, :n], self.v[layer, :, :, :n]

    @property
    def format_nbytes(self) -> int:
        """Bytes of the format: one a number (half for int4: two codes a byte) plus the fp32 scales."""
        codes = (self.k.numel() + self.v.numel()) // (2 if self.fmt == "int4" else 1)
        return codes + 4 * sum(s.numel() for s in self.scales)


class _RoundedStore(QuantizedTensorStore):
    """A QuantizedTensorStore that keeps each block as `rounding` reads it back (floats), not codes:
    the cache's blocks, residual window and per-query views stay exactly QuantizedKVCache's."""

    def __init__(self, layout, n_layers, batch, dtype, device, rounding):
        super().__init__(layout, n_layers, batch, dtype, torch.float16, device)
        self.codes = torch.zeros(n_layers, batch, layout.max_seq_len, layout.width, dtype=dtype,
                                 device=self.codes.device)
        self.rounding = rounding  # (B, blocks, block, width) -> the same, as read back

    def _quantize_blocks(self, x):
        b, t, w = x.shape
        block = self.layout.block
        values = self.rounding(x.reshape(b, t // block, block, w)).reshape(b, t, w)
        return values, self.scales.new_zeros(b, t // block, 1, self.layout.scale_width)

    def read(self, layer):
        n = self.quantized[layer]
        window = self.exact[layer][:, n - self.exact_from[layer]:]
        rows = torch.cat([self.codes[layer, :, :n], window], dim=1)
        return rows.reshape(rows.shape[0], rows.shape[1], self.layout.heads,
                            self.layout.head_dim).transpose(1, 2)


class KIVIKVCache(QuantizedKVCache):
    """KIVI-style asymmetric low-bit cache (Liu et al. 2024): keys per channel over blocks of
    `group_size` tokens, values per token in groups of `group_size` channels (within a head), both
    with a min/max zero point (`kvlab.quant.fake_quantize_minmax`), and the `residual` most recent
    tokens of both in full precision (KIVI: 2 bits, group 32, residual 128). The layout, window
    and per-query views are QuantizedKVCache's (keys are quantized a block at a time once older
    than the residual, where KIVI quantizes R at a time; both keep R to R + group − 1 keys exact).
    A simulation for measuring quality: it keeps the rounded values as floats; `format_nbytes`
    counts what the format would store (packed codes, an fp16 scale and zero point per group, the
    fp16 window)."""

    def __init__(self, config, batch_size, max_seq_len, dtype=torch.float32, device="cpu", *,
                 bits: int = 2, group_size: int = 32, residual: int = 128):
        super().__init__(config, batch_size, max_seq_len, dtype=dtype, device=device, bits=8,
                         key_granularity="channel", value_granularity="token", group_size=group_size,
                         residual=residual)
        self.bits = bits
        fake_quantize_minmax(torch.zeros(1, self.config.head_dim), bits, "token",
                             min(group_size, self.config.head_dim))   # refuses bad bits / groups now
        value_group = min(group_size, self.config.head_dim)

        def keys(blocks):    # (B, n, block, width): per channel over each block's tokens
            return fake_quantize_minmax(blocks, bits, "channel")

        def values(rows):    # (B, n, 1, width): per token, groups of channels
            return fake_quantize_minmax(rows, bits, "token", value_group)

        self.sides = {side: _RoundedStore(store.layout, self.config.n_layers, batch_size, dtype,
                                          device, fn)
                      for (side, store), fn in zip(self.sides.items(), (keys, values), strict=True)}

    @property
    def format_nbytes(self) -> int:
        return kivi_cache_bytes(self.config, self.max_seq_len, self.batch_size, self.bits,
                                self.group_size, self.residual)


def kivi_cache_bytes(config, seq_len: int, batch_size: int = 1, bits: int = 2, group_size: int = 32,
                     residual: int = 128) -> int:
    """Bytes KIVIKVCache's format takes for seq_len positions: packed codes, an fp16 scale and zero
    point per group (K: a channel over group_size tokens; V: group_size channels of a token), and
    the fp16 full-precision window (residual + group_size − 1 keys, residual values)."""
    c, n = config, validate.integer("seq_len", seq_len)
    width, g = c.n_kv_heads * c.head_dim, validate.integer("group_size", group_size)
    codes = 2 * n * width * bits // 8
    groups = -(-n // g) * width + n * width // min(g, c.head_dim)
    window = min(residual + g - 1, n) + min(residual, n)
    return validate.integer("batch_size", batch_size) * c.n_layers * (codes + 4 * groups + 2 * window * width)


@torch.inference_mode()
def window_losses(model, windows: torch.Tensor, caches: dict, score_from: int = 1,
                  batch_size: int = 64) -> dict:
    """Each window's mean next-token loss (nats per token) over the positions from `score_from`
    on, with each cache of `caches` (label -> a function (batch, T) -> an empty cache; None: no
    cache, the exact model). One prefill pass per `batch_size` windows: kvlab's quantized caches
    give every query the same decisions as decoding token by token (codes once a block is
    complete, the newest block exact), so the loss is the decoding loss, up to float rounding
    (`decoding_losses` measures it the slow way)."""
    windows = torch.as_tensor(windows)
    t = windows.shape[1]
    score_from = validate.integer("score_from", score_from, low=1, high=t - 1)
    batch_size = validate.integer("batch_size", batch_size)
    out = {}
    for label, make in caches.items():
        per_batch = []
        for chunk in windows.split(batch_size):
            cache = None if make is None else make(chunk.shape[0], t)
            per_batch.append(_scored_loss(model(chunk, cache=cache)[:, score_from - 1:-1],
                                          chunk[:, score_from:]))
        out[label] = torch.cat(per_batch)
    return out


@torch.inference_mode()
def decoding_losses(model, windows: torch.Tensor, caches: dict, score_from: int = 1) -> dict:
    """`window_losses` measured as generation runs: each window's first `score_from` tokens in one
    prefill pass, then one token a step, scoring the same positions (None: an exact
    StaticKVCache). Slow (one forward pass a token): for checking the one-pass losses, and for a
    cache whose rounding of earlier positions changes from step to step, which a single pass cannot
    show each query (NoWindowQuantizedKVCache re-scales its unfinished block every step)."""
    windows = torch.as_tensor(windows)
    b, t = windows.shape
    score_from = validate.integer("score_from", score_from, low=1, high=t - 1)
    dtype = next(model.parameters()).dtype
    out = {}
    for label, make in caches.items():
        cache = (StaticKVCache(model.config, b, t, dtype=dtype, device=windows.device) if make is None
                 else make(b, t))
        logits = [model(windows[:, :score_from], cache=cache)[:, -1:]]
        logits += [model(windows[:, p:p + 1], cache=cache) for p in range(score_from, t - 1)]
        out[label] = _scored_loss(torch.cat(logits, dim=1), windows[:, score_from:])
    return out


def _scored_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of each row (B,), logits (B, n, vocab) against targets (B, n)."""
    nats = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             targets.reshape(-1), reduction="none")
    return nats.view(targets.shape[0], -1).mean(dim=1).cpu()


def paired_change(losses: torch.Tensor, baseline: torch.Tensor) -> tuple[float, float]:
    """(mean of losses − baseline, its standard error): the change measured window by window, so
    the windows' own difficulty cancels. Needs two or more windows."""
    d = (torch.as_tensor(losses) - torch.as_tensor(baseline)).double()
    if d.dim() != 1 or d.numel() < 2:
        raise ValueError(f"need the per-window losses of 2 or more windows; got shape {tuple(d.shape)}")
    return d.mean().item(), (d.std() / d.numel() ** 0.5).item()


def t_critical(df: int, level: float = 0.95) -> float:
    """The two-sided critical value of Student's t with `df` degrees of freedom: with n paired
    windows (df = n − 1) a change beyond t_critical × its standard error is resolved at `level`
    (df = 5: 2.571; it falls towards 1.960 as df grows, so "2 SE" is a 5 % cut only for many
    windows). Computed by integrating the t density numerically (no SciPy needed)."""
    df = validate.integer("df", df)
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} must be between 0 and 1 (e.g. 0.95)")
    x = torch.linspace(0, 1000, 200_001, dtype=torch.float64)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = torch.exp(log_c - (df + 1) / 2 * torch.log1p(x * x / df))
    cdf = torch.cat([x.new_zeros(1), torch.cumulative_trapezoid(density, x)]) + 0.5   # P(T <= x)
    target = 0.5 + level / 2
    i = int(torch.searchsorted(cdf, target))
    if i >= x.numel():
        raise ValueError(f"t_critical(df={df}, level={level}) lies beyond 1,000: choose a lower level")
    # linear between the two grid points around it
    return (x[i - 1] + (target - cdf[i - 1]) / (cdf[i] - cdf[i - 1]) * (x[i] - x[i - 1])).item()


# ---- the small run chapter 05's explorer shows ------------------------------------------------------

SMALL_RUN = {"batch": 2, "tokens": 96, "prompt_len": 32}  # 2 sequences of 96 tokens, a prefill of 32


def small_run() -> tuple:
    """(model, tokens (batch, T), calibration tokens, description) of a small measurement:
    kvlab-tiny on held-out text, calibrated on the first 512 bytes of the validation split, when
    its checkpoint is there; otherwise a random tiny-mha model (seed 0) on random bytes."""
    from . import pretrained
    from .config import PRESETS
    from .generate import encode_bytes
    from .model import Transformer

    b, t = SMALL_RUN["batch"], SMALL_RUN["tokens"]
    try:
        model = pretrained.load("kvlab-tiny")
        ids = encode_bytes(pretrained.corpus_text("held_out"))[: b * t]
        calibration = encode_bytes(pretrained.corpus_text("validation"))[:512]
        return (model, torch.tensor(ids).view(b, t), torch.tensor([calibration]),
                "kvlab-tiny on held-out text")
    except (FileNotFoundError, OSError):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Transformer(PRESETS["tiny-mha"]).eval()
        ids, calibration = (torch.randint(0, model.config.vocab_size, shape,
                                          generator=torch.Generator().manual_seed(seed))
                            for shape, seed in (((b, t), 0), ((1, 512), 1)))
        return model, ids, calibration, "a random tiny-mha model (kvlab-tiny not built) on random bytes"


def small_run_errors(storage: str = "int8", **cache_options) -> dict:
    """`measure_cache_error` of one storage setting on `small_run()`, plus "run" (what was measured).
    `calibrated=True` (int8 / int4) measures one fixed scale per layer for all of K and one for V,
    taken from the calibration text in advance (FixedScaleKVCache): a true per-tensor scale.

    The model and tokens are fixed, so each setting is measured once and remembered (an explorer
    redraws often); the caller gets its own copy of the result.
    """
    return dict(_small_run_errors(storage, tuple(sorted(cache_options.items()))))


@functools.cache
def _small_run_errors(storage: str, cache_options: tuple) -> dict:
    model, tokens, calibration, name = small_run()
    options = dict(cache_options)
    if options.pop("calibrated", False):
        validate.choice("storage", storage, INT_MAX_CODE)
        if options:
            raise ValueError(f"calibrated=True takes no other cache options; got {sorted(options)}")
        k_max, v_max = kv_absmax(model, calibration)
        setting = {storage: lambda b, t: FixedScaleKVCache(model.config, b, t, fmt=storage,
                                                           k_absmax=k_max, v_absmax=v_max)}
        result = compare_caches(model, tokens, SMALL_RUN["prompt_len"], setting)[storage]
    else:
        result = measure_cache_error(model, tokens, SMALL_RUN["prompt_len"], storage, **options)
    result["run"] = (f"{name}: {tokens.shape[0]} × {tokens.shape[1]} tokens, prefill "
                     f"{SMALL_RUN['prompt_len']}, then one token a step")
    return result
