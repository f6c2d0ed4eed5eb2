"""Speculative decoding (kvlab.speculative) and its drafters (kvlab.drafters), through the public API:
the tokens of plain greedy decoding with every cache kind that can roll back, whatever the drafter
guesses; a cache left as if only the kept tokens had been fed; the kinds that cannot roll back
refused up front; the statistics consistent; the expected speed-up formula against a simulation."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab import oracle, pretrained
from kvlab.cache import (
    HeavyHitterKVCache,
    PagedKVCache,
    PrefixKVStore,
    QuantizedKVCache,
    SlidingWindowKVCache,
    StaticKVCache,
    blocks_needed,
)
from kvlab.config import ModelConfig
from kvlab.drafters import Drafter, ModelDrafter, PromptLookupDrafter, early_exit, layer_subset
from kvlab.generate import encode_bytes, generate
from kvlab.model import Transformer
from kvlab.speculative import (
    expected_speedup,
    expected_tokens_per_step,
    speculative_generate,
)

VOCAB = 12
CFG = ModelConfig(n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=VOCAB,
                  max_seq_len=128, name="spec-test")
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_model(seed: int, std: float = 0.4, config: ModelConfig = CFG) -> Transformer:
    """A random float64 model; weights large enough that it repeats itself (guesses get accepted)."""
    torch.manual_seed(seed)
    model = Transformer(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    return model


class RandomDrafter(Drafter):
    """Guesses uniformly at random: almost every guess is rejected."""

    name = "random"

    def __init__(self, seed: int, vocab: int = VOCAB):
        self.rng, self.vocab = random.Random(seed), vocab

    def propose(self, context, k):
        return [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(0, k))]


class NoisyOracle(Drafter):
    """Knows the target's greedy continuation and guesses each of its next tokens right with
    probability `a`, independently: the assumption of Leviathan et al.'s formula."""

    name = "noisy oracle"

    def __init__(self, continuation: list[int], a: float, seed: int, vocab: int = VOCAB):
        self.continuation, self.a, self.vocab = continuation, a, vocab
        self.rng = random.Random(seed)

    def propose(self, context, k):
        right = self.continuation[len(context):len(context) + k]
        return [t if self.rng.random() < self.a else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                for t in right]


def target_cache(kind: str, total: int, k: int, window=(4, 1)):
    """A fresh cache of `kind` for one sequence of `total` positions that can crop k of them."""
    if kind in ("dynamic", "static", "paged"):
        return kind
    if kind == "paged2":
        return PagedKVCache(CFG, 1, total, torch.float64, block_size=2)
    if kind == "prefix":
        cache = PrefixKVStore(CFG, num_blocks=64, block_size=2, dtype=torch.float64).cache_for([0])
        cache.reset()  # a store's cache starts with its prompt's sequence: start it empty
        return cache
    if kind == "window":
        return SlidingWindowKVCache(CFG, 1, window=window[0], sinks=window[1], rollback=k,
                                    dtype=torch.float64)
    if kind in ("int8", "int4"):
        return quantized(int(kind[3:]), total, residual=window[0] % 3, rollback=k)
    raise AssertionError(kind)


def plain_cache(kind: str, total: int, window=(4, 1)):
    """The same kind for plain decoding (a window without extra rollback room: it changes nothing)."""
    if kind == "window":
        return SlidingWindowKVCache(CFG, 1, window=window[0], sinks=window[1], dtype=torch.float64)
    if kind in ("int8", "int4"):
        return quantized(int(kind[3:]), total, residual=window[0] % 3)
    return target_cache(kind, total, 0, window)


def drafter_for(name: str, model: Transformer, seed: int, plain_tokens: list[int]) -> Drafter:
    if name == "lookup":
        return PromptLookupDrafter(max_ngram=3)
    if name == "early exit":
        return ModelDrafter(early_exit(model, 1))
    if name == "other model":
        return ModelDrafter(random_model(seed + 1))
    if name == "random":
        return RandomDrafter(seed)
    return NoisyOracle(plain_tokens, 0.7, seed)


EXACT_KINDS = ["dynamic", "static", "paged", "paged2", "prefix", "window", "int8", "int4"]
DRAFTERS = ["lookup", "early exit", "other model", "random", "oracle"]


@FAST
@given(seed=st.integers(0, 10_000), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
       k=st.integers(1, 6), new=st.integers(1, 24), kind=st.sampled_from(EXACT_KINDS),
       drafter=st.sampled_from(DRAFTERS), window=st.tuples(st.integers(2, 8), st.integers(0, 2)))
def test_the_tokens_of_plain_greedy_decoding_whatever_the_drafter_and_cache(seed, prompt, k, new, kind,
                                                                          drafter, window):
    model = random_model(seed % 50)
    total = len(prompt) + new
    plain = generate(model, prompt, new, cache=plain_cache(kind, total, window)).tokens
    cache = target_cache(kind, total, k, window)
    run = speculative_generate(model, prompt, new, drafter_for(drafter, model, seed, plain[0].tolist()),
                               k=k, cache=cache)
    assert torch.equal(run.tokens, plain)
    # The counts agree with each other and with what the loop did.
    assert run.target_passes == 1 + len(run.steps)
    assert sum(s.new_tokens for s in run.steps) == new - 1
    for step in run.steps:
        assert 0 <= step.accepted <= step.proposed <= k
        assert step.new_tokens == step.accepted + 1
        assert len(step.choices) == step.proposed + 1
        assert step.after.seq_len == step.before.seq_len - (step.proposed - step.accepted)
        assert step.blocks_freed >= 0
    if not isinstance(cache, str):  # the cache now holds every token but the last, as a fresh one would
        assert cache.seq_len == total - 1
        fresh = plain_cache(kind, total, window)
        with torch.inference_mode():
            model(run.tokens[:, :-1], cache=fresh)
            want = model(run.tokens[:, -1:], cache=fresh)
            got = model(run.tokens[:, -1:], cache=cache)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


# The oracle's tolerances of tests/test_cache_contract.py (bounds stated there for the quantized kinds).
ORACLE_TOLERANCE = {"static": (1e-5, 1e-4), "paged2": (1e-5, 1e-4), "window": (1e-5, 1e-4),
                    "int8": (1e-3, 0.02), "int4": (1e-2, 0.3)}


def quantized(bits: int, total: int, residual: int, rollback: int = 0, dtype=torch.float64):
    return QuantizedKVCache(CFG, 1, total, dtype, bits=bits, group_size=4, residual=residual,
                            rollback=rollback)


@pytest.mark.parametrize("kind", sorted(ORACLE_TOLERANCE))
def test_every_verify_pass_and_crop_checks_out_against_the_oracle(kind):
    """Replay a run's passes (prompt, then [last token, guesses…] and a crop a step) on a fresh
    cache under kvlab.oracle: keys, values and logits match a recomputation without a cache at every
    pass (quantized kinds within their stated bound), and the choices are the run's."""
    model, k, prompt, new = random_model(3, std=0.02), 4, [1, 2, 3, 1, 2], 30  # the contract's scale
    total = len(prompt) + new

    fresh = {"static": lambda: StaticKVCache(CFG, 1, total, torch.float64),
             "paged2": lambda: target_cache("paged2", total, k),
             "window": lambda: target_cache("window", total, k),
             "int8": lambda: quantized(8, total, residual=0, rollback=k),
             "int4": lambda: quantized(4, total, residual=0, rollback=k)}[kind]
    run = speculative_generate(model, prompt, new, RandomDrafter(0), k=k, cache=fresh())
    assert run.rejections, "a random drafter should be rejected at least once"
    atol, rtol = ORACLE_TOLERANCE[kind]
    check = oracle.Oracle(model, fresh(), atol=atol, rtol=rtol)
    tokens = run.tokens[0].tolist()
    check.feed(torch.tensor([prompt]))
    for i, step in enumerate(run.steps):
        last = tokens[step.before.seq_len - step.proposed - 1]
        logits = check.feed(torch.tensor([[last, *step.guesses]]))
        assert logits[0].argmax(-1).tolist() == list(step.choices), f"step {i}"
        check.crop(step.after.seq_len)
    assert check.report.ok, str(check.report)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_cache_built_by_name_gets_the_rollback_it_needs(bits):
    model, prompt = random_model(5), [3, 1, 4, 1, 5, 9]
    run = speculative_generate(model, prompt, 30, RandomDrafter(1), k=5, cache=f"int{bits}")
    assert len(run.rejections) > 0 and run.tokens.shape[1] == len(prompt) + 30
    with pytest.raises(ValueError, match=r"rollback=2 extra positions.*build it with rollback=5"):
        speculative_generate(model, prompt, 30, RandomDrafter(1), k=5,
                             cache=quantized(bits, 36, residual=0, rollback=2))


def test_quantized_caches_agree_with_plain_decoding_on_the_shipped_model():
    """In float32 too, on kvlab-tiny with int8 codes: the tokens of plain int8 decoding."""
    model = pretrained.load("kvlab-tiny")
    text = pretrained.corpus_text("held_out")
    ids, k = encode_bytes(text[3000:3060]), 4
    plain = generate(model, ids, 40, cache=QuantizedKVCache(model.config, 1, 100)).tokens
    run = speculative_generate(model, ids, 40, PromptLookupDrafter(), k=k, cache="int8")
    assert torch.equal(run.tokens, plain) and run.rejections


def test_paged_crops_give_blocks_back_and_the_counts_add_up():
    model, prompt, new = random_model(7), [0, 1, 2], 40
    cache = PagedKVCache(CFG, 1, len(prompt) + new, torch.float64, block_size=1)
    run = speculative_generate(model, prompt, new, RandomDrafter(2), k=6, cache=cache)
    freed = [s.blocks_freed for s in run.steps]
    assert run.blocks_freed == sum(freed) > 0
    assert all(f == s.rejected for f, s in zip(freed, run.steps, strict=True))  # one token a block
    assert cache.blocks_in_use == blocks_needed(cache.seq_len, 1) == len(prompt) + new - 1
    for step in run.rejections:  # the storage is the pool: its bytes stay, its lengths and blocks go
        assert step.before.nbytes == step.after.nbytes and step.before.seq_len > step.after.seq_len


def test_stops_at_eos_like_generate():
    model, prompt = random_model(11), [4, 4, 2]
    plain = generate(model, prompt, 30).tokens[0].tolist()
    eos = plain[len(prompt) + 7]  # a token the continuation produces
    want = generate(model, prompt, 30, eos_token_id=eos).tokens
    for drafter in (PromptLookupDrafter(), NoisyOracle(plain, 0.9, 0)):
        got = speculative_generate(model, prompt, 30, drafter, k=4, eos_token_id=eos).tokens
        assert torch.equal(got, want) and int(got[0, -1]) == eos


def test_a_good_drafter_gets_several_tokens_a_pass():
    model, prompt, new = random_model(13), [1, 5, 2], 60
    plain = generate(model, prompt, new).tokens[0].tolist()
    run = speculative_generate(model, prompt, new, NoisyOracle(plain, 1.0, 0), k=5)
    assert run.accepted_fraction == 1.0 and run.per_token_acceptance == 1.0
    assert run.target_passes == 1 + math.ceil((new - 1) / 6)  # k + 1 tokens a pass, the prefill's one
    bad = speculative_generate(model, prompt, new, NoisyOracle(plain, 0.0, 0), k=5)
    assert bad.accepted == 0 and bad.target_passes == new and bad.tokens_per_step == 1.0


# --- refusals -------------------------------------------------------------------------------------

def test_caches_that_cannot_roll_back_are_refused_up_front():
    model, prompt = random_model(0), [1, 2, 3]
    hh = HeavyHitterKVCache(CFG, 1, budget=8, recent=2, dtype=torch.float64)
    with pytest.raises(ValueError, match="HeavyHitterKVCache cannot roll back"):
        speculative_generate(model, prompt, 5, PromptLookupDrafter(), k=2, cache=hh)
    assert hh.seq_len == 0  # refused before any pass
    small = SlidingWindowKVCache(CFG, 1, window=4, rollback=1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"rollback=1 .*rollback=3 or more"):
        speculative_generate(model, prompt, 5, PromptLookupDrafter(), k=3, cache=small)
    renumbered = SlidingWindowKVCache(CFG, 1, window=4, rollback=4, positions="cache", dtype=torch.float64)
    with pytest.raises(ValueError, match="positions='original'"):
        speculative_generate(model, prompt, 5, PromptLookupDrafter(), k=3, cache=renumbered)


def test_bad_arguments_are_refused_with_what_is_allowed():
    model = random_model(0)
    with pytest.raises(ValueError, match="takes one sequence; input_ids has batch 2"):
        speculative_generate(model, [[1, 2], [3, 4]], 5, PromptLookupDrafter())
    with pytest.raises(ValueError, match="k=0 must be an integer >= 1"):
        speculative_generate(model, [1, 2], 5, PromptLookupDrafter(), k=0)
    with pytest.raises(ValueError, match="must be a kvlab.drafters.Drafter"):
        speculative_generate(model, [1, 2], 5, lambda context, k: [])
    wide = random_model(0, config=CFG.with_(vocab_size=20))
    with pytest.raises(ValueError, match="vocab_size=20, the target 12"):
        speculative_generate(model, [1, 2], 5, ModelDrafter(wide))
    with pytest.raises(ValueError, match="cache='lru' is not a known cache kind"):
        speculative_generate(model, [1, 2], 5, PromptLookupDrafter(), cache="lru")

    class TooMany(Drafter):
        def propose(self, context, k):
            return [0] * (k + 1)

    class OutOfVocabulary(Drafter):
        def propose(self, context, k):
            return [VOCAB]

    with pytest.raises(ValueError, match="at most k=2 token ids"):
        speculative_generate(model, [1, 2], 5, TooMany(), k=2)
    with pytest.raises(ValueError, match=f"a proposed token={VOCAB} must be an integer in"):
        speculative_generate(model, [1, 2], 5, OutOfVocabulary(), k=2)


# --- the expected speed-up ------------------------------------------------------------------------

def test_expected_tokens_per_step_is_the_geometric_sum():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    for a, k in [(0.5, 2), (0.8, 5), (0.3, 1)]:
        assert expected_tokens_per_step(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))
    assert expected_speedup(0.8, 4, 0.0) == pytest.approx(expected_tokens_per_step(0.8, 4))
    # Leviathan et al.: a = 0.8, k = 4 and a draft 5 % of the target's cost: 3.36 / 1.2 = 2.8x.
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(2.8, abs=0.01)
    assert expected_speedup(0.2, 4, 0.5) < 1  # poor guesses from a costly drafter: speculation loses
    assert expected_speedup(0.8, 4, 0.05, verify_cost=1.5) < expected_speedup(0.8, 4, 0.05)
    for bad in (dict(a=1.5, k=2, c=0.1), dict(a=0.5, k=-1, c=0.1), dict(a=0.5, k=2, c=-1)):
        with pytest.raises(ValueError, match="must be"):
            expected_speedup(**bad)


@pytest.mark.parametrize("a", [0.5, 0.8])
def test_the_formula_predicts_a_drafter_that_is_right_with_probability_a(a):
    """Guesses right with probability a, independently: the tokens per pass measured over ~100
    passes match (1 - a^(k+1)) / (1 - a) within 4 standard errors, and per_token_acceptance
    estimates a, while accepted_fraction (accepted / proposed) falls short of it: the guesses after
    a rejection are proposed but never judged."""
    model, prompt, new, k = random_model(17), [2, 7], 120, 3
    plain = generate(model, prompt, new).tokens[0].tolist()
    run = speculative_generate(model, prompt, new, NoisyOracle(plain, a, seed=1), k=k)
    full = [s.new_tokens for s in run.steps if s.proposed == k]  # the last steps propose fewer
    mean = sum(full) / len(full)
    se = (sum((x - mean) ** 2 for x in full) / (len(full) - 1)) ** 0.5 / len(full) ** 0.5
    assert abs(mean - expected_tokens_per_step(a, k)) < 4 * se
    judged = run.accepted + len(run.rejections)
    assert abs(run.per_token_acceptance - a) < 4 * (a * (1 - a) / judged) ** 0.5
    assert run.accepted_fraction == run.accepted / run.proposed < run.per_token_acceptance


# --- drafters -------------------------------------------------------------------------------------

def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    lookup = PromptLookupDrafter(max_ngram=3)
    #           0  1  2  3  4  5  6  7  8  9 10
    context = [5, 1, 2, 9, 9, 1, 2, 7, 8, 1, 2]
    assert lookup.propose(context, 3) == [7, 8, 1]      # "1 2" last seen at 5: what followed it
    assert lookup.propose(context, 10) == [7, 8, 1, 2]  # no further than the context goes
    # "1 2 3" at 0 (then 9) wins over the later "2 3" at 4 (then 7): the longest match first.
    assert lookup.propose([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2) == [9, 2]
    assert lookup.propose([1, 2, 3], 4) == [] and lookup.propose([7], 4) == []
    assert lookup.passes == 0
    with pytest.raises(ValueError, match="min_ngram=4 must be an integer in"):
        PromptLookupDrafter(max_ngram=3, min_ngram=4)


def test_a_model_drafter_guesses_its_models_greedy_continuation_and_rolls_back():
    draft = random_model(21)
    drafter = ModelDrafter(draft)
    drafter.reset(60)
    context = [1, 2, 3, 4]
    greedy = generate(draft, context, 5).new_tokens[0].tolist()
    assert drafter.propose(context, 5) == greedy
    assert drafter.passes == 5  # one pass for the context and the first guess, then one a guess
    # Two guesses accepted, then a token of the target's: crop, and the next guesses are still right.
    context = context + greedy[:2] + [(greedy[2] + 1) % VOCAB]
    drafter.crop(6)
    assert drafter.propose(context, 3) == generate(draft, context, 3).new_tokens[0].tolist()
    # Without the crop it notices the context changed and rolls back by itself.
    context = context[:5] + [(context[5] + 1) % VOCAB]
    assert drafter.propose(context, 2) == generate(draft, context, 2).new_tokens[0].tolist()


def test_early_exit_shares_the_weights_and_is_the_first_layers():
    model = random_model(23, config=CFG.with_(n_layers=4))
    draft = early_exit(model, 2)
    assert draft.config.n_layers == 2 and len(draft.layers) == 2
    assert draft.layers[1] is model.layers[1] and draft.lm_head is model.lm_head
    assert draft.embed.weight.data_ptr() == model.embed.weight.data_ptr()
    copy = Transformer(CFG.with_(n_layers=2)).double().eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("layers.2", "layers.3"))}
    copy.load_state_dict(state)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    torch.testing.assert_close(draft(ids), copy(ids))
    assert layer_subset(model, [0, 3]).layers[1] is model.layers[3]
    with pytest.raises(ValueError, match="increasing order"):
        layer_subset(model, [2, 1])
    with pytest.raises(ValueError, match="n_layers=5 must be an integer in"):
        early_exit(model, 5)


# --- the shipped draft model and the real model -----------------------------------------------------

def test_kvlab_tiny_draft_is_a_cheaper_model_with_kvlab_tinys_bytes():
    target, draft = pretrained.load("kvlab-tiny"), pretrained.load("kvlab-tiny-draft")
    assert draft.config.vocab_size == target.config.vocab_size == 256
    assert draft.config.n_layers < target.config.n_layers
    assert draft.num_params() * 4 < target.num_params()
    record = pretrained.info("kvlab-tiny-draft")
    assert record["held_out_loss"] < math.log(256) / 2 and record["held_out_loss_se"] > 0
    ids = encode_bytes(pretrained.corpus_text("held_out")[:80])
    run = speculative_generate(target, ids, 48, ModelDrafter(draft), k=3)
    assert torch.equal(run.tokens, generate(target, ids, 48).tokens)
    assert run.per_token_acceptance > 0.3


def test_the_real_model_decodes_the_same_with_both_drafters():
    from kvlab import course_model

    model, tokenizer = course_model.load_course_model()  # without the model: fails with the install line
    ids = tokenizer("The KV cache stores the keys and values of every token. The KV cache")["input_ids"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the course's CPU policy (kvlab.env): two threads on a busy machine crawl
    try:
        plain = generate(model, ids, 12).tokens
        for drafter in (PromptLookupDrafter(), ModelDrafter(early_exit(model, model.config.n_layers // 2))):
            run = speculative_generate(model, ids, 12, drafter, k=3)
            assert torch.equal(run.tokens, plain) and run.proposed > 0  # guesses were verified
    finally:
        torch.set_num_threads(threads)
