import pytest
import torch

from kvlab import PRESETS
from kvlab.cache import CACHE_KINDS, DynamicKVCache, StaticKVCache, make_cache

CFG = PRESETS["tiny-gqa"]  # 2 layers, 2 KV heads, head_dim 16


def kv(t, batch=1):
    shape = (batch, CFG.n_kv_heads, t, CFG.head_dim)
    return torch.randn(shape), torch.randn(shape)


def fill(cache, t, batch=1):
    for layer in range(CFG.n_layers):
        k, v = kv(t, batch)
        cache.update(layer, k, v)


def test_static_cache_is_preallocated_with_the_documented_shape():
    c = StaticKVCache(CFG, batch_size=3, max_seq_len=100)
    assert c.k.shape == c.v.shape == (2, 3, 2, 100, 16)
    assert c.nbytes == 2 * 2 * 3 * 2 * 100 * 16 * 4  # K and V, fp32
    assert c.seq_len == 0
    fill(c, 10, batch=3)
    assert c.seq_len == 10 and c.nbytes == 2 * 2 * 3 * 2 * 100 * 16 * 4


def test_update_returns_everything_stored_so_far():
    for cache in (DynamicKVCache(CFG), StaticKVCache(CFG, 1, 20)):
        k1, v1 = kv(3)
        k2, v2 = kv(1)
        cache.update(0, k1, v1)
        k_all, v_all = cache.update(0, k2, v2)
        assert torch.equal(k_all, torch.cat([k1, k2], dim=2))
        assert torch.equal(v_all, torch.cat([v1, v2], dim=2))


def test_dynamic_cache_grows_and_copies_everything_each_step():
    c = DynamicKVCache(CFG)
    assert c.nbytes == 0
    for _ in range(4):
        fill(c, 1)
    assert c.seq_len == 4
    row = 2 * CFG.n_kv_heads * CFG.head_dim * 4  # one position of K and V, one layer, fp32
    assert c.nbytes == 4 * row * CFG.n_layers
    # Concatenation copies the whole cache each step: 1 + 2 + 3 + 4 rows per layer.
    assert c.bytes_copied == (1 + 2 + 3 + 4) * row * CFG.n_layers
    assert c.allocations == 2 * 4 * CFG.n_layers


def test_static_cache_writes_only_the_new_rows():
    c = StaticKVCache(CFG, 1, 16)
    for _ in range(4):
        fill(c, 1)
    row = 2 * CFG.n_kv_heads * CFG.head_dim * 4
    assert c.bytes_copied == 4 * row * CFG.n_layers
    assert c.allocations == 2


def test_full_cache_says_so():
    c = StaticKVCache(CFG, 1, 512)
    fill(c, 512)
    with pytest.raises(ValueError, match="cache is full: 512 of 512 positions used, 1 more requested"):
        c.update(0, *kv(1))


def test_reset_forgets_positions_but_keeps_storage():
    c = StaticKVCache(CFG, 1, 8)
    fill(c, 5)
    c.reset()
    assert c.seq_len == 0 and c.nbytes > 0


def test_bad_layer_and_sizes_are_refused():
    with pytest.raises(IndexError, match=r"layer=2 out of range: the model has 2 layers \(0..1\)"):
        DynamicKVCache(CFG).update(2, *kv(1))
    with pytest.raises(ValueError, match="max_seq_len=0 must be an integer >= 1"):
        StaticKVCache(CFG, 1, 0)
    with pytest.raises(ValueError, match="batch_size=-1 must be an integer >= 1"):
        StaticKVCache(CFG, -1, 8)


def test_make_cache_builds_every_kind_by_name():
    assert set(CACHE_KINDS) == {"dynamic", "static", "int8", "int4", "paged"}
    assert isinstance(make_cache("static", CFG, 1, 8), StaticKVCache)
    assert isinstance(make_cache("dynamic", CFG, 1, 8), DynamicKVCache)
    assert make_cache("int8", CFG, 1, 8).bits == 8 and make_cache("int4", CFG, 1, 8).bits == 4
    assert type(make_cache("paged", CFG, 1, 8)).__name__ == "PagedKVCache"
    for kind in CACHE_KINDS:
        cache = make_cache(kind, CFG, 2, 8, dtype=torch.float64)
        assert cache.lengths == [0] * CFG.n_layers and cache.seq_len == 0
        k, v = (x.double() for x in kv(3, batch=2))
        k_all, _ = cache.update(0, k, v)
        # a quantized kind may hand back extra copies of positions it quantized within the pass
        positions = cache.key_positions(0)
        held = 3 if positions is None else len(positions)
        assert positions is None or set(positions.tolist()) == {0, 1, 2}
        assert cache.lengths == [3, 0] and k_all.shape == (2, CFG.n_kv_heads, held, CFG.head_dim)
        assert k_all.dtype == torch.float64
    with pytest.raises(ValueError, match=r"cache=\['static'\] is not a known cache kind"):
        make_cache(["static"], CFG, 1, 8)
    with pytest.raises(ValueError, match="cache='huge' is not a known cache kind; allowed: None, 'dynamic'"):
        make_cache("huge", CFG, 1, 8)
