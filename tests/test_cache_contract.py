"""The cache contract (kvlab.cache.base), for every kind: masks from the cache, crop, fork, reset,
and the oracle (kvlab.oracle) that locates a wrong cache.

The state machine at the end drives every kind through random sequences of prefill, decode, crop,
fork, reset and padded batches, and checks every pass against a recomputation without a cache:
exact (up to float rounding) for the dense, paged and prefix kinds and the window, within the stated
bound for the quantized ones.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlab import PRESETS, oracle
from kvlab.cache import (
    DynamicKVCache,
    HeavyHitterKVCache,
    KVCache,
    PagedKVCache,
    PrefixKVStore,
    QuantizedKVCache,
    SlidingWindowKVCache,
    StaticKVCache,
)
from kvlab.model import Transformer

CFG = PRESETS["tiny-gqa"]  # 2 layers, 4 query heads sharing 2 KV heads, head_dim 16
MAX = 64

# Every kind: (does it take a batch > 1, the oracle's tolerance (atol, rtol)). The quantized kinds
# state their bound: int8 codes are within max|x| / 254 of each value, int4 within max|x| / 14, and
# the next layers carry that error on, so the tolerance is a few times the codes' own.
EXACT = (1e-5, 1e-4)
KINDS = {
    "dynamic": (True, EXACT),
    "static": (True, EXACT),
    "paged": (True, EXACT),
    "prefix": (False, EXACT),
    "int8": (True, (1e-3, 0.02)),
    "int4": (True, (1e-2, 0.3)),
    "window": (True, EXACT),
    "heavy hitters": (True, EXACT),
}
# The kinds whose crop goes back to any n (within what they still hold).
CROPPING = ("dynamic", "static", "paged", "prefix", "int8", "int4", "window")


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return Transformer(CFG).to(dtype).eval()


MODEL = model()


@torch.inference_mode()
def greedy(m, cache, first: torch.Tensor, steps: int) -> list[int]:
    """Feed `first` (1, T) after what the cache holds, then decode `steps` tokens greedily."""
    out, feed = [], first
    for _ in range(steps):
        nxt = m(feed, cache=cache)[:, -1].argmax(-1, keepdim=True)
        out.append(int(nxt))
        feed = nxt
    return out


# --- crop ---------------------------------------------------------------------------------------

def make(kind: str, dtype=torch.float32, batch: int = 1) -> KVCache:
    """An empty cache of `kind` (as KINDS builds it) holding `dtype`."""
    if kind == "dynamic":
        return DynamicKVCache(CFG)
    if kind == "static":
        return StaticKVCache(CFG, batch, MAX, dtype=dtype)
    if kind == "paged":
        return PagedKVCache(CFG, batch, MAX, dtype=dtype, block_size=4)
    if kind == "prefix":
        cache = PrefixKVStore(CFG, num_blocks=64, block_size=4, dtype=dtype).cache_for([0])
        cache.reset()  # a store's cache starts with its prompt's sequence: start it empty
        return cache
    if kind in ("int8", "int4"):
        return QuantizedKVCache(CFG, batch, MAX, dtype=dtype, bits=8 if kind == "int8" else 4,
                                group_size=8, residual=2, rollback=4)
    if kind == "window":
        return SlidingWindowKVCache(CFG, batch, window=6, sinks=2, rollback=3, dtype=dtype)
    return HeavyHitterKVCache(CFG, batch, budget=10, recent=3, sinks=1, dtype=dtype)


@pytest.mark.parametrize("kind", CROPPING)
def test_crop_then_decode_gives_the_tokens_of_a_fresh_decode(kind):
    """Fill 30 positions, crop back to n, decode on: exactly the tokens of a cache that only ever
    saw the first n + 1 tokens (float64, so rounding cannot flip a greedy choice)."""
    m = model(torch.float64)
    ids = torch.randint(0, CFG.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    n = 27
    cache = make(kind, torch.float64)
    with torch.inference_mode():
        m(ids, cache=cache)
    cache.crop(n)
    assert cache.seq_len == n
    got = greedy(m, cache, ids[:, n:n + 1], 12)
    want = greedy(m, make(kind, torch.float64), ids[:, :n + 1], 12)
    assert got == want


def test_crop_zero_empties_every_kind_and_crop_past_the_end_is_refused():
    ids = torch.randint(0, CFG.vocab_size, (1, 12))
    for kind in KINDS:
        cache = make(kind)
        with torch.inference_mode():
            MODEL(ids, cache=cache)
        with pytest.raises(ValueError, match=r"n=13 must be an integer in \[0, 12\]"):
            cache.crop(13)
        cache.crop(0)
        assert cache.seq_len == 0, kind


def test_the_kinds_that_cannot_roll_back_say_what_they_can_do():
    ids = torch.randint(0, CFG.vocab_size, (1, 30))
    hh = make("heavy hitters")
    q8 = QuantizedKVCache(CFG, 1, MAX, group_size=8, residual=4)  # no rollback
    win = SlidingWindowKVCache(CFG, 1, window=6, sinks=2)  # no rollback
    with torch.inference_mode():
        for cache in (hh, q8, win):
            MODEL(ids, cache=cache)
    with pytest.raises(ValueError, match="cannot roll back.*crop to 0"):
        hh.crop(29)
    # Values per token: 26 quantized, 26..29 exact; a cache fed 29 tokens would hold 25 exactly.
    with pytest.raises(ValueError, match=r"crop\(n=29\).*can crop to n >= 30 .*rollback=R"):
        q8.crop(29)
    with pytest.raises(ValueError, match=r"evicted.*n >= 29 or to 0.*rollback=R"):
        win.crop(26)
    win.crop(29)


def test_a_paged_crop_gives_its_blocks_back():
    cache = PagedKVCache(CFG, 2, MAX, block_size=4)
    with torch.inference_mode():
        MODEL(torch.zeros(2, 17, dtype=torch.long), cache=cache)
    assert cache.blocks_in_use == 2 * 5
    cache.crop(8)
    assert cache.blocks_in_use == 2 * 2 and cache.allocator.num_free == cache.num_blocks - 4


def test_a_prefix_crop_keeps_the_blocks_another_request_shares():
    store = PrefixKVStore(CFG, num_blocks=16, block_size=4)
    a = store.cache_for([1] * 8)
    with torch.inference_mode():
        MODEL(torch.ones(1, 8, dtype=torch.long), cache=a)
    b = a.fork()
    assert store.manager.refs[a.seq.table[0]] == 2
    a.crop(3)   # a gives up its second block; b still holds both
    assert len(a.seq.table) == 1 and len(b.seq.table) == 2
    assert store.manager.refs[b.seq.table[1]] == 1 and store.manager.refs[b.seq.table[0]] == 2


# --- fork -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_a_fork_goes_on_independently(kind):
    ids = torch.randint(0, CFG.vocab_size, (1, 14))
    cache = make(kind)
    with torch.inference_mode():
        MODEL(ids[:, :10], cache=cache)
        twin = cache.fork()
        a = MODEL(ids[:, 10:], cache=cache)
        b = MODEL(ids[:, 10:], cache=twin)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert cache.seq_len == twin.seq_len == 14
    twin.crop(0) if kind != "heavy hitters" else twin.reset()
    assert cache.seq_len == 14


# --- the oracle -----------------------------------------------------------------------------------

class _OffByOne(StaticKVCache):
    """A cache with a classic bug: after a rollback it writes the next token one slot too far, so
    attention reads the stale key (and value) left at the rolled-back position."""

    def crop(self, n):
        super().crop(n)
        self.shift = True

    def update(self, layer, k, v):
        if not getattr(self, "shift", False):
            return super().update(layer, k, v)
        start, t = self.lengths[layer], k.shape[2]
        self.k[layer, :, :, start + 1:start + 1 + t], self.v[layer, :, :, start + 1:start + 1 + t] = k, v
        self.lengths[layer] = start + t
        return self.k[layer, :, :, :start + t], self.v[layer, :, :, :start + t]


class _Miscounts(StaticKVCache):
    def crop(self, n):
        self.lengths = [n + 1] * self.config.n_layers  # forgets the last position it should drop


def test_the_oracle_passes_every_correct_kind():
    ids = torch.randint(0, CFG.vocab_size, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0
    for kind, (batched, (atol, rtol)) in KINDS.items():
        batch = 2 if batched else 1
        report = oracle.check(MODEL, make(kind, batch=batch), ids[:batch], prompt_len=16,
                              attention_mask=mask[:batch] if batched else None, atol=atol, rtol=rtol)
        assert report.ok, f"{kind}: {report}"
        assert report.passes == 1 + 8


def test_the_oracle_locates_a_rollback_bug():
    ids = torch.randint(0, CFG.vocab_size, (1, 12))
    o = oracle.Oracle(MODEL, _OffByOne(CFG, 1, MAX))
    o.feed(ids[:, :10])
    o.crop(6)
    o.feed((ids[:, 6:7] + 1) % CFG.vocab_size)  # another token than the one rolled back
    assert not o.report.ok
    first = o.report.first
    assert first.what == "keys" and first.layer == 0 and first.position == 6
    assert "keys of layer 0 at position 6 differ" in str(o.report)


def test_the_oracle_notices_a_cache_that_miscounts_after_a_crop():
    o = oracle.Oracle(MODEL, _Miscounts(CFG, 1, MAX))
    o.feed(torch.randint(0, CFG.vocab_size, (1, 10)))
    o.crop(6)
    assert str(o.report).startswith("✗ the cache says it holds 7 positions, but the stream holds 6")


def test_the_oracle_locates_a_key_written_at_the_wrong_position():
    class Shifted(DynamicKVCache):
        def update(self, layer, k, v):
            K, V = super().update(layer, k, v)
            if layer == 1 and K.shape[2] >= 9:  # layer 1 swaps two old keys
                K = K.clone()
                K[:, :, [3, 4]] = K[:, :, [4, 3]]
            return K, V

    report = oracle.check(MODEL, Shifted(CFG), torch.randint(0, CFG.vocab_size, (1, 12)), prompt_len=8)
    assert (report.first.what, report.first.layer, report.first.position) == ("keys", 1, 3)
    assert report.max_error["keys"][0] == pytest.approx(0, abs=1e-5)  # layer 0 is right


def test_the_oracle_locates_nan_keys_which_no_tolerance_admits():
    class Poisoned(DynamicKVCache):
        def update(self, layer, k, v):
            K, V = super().update(layer, k, v)
            if layer == 1 and K.shape[2] >= 10:  # layer 1 hands back NaN at position 9
                K = K.clone()
                K[:, :, 9] = float("nan")
            return K, V

    report = oracle.check(MODEL, Poisoned(CFG), torch.randint(0, CFG.vocab_size, (1, 12)), prompt_len=8)
    assert not report.ok
    assert (report.first.what, report.first.layer, report.first.position) == ("keys", 1, 9)
    assert math.isnan(report.max_error["keys"][1])


def test_the_oracle_holds_quantized_caches_to_the_tolerance_it_is_given():
    ids = torch.randint(0, CFG.vocab_size, (1, 24))
    strict = oracle.check(MODEL, QuantizedKVCache(CFG, 1, MAX, group_size=8), ids, prompt_len=16)
    assert not strict.ok and strict.first.what in ("keys", "values")
    loose = oracle.check(MODEL, QuantizedKVCache(CFG, 1, MAX, group_size=8), ids, prompt_len=16,
                         atol=1e-3, rtol=0.02)
    assert loose.ok


def test_the_oracle_refuses_what_it_cannot_recompute():
    with pytest.raises(ValueError, match="renumbers positions"):
        oracle.Oracle(MODEL, SlidingWindowKVCache(CFG, 1, window=4, positions="cache"))
    with pytest.raises(ValueError, match="not a kvlab cache"):
        oracle.Oracle(MODEL, "static")


# --- the state machine ----------------------------------------------------------------------------

class CacheMachine(RuleBasedStateMachine):
    """One cache kind, a random life: prefill chunks, decode steps, crops, forks, resets; a padded
    batch of two for the kinds that take batches. Every pass is checked by the oracle."""

    kind = "dynamic"

    @initialize(padded=st.booleans(), pad=st.integers(1, 4), seed=st.integers(0, 2**16))
    def start(self, padded, pad, seed):
        batched, (atol, rtol) = KINDS[self.kind]
        self.batch = 2 if batched and padded else 1
        self.pad = pad if self.batch == 2 else 0
        self.gen = torch.Generator().manual_seed(seed)
        self.oracles = [oracle.Oracle(MODEL, make(self.kind, batch=self.batch), atol=atol, rtol=rtol)]

    def _tokens(self, n):
        return torch.randint(0, CFG.vocab_size, (self.batch, n), generator=self.gen)

    @property
    def o(self) -> oracle.Oracle:
        return self.oracles[-1]

    def _feed(self, n):
        ids = self._tokens(n)
        mask = None
        if self.pad and self.o.tokens.shape[1] == 0:  # the first chunk of a padded batch
            mask = torch.ones(self.batch, n, dtype=torch.long)
            mask[0, :min(self.pad, n - 1)] = 0
        self.o.feed(ids, mask)

    @precondition(lambda self: self.o.cache.seq_len + 12 <= MAX - 8)
    @rule(n=st.integers(1, 12))
    def prefill(self, n):
        self._feed(n)

    @precondition(lambda self: 0 < self.o.cache.seq_len < MAX - 8)
    @rule()
    def decode(self):
        self._feed(1)

    @precondition(lambda self: self.kind in CROPPING and self.o.cache.seq_len > 0)
    @rule(data=st.data())
    def crop(self, data):
        cache = self.o.cache
        floor = 0
        if isinstance(cache, QuantizedKVCache):
            floor = cache.crop_floor
        elif isinstance(cache, SlidingWindowKVCache):
            floor = max(0, cache.low[0] + cache.window - 1) if cache.low[0] > cache.sinks else 0
        n = data.draw(st.integers(min(floor, cache.seq_len), cache.seq_len))
        self.o.crop(n)
        assert cache.seq_len == n

    @precondition(lambda self: len(self.oracles) < 3 and self.o.cache.seq_len > 0)
    @rule()
    def fork(self):
        self.oracles.append(self.o.fork())
        if self.o.cache.seq_len < MAX - 8:
            self.decode_every_fork()  # the forks part ways at once

    @precondition(lambda self: len(self.oracles) > 1 and self.o.cache.seq_len < MAX - 8)
    @rule()
    def decode_every_fork(self):
        """One different token into each fork in turn: writes into shared blocks interleave."""
        for _ in self.oracles:
            self.oracles.append(self.oracles.pop(0))
            if 0 < self.o.cache.seq_len < MAX - 8:
                self._feed(1)

    @precondition(lambda self: len(self.oracles) > 1)
    @rule(i=st.integers(0, 2))
    def switch(self, i):
        """Drive another of the forks (shared blocks: one's writes must not reach the other)."""
        self.oracles.append(self.oracles.pop(i % len(self.oracles)))

    @rule()
    def reset(self):
        self.o.reset()
        assert self.o.cache.seq_len == 0

    @invariant()
    def matches_the_recomputation(self):
        for o in getattr(self, "oracles", []):
            assert o.report.ok, f"{self.kind}: {o.report}"


MACHINE_SETTINGS = settings(max_examples=15, stateful_step_count=10, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_survives_random_lives(kind):
    machine = type(f"{kind.title().replace(' ', '')}Machine", (CacheMachine,), {"kind": kind})
    machine.TestCase.settings = MACHINE_SETTINGS
    machine.TestCase().runTest()
