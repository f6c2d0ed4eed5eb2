"""Autoregressive generation, naive (recompute everything each step) or cached, with per-step stats.

Naive: step t feeds the whole sequence so far through the model, so the K and V of every earlier
token are computed again: 1 + 2 + … + N rows for N steps. Cached: the prompt is prefilled once
(all its tokens in parallel), then each step feeds one new token and reads the rest from the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode

from .cache import KVCache, make_cache


@dataclass
class Step:
    """What one forward pass cost: tokens fed, K/V rows computed (per layer, per sequence),
    wall time and, when counted, FLOPs."""

    fed_tokens: int
    kv_rows: int
    seconds: float
    flops: int | None = None


@dataclass
class Generation:
    tokens: torch.Tensor               # (B, T_prompt + T_new)
    prompt_len: int
    steps: list[Step] = field(default_factory=list)

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len:]

    @property
    def kv_rows(self) -> int:
        return sum(s.kv_rows for s in self.steps)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def flops(self) -> int | None:
        return None if any(s.flops is None for s in self.steps) else sum(s.flops for s in self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens.numel() / self.seconds if self.seconds else float("nan")


def as_batch(input_ids, device=None) -> torch.Tensor:
    """Accept a list of ids, a 1-D or a (B, T) tensor; return a (B, T) long tensor."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty list or a (batch, tokens) tensor; "
                         f"got shape {tuple(ids.shape)}")
    return ids


@torch.inference_mode()
def generate(model, input_ids, max_new_tokens: int, cache: str | KVCache | None = "static", *,
             temperature: float = 0.0, top_k: int | None = None, seed: int | None = None,
             eos_token_id: int | None = None, attention_mask=None, count_flops: bool = False,
             on_token: Callable[[int, torch.Tensor], None] | None = None) -> Generation:
    """Generate up to max_new_tokens after input_ids.

    cache: None (naive: no cache, recompute everything each step), a kind name from
    `kvlab.cache.CACHE_KINDS` ("dynamic", "static", …) or a KVCache object to fill.
    temperature 0 is greedy; otherwise sample (optionally from the top_k logits) with `seed`.
    Generation stops early once every sequence has produced eos_token_id (later positions are
    filled with it). on_token(step, new_ids) is called after each step, e.g. to print text.
    """
    cfg = model.config
    device = next(model.parameters()).device
    ids = as_batch(input_ids, device)
    _check_args(max_new_tokens, temperature, top_k, ids, cfg)
    batch, prompt_len = ids.shape
    if isinstance(cache, str):
        cache = make_cache(cache, cfg, batch, prompt_len + max_new_tokens,
                           dtype=next(model.parameters()).dtype, device=device)
    elif cache is not None and not isinstance(cache, KVCache):
        raise ValueError(f"cache={cache!r} is not a cache; allowed: None, a kind name or a KVCache")
    mask = None if attention_mask is None else torch.as_tensor(attention_mask, device=device)
    sampler = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    out = Generation(tokens=ids, prompt_len=prompt_len)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    feed = ids
    for step in range(max_new_tokens):
        logits, cost = _forward(model, feed, cache, mask, count_flops, device)
        out.steps.append(cost)
        nxt = _pick(logits[:, -1], temperature, top_k, sampler)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        out.tokens = torch.cat([out.tokens, nxt[:, None]], dim=1)
        if on_token is not None:
            on_token(step, nxt)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if bool(done.all()):
            break
        feed = out.tokens if cache is None else nxt[:, None]  # naive: everything again
    return out


def _forward(model, feed, cache, mask, count_flops, device):
    """One timed forward pass; returns the logits and its Step record."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    if count_flops:
        with FlopCounterMode(display=False) as counter:
            logits = model(feed, cache=cache, attention_mask=mask)
        flops = counter.get_total_flops()
    else:
        logits, flops = model(feed, cache=cache, attention_mask=mask), None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return logits, Step(fed_tokens=feed.shape[1], kv_rows=feed.shape[1], seconds=seconds,
                        flops=flops)


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, sampler) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=sampler)[:, 0]


def _check_args(max_new_tokens, temperature, top_k, ids, cfg) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be a positive integer or None")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in 0..{cfg.vocab_size - 1}; "
                         f"got min {int(ids.min())}, max {int(ids.max())}")
    total = ids.shape[1] + max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(f"prompt of {ids.shape[1]} + max_new_tokens={max_new_tokens} = {total} "
                         f"tokens exceeds the model's max_seq_len={cfg.max_seq_len}")


def decode_bytes(ids: Sequence[int] | torch.Tensor) -> str:
    """Byte-level token ids -> text (invalid UTF-8, e.g. half a Chinese character, shows as �)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def encode_bytes(text: str) -> list[int]:
    """Text -> byte-level token ids (UTF-8 bytes: one per ASCII letter, three per Chinese character)."""
    return list(text.encode("utf-8"))
