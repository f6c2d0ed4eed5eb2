"""Speculative decoding: a drafter guesses k tokens, the target checks them all in ONE forward pass,
and the KV cache is cropped back past the first wrong guess.

A decode step of a large model is memory-bound: it reads every weight (and the cache) to produce
one token, so feeding it k + 1 tokens at once costs about the same as feeding one (chapter 06).
Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) turns that spare arithmetic into
tokens. One step, after the tokens so far, whose last one (`last`) is not in the target's cache yet:

1. a drafter (`kvlab.drafters`) proposes d1 … dk;
2. the target runs one forward pass over [last, d1, …, dk]: its logits at each position are its own
   greedy choice after it (t0 after last, t1 after d1, …);
3. the longest prefix d1 … dm with d_i = t_(i-1) is accepted, and the step adds d1 … dm and t_m: the
   target's correction at the first mismatch, or a bonus token when all k matched. m + 1 tokens for
   one target pass, never fewer than plain decoding's one;
4. the cache is rolled back: `cache.crop(n)` keeps the positions up to dm and forgets the k - m
   rejected ones (a paged cache gives their blocks back); the drafter crops its own cache too.

Every token added is the target's argmax after the tokens before it, so the output is plain greedy
decoding's (`kvlab.generate.generate`), token for token, with every cache that keeps positions
exactly: "dynamic", "static", "paged", a `SlidingWindowKVCache` with `rollback >= k`, and the
quantized caches ("int8", "int4") with `rollback >= k` (chosen for you when built by name: each
query of a verify pass sees every position as one-token decoding would have shown it, and a crop
restores the exact values the rejected tokens' quantization replaced) — tested, hypothesis, in
float64. One caveat is arithmetic: a pass over k + 1 tokens multiplies matrices of another shape
than a one-token step, so logits can differ in the last bits and an exact tie could break the other
way (the benchmark checks the tokens in float32). A `HeavyHitterKVCache` cannot roll back (its
scores hold the attention of the rejected queries) and is refused up front, as is a batch: this
module decodes one sequence (each row would accept a different number of tokens).

The speed-up (Leviathan et al. 2023, eq. 1 and theorem 3.8): if each guess is accepted with
probability a, independently, a step yields E = (1 - a^(k+1)) / (1 - a) tokens; a step costs one
target pass plus k draft passes of relative cost c, so speculation is
`expected_speedup(a, k, c) = E / (k c + 1)` times faster than plain decoding — and slower when
E < k c + 1, i.e. when guesses are poor or the drafter is not much cheaper. On a CPU the verify pass
of k + 1 tokens is not quite free: `verify_cost` (its time over one step's) refines the denominator.

Measured by `python -m kvlab.bench --sweeps speculative` (kvlab.bench.speculation) on a shared
2-core CPU, one thread, CPU time, runs interleaved, medians of 5 (3 for the real model), static cache,
every row's tokens identical to plain greedy decoding's. These are the sweep's own prompts and lengths;
chapter 10 measures its own in its cells, on other prompts, so its figures differ.
α is `per_token_acceptance`; "formula" is expected_speedup(α, k, c) with the paper's verify cost of 1,
then with the measured one.

    kvlab-tiny, 4 prompts × 96 new tokens    k    α     tokens/pass  speed-up  formula
    held-out text, prompt lookup             4   0.34   1.45         1.06×     1.44 / 1.04
    held-out text, kvlab-tiny-draft          4   0.88   3.84         1.50×     1.75 / 1.48
    repeating text, prompt lookup            6   0.65   2.35         1.97×     2.61 / 1.80
    repeating text, kvlab-tiny-draft         6   0.92   5.35         1.70×     1.95 / 1.67
    SmolLM2-135M fp32, 2 prompts × 48 tokens
    held-out text, prompt lookup             3   0.54   1.84         1.10×     2.00 / 1.14
    repeating text, prompt lookup            3   0.75   2.35         1.25×     2.73 / 1.56
    held-out text, its first 15 of 30 layers 3   0.20   1.24         0.39×     0.45 / 0.36
    held-out text, its first 25 of 30 layers 3   0.54   2.00         0.53×     0.54 / 0.45

Costs in target decode steps: a kvlab-tiny-draft pass c = 0.26-0.31 (one layer, but the step's fixed
overhead stays); prompt lookup 0.01-0.04 a step; kvlab-tiny's pass over k + 1 tokens 1.23 (k = 1) to
1.47 (k = 6), so on this CPU verifying is not free and the measured verify cost, not 1, predicts the
speed-up. SmolLM2's early exit costs c = 0.58 (15 layers) and 0.89 (25 layers: the LM head of 49,152
rows is a fifth of a step), its 4-token verify pass 1.75 steps. As k grows, accepted / proposed falls
(kvlab-tiny-draft, held-out: 0.86 at k = 1, 0.68 at k = 6) while α stays at 0.86-0.90, and the
speed-up levels off at k = 4 to 6.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import validate
from .cache import (
    HeavyHitterKVCache,
    KVCache,
    PagedKVCache,
    QuantizedKVCache,
    SlidingWindowKVCache,
    make_cache,
)
from .drafters import Drafter
from .generate import check_cache_object
from .sampling import as_batch, check_generate_args

QUANTIZED_KINDS = ("int8", "int4")


# --- what one run records -------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheState:
    """The target's cache at one moment: positions, the bytes its tensors (or views) cover and, for a
    paged cache, blocks in use. A dynamic cache's crop makes views, so its nbytes falls at once while
    the storage goes only at the next concatenation."""

    seq_len: int
    nbytes: int
    blocks: int | None = None

    @classmethod
    def of(cls, cache: KVCache) -> CacheState:
        blocks = cache.blocks_in_use if isinstance(cache, PagedKVCache) else None
        return cls(cache.seq_len, cache.nbytes, blocks)


@dataclass(frozen=True)
class SpeculativeStep:
    """One draft-and-verify step: the guesses, the target's own choice after each position it was
    fed (one more than the guesses: the last is the bonus token), how many guesses were accepted,
    tokens added, passes, time, and the target's cache after the verify pass (`before` the crop)
    and after the crop."""

    guesses: tuple[int, ...]
    choices: tuple[int, ...]
    accepted: int
    new_tokens: int        # accepted + 1, fewer only when the sequence ended (eos)
    draft_passes: int
    seconds: float         # the whole step (wall clock)
    draft_seconds: float   # of which proposing
    before: CacheState
    after: CacheState
    target_passes: int = 1

    @property
    def proposed(self) -> int:
        return len(self.guesses)

    @property
    def rejected(self) -> int:
        return self.proposed - self.accepted

    @property
    def blocks_freed(self) -> int:
        """Blocks the crop gave back to the free list (0 for caches without blocks)."""
        return 0 if self.before.blocks is None else self.before.blocks - self.after.blocks


@dataclass
class Speculation:
    """The tokens of a speculative run (1, prompt + new) and what each step did."""

    tokens: torch.Tensor
    prompt_len: int
    k: int
    drafter: str
    prefill_seconds: float = 0.0
    steps: list[SpeculativeStep] = field(default_factory=list)

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len:]

    @property
    def proposed(self) -> int:
        return sum(s.proposed for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def accepted_fraction(self) -> float:
        """Accepted guesses / proposed guesses (NaN when nothing was proposed). Not α: the guesses
        after a first rejection are proposed but never judged, so this falls as k grows while α
        stays; α (Leviathan et al.'s acceptance rate) is `per_token_acceptance`."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def per_token_acceptance(self) -> float:
        """The α of Leviathan et al.: the chance that a guess is accepted when the ones before it
        were. Estimated as accepted / (accepted + first rejections): guesses after a rejection
        are never judged, so accepted / proposed understates it."""
        judged = self.accepted + sum(1 for s in self.steps if s.rejected)
        return self.accepted / judged if judged else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """New tokens per verify pass (the prefill's token not counted)."""
        return sum(s.new_tokens for s in self.steps) / len(self.steps) if self.steps else float("nan")

    @property
    def target_passes(self) -> int:
        return 1 + sum(s.target_passes for s in self.steps)  # the prefill, then one a step

    @property
    def draft_passes(self) -> int:
        return sum(s.draft_passes for s in self.steps)

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + sum(s.seconds for s in self.steps)

    @property
    def rejections(self) -> list[SpeculativeStep]:
        """The steps that rejected at least one guess (and so cropped the cache)."""
        return [s for s in self.steps if s.rejected]

    @property
    def blocks_freed(self) -> int:
        return sum(s.blocks_freed for s in self.steps)


# --- the expected speed-up ------------------------------------------------------------------------

def expected_tokens_per_step(a: float, k: int) -> float:
    """Tokens one verify pass yields when each of k guesses is accepted with probability a (given
    the ones before it): 1 + a + a² + … + a^k = (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023)."""
    a = validate.number("a", a, low=0, high=1)
    k = validate.integer("k", k, low=0)
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def expected_speedup(a: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Plain decoding's time per token over speculation's: expected_tokens_per_step(a, k) divided by
    a step's cost in target steps, k·c + verify_cost (c: one draft pass over one target step;
    verify_cost: the target's pass over k + 1 tokens over its one-token step, 1 in the paper)."""
    c = validate.number("c", c, low=0)
    verify_cost = validate.number("verify_cost", verify_cost, low=0, low_inclusive=False)
    return expected_tokens_per_step(a, k) / (k * c + verify_cost)


# --- decoding -------------------------------------------------------------------------------------

@torch.inference_mode()
def speculative_generate(model, input_ids, max_new_tokens: int, drafter: Drafter, k: int = 4,
                         cache: str | KVCache = "static", *,
                         eos_token_id: int | None = None) -> Speculation:
    """Greedy decoding of `model` sped up by `drafter`'s guesses, k at a time: the same tokens as
    `kvlab.generate.generate(model, input_ids, max_new_tokens, cache, eos_token_id=…)`.

    input_ids: one sequence (a list of ids or a (1, T) tensor). cache: a kind name ("static",
    "dynamic", "paged", "int8", "int4"; a quantized one gets rollback=k) or an empty KVCache that
    can crop k positions. Returns a `Speculation` (tokens, per-step statistics, acceptance)."""
    cfg = model.config
    param = next(model.parameters())
    ids = as_batch(input_ids, param.device)
    if ids.shape[0] != 1:
        raise ValueError(f"speculative decoding here takes one sequence; input_ids has batch "
                         f"{ids.shape[0]} (each row would accept a different number of guesses): "
                         "decode the rows one at a time")
    max_new_tokens = check_generate_args(cfg, ids, max_new_tokens, eos_token_id)
    k = validate.integer("k", k)
    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter={drafter!r:.60} must be a kvlab.drafters.Drafter "
                         "(PromptLookupDrafter, ModelDrafter, or a subclass of your own)")
    drafter.check_compatible(cfg)
    prompt_len = ids.shape[1]
    total = prompt_len + max_new_tokens
    cache = _target_cache(cache, cfg, total, k, param)
    drafter.reset(total)

    started = time.perf_counter()
    tokens = ids[0].tolist()
    tokens.append(int(model(ids, cache=cache)[0, -1].argmax()))
    out = Speculation(ids, prompt_len, k, drafter.name, prefill_seconds=time.perf_counter() - started)
    while tokens[-1] != eos_token_id and len(tokens) < total:
        out.steps.append(_step(model, cache, drafter, tokens, min(k, total - len(tokens) - 1),
                               eos_token_id))
    out.tokens = torch.tensor([tokens], device=param.device)
    return out


def _step(model, cache: KVCache, drafter: Drafter, tokens: list[int], k: int,
          eos_token_id: int | None) -> SpeculativeStep:
    """Propose up to k guesses, verify them in one pass, keep the agreed ones and the target's next
    token (appended to `tokens`), crop the caches back."""
    started, passes = time.perf_counter(), drafter.passes
    guesses = _checked(drafter.propose(tokens, k) if k else [], k, model.config.vocab_size, drafter)
    drafted = time.perf_counter()
    kept = cache.seq_len + 1                      # the cache holds all but the last token
    feed = torch.tensor([tokens[-1:] + guesses], device=model.lm_head.weight.device)
    choices = model(feed, cache=cache)[0].argmax(-1).tolist()  # the target's choice after each
    accepted = 0
    while accepted < len(guesses) and guesses[accepted] == choices[accepted]:
        accepted += 1
    new = guesses[:accepted] + [choices[accepted]]
    if eos_token_id in new:
        new = new[:new.index(eos_token_id) + 1]
    before = CacheState.of(cache)
    cache.crop(kept + accepted)                   # forget the rejected guesses
    drafter.crop(kept + accepted)
    tokens += new
    return SpeculativeStep(tuple(guesses), tuple(choices), accepted, len(new), drafter.passes - passes,
                           time.perf_counter() - started, drafted - started, before, CacheState.of(cache))


def _checked(guesses, k: int, vocab: int, drafter: Drafter) -> list[int]:
    if not isinstance(guesses, Sequence) or isinstance(guesses, (str, bytes)) or len(guesses) > k:
        raise ValueError(f"{drafter!r}.propose returned {guesses!r:.60}; it must return a list of at "
                         f"most k={k} token ids")
    out = [validate.integer("a proposed token", int(g) if isinstance(g, torch.Tensor) else g,
                            low=0, high=vocab - 1) for g in guesses]
    return out


def _target_cache(cache, config, total: int, k: int, param: torch.Tensor) -> KVCache:
    """The target's cache: built by name (a quantized kind with rollback=k), or the caller's, checked
    to hold nothing yet, to fit, and to be able to crop k positions."""
    if isinstance(cache, str) and cache in QUANTIZED_KINDS:
        bits = 8 if cache == "int8" else 4
        cache = QuantizedKVCache(config, 1, total, param.dtype, param.device, bits=bits, rollback=k)
    elif isinstance(cache, str):
        cache = make_cache(cache, config, 1, total, param.dtype, param.device)
    else:
        check_cache_object(cache, config, 1, total, param)
    check_can_roll_back(cache, k)
    return cache


def check_can_roll_back(cache: KVCache, k: int) -> None:
    """Refuse, before any decoding, a cache that could not crop the k guesses of a rejected step."""
    what = f"speculative decoding with k={k} must crop up to {k} rejected positions after each verify pass"
    if isinstance(cache, HeavyHitterKVCache):
        raise ValueError(f"{what}, and a HeavyHitterKVCache cannot roll back (its scores already hold "
                         "the attention of the rejected queries, and evicted keys are gone); use "
                         "'static', 'dynamic', 'paged', 'int8' or a SlidingWindowKVCache with rollback=k")
    if type(cache).crop is KVCache.crop:
        raise ValueError(f"{what}, and {type(cache).__name__} has no crop")
    if isinstance(cache, QuantizedKVCache) and cache.rollback < k:
        raise ValueError(f"{what}, and this QuantizedKVCache keeps the exact values of rollback="
                         f"{cache.rollback} extra positions (what a crop needs): build it with "
                         f"rollback={k} or more, or pass cache='int8' / 'int4' to have it chosen")
    if isinstance(cache, SlidingWindowKVCache):
        if cache.renumbers_positions:
            raise ValueError(f"{what}; a SlidingWindowKVCache with positions='cache' feeds one token a "
                             "pass once full, so a verify pass would not be one pass: use "
                             "positions='original'")
        if cache.rollback < k:
            raise ValueError(f"{what}, and this SlidingWindowKVCache keeps rollback={cache.rollback} "
                             f"extra positions: build it with rollback={k} or more")
