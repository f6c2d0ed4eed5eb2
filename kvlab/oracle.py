"""Is a cache right? Compare a cache-driven run with recomputing everything without a cache.

The most common KV-cache bugs are silent: a key written one position off, a stale row kept after a
rollback, a mask that lets a query see a dropped key. The tokens may even come out the same for a
while. The oracle finds *where* such a bug is:

    report = kvlab.oracle.check(model, cache, ids)       # prefill, then one token a step
    print(report)          # ✓ ... or ✗ keys of layer 1 at position 7 differ by 0.83 ...

Each time tokens go through the model with the cache, the oracle also recomputes the whole stream
so far without a cache and compares, at every layer, the keys and values the cache handed to
attention (at the stream positions it says they hold) and the logits. The recomputation follows the
kind's own rule: full causal attention for the kinds that keep every position, the window's band for
`SlidingWindowKVCache`, and for kinds that keep different keys per head (heavy hitters) the keys each
query saw. `Oracle` does the same step by step, with `crop`, `fork` and `reset` in between (the
state-machine tests drive every kind this way). A cache that starts with positions already filled
(a prefix a `PrefixKVStore` found cached) is checked from there: `check(..., cached=n)` or
`Oracle(..., held=ids)`; the recomputation includes those tokens, so the reused K/V are compared too.

Errors are measured per layer as max |cached - recomputed| and compared with
atol + rtol · max |recomputed| of that layer (defaults for float32: exact up to rounding). A
quantized cache is not exact: give it a tolerance that states its bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import validate
from .attention import attention
from .cache.base import KVCache
from .model import attend_with
from .sampling import check_model, token_ids

WHAT = ("length", "keys", "values", "logits")


@dataclass(frozen=True)
class Divergence:
    """Where a cache-driven run first differs from the recomputation."""

    what: str           # "keys", "values", "logits", or "length" (the cache miscounts its positions)
    layer: int | None   # None for logits and length
    position: int       # stream position (for "length": how many tokens the stream holds)
    error: float        # max |cached - recomputed| there (inf: a position the stream does not have;
    allowed: float      # for "length": the count the cache claims) and the tolerance it broke

    def __str__(self) -> str:
        if self.what == "length":
            return (f"the cache says it holds {int(self.error)} positions, but the stream holds "
                    f"{self.position} tokens")
        where = f"of layer {self.layer} " if self.layer is not None else ""
        if self.error == float("inf"):
            return f"{self.what} {where}at position {self.position}: the stream has no such position"
        return (f"{self.what} {where}at position {self.position} differ from the recomputation by "
                f"{self.error:.3g} (allowed {self.allowed:.3g})")


@dataclass
class Report:
    """What the oracle found: the first divergence (None: none) and the largest error per layer."""

    passes: int = 0
    first: Divergence | None = None
    max_error: dict[str, list[float]] = field(default_factory=dict)  # keys / values per layer
    max_logits_error: float = 0.0

    @property
    def ok(self) -> bool:
        return self.first is None

    def __str__(self) -> str:
        layers = [e for what in ("keys", "values") for e in self.max_error.get(what, [])]
        worst = max([self.max_logits_error, *layers])
        if self.ok:
            return (f"✓ the cache matches the recomputation at every layer and position "
                    f"({self.passes} passes; largest difference {worst:.2g})")
        return f"✗ {self.first}; first of the differences found in {self.passes} passes"


class Oracle:
    """Drive `cache` through `model` and compare every pass with a recomputation without a cache.

    `feed(ids)` runs ids (B, T) after what the cache holds and returns the logits; `crop(n)`,
    `fork()` and `reset()` do the same to the cache and to the oracle's record of the stream. The
    findings accumulate in `report`. `held` (B, N): the token ids the cache holds already (its
    first N positions, e.g. a cached prefix), which the recomputation starts from."""

    def __init__(self, model, cache: KVCache, *, atol: float = 1e-5, rtol: float = 1e-4, held=None):
        check_model(model)
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache={cache!r:.60} is not a kvlab cache (a kvlab.cache.KVCache)")
        if cache.renumbers_positions:
            raise ValueError(f"{type(cache).__name__} renumbers positions by their place in the cache "
                             "(positions='cache'), which no single recomputation reproduces; check it "
                             "with positions='original'")
        self.model, self.cache = model, cache
        self.atol = validate.number("atol", atol, low=0)
        self.rtol = validate.number("rtol", rtol, low=0)
        self.report = Report(max_error={w: [0.0] * model.config.n_layers for w in ("keys", "values")})
        device = next(model.parameters()).device
        self.tokens = torch.zeros(0, 0, dtype=torch.long, device=device)  # the stream so far (B, N)
        if held is not None:
            self.tokens = token_ids(model, held)
            if self.tokens.shape[1] != cache.seq_len:
                raise ValueError(f"held has {self.tokens.shape[1]} tokens, but the cache holds "
                                 f"{cache.seq_len} positions: pass the tokens it already holds")
        self.keep: torch.Tensor | None = None   # its padding mask (B, N), None without padding
        self.seen: list[torch.Tensor] | None = None  # per layer (B, H_kv, N, N): keys each query saw

    # --- driving the cache ---------------------------------------------------------------------

    @torch.inference_mode()
    def feed(self, ids, attention_mask=None) -> torch.Tensor:
        """Feed ids (B, T) through the model with the cache, compare with a recomputation, and
        return the cache-driven logits (B, T, vocab). attention_mask (B, T): 1 token, 0 padding."""
        ids = token_ids(self.model, ids)
        self._check_length()
        keep = self._extend_keep(ids, attention_mask)
        passes: list[list[tuple]] = [[] for _ in range(self.model.config.n_layers)]

        def probe(layer, q, k, v, mask):
            positions = self.cache.key_positions(layer)
            end = self.cache.lengths[layer]
            q_pos = torch.arange(end - q.shape[2], end, device=q.device)
            if positions is None:
                positions = torch.arange(k.shape[2], device=k.device)
            passes[layer].append((k.clone(), v.clone(), positions.clone(), q_pos,
                                  self.cache.visible(q_pos, positions, layer)))
            return attention(q, k, v, mask)

        with attend_with(self.model, probe):
            logits = self.model(ids, cache=self.cache, attention_mask=keep)
        start = self.tokens.shape[1]
        self.tokens = ids if start == 0 else torch.cat([self.tokens, ids], dim=1)
        self.keep = keep
        self._record_seen(passes)
        self._compare(passes, logits, start)
        return logits

    def crop(self, n: int) -> None:
        self.cache.crop(n)
        self.tokens = self.tokens[:, :n]
        self._check_length()
        self.keep = None if self.keep is None else self.keep[:, :n]
        if self.seen is not None:
            self.seen = [s[:, :, :n, :n] for s in self.seen]

    def reset(self) -> None:
        self.crop(0)

    def fork(self) -> Oracle:
        """A second oracle over `cache.fork()`, with the same record of the stream."""
        other = Oracle(self.model, self.cache.fork(), atol=self.atol, rtol=self.rtol)
        other.tokens, other.keep = self.tokens.clone(), None if self.keep is None else self.keep.clone()
        other.seen = None if self.seen is None else [s.clone() for s in self.seen]
        return other

    def _check_length(self) -> None:
        n = self.tokens.shape[1]
        if self.cache.seq_len != n and self.report.first is None:
            self.report.first = Divergence("length", None, n, float(self.cache.seq_len), 0.0)

    # --- the recomputation ---------------------------------------------------------------------

    def _extend_keep(self, ids: torch.Tensor, attention_mask) -> torch.Tensor | None:
        if attention_mask is None and self.keep is None:
            return None
        new = (torch.ones_like(ids, dtype=torch.bool) if attention_mask is None
               else _mask_like(attention_mask, ids))
        old = (self.keep if self.keep is not None
               else torch.ones(ids.shape[0], self.tokens.shape[1], dtype=torch.bool, device=ids.device))
        return torch.cat([old, new], dim=1)

    def _record_seen(self, passes) -> None:
        """Keys each query saw, per layer, for kinds that keep different keys per head."""
        if not any(p[2].dim() == 3 for layer in passes for p in layer) and self.seen is None:
            return
        n, b = self.tokens.shape[1], self.tokens.shape[0]
        h = self.model.config.n_kv_heads
        if self.seen is None:
            self.seen = [torch.zeros(b, h, 0, 0, dtype=torch.bool, device=self.tokens.device)
                         for _ in passes]
        for layer, records in enumerate(passes):
            old = self.seen[layer]
            grown = torch.zeros(b, h, n, n, dtype=torch.bool, device=old.device)
            grown[:, :, :old.shape[2], :old.shape[3]] = old
            for _, _, positions, q_pos, visible in records:
                pos = positions.expand(b, h, -1) if positions.dim() == 1 else positions
                vis = visible.expand(b, h, -1, -1) if visible.dim() == 2 else visible
                rows = grown[:, :, q_pos]                                         # (B, H, T, N)
                rows.scatter_(-1, pos[:, :, None, :].expand_as(vis), vis)
                grown[:, :, q_pos] = rows
            self.seen[layer] = grown

    def _policy(self, layer: int, n: int) -> torch.Tensor | None:
        """The recomputation's extra rule: None (causal only), the kind's band (N, N), or the keys
        each query saw (B, H, N, N)."""
        if self.seen is not None:
            return self.seen[layer].repeat_interleave(self.model.config.n_rep, dim=1)
        if not self.cache.drops_keys:
            return None  # every position kept: plain causal attention
        positions = torch.arange(n, device=self.tokens.device)
        return self.cache.visible(positions, positions, layer)

    def _recompute(self):
        n = self.tokens.shape[1]
        keys, values = [], []

        def probe(layer, q, k, v, mask):
            keys.append(k)
            values.append(v)
            rule = self._policy(layer, n)
            if rule is not None:
                mask = rule if mask is None else mask & rule
            return attention(q, k, v, mask)

        with attend_with(self.model, probe):
            logits = self.model(self.tokens, attention_mask=self.keep)
        return keys, values, logits

    def _compare(self, passes, logits: torch.Tensor, start: int) -> None:
        keys, values, ref_logits = self._recompute()
        self.report.passes += 1
        found: list[Divergence] = []
        for layer, records in enumerate(passes):
            for what, ref in (("keys", keys[layer]), ("values", values[layer])):
                allowed = self.atol + self.rtol * float(ref.abs().max())
                for k, v, positions, _, _ in records:
                    cached = k if what == "keys" else v
                    beyond = positions >= ref.shape[2]
                    if bool(beyond.any()):  # a key at a position the stream does not have
                        found.append(Divergence(what, layer, int(positions[beyond].min()), float("inf"),
                                                allowed))
                        positions = positions.clamp(max=ref.shape[2] - 1)
                    err, pos = self._per_position(cached, ref, positions)
                    err = err.masked_fill(beyond, 0.0)
                    if err.numel():
                        worst = float(err.max())
                        row = self.report.max_error[what]
                        row[layer] = worst if math.isnan(worst) else max(row[layer], worst)
                        bad = (~(err <= allowed)).nonzero()  # NaN is never within the tolerance
                        if bad.numel():
                            i = bad[0].tolist()
                            found.append(Divergence(what, layer, int(pos[tuple(i)]), float(err[tuple(i)]),
                                                    allowed))
        t = logits.shape[1]
        ref = ref_logits[:, start:start + t]
        diff = (logits.float() - ref.float()).abs().amax(-1)           # (B, T)
        if self.keep is not None:                                       # padding rows do not count
            diff = diff.masked_fill(~self.keep[:, start:start + t].bool(), 0.0)
        allowed = self.atol + self.rtol * float(ref.abs().max())
        worst = float(diff.max())
        old = self.report.max_logits_error
        self.report.max_logits_error = worst if math.isnan(worst) else max(old, worst)
        bad = (~(diff.amax(0) <= allowed)).nonzero()
        if bad.numel():
            i = int(bad[0])
            found.append(Divergence("logits", None, start + i, float(diff[:, i].max()), allowed))
        if found and self.report.first is None:
            order = {w: i for i, w in enumerate(WHAT)}
            self.report.first = min(found, key=lambda d: (d.position, order[d.what], d.layer or 0))

    def _per_position(self, cached: torch.Tensor, ref: torch.Tensor, positions: torch.Tensor):
        """max |cached - ref| over the head dimension at each returned key (padding keys left out),
        and the stream position of each: both (S,) or (B, H_kv, S)."""
        b, h, s, d = cached.shape
        if positions.dim() == 1:
            expected = ref[:, :, positions]                                     # (B, H, S, D)
            err = (cached.float() - expected.float()).abs().amax(dim=(0, 1, 3))  # (S,)
            if self.keep is not None:
                real = self.keep[:, positions].any(0)
                err = err * real
            return err, positions
        idx = positions[..., None].expand(b, h, s, d)
        expected = ref.gather(2, idx)
        err = (cached.float() - expected.float()).abs().amax(-1)               # (B, H, S)
        if self.keep is not None:
            err = err * self.keep.gather(1, positions.reshape(b, -1)).view(b, h, s)
        return err, positions


def check(model, cache: KVCache, ids, prompt_len: int | None = None, attention_mask=None, *,
          atol: float = 1e-5, rtol: float = 1e-4, cached: int = 0) -> Report:
    """Feed ids (B, T) through `model` with `cache` as a decode would (the first prompt_len tokens
    at once, default all but 4, then one a step, teacher-forced) and compare every pass with a
    recomputation. Returns the Report (`print(report)` says where the first difference is).
    cached: how many of the first ids the cache holds already (a prefix a prefix store found);
    they are not fed again, but their K/V are compared with the recomputation too."""
    ids = token_ids(model, ids)
    total = ids.shape[1]
    cached = validate.integer("cached", cached, low=0, high=total - 1)
    prompt_len = max(cached + 1, total - 4) if prompt_len is None else validate.integer(
        "prompt_len", prompt_len, low=cached + 1, high=total)
    if cached and attention_mask is not None:
        raise ValueError("cached > 0 with an attention_mask: a cache that holds a prefix already "
                         "(a prefix store's) serves one unpadded sequence; pass no attention_mask")
    oracle = Oracle(model, cache, atol=atol, rtol=rtol, held=ids[:, :cached] if cached else None)
    mask = None if attention_mask is None else _mask_like(attention_mask, ids)  # (B, T) bool
    oracle.feed(ids[:, cached:prompt_len], None if mask is None else mask[:, :prompt_len])
    for i in range(prompt_len, total):
        oracle.feed(ids[:, i:i + 1], None if mask is None else mask[:, i:i + 1])
    return oracle.report


def _mask_like(attention_mask, ids: torch.Tensor) -> torch.Tensor:
    """attention_mask as a bool tensor of the shape of ids, when it holds only 0s and 1s."""
    try:
        mask = torch.as_tensor(attention_mask, device=ids.device)
    except (TypeError, ValueError, RuntimeError):
        mask = None
    if mask is None or mask.numel() != ids.numel():
        shape = "not a tensor" if mask is None else f"shape {tuple(mask.shape)}"
        raise ValueError(f"attention_mask has {shape}; expected one 0 or 1 per token, shape "
                         f"{tuple(ids.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 1 (token) and 0 (padding)")
    return mask.reshape(ids.shape).bool()
