"""Prefix caching (kvlab.cache.prefix, kvlab.prefix): shared blocks, copy-on-write, the index, LRU."""

import pytest
import torch

from kvlab import PRESETS, pretrained
from kvlab.cache import OutOfBlocksError
from kvlab.cache.prefix import PrefixBlockManager, PrefixKVStore, prefix_hashes
from kvlab.generate import encode_bytes, generate
from kvlab.memory import kv_bytes_per_token, param_count
from kvlab.model import Transformer
from kvlab.offload import LINKS, offload_seconds, recompute_seconds
from kvlab.prefix import prefill_flops, run_request, sample_stream, sharing, simulate_stream


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(PRESETS["tiny-gqa"]).eval()


# --- the index ----------------------------------------------------------------------------------

def test_block_keys_depend_on_every_earlier_token():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = prefix_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3        # full blocks only
    assert a[1] != b[1]                        # same tokens 3, 4 but a different first block
    assert prefix_hashes([1, 2, 3, 4, 0], 2) == a[:2]


def test_a_second_request_shares_the_full_blocks_of_a_common_prefix():
    m = PrefixBlockManager(num_blocks=16, block_size=4)
    first = m.new_sequence(list(range(10)))          # blocks of 4, 4 and 2 tokens
    assert first.cached_tokens == 0 and len(first.table) == 3
    m.register(first)                                # two full blocks indexed
    second = m.new_sequence(list(range(9)) + [99, 98])
    assert second.cached_tokens == 8 and second.table[:2] == first.table[:2]
    assert second.table[2] != first.table[2]
    assert m.refs[first.table[0]] == 2 and m.num_in_use == 4
    assert m.hit_rate == pytest.approx(8 / 21)


def test_the_last_prompt_token_is_always_computed():
    m = PrefixBlockManager(num_blocks=8, block_size=4)
    m.register(m.new_sequence(list(range(8))))
    again = m.new_sequence(list(range(8)))          # fully cached prompt
    assert again.cached_tokens == 4                  # its last block is recomputed


def test_unused_blocks_stay_cached_and_are_evicted_least_recently_used_first():
    m = PrefixBlockManager(num_blocks=4, block_size=2)
    a = m.new_sequence([1, 1, 1, 1])
    a_blocks = list(a.table)
    m.register(a)
    m.free(a)
    b = m.new_sequence([2, 2, 2, 2])
    b_blocks = list(b.table)
    m.register(b)
    m.free(b)
    assert a.table == [] and m.num_cached == 4 and m.allocator.num_free == 0
    m.new_sequence([1, 1, 5])        # revives a's first block and needs one more: evicts a's second
    assert m.evictions == 1 and m.num_cached == 2
    assert m.match([1, 1, 1, 1]) == a_blocks[:1]
    c = m.new_sequence([7, 7, 7, 7])  # two more: b's blocks, the least recently used left
    assert m.evictions == 3 and sorted(c.table) == sorted(b_blocks)
    assert m.match([2, 2, 2, 2]) == []
    with pytest.raises(OutOfBlocksError, match="out of KV blocks"):
        m.new_sequence([8] * 6)


def test_a_failed_allocation_changes_no_reference_count():
    m = PrefixBlockManager(num_blocks=3, block_size=2)
    a = m.new_sequence([1, 2, 3])
    m.register(a)
    refs = dict(m.refs)
    with pytest.raises(OutOfBlocksError):
        m.new_sequence([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.refs == refs


def test_fork_shares_blocks_and_the_first_write_copies_a_shared_partial_block():
    m = PrefixBlockManager(num_blocks=8, block_size=4)
    copied = []
    m.on_copy = lambda src, dst: copied.append((src, dst))
    a = m.new_sequence([1, 2, 3, 4, 5, 6])
    b = m.fork(a)
    assert b.table == a.table and all(m.refs[x] == 2 for x in a.table)
    m.append(b, 7)                                   # block 1 is partly filled and shared
    assert copied == [(a.table[1], b.table[1])] and b.table[0] == a.table[0]
    assert m.refs[a.table[1]] == 1 and m.copies == 1
    m.append(b, 8)                                   # b's copy is private now: no second copy
    assert m.copies == 1


# --- real K/V -----------------------------------------------------------------------------------

def test_reusing_a_prefix_gives_the_same_greedy_tokens_and_computes_only_the_suffix(model):
    system = torch.randint(0, 256, (37,)).tolist()
    store = PrefixKVStore(model.config, num_blocks=32, block_size=8)
    for i, question in enumerate(([1, 2, 3], [4, 5, 6, 7, 8], [9] * 11)):
        prompt = system + question
        ref = generate(model, torch.tensor([prompt]), 12, cache="static")
        got = run_request(model, store, prompt, 12)
        assert got.new_tokens == ref.new_tokens[0].tolist()
        assert got.cached_tokens == (0 if i == 0 else 32)        # 4 full blocks of the system prompt
        assert got.computed_tokens == len(prompt) - got.cached_tokens
    assert store.manager.num_in_use == 0 and store.manager.num_cached > 0


def test_without_reuse_everything_is_computed_and_tokens_agree(model):
    prompt = torch.randint(0, 256, (20,)).tolist()
    store = PrefixKVStore(model.config, num_blocks=16, block_size=4)
    first = run_request(model, store, prompt, 6)
    again = run_request(model, store, prompt, 6, reuse=False)
    assert again.cached_tokens == 0 and again.new_tokens == first.new_tokens


def test_copy_on_write_keeps_the_parent_intact(model):
    prompt = torch.randint(0, 256, (10,)).tolist()         # 2.5 blocks of 4: a shared partial block
    store = PrefixKVStore(model.config, num_blocks=16, block_size=4)
    parent = run_request(model, store, prompt, 1, keep=True).cache
    child = parent.fork()
    snapshot = (store.k.clone(), store.v.clone())
    with torch.inference_mode():
        model(torch.tensor([[200]]), cache=child)           # the child writes first
    assert store.manager.copies == 1
    shared_partial = parent.seq.table[2]
    assert torch.equal(store.k[:, shared_partial], snapshot[0][:, shared_partial])
    with torch.inference_mode():
        logits = model(torch.tensor([[77]]), cache=parent)
    ref = model(torch.tensor([prompt + [77]]))
    torch.testing.assert_close(logits[0, -1], ref[0, -1], rtol=1e-4, atol=1e-5)


def test_prefix_reuse_on_kvlab_tiny_gives_identical_text():
    tiny = pretrained.load("kvlab-tiny")
    system = encode_bytes("You explain the KV cache in plain words to a curious student. ")
    store = PrefixKVStore(tiny.config, num_blocks=64, block_size=16)
    prompts = [system + encode_bytes(q) for q in ("What is a block? ", "Why share a prefix? ")]
    for prompt in prompts:
        ref = generate(tiny, torch.tensor([prompt]), 24, cache="static")
        assert run_request(tiny, store, prompt, 24).new_tokens == ref.new_tokens[0].tolist()
    common = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)   # 64: "…student. W"
    assert store.manager.hit_tokens == common // 16 * 16 > 0


def test_the_oracle_checks_a_cache_that_starts_with_a_cached_prefix(model):
    """kvlab.oracle with `cached=n`: the store's cache holds the first n tokens already; the oracle
    recomputes them too. It must be told how many (or be given them), and says so when it is not."""
    from kvlab import oracle

    store = PrefixKVStore(model.config, num_blocks=32, block_size=8)
    ids = torch.randint(0, 256, (1, 30)).tolist()[0]
    run_request(model, store, ids[:20], 2)                    # indexes 2 full blocks of 8
    cache = store.cache_for(ids[:24])
    assert cache.seq_len == 16
    assert oracle.check(model, cache, [ids], prompt_len=24, cached=16).ok
    cache.release()
    cache = store.cache_for(ids[:24])
    untold = oracle.check(model, cache, [ids], prompt_len=24)
    assert str(untold).startswith("✗ the cache says it holds 16 positions, but the stream holds 0")
    cache.release()
    cache = store.cache_for(ids[:24])
    with pytest.raises(ValueError, match="held has 15 tokens, but the cache holds 16 positions"):
        oracle.Oracle(model, cache, held=[ids[:15]])
    with pytest.raises(ValueError, match="cached > 0 with an attention_mask"):
        oracle.check(model, cache, [ids], cached=16, attention_mask=[[1] * 30])
    with pytest.raises(ValueError, match="cached=30 must be an integer"):
        oracle.check(model, cache, [ids], cached=30)


# --- arithmetic ---------------------------------------------------------------------------------

def test_sharing_counts_blocks_bytes_and_prefill():
    cfg = PRESETS["llama-2-7b"]
    s = sharing(users=10, prefix_len=1000, suffix_len=100, block_size=16, config=cfg)
    assert s.blocks_alone == 10 * 69                       # ceil(1100 / 16)
    assert s.blocks_shared == 62 + 10 * (69 - 62)          # 62 full prefix blocks held once
    assert s.bytes_shared == s.blocks_shared * 16 * kv_bytes_per_token(cfg)
    assert s.prefill_tokens_alone == 11000
    assert s.prefill_tokens_shared == 11000 - 9 * 62 * 16
    assert sharing(1, 1000, 100, 16).blocks_shared == sharing(1, 1000, 100, 16).blocks_alone
    with pytest.raises(ValueError, match="users"):
        sharing(0, 10, 10)


def test_prefill_flops_and_offloading_arithmetic():
    cfg = PRESETS["llama-2-7b"]
    # 2 FLOPs per weight of the 32 layers (Q, K, V, O: 4·d²; gate, up, down: 3·d·d_ff) per token; the
    # embedding is a lookup and K/V need no LM head.
    per_token = 2 * 32 * (4 * 4096**2 + 3 * 4096 * 11008)
    assert prefill_flops(cfg, 10) == 10 * per_token
    llama3 = PRESETS["llama-3-8b"]  # the old "2 × all parameters" counted its 128K-row tables twice:
    assert 2 * param_count(llama3) > 1.14 * prefill_flops(llama3, 1)  # 15 % too many
    t = offload_seconds(cfg, 1024, LINKS["PCIe 4.0 x16"])
    assert t == pytest.approx(kv_bytes_per_token(cfg) * 1024 / 32e9)
    assert offload_seconds(cfg, 1024, LINKS["PCIe 5.0 x16"]) == pytest.approx(t / 2)
    assert recompute_seconds(cfg, 1024, 1e15) == pytest.approx(per_token * 1024 / 1e15)
    with pytest.raises(ValueError, match="bandwidth"):
        offload_seconds(cfg, 1, 0)


def test_stream_hit_rate_rises_with_memory_and_with_shared_prefixes():
    reqs = sample_stream(300, n_prefixes=16, prefix_len=256, suffix_len=32, seed=1)
    small = simulate_stream(reqs, num_blocks=40, block_size=16)
    big = simulate_stream(reqs, num_blocks=2000, block_size=16)
    assert 0 <= small.hit_rate < big.hit_rate <= 256 / 288
    assert big.evictions == 0 and small.evictions > 0
    assert big.computed_tokens == big.prompt_tokens - round(big.hit_rate * big.prompt_tokens)
    unique = sample_stream(100, n_prefixes=1, prefix_len=0, suffix_len=64, seed=2)
    assert simulate_stream(unique, num_blocks=2000).hit_rate == 0
