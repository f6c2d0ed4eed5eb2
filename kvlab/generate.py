"""Autoregressive generation, naive (recompute everything each step) or cached, with per-step stats.

Naive: step t feeds the whole sequence so far through the model, so the K and V of every earlier
token are computed again: 1 + 2 + … + N rows for N steps. Cached: the prompt is prefilled once
(all its tokens in parallel), then each step feeds one new token and reads the rest from the cache.
The loop itself (feed, choose, feed back) is `kvlab.sampling.decode_loop`, shared with `kvlab.fast`;
this module adds the choice of forward pass and the per-step statistics a chapter plots.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode

from . import validate
from .cache import CACHE_KINDS, KVCache, make_cache
from .sampling import as_batch, check_generate_args, check_model, check_sampling, decode_loop, make_generator


@dataclass
class Step:
    """What one forward pass cost: tokens fed, K/V rows (per layer, per sequence: the tokens fed, by
    construction — chapter 01 counts them with hooks on the projections),
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


@torch.inference_mode()
def generate(model, input_ids, max_new_tokens: int, cache: str | KVCache | None = "static", *,
             temperature: float = 0.0, top_k: int | None = None, seed: int | None = None,
             eos_token_id: int | None = None, attention_mask=None, count_flops: bool = False,
             on_token: Callable[[int, torch.Tensor], None] | None = None) -> Generation:
    """Generate up to max_new_tokens after input_ids (a list of ids or a left-padded (B, T) batch).

    cache: None (naive: no cache, recompute everything each step), a kind name from
    `kvlab.cache.CACHE_KINDS` ("dynamic", "static", …) or an empty KVCache object to fill.
    temperature 0 is greedy; otherwise sample (optionally from the top_k logits) with `seed`
    (a temperature must be 0 or >= `kvlab.sampling.MIN_TEMPERATURE`).
    Generation stops early once every sequence has produced eos_token_id (later positions are
    filled with it). on_token(step, new_ids) is called after each step, e.g. to print text.
    attention_mask (B, T): 1 for tokens, 0 for padding, which must be on the left.
    Every forward pass is recorded as a `Step` (tokens fed, K/V rows, seconds; FLOPs with
    count_flops=True). Every cache kind goes through the model's own forward; the fixed-shape step
    that a CUDA graph can replay is `kvlab.fast.fast_generate` (the same maths, fewer operations).
    On a GPU the steps are timed with CUDA events, read once at the end (no wait between steps).
    """
    cfg = check_model(model).config
    param = next(model.parameters())
    ids = as_batch(input_ids, param.device)
    max_new_tokens = check_generate_args(cfg, ids, max_new_tokens, eos_token_id)
    temperature, top_k, seed = check_sampling(temperature, top_k, seed)
    batch, prompt_len = ids.shape
    total = prompt_len + max_new_tokens
    mask = _full_mask(attention_mask, ids, total)
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token={on_token!r} must be a function (step, new_ids) -> None, or None")
    count_flops = validate.boolean("count_flops", count_flops)
    if isinstance(cache, str):
        cache = make_cache(cache, cfg, batch, total, dtype=param.dtype, device=param.device)
    elif cache is not None:
        check_cache_object(cache, cfg, batch, total, param)
    out = Generation(tokens=ids, prompt_len=prompt_len)
    timer = _StepTimer(param.device)
    forward = _recorded(_model_forward(model, cache, mask), out.steps, count_flops, timer)
    out.tokens = decode_loop(forward, ids, max_new_tokens, naive=cache is None,
                             temperature=temperature, top_k=top_k,
                             generator=make_generator(seed, param.device),
                             eos_token_id=eos_token_id, on_token=on_token)
    timer.fill(out.steps)
    return out


def _model_forward(model, cache: KVCache | None, mask: torch.Tensor | None):
    """forward(feed, positions) through the model's own forward: logits of the last position."""
    def forward(feed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        seen = feed.shape[1] + (cache.seq_len if cache is not None else 0)
        return model(feed, cache=cache, attention_mask=None if mask is None else mask[:, :seen])[:, -1]
    return forward


class _StepTimer:
    """Times each forward pass: perf_counter on the CPU; on a GPU, a pair of CUDA events around
    each pass (the GPU records when it reaches them), read after the loop with one synchronize, so
    the timing never makes the CPU wait for the GPU between steps."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list[tuple] = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started) -> float | None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append((started, event))
            return None  # known once the GPU has run it: fill()
        return time.perf_counter() - started

    def fill(self, steps: list[Step]) -> None:
        """Write the GPU times into the steps (after the loop: one synchronize for all)."""
        if self.cuda and self.events:
            self.events[-1][1].synchronize()
            for step, (begin, end) in zip(steps, self.events, strict=True):
                step.seconds = begin.elapsed_time(end) / 1000


def _recorded(forward, steps: list[Step], count_flops: bool, timer: _StepTimer):
    """forward, timed (and its FLOPs counted if asked), appending one Step a call to `steps`."""
    def timed(feed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        started = timer.start()
        if count_flops:
            with FlopCounterMode(display=False) as counter:
                logits = forward(feed, positions)
            flops = counter.get_total_flops()
        else:
            logits, flops = forward(feed, positions), None
        seconds = timer.stop(started)
        n = feed.shape[1]
        steps.append(Step(fed_tokens=n, kv_rows=n, seconds=seconds or 0.0, flops=flops))
        return logits
    return timed


def _full_mask(attention_mask, ids: torch.Tensor, total: int) -> torch.Tensor | None:
    """The prompt's padding mask extended with 1s for the tokens to come, (B, total) bool; refuses
    a mask of the wrong shape or values, right padding, and rows that are all padding."""
    if attention_mask is None:
        return None
    try:
        mask = torch.as_tensor(attention_mask, device=ids.device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"attention_mask={attention_mask!r:.60} is not a list or tensor of 0s and "
                         "1s") from None
    if mask.dim() == 1:  # one sequence, like a 1-D prompt
        mask = mask[None]
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; expected the prompt's "
                         f"{tuple(ids.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 1 (token) and 0 (padding); got values "
                         f"{sorted(set(mask.flatten().tolist()))[:6]}")
    keep = mask.bool()
    right = (keep[:, :-1] & ~keep[:, 1:]).any(dim=1)
    if bool(right.any()):
        row = int(right.nonzero()[0])
        raise ValueError(f"attention_mask row {row} is {keep[row].int().tolist()}: a 0 after a 1 means "
                         "padding on the right; pad on the left (0s first) so every row's last token "
                         "is real")
    if not bool(keep[:, -1].all()):
        row = int((~keep[:, -1]).nonzero()[0])
        raise ValueError(f"attention_mask row {row} is all 0: every sequence needs at least one token")
    full = torch.ones(ids.shape[0], total, dtype=torch.bool, device=ids.device)
    full[:, :ids.shape[1]] = keep
    return full


def check_cache_object(cache, config, batch: int, total: int, param: torch.Tensor) -> None:
    """Refuse what is not a cache, a cache that already holds positions, or one that does not fit
    the model and the prompt."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache={cache!r} is not a cache; allowed: None, a kind name "
                         f"({', '.join(map(repr, CACHE_KINDS))}) or a KVCache object")
    if cache.seq_len:
        raise ValueError(f"the cache already holds {cache.seq_len} positions (from an earlier call?): "
                         "call cache.reset() or pass a fresh cache")
    cache.check_compatible(config, batch, param.dtype, param.device)
    if cache.max_seq_len is not None and cache.max_seq_len < total:
        raise ValueError(f"the cache has room for {cache.max_seq_len} positions; the prompt and "
                         f"max_new_tokens need {total}")


def decode_bytes(ids: Sequence[int] | torch.Tensor) -> str:
    """Byte-level token ids -> text (invalid UTF-8, e.g. half a Chinese character, shows as �)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def encode_bytes(text: str) -> list[int]:
    """Text -> byte-level token ids (UTF-8 bytes: one per ASCII letter, three per Chinese character)."""
    return list(text.encode("utf-8"))
