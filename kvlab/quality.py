"""What a quantized KV cache costs in quality, measured on a model.

`compare_caches` runs the same tokens through a model twice or more, teacher-forced (a prefill,
then one token a step, as in decoding): once with an exact cache and once per storage setting, and
reports how far K, V, the attention outputs and the logits moved, how often the greedy token
agrees and how the next-token loss changed. The quantization itself lives in `kvlab.quant`, the
caches in `kvlab.cache`; this module only measures.
"""

from __future__ import annotations

import functools

import torch

from . import validate
from .cache import QuantizedKVCache, StaticKVCache
from .quant import max_abs_error, relative_rms_error

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

    Returns {label: metrics}: the relative RMS errors of K, V (all layers), the attention outputs
    (all layers) and the logits; the logits' max abs error; the fraction of positions whose greedy
    (arg-max) token agrees; the next-token loss (nats per token) of the exact and of this run, and
    each sequence's mean loss (tensors of B: "loss_exact_per_sequence", "loss_quant_per_sequence"),
    for a paired standard error; the cache's nbytes and the number of predictions. A setting with
    `key_window=False` measures NoWindowQuantizedKVCache (every key quantized).
    """
    tokens = torch.as_tensor(tokens)
    prompt_len = validate.integer("prompt_len", prompt_len)
    if tokens.dim() != 2 or not 1 <= prompt_len < tokens.shape[1]:
        raise ValueError(f"tokens must be (batch, T) with T > prompt_len={prompt_len} >= 1; "
                         f"got shape {tuple(tokens.shape)}")
    caches = {label: _storage_cache(model, tokens, **dict(options)) for label, options in settings.items()}
    exact_logits, exact_attn, exact_cache = _teacher_forced(model, tokens, prompt_len,
                                                            _storage_cache(model, tokens, "fp32"))
    targets = tokens[:, 1:].reshape(-1)
    cross_entropy = torch.nn.functional.cross_entropy
    k_exact, v_exact = _all_layers(exact_cache)
    vocab = exact_logits.shape[-1]
    out = {}
    for label, cache in caches.items():
        logits, attn, cache = _teacher_forced(model, tokens, prompt_len, cache)
        k_stored, v_stored = _all_layers(cache)
        out[label] = {
            "k_relative_rms_error": relative_rms_error(k_exact, k_stored),
            "v_relative_rms_error": relative_rms_error(v_exact, v_stored),
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

    def update(self, layer, k, v):
        super().update(layer, k, v)
        return self.read(layer)

    def read(self, layer):
        n = self.lengths[layer]
        k = _fake_blocks(self.k[layer, :, :, :n], self.key_granularity, self.group_size, self.bits)
        return k, _fake_blocks(self.v[layer, :, :, :n], "token", 1, self.bits)


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


# ---- the small run chapter 05's explorer shows ------------------------------------------------------

SMALL_RUN = {"batch": 2, "tokens": 96, "prompt_len": 32}  # 2 sequences of 96 tokens, a prefill of 32


def small_run() -> tuple:
    """(model, tokens (batch, T), description) of a small measurement: kvlab-tiny on held-out text
    when its checkpoint is there, otherwise a random tiny-mha model (seed 0) on random bytes."""
    from . import pretrained
    from .config import PRESETS
    from .generate import encode_bytes
    from .model import Transformer

    b, t = SMALL_RUN["batch"], SMALL_RUN["tokens"]
    try:
        model = pretrained.load("kvlab-tiny")
        ids = encode_bytes(pretrained.corpus_text("held_out"))[: b * t]
        return model, torch.tensor(ids).view(b, t), "kvlab-tiny on held-out text"
    except (FileNotFoundError, OSError):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Transformer(PRESETS["tiny-mha"]).eval()
        ids = torch.randint(0, model.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))
        return model, ids, "a random tiny-mha model (kvlab-tiny not built) on random bytes"


def small_run_errors(storage: str = "int8", **cache_options) -> dict:
    """`measure_cache_error` of one storage setting on `small_run()`, plus "run" (what was measured).

    The model and tokens are fixed, so each setting is measured once and remembered (an explorer
    redraws often); the caller gets its own copy of the result.
    """
    return dict(_small_run_errors(storage, tuple(sorted(cache_options.items()))))


@functools.cache
def _small_run_errors(storage: str, cache_options: tuple) -> dict:
    model, tokens, name = small_run()
    result = measure_cache_error(model, tokens, SMALL_RUN["prompt_len"], storage, **dict(cache_options))
    result["run"] = (f"{name}: {tokens.shape[0]} × {tokens.shape[1]} tokens, prefill "
                     f"{SMALL_RUN['prompt_len']}, then one token a step")
    return result
