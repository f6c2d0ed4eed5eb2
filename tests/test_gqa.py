"""MHA → GQA → MQA: repeat_kv, KV-head sharing in the model, mean-pooling conversion, cache bytes,
and the GQA explorer's drawing function."""

import pytest
import torch

from kvlab import PRESETS, gqa
from kvlab.attention import attention, causal_mask, naive_attention, repeat_kv
from kvlab.cache import StaticKVCache
from kvlab.memory import kv_cache_bytes
from kvlab.model import Transformer

TINY = PRESETS["tiny-mha"]


def _model(config, seed=0):
    torch.manual_seed(seed)
    return Transformer(config).eval()


def _ids(n=24, batch=2, seed=1):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


# --- repeat_kv --------------------------------------------------------------------------------

@pytest.mark.parametrize("h_kv,n_rep", [(1, 1), (1, 8), (2, 4), (4, 1), (3, 2)])
def test_repeat_kv_shape(h_kv, n_rep):
    x = torch.randn(2, h_kv, 5, 8)
    assert repeat_kv(x, n_rep).shape == (2, h_kv * n_rep, 5, 8)


def test_repeat_kv_each_kv_head_serves_its_group():
    x = torch.randn(2, 3, 5, 8)
    y = repeat_kv(x, 4)
    for h in range(12):
        assert torch.equal(y[:, h], x[:, h // 4])
        assert gqa.kv_head_of(h, 12, 3) == h // 4
    assert gqa.kv_groups(12, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_repeat_kv_n_rep_one_is_identity():
    x = torch.randn(1, 4, 3, 2)
    assert torch.equal(repeat_kv(x, 1), x)


def test_attention_with_shared_heads_equals_attention_on_repeated_heads():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    mask = causal_mask(6, 6)
    shared = naive_attention(q, k, v, mask)
    assert torch.equal(shared, naive_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), mask))
    torch.testing.assert_close(attention(q, k, v, mask), shared, rtol=1e-5, atol=1e-6)


# --- GQA in the model ---------------------------------------------------------------------------

def test_gqa_with_as_many_kv_heads_as_query_heads_is_mha():
    # A GQA model expanded to one KV head per query head (copies) computes exactly the same logits.
    small = _model(PRESETS["tiny-gqa"])
    mha = gqa.gqa_to_mha(small)
    assert mha.config.n_kv_heads == mha.config.n_heads == 4
    assert mha.config.attention_kind == "MHA"
    with torch.no_grad():
        assert torch.equal(mha(_ids()), small(_ids()))


def test_mqa_is_one_kv_head_for_all_query_heads():
    mqa = _model(PRESETS["tiny-mqa"])
    assert mqa.config.attention_kind == "MQA" and mqa.config.n_rep == mqa.config.n_heads
    k_rows = mqa.layers[0].attn.split[1]
    assert k_rows == mqa.config.head_dim  # K projection: one head's worth of rows
    with torch.no_grad():
        assert torch.equal(gqa.gqa_to_mha(mqa)(_ids()), mqa(_ids()))


def test_mha_to_gqa_with_all_heads_is_an_exact_copy():
    model = _model(TINY)
    same = gqa.mha_to_gqa(model, TINY.n_heads)
    with torch.no_grad():
        assert torch.equal(same(_ids()), model(_ids()))
    assert same is not model
    assert same.layers[0].attn.qkv.weight.data_ptr() != model.layers[0].attn.qkv.weight.data_ptr()


@pytest.mark.parametrize("n_kv", [2, 1])
def test_mha_to_gqa_mean_pools_k_and_v_heads(n_kv):
    model = _model(TINY)
    pooled = gqa.mha_to_gqa(model, n_kv)
    cfg, D = TINY, TINY.head_dim
    assert pooled.config == cfg.with_(n_kv_heads=n_kv)
    q_rows = cfg.n_heads * D
    for old, new in zip(model.layers, pooled.layers, strict=True):
        w_old, w_new = old.attn.qkv.weight, new.attn.qkv.weight
        assert torch.equal(w_new[:q_rows], w_old[:q_rows])  # queries untouched
        for part in range(2):  # K then V
            old_heads = w_old[q_rows + part * cfg.n_heads * D:][:cfg.n_heads * D].view(cfg.n_heads, D, -1)
            new_heads = w_new[q_rows + part * n_kv * D:][:n_kv * D].view(n_kv, D, -1)
            for g, members in enumerate(gqa.kv_groups(cfg.n_heads, n_kv)):
                torch.testing.assert_close(new_heads[g], old_heads[members].mean(0), rtol=0, atol=1e-7)
        assert torch.equal(new.attn.out.weight, old.attn.out.weight)
        assert torch.equal(new.ffn.gate_up.weight, old.ffn.gate_up.weight)


def test_pooling_copies_gives_back_the_original():
    small = _model(PRESETS["tiny-gqa"])
    back = gqa.mha_to_gqa(gqa.gqa_to_mha(small), 2)
    for (name, a), b in zip(small.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_pool_kv_heads_handles_biases():
    bias = torch.arange(8.0)  # 4 heads of head_dim 2
    assert gqa.pool_kv_heads(bias, 2, 2).tolist() == [1.0, 2.0, 5.0, 6.0]
    assert gqa.repeat_kv_heads(torch.tensor([1.0, 2.0]), 3, 2).tolist() == [1.0, 2.0] * 3


def test_conversion_keeps_qkv_bias_dtype_and_training_flag():
    cfg = TINY.with_(qkv_bias=True)
    model = _model(cfg).to(torch.float64)
    torch.nn.init.normal_(model.layers[0].attn.qkv.bias)
    pooled = gqa.mha_to_gqa(model, 2)
    assert next(pooled.parameters()).dtype == torch.float64 and not pooled.training
    b = model.layers[0].attn.qkv.bias
    q_rows = cfg.n_heads * cfg.head_dim
    k_old = b[q_rows:q_rows * 2].view(4, -1)
    torch.testing.assert_close(pooled.layers[0].attn.qkv.bias[q_rows:q_rows + 2 * cfg.head_dim],
                               k_old.view(2, 2, -1).mean(1).reshape(-1))


@pytest.mark.parametrize("bad", [3, 0, -2, 8, 2.0, True])
def test_mha_to_gqa_refuses_non_divisors(bad):
    with pytest.raises(ValueError, match=r"n_kv_heads=.*allowed: \[1, 2, 4\]"):
        gqa.mha_to_gqa(_model(TINY), bad)


def test_mha_to_gqa_cannot_add_heads():
    with pytest.raises(ValueError, match=r"must divide the model's n_kv_heads=2; allowed: \[1, 2\]"):
        gqa.mha_to_gqa(_model(PRESETS["tiny-gqa"]), 4)


# --- sizes --------------------------------------------------------------------------------------

def test_static_cache_bytes_shrink_with_kv_heads():
    cfg = PRESETS["tiny-mha"].with_(n_heads=8, d_model=128)
    caches = {k: StaticKVCache(cfg.with_(n_kv_heads=k), 2, 64) for k in (8, 2, 1)}
    assert caches[8].nbytes == 4 * caches[2].nbytes == 8 * caches[1].nbytes
    for k, c in caches.items():
        assert c.k.shape == (cfg.n_layers, 2, k, 64, cfg.head_dim)
        assert c.nbytes == kv_cache_bytes(cfg.with_(n_kv_heads=k), 64, 2, dtype="fp32")


def test_published_ratios_and_mla_equivalent():
    assert gqa.mha_ratio(PRESETS["llama-2-70b"]) == 8
    assert gqa.mha_ratio(PRESETS["llama-7b"]) == 1
    assert gqa.mha_ratio(PRESETS["qwen2.5-7b"]) == 7
    ds = PRESETS["deepseek-v2"]
    assert gqa.gqa_equivalent_kv_heads(ds) == 2.25
    assert round(gqa.mha_ratio(ds)) == 57
    assert list(gqa.variants(PRESETS["llama-2-70b"])) == [
        "MHA (64 KV heads)", "GQA (8 KV heads)", "MQA (1 KV head)"]
    assert list(gqa.variants(ds))[-1] == "MLA (576-element latent)"
    assert list(gqa.variants(PRESETS["llama-2-70b"].with_(n_heads=1, n_kv_heads=1, d_model=128))) == [
        "MHA (1 KV head)"]  # one query head: its MHA is its MQA
