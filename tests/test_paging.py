import numpy as np
import pytest
import torch

from kvlab import PRESETS, fragmentation
from kvlab.cache import CACHE_KINDS, StaticKVCache, make_cache
from kvlab.cache.paged import (
    BlockAllocator,
    OutOfBlocksError,
    PagedKVCache,
    blocks_needed,
    wasted_slots,
)
from kvlab.fragmentation import POLICIES, RequestMix, paged_waste, sample_requests, simulate
from kvlab.generate import generate
from kvlab.model import Transformer

# --- the allocator -------------------------------------------------------------------------------

def test_allocator_hands_out_distinct_blocks_and_reuses_freed_ones_first():
    a = BlockAllocator(8)
    first = a.allocate(3)
    assert len(set(first)) == 3 and a.num_used == 3 and a.num_free == 5
    second = a.allocate(2)
    assert not set(first) & set(second)
    a.free(first[1])
    assert a.num_used == 4
    assert a.allocate(1) == [first[1]]  # the free list is a stack: freed block comes back first
    a.free(first[0:1] + second)
    assert a.num_used == 2 and a.num_free == 6
    assert sorted(a.allocate(6) + [first[1], first[2]]) == list(range(8))


def test_allocator_runs_out_with_a_clear_error_and_changes_nothing():
    a = BlockAllocator(64)
    a.allocate(60)
    with pytest.raises(OutOfBlocksError, match="out of KV blocks: 60 of 64 blocks in use, 5 more"):
        a.allocate(5)
    assert a.num_used == 60  # all or nothing
    a.allocate(4)
    with pytest.raises(OutOfBlocksError, match="64 of 64 blocks in use"):
        a.allocate()


def test_allocator_rejects_double_free_and_bad_sizes():
    a = BlockAllocator(4)
    b = a.allocate(1)
    a.free(b)
    with pytest.raises(ValueError, match="not in use"):
        a.free(b)
    with pytest.raises(ValueError, match="not in use"):
        a.free(99)
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="num_blocks"):
            BlockAllocator(bad)
    with pytest.raises(ValueError, match="n="):
        a.allocate(-1)


@pytest.mark.parametrize("n, bs, blocks, waste", [(0, 16, 0, 0), (1, 16, 1, 15), (16, 16, 1, 0),
                                                  (17, 16, 2, 15), (1000, 16, 63, 8), (5, 1, 5, 0)])
def test_blocks_needed_and_wasted_slots(n, bs, blocks, waste):
    assert blocks_needed(n, bs) == blocks
    assert wasted_slots(n, bs) == waste


def test_block_arithmetic_rejects_bad_input():
    with pytest.raises(ValueError, match="block_size"):
        blocks_needed(10, 0)
    with pytest.raises(ValueError, match="n_tokens"):
        blocks_needed(-1, 16)


# --- the paged cache -----------------------------------------------------------------------------

def _kv(cfg, batch, t):
    shape = (batch, cfg.n_kv_heads, t, cfg.head_dim)
    return torch.randn(shape), torch.randn(shape)


@pytest.mark.parametrize("name", ["tiny-mha", "tiny-gqa", "tiny-mqa"])
def test_paged_cache_returns_what_a_static_cache_returns(name):
    cfg = PRESETS[name]
    paged = PagedKVCache(cfg, batch_size=3, max_seq_len=40, block_size=4)
    static = StaticKVCache(cfg, batch_size=3, max_seq_len=40)
    for t in (7, 1, 1, 5, 1):
        for layer in range(cfg.n_layers):
            k, v = _kv(cfg, 3, t)
            kp, vp = paged.update(layer, k, v)
            ks, vs = static.update(layer, k, v)
            assert torch.equal(kp, ks) and torch.equal(vp, vs)
    assert paged.seq_len == static.seq_len == 15
    assert paged.blocks_in_use == 3 * 4 and paged.wasted_slots == 3 * 1


def test_paged_cache_storage_is_a_pool_of_blocks_read_through_block_tables():
    cfg = PRESETS["tiny-gqa"]
    c = PagedKVCache(cfg, batch_size=2, max_seq_len=32, block_size=8)
    assert c.k.shape == c.v.shape == (cfg.n_layers, 8, 8, cfg.n_kv_heads, cfg.head_dim)
    assert c.nbytes == 2 * cfg.n_layers * 8 * 8 * cfg.n_kv_heads * cfg.head_dim * 4
    assert c.nbytes == StaticKVCache(cfg, 2, 32).nbytes  # default pool: the same memory
    assert c.blocks_in_use == 0  # nothing taken until tokens arrive
    k, v = _kv(cfg, 2, 10)
    for layer in range(cfg.n_layers):
        c.update(layer, k, v)
    assert [len(t) for t in c.block_tables] == [2, 2] and c.blocks_in_use == 4
    # Token 9 of sequence 1 sits in that sequence's block 1, offset 1, wherever that block is.
    block = c.block_tables[1][1]
    assert torch.equal(c.k[0, block, 1], k[1, :, 9])
    # What attention reads back is gathered through the tables: the tokens in their order.
    before = c.update(0, *_kv(cfg, 2, 1))[0][:, :, :10]
    assert torch.equal(before, k)


def test_paged_cache_out_of_blocks_error_leaves_the_cache_unchanged():
    cfg = PRESETS["tiny-mha"]
    c = PagedKVCache(cfg, batch_size=2, max_seq_len=64, block_size=4, num_blocks=5)
    c.update(0, *_kv(cfg, 2, 8))  # 2 blocks each: 4 of 5 in use
    with pytest.raises(OutOfBlocksError, match=r"out of KV blocks: 4 of 5 blocks in use, 2 more"):
        c.update(0, *_kv(cfg, 2, 1))
    assert c.lengths[0] == 8 and c.blocks_in_use == 4


def test_paged_cache_reset_returns_blocks_and_rejects_bad_input():
    cfg = PRESETS["tiny-mha"]
    c = PagedKVCache(cfg, batch_size=2, max_seq_len=16, block_size=4)
    for layer in range(cfg.n_layers):
        c.update(layer, *_kv(cfg, 2, 6))
    c.reset()
    assert c.seq_len == 0 and c.blocks_in_use == 0 and c.allocator.num_free == c.num_blocks
    with pytest.raises(ValueError, match="batch_size=2"):
        c.update(0, *_kv(cfg, 3, 1))
    with pytest.raises(IndexError, match="layer=5"):
        c.update(5, *_kv(cfg, 2, 1))
    for kwargs in ({"block_size": 0}, {"num_blocks": -3}, {"block_size": 2.0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            PagedKVCache(cfg, 2, 16, **kwargs)


def test_paged_is_a_registered_cache_kind():
    assert "paged" in CACHE_KINDS
    assert isinstance(make_cache("paged", PRESETS["tiny-mha"], 2, 10), PagedKVCache)


@pytest.mark.parametrize("name, batch", [("tiny-mha", 1), ("tiny-gqa", 3), ("tiny-mqa", 2)])
def test_generate_with_a_paged_cache_gives_the_static_tokens(name, batch):
    torch.manual_seed(1)
    model = Transformer(PRESETS[name]).eval()
    ids = torch.randint(0, 256, (batch, 9))
    static = generate(model, ids, 12, cache="static")
    paged = generate(model, ids, 12, cache="paged")
    assert torch.equal(paged.tokens, static.tokens)
    small = PagedKVCache(model.config, batch, 21, block_size=3, num_blocks=batch * 7)
    assert torch.equal(generate(model, ids, 12, cache=small).tokens, static.tokens)
    assert small.blocks_in_use == batch * blocks_needed(20, 3)  # the last token is never fed


def test_paged_cache_with_left_padding_matches_each_prompt_alone():
    torch.manual_seed(2)
    model = Transformer(PRESETS["tiny-gqa"]).eval()
    prompts = [torch.randint(1, 256, (n,)) for n in (3, 8, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = (torch.arange(width) >= width - torch.tensor([len(p) for p in prompts])[:, None]).long()
    batched = generate(model, ids, 6, cache="paged", attention_mask=mask)
    for row, p in zip(batched.new_tokens, prompts, strict=True):
        alone = generate(model, p, 6, cache="static")
        assert torch.equal(row, alone.new_tokens[0])


# --- the simulation ------------------------------------------------------------------------------

def test_sample_requests_follows_the_mix_and_its_limits():
    mix = RequestMix(max_len=512)
    p, o = sample_requests(2000, mix, seed=3)
    assert p.shape == o.shape == (2000,)
    assert p.min() >= 1 and o.min() >= 1 and (p + o).max() <= 512
    assert 150 < np.median(p) < 250  # median 200 (few clipped)
    p2, o2 = sample_requests(2000, mix, seed=3)
    assert np.array_equal(p, p2) and np.array_equal(o, o2)
    assert "LogNormal" in mix.describe()


def test_sample_requests_rejects_bad_input():
    with pytest.raises(ValueError, match="n="):
        sample_requests(-5)
    with pytest.raises(ValueError, match="max_len"):
        sample_requests(5, RequestMix(max_len=1))
    with pytest.raises(ValueError, match="prompt_median"):
        sample_requests(5, RequestMix(prompt_median=0))


@pytest.fixture(scope="module")
def requests():
    return sample_requests(300, RequestMix(), seed=0)


@pytest.mark.parametrize("policy", POLICIES)
def test_simulation_shares_add_up_and_every_request_finishes(requests, policy):
    p, o = requests
    r = simulate(p, o, policy, capacity=8 * 2048)
    shares = r.fractions()
    assert all(0.0 <= x <= 1.0 for x in shares.values())
    assert sum(shares.values()) == pytest.approx(1.0)
    assert 0.0 <= r.waste <= 1.0 and 0.0 <= r.reserved_unused <= 1.0
    assert r.finished == len(p)
    assert r.steps >= o.max()


def test_max_reservation_wastes_most_memory_and_paging_little(requests):
    p, o = requests
    res = {pol: simulate(p, o, pol, capacity=8 * 2048) for pol in POLICIES}
    assert res["max"].mean_running == pytest.approx(8.0)  # 8 chunks of 2,048, always full
    assert res["max"].external == 0.0                    # equal chunks leave no unusable gaps
    assert res["max"].waste > 0.6
    assert res["exact"].internal == 0.0                  # an oracle reserves no unused tail
    assert res["paged"].future == res["paged"].external == 0.0
    assert res["paged"].waste < 0.04
    assert res["max"].waste > res["pow2"].waste > res["exact"].waste > res["paged"].waste
    assert res["paged"].mean_running > 3 * res["max"].mean_running


def test_paged_simulation_wastes_less_than_one_block_per_sequence(requests):
    p, o = requests
    for bs in (1, 8, 64):
        r = simulate(p, o, "paged", capacity=4 * 2048, block_size=bs)
        assert r.internal * r.capacity <= (bs - 1) * r.mean_running + 1e-6
        if bs == 1:
            assert r.internal == 0.0


def test_paged_headroom_trades_free_blocks_for_fewer_preemptions(requests):
    p, o = requests
    tight = simulate(p, o, "paged", capacity=4 * 2048)
    roomy = simulate(p, o, "paged", capacity=4 * 2048, headroom=2.0)
    assert roomy.preemptions < tight.preemptions
    assert roomy.free > tight.free
    assert roomy.finished == tight.finished == len(p)
    with pytest.raises(ValueError, match="headroom=-1"):
        simulate(p, o, "paged", headroom=-1)


def test_paged_waste_counts_only_last_blocks():
    lens = np.array([1, 16, 17, 100])
    assert paged_waste(lens, 16) == pytest.approx((15 + 0 + 15 + 12) / (16 + 16 + 32 + 112))
    assert paged_waste(lens, 1) == 0.0
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 2048, 500)
    for bs in (2, 16, 128):
        assert paged_waste(lens, bs) * (-(-lens // bs) * bs).sum() <= (bs - 1) * len(lens)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_waste([0, 3], 16)


def reserved_slots(layout, request=0) -> int:
    return sum(n for _, n, kind, r in layout if r == request and kind != "gap")


def test_pow2_reserves_the_prompt_plus_the_output_rounded_up_to_a_power_of_two():
    # the vLLM paper (§6.1): "if the true output length is 25, it reserves 32 positions for outputs"
    r = simulate([10], [25], "pow2", capacity=256, max_len=128, layout_step=0)
    assert reserved_slots(r.layout) == 10 + 32       # not 64, the power of two above 10 + 25
    r = simulate([100], [20], "pow2", capacity=256, max_len=128, layout_step=0)
    assert reserved_slots(r.layout) == 128           # 100 + 32, cut to max_len
    r = simulate([7], [32], "pow2", capacity=256, max_len=128, layout_step=0)
    assert reserved_slots(r.layout) == 7 + 32        # a power of two already: nothing added
    # the capacity check counts what a request reserves, not its length
    with pytest.raises(ValueError, match="cannot hold even one request of 42 slots"):
        simulate([10], [25], "pow2", capacity=40, max_len=128)


def test_layouts_cover_the_memory_without_overlap(requests):
    p, o = requests
    for policy in ("pow2", "paged"):
        r = simulate(p[:60] // 16 + 1, o[:60] // 16 + 1, policy, capacity=512, max_len=128,
                     block_size=4, layout_step=5)
        covered = np.zeros(512, dtype=int)
        for start, n, kind, _req in r.layout:
            assert kind in fragmentation.LAYOUT_KINDS and n > 0
            covered[start:start + n] += 1
        assert (covered == 1).all()


def test_simulation_rejects_bad_input(requests):
    p, o = requests
    with pytest.raises(ValueError, match="policy='lru'"):
        simulate(p, o, "lru")
    with pytest.raises(ValueError, match="capacity=1000 slots cannot hold even one request"):
        simulate(p, o, "max", capacity=1000)
    with pytest.raises(ValueError, match="equal length"):
        simulate(p, o[:-1])
    with pytest.raises(ValueError, match=">= 1"):
        simulate([0], [3])
    with pytest.raises(ValueError, match="exceeds max_len=100"):
        simulate([90], [20], max_len=100, capacity=1000)
