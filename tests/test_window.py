"""Bounded caches (kvlab.cache.window, kvlab.cache.heavy_hitters) and their measurements (kvlab.eviction)."""

import pytest
import torch

from kvlab import PRESETS, pretrained
from kvlab.attention import attention
from kvlab.cache import HeavyHitterKVCache, SlidingWindowKVCache, StaticKVCache
from kvlab.eviction import attention_maps, token_losses
from kvlab.generate import encode_bytes, generate
from kvlab.model import Transformer, attend_with


@torch.inference_mode()
def feed(model, ids, cache):
    """All of ids through the model with the cache in one call (the model splits it where the cache
    must evict between tokens)."""
    return model(ids, cache=cache)


@pytest.fixture(scope="module")
def tiny():
    return pretrained.load("kvlab-tiny")


@pytest.fixture(scope="module")
def random_model():
    torch.manual_seed(0)
    return Transformer(PRESETS["tiny-gqa"]).eval()   # 2 KV heads shared by 4 query heads


PROMPT = encode_bytes("The KV cache stores the keys and values ")


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_window_covering_everything_gives_the_static_tokens(tiny, positions):
    ids = torch.tensor([PROMPT])
    ref = generate(tiny, ids, 40, cache="static")
    cache = SlidingWindowKVCache(tiny.config, 1, window=len(PROMPT) + 40, positions=positions)
    got = generate(tiny, ids, 40, cache=cache)
    assert torch.equal(got.tokens, ref.tokens)


def test_window_with_sinks_covering_everything_equals_full_attention_logits(random_model):
    ids = torch.randint(0, random_model.config.vocab_size, (2, 30))
    full = random_model(ids)
    cache = SlidingWindowKVCache(random_model.config, 2, window=26, sinks=4)
    torch.testing.assert_close(feed(random_model, ids, cache), full)


def test_window_storage_never_grows_and_keeps_sinks_and_the_last_tokens(random_model):
    cfg = random_model.config
    cache = SlidingWindowKVCache(cfg, 1, window=5, sinks=2)
    expected_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * 7 * cfg.head_dim * 4  # fp32
    assert cache.nbytes == expected_bytes
    feed(random_model, torch.randint(0, cfg.vocab_size, (1, 23)), cache)
    assert cache.nbytes == expected_bytes
    assert cache.stored == 7 and cache.seq_len == 23
    assert cache.kept_positions() == [0, 1, 18, 19, 20, 21, 22]


def _banded(model, ids, window, sinks, attention_mask=None):
    """Logits of one pass over all of ids without a cache, with the sliding-window mask."""
    T = ids.shape[1]
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    band = (k <= q) & ((k < sinks) | (k > q - window))
    with attend_with(model, lambda _i, q_, k_, v_, mask: attention(q_, k_, v_, band if mask is None
                                                                  else mask & band)):
        return model(ids, attention_mask=attention_mask)


@pytest.mark.parametrize("fed", ["one token at a time", "the prompt in one pass"])
def test_window_matches_attention_restricted_to_the_same_keys(random_model, fed):
    """Sliding-window decoding equals full attention with a mask that hides exactly the evicted
    keys, whether a prompt longer than the window goes in one pass or a token at a time."""
    cfg = random_model.config
    T, window, sinks = 20, 6, 2
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    cache = SlidingWindowKVCache(cfg, 1, window=window, sinks=sinks)
    if fed == "the prompt in one pass":
        got = torch.cat([feed(random_model, ids[:, :15], cache), feed(random_model, ids[:, 15:], cache)], 1)
    else:
        got = torch.cat([feed(random_model, ids[:, i:i + 1], cache) for i in range(T)], dim=1)
    torch.testing.assert_close(got, _banded(random_model, ids, window, sinks), rtol=1e-4, atol=1e-5)


def test_generate_with_a_window_takes_a_long_prompt_and_a_padded_batch(tiny):
    """A 38-token prompt and a window of 32 with 4 sinks (the case that used to be refused), and a
    left-padded batch: generate's tokens are those of greedy decoding under the banded mask."""
    short = encode_bytes("Sinks and a window: ")
    long = encode_bytes("The KV cache stores the keys and values")
    pad = len(long) - len(short)
    ids = torch.tensor([[0] * pad + short, long])
    mask = torch.tensor([[0] * pad + [1] * len(short), [1] * len(long)])
    cache = SlidingWindowKVCache(tiny.config, 2, window=32, sinks=4)
    out = generate(tiny, ids, 30, cache=cache, attention_mask=mask)
    tokens, full_mask = ids, mask
    for _ in range(30):  # greedy decoding by recomputation with the banded mask
        nxt = _banded(tiny, tokens, 32, 4, full_mask)[:, -1].argmax(-1, keepdim=True)
        tokens, full_mask = torch.cat([tokens, nxt], 1), torch.cat([full_mask, torch.ones_like(nxt)], 1)
    assert torch.equal(out.tokens, tokens)


def test_cache_positions_stream_past_max_seq_len(random_model):
    cfg = random_model.config
    n = cfg.max_seq_len + 20
    ids = torch.randint(0, cfg.vocab_size, (1, n))
    cache = SlidingWindowKVCache(cfg, 1, window=8, sinks=2, positions="cache")
    logits = feed(random_model, ids, cache)
    assert logits.shape == (1, n, cfg.vocab_size) and torch.isfinite(logits).all()
    assert cache.seq_len == n  # tokens fed; the next one takes the last place's RoPE position:
    assert cache.rope_positions(1).tolist() == [9]
    with pytest.raises(ValueError, match="max_seq_len"):
        feed(random_model, ids, SlidingWindowKVCache(cfg, 1, window=8, sinks=2))


def test_cache_positions_equal_original_positions_for_a_window_alone(random_model):
    """RoPE scores depend only on the distance between query and key: renumbering the keys of a
    window (no sinks) from 0 changes no distance, so the logits agree."""
    cfg = random_model.config
    ids = torch.randint(0, cfg.vocab_size, (1, 40))
    a = feed(random_model, ids, SlidingWindowKVCache(cfg, 1, window=8))
    b = feed(random_model, ids, SlidingWindowKVCache(cfg, 1, window=8, positions="cache"))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_cache_positions_refuse_a_padding_mask(random_model):
    cfg = random_model.config
    cache = SlidingWindowKVCache(cfg, 2, window=4, sinks=1, positions="cache")
    with pytest.raises(ValueError, match="takes no attention_mask"):
        random_model(torch.zeros(2, 6, dtype=torch.long), cache=cache,
                     attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6]))


@pytest.mark.parametrize("bad", [0, -3, 2.5, None, "8", True])
def test_window_rejects_bad_sizes(bad):
    cfg = PRESETS["tiny-mha"]
    with pytest.raises(ValueError, match="window"):
        SlidingWindowKVCache(cfg, 1, window=bad)
    with pytest.raises(ValueError, match="positions"):
        SlidingWindowKVCache(cfg, 1, window=4, positions="relative")


def test_window_crop_goes_back_as_far_as_its_held_tokens_allow(random_model):
    cfg = random_model.config
    cache = SlidingWindowKVCache(cfg, 1, window=4)
    feed(random_model, torch.zeros(1, 9, dtype=torch.long), cache)
    cache.crop(8)  # the window still holds what a query at position 8 needs
    with pytest.raises(ValueError, match="can crop to n >= 8 or to 0.*rollback=R"):
        cache.crop(5)
    cache.reset()
    assert cache.seq_len == 0 and cache.stored == 0
    roomy = SlidingWindowKVCache(cfg, 1, window=4, rollback=3)
    feed(random_model, torch.zeros(1, 9, dtype=torch.long), roomy)
    roomy.crop(6)
    assert roomy.seq_len == 6 and roomy.kept_positions() == [2, 3, 4, 5]


# --- heavy hitters --------------------------------------------------------------------------------

def test_heavy_hitters_with_room_for_everything_equal_full_attention(random_model):
    ids = torch.randint(0, random_model.config.vocab_size, (2, 25))
    cache = HeavyHitterKVCache(random_model.config, 2, budget=25, recent=4)
    torch.testing.assert_close(feed(random_model, ids, cache), random_model(ids))


def test_heavy_hitters_keep_the_budget_the_recent_tokens_and_the_most_attended(random_model):
    cfg = random_model.config
    ids = torch.randint(0, cfg.vocab_size, (1, 40))
    cache = HeavyHitterKVCache(cfg, 1, budget=10, recent=3, sinks=1)
    nbytes = cache.nbytes
    feed(random_model, ids, cache)
    assert cache.nbytes == nbytes and cache.stored == 10 and cache.seq_len == 40
    for layer in range(cfg.n_layers):
        for head in range(cfg.n_kv_heads):
            kept = cache.kept_positions(layer, 0, head)
            assert len(kept) == 10 and kept[0] == 0 and kept[-3:] == [37, 38, 39]


def test_heavy_hitters_evict_the_least_attended_unprotected_key(random_model):
    """Layer 0 (whose input does not depend on earlier evictions): after a full prompt of `budget`
    tokens, one more token evicts, per KV head, the key with the lowest accumulated attention
    (prompt queries + the new query) among those not protected as recent."""
    cfg = random_model.config
    budget, recent = 10, 2
    ids = torch.randint(0, cfg.vocab_size, (1, budget + 1))
    cache = HeavyHitterKVCache(cfg, 1, budget=budget, recent=recent)
    feed(random_model, ids[:, :budget], cache)
    before = cache.score[0, 0, :, :budget].clone()
    feed(random_model, ids[:, budget:], cache)
    last = attention_maps(random_model, ids)[0][0, :, -1]          # (H, budget + 1)
    received = last.view(cfg.n_kv_heads, -1, budget + 1).sum(1)
    total = torch.nn.functional.pad(before, (0, 1)) + received
    for head in range(cfg.n_kv_heads):
        victim = int(total[head, :budget + 1 - recent].argmin())
        assert cache.kept_positions(0, 0, head) == [p for p in range(budget + 1) if p != victim]


def test_heavy_hitter_scores_are_the_attention_received(random_model):
    """After a prompt that fits, each key's score is the sum over the later queries (and query
    heads sharing its KV head) of the attention weight it got: compare with attention_maps."""
    cfg = random_model.config
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    cache = HeavyHitterKVCache(cfg, 1, budget=16, recent=2)
    feed(random_model, ids, cache)
    maps = attention_maps(random_model, ids)     # per layer (B, H, T, T)
    group = cfg.n_heads // cfg.n_kv_heads
    for layer, a in enumerate(maps):
        want = a[0].sum(dim=1).view(cfg.n_kv_heads, group, -1).sum(1)
        torch.testing.assert_close(cache.score[layer, 0, :, :12], want, rtol=1e-4, atol=1e-5)


def test_heavy_hitters_need_the_queries(random_model):
    cfg = random_model.config
    cache = HeavyHitterKVCache(cfg, 1, budget=8)
    k = torch.zeros(1, cfg.n_kv_heads, 3, cfg.head_dim)
    with pytest.raises(ValueError, match="needs the queries"):
        cache.update(0, k, k)  # called directly, without the model handing the queries over
    feed(random_model, torch.zeros(1, 3, dtype=torch.long), cache)  # the model does
    assert cache.seq_len == 3


def test_heavy_hitters_cannot_roll_back(random_model):
    cache = HeavyHitterKVCache(random_model.config, 1, budget=8)
    feed(random_model, torch.zeros(1, 12, dtype=torch.long), cache)
    cache.crop(12)  # keeping everything is fine
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.crop(10)
    cache.crop(0)
    assert cache.seq_len == 0


def test_heavy_hitter_arguments_are_checked():
    cfg = PRESETS["tiny-mha"]
    with pytest.raises(ValueError, match="recent"):
        HeavyHitterKVCache(cfg, 1, budget=4, recent=4)
    with pytest.raises(ValueError, match="sinks"):
        HeavyHitterKVCache(cfg, 1, budget=4, recent=2, sinks=2)


# --- measurements -------------------------------------------------------------------------------

def test_attention_maps_are_causal_distributions(random_model):
    ids = torch.randint(0, random_model.config.vocab_size, (1, 9))
    for a in attention_maps(random_model, ids):
        assert a.shape == (1, random_model.config.n_heads, 9, 9)
        torch.testing.assert_close(a.sum(-1), torch.ones(1, random_model.config.n_heads, 9))
        assert (a.triu(1) == 0).all()


def test_token_losses_with_a_full_window_equal_the_plain_model(tiny):
    ids = torch.tensor([encode_bytes(pretrained.corpus_text("held_out")[:120])])
    full = token_losses(tiny, ids)
    windowed = token_losses(tiny, ids, SlidingWindowKVCache(tiny.config, 1, window=120))
    torch.testing.assert_close(windowed, full, rtol=1e-4, atol=1e-4)
    short = token_losses(tiny, ids, SlidingWindowKVCache(tiny.config, 1, window=8))
    torch.testing.assert_close(short[:, :7], full[:, :7], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(short[:, 20:], full[:, 20:])


def test_static_cache_is_unaffected(tiny):
    ids = torch.tensor([PROMPT])
    cache = StaticKVCache(tiny.config, 1, len(PROMPT))
    torch.testing.assert_close(feed(tiny, ids, cache), tiny(ids))


def test_paired_difference_over_streams_and_over_blocks():
    from kvlab.eviction import paired_difference

    ref = torch.zeros(2, 8)
    a = torch.tensor([[1.0] * 8, [3.0] * 8])
    assert paired_difference(a, ref) == pytest.approx((2.0, 1.0, 2))
    blocks = torch.arange(16.0).view(2, 8)
    mean, se, n = paired_difference(blocks, ref, start=2, block=3)
    units = torch.tensor([3.0, 6.0, 11.0, 14.0])   # blocks 2..4, 5..7 of each row
    assert n == 4 and mean == pytest.approx(units.mean().item())
    assert se == pytest.approx(units.std().item() / 2)
    with pytest.raises(ValueError, match="same shape"):
        paired_difference(a, torch.zeros(2, 7))
    with pytest.raises(ValueError, match="at least 2 units"):
        paired_difference(a[:1], ref[:1])


def test_bounded_cache_numbers_window_keys_as_asked(tiny):
    from kvlab.eviction import bounded_cache

    # by default at their original positions, as heavy hitters keep them: a fair comparison
    assert bounded_cache("sinks + window", tiny.config, 1, 8).positions == "original"
    assert bounded_cache("window", tiny.config, 1, 8, positions="cache").positions == "cache"
    with pytest.raises(ValueError, match="positions='ring'"):
        bounded_cache("window", tiny.config, 1, 8, positions="ring")


def test_loss_vs_budget_compares_policies_at_original_positions_unless_asked(tiny):
    from kvlab.eviction import loss_vs_budget

    ids = torch.tensor([encode_bytes("a stream longer than the budget, with sinks kept first")])
    kw = {"policies": ["sinks + window"], "sinks": 2}
    default = loss_vs_budget(tiny, ids, [12], **kw)["sinks + window"][0]
    original = loss_vs_budget(tiny, ids, [12], positions="original", **kw)["sinks + window"][0]
    renumbered = loss_vs_budget(tiny, ids, [12], positions="cache", **kw)["sinks + window"][0]
    assert torch.equal(default, original) and not torch.allclose(default, renumbered)
