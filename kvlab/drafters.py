"""Drafters for speculative decoding: cheap guesses of the next few tokens, which the target model
then verifies in one forward pass (`kvlab.speculative`).

Every drafter has the same small interface (`Drafter`):

    drafter.reset(max_len)          # a new request: forget everything; the context stays <= max_len
    drafter.propose(context, k)     # up to k guesses for the tokens after `context` (a list of ids)
    drafter.crop(n)                 # only the first n tokens of the context still hold (rollback)
    drafter.passes                  # forward passes it has run so far (0 for a lookup)

Two kinds ship:
- `PromptLookupDrafter`: no second model. It finds the latest earlier place where the context's
  last n tokens occurred and proposes what followed them there (n from `max_ngram` down to 1). Free
  to run, and right exactly when the output repeats its input: a summary quoting its source, an
  edited piece of code, a chat that repeats a name (Saxena 2023, "prompt lookup decoding"; in
  transformers as `prompt_lookup_num_tokens`).
- `ModelDrafter`: a smaller model with the target's tokenizer, decoding greedily with its own KV cache,
  which is cropped back like the target's. For kvlab-tiny: `kvlab.pretrained.load("kvlab-tiny-draft")`,
  a 1-layer byte model trained on the same corpus. For a model without a small sibling:
  `early_exit(model, n)`, the model's own first n layers with its final norm and LM head (shared
  weights, nothing copied), as self-speculative decoding does (Zhang et al. 2023, LayerSkip by
  Elhoushi et al. 2024, which also trains the model so that early layers predict well).

Measured on SmolLM2-135M-Instruct (30 layers, not trained for early exit; kvlab.speculative has the
table): its first 15 layers guess with α = 0.20 at c = 0.58 target steps a guess, its first 25 with
α = 0.54 at c = 0.89, so the self-draft loses (0.39× and 0.53× plain decoding's speed), as the formula
predicts; skipping middle layers instead (`layer_subset`: every other layer, or the first 8 and last 8)
guessed worse still (α ≤ 0.11 on a held-out prompt). Prompt lookup, free to run, is the drafter that
pays on that model (1.10× on held-out text, 1.25× on text that repeats its prompt); kvlab-tiny-draft,
trained for the job, is kvlab-tiny's (α = 0.88, 1.5×).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn

from . import validate
from .cache import make_cache
from .config import ModelConfig
from .model import Transformer


class Drafter:
    """What speculative decoding needs from a drafter. Stateless drafters keep the defaults."""

    name = "drafter"
    passes = 0  # forward passes of a draft model so far

    def reset(self, max_len: int) -> None:
        """Start a new request whose context will hold at most max_len tokens."""

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k token ids guessed to follow `context` (fewer, or none, when it has no guess)."""
        raise NotImplementedError

    def crop(self, n: int) -> None:
        """The context now agrees with what the drafter saw only in its first n tokens."""

    def check_compatible(self, config: ModelConfig) -> None:
        """Refuse a target whose tokens this drafter cannot guess (another vocabulary)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class PromptLookupDrafter(Drafter):
    """Propose what followed the latest earlier occurrence of the context's last n tokens, trying
    n = max_ngram, …, min_ngram (longer matches first: they are more specific)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = validate.integer("max_ngram", max_ngram)
        self.min_ngram = validate.integer("min_ngram", min_ngram, low=1, high=self.max_ngram)
        self.name = f"prompt lookup (n-grams {self.max_ngram}..{self.min_ngram})"

    def propose(self, context, k):
        tokens = np.asarray(context, dtype=np.int64)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = latest_match(tokens, n)
            if start is not None:
                return tokens[start + n:start + n + k].tolist()
        return []


def latest_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest earlier occurrence of tokens[-n:] in tokens (not the suffix itself), or None."""
    suffix = tokens[-n:]
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # starts 0 .. len - n - 1
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    return int(hits[-1]) if hits.size else None


class ModelDrafter(Drafter):
    """Greedy guesses of a draft model with its own KV cache (`cache`: a kind name of
    kvlab.cache.CACHE_KINDS, sized at `reset`). Each `propose(context, k)` feeds the context tokens
    the cache lacks in one pass (that pass also gives the first guess), then one guess a pass: k
    passes for k guesses. `crop(n)` crops the cache back to the first n tokens of the context."""

    def __init__(self, model: Transformer, cache: str = "static", name: str | None = None):
        if not isinstance(model, Transformer):
            raise ValueError(f"model={model!r:.60} must be a kvlab Transformer (the draft model)")
        self.model, self.kind = model, cache
        self.name = name or model.config.name or f"{model.config.n_layers}-layer draft model"
        self.cache = None
        self.fed: list[int] = []  # the tokens the cache holds, in order
        self.passes = 0

    def check_compatible(self, config: ModelConfig) -> None:
        mine = self.model.config.vocab_size
        if mine != config.vocab_size:
            raise ValueError(f"the draft model has vocab_size={mine}, the target {config.vocab_size}: "
                             "a draft model must share the target's tokenizer")

    def reset(self, max_len: int) -> None:
        max_len = validate.integer("max_len", max_len, high=self.model.config.max_seq_len)
        param = next(self.model.parameters())
        self.cache = make_cache(self.kind, self.model.config, 1, max_len, param.dtype, param.device)
        self.fed = []

    def crop(self, n: int) -> None:
        if n < len(self.fed):
            self.cache.crop(n)
            del self.fed[n:]

    @torch.inference_mode()
    def propose(self, context, k):
        if self.cache is None:
            raise RuntimeError("call reset(max_len) before the first propose")
        context = [int(t) for t in context]
        if not context:
            raise ValueError("context=[] : a draft model guesses what follows at least one token")
        # Keep what still agrees with the context (whatever the caller cropped), but feed at least
        # its last token again: its logits give the first guess.
        self.crop(min(_common_prefix(self.fed, context), len(context) - 1))
        device = next(self.model.parameters()).device
        feed, guesses = context[len(self.fed):], []
        for _ in range(validate.integer("k", k, low=0)):
            logits = self.model(torch.tensor([feed], device=device), cache=self.cache)
            self.passes += 1
            self.fed += feed
            guesses.append(int(logits[0, -1].argmax()))
            feed = guesses[-1:]
        return guesses


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def early_exit(model: Transformer, n_layers: int) -> Transformer:
    """The model's first n_layers blocks, then its own final norm and LM head (`layer_subset`)."""
    n_layers = validate.integer("n_layers", n_layers, high=model.config.n_layers)
    return layer_subset(model, range(n_layers))


def layer_subset(model: Transformer, layers: Sequence[int]) -> Transformer:
    """A cheaper model made of some of `model`'s blocks, in their order, between its own embedding and
    its final norm and LM head. It shares every weight with `model` (nothing is copied)."""
    n = model.config.n_layers
    keep = [validate.integer("layer", i, low=0, high=n - 1) for i in layers]
    if not keep or keep != sorted(set(keep)):
        raise ValueError(f"layers={list(layers)!r} must be distinct block indices in increasing order "
                         f"(0..{n - 1}), at least one")
    in_a_row = keep == list(range(keep[0], keep[-1] + 1))
    label = f"{keep[0]}..{keep[-1]}" if in_a_row else ",".join(map(str, keep))
    config = model.config.with_(n_layers=len(keep), name=f"{model.config.name or 'model'}[{label}]")
    with torch.device("meta"):  # no storage: every module is replaced by the model's own below
        draft = Transformer(config)
    draft.embed, draft.norm, draft.lm_head = model.embed, model.norm, model.lm_head
    draft.layers = nn.ModuleList(model.layers[i] for i in keep)
    draft.rope_cos, draft.rope_sin = model.rope_cos, model.rope_sin
    return draft.eval()
