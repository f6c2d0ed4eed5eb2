"""MHA → GQA → MQA: repeat_kv, KV-head sharing in the model, mean-pooling conversion, cache bytes,
and the GQA explorer's drawing function."""

import matplotlib.pyplot as plt
import pytest
import torch

from kvlab import PRESETS, gqa, widgets
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
    assert list(gqa.variants(ds))[-1] == "MLA"


# --- the explorer's drawing function --------------------------------------------------------

def test_draw_gqa_default_reads_320_and_40_gib():
    fig, text = widgets.draw_gqa()
    plt.close(fig)
    assert "320.00 GiB" in text and "40.00 GiB" in text and "8× smaller" in text
    assert "64× smaller" in text  # MQA


def test_draw_gqa_bars_say_what_the_readout_says():
    # Llama-2-70B at 4,096 tokens: MHA 10 GiB, GQA-8 1.25 GiB, MQA 160 MiB (not "0.156 GiB").
    fig, text = widgets.draw_gqa(seq_len=4096)
    bar_labels = [t.get_text().split("\n")[0] for t in fig.axes[1].texts]
    plt.close(fig)
    assert bar_labels == ["10.00 GiB", "1.25 GiB", "160.00 MiB"]
    assert all(label in text for label in bar_labels)


@pytest.mark.parametrize("kw", [
    dict(model="custom", n_heads=1, layers=1000, head_dim=1024, seq_len=2**20),
    dict(model="custom", n_heads=256, n_kv_heads=256, layers=1, head_dim=2, seq_len=1),
    dict(model="llama-3-8b", n_kv_heads=5, seq_len=128),
    dict(model="custom", head_dim=7),
    dict(model="deepseek-v2", seq_len=2**24, batch_size=1024, dtype="fp32"),
    dict(model="smollm2-135m", n_kv_heads=3),
])
def test_draw_gqa_extreme_settings_never_raise(kw):
    fig, text = widgets.draw_gqa(**kw)
    plt.close(fig)
    assert text


def test_draw_gqa_explains_what_is_not_allowed():
    fig, text = widgets.draw_gqa("llama-3-8b", n_kv_heads=5)
    plt.close(fig)
    assert "n_kv_heads=5 must divide n_heads=32; allowed: [1, 2, 4, 8, 16, 32]" in text
    fig, text = widgets.draw_gqa("custom", head_dim=7)
    plt.close(fig)
    assert "head_dim=7 is odd" in text


def test_draw_gqa_mla_bar_for_deepseek():
    fig, text = widgets.draw_gqa("deepseek-v2")
    plt.close(fig)
    assert "MLA" in text and "2.25 KV heads" in text and "56.9× smaller" in text


def test_draw_gqa_refuses_programming_errors():
    with pytest.raises(ValueError, match="model='nope'"):
        widgets.draw_gqa("nope")
    with pytest.raises(ValueError, match="seq_len=0"):
        widgets.draw_gqa(seq_len=0)


def test_gqa_explorer_builds_and_keeps_kv_heads_divisors():
    box = widgets.gqa_explorer()
    controls = {c.description: c for c in _walk(box) if getattr(c, "description", "")}
    assert {"model", "query heads", "KV heads", "layers", "head dim", "seq len"} <= set(controls)
    controls["query heads"].value = 12
    assert list(controls["KV heads"].options) == [1, 2, 3, 4, 6, 12]
    assert controls["model"].value == "custom"
    controls["model"].value = "qwen2.5-7b"
    assert controls["query heads"].value == 28 and controls["KV heads"].value == 4
    readout = next(c for c in _walk(box) if "kvlab-readout" in c._dom_classes)
    _, expected = widgets.draw_gqa("qwen2.5-7b", 4, controls["seq len"].value, 28, 28, 128)
    plt.close("all")
    assert "qwen2.5-7b" in readout.value and "7× smaller" in readout.value
    assert expected.splitlines()[1].strip() in readout.value


def test_gqa_explorer_redraws_once_per_change(monkeypatch):
    calls = []
    real = widgets.draw_gqa

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(widgets, "draw_gqa", counting)
    box = widgets.gqa_explorer()
    controls = {c.description: c for c in _walk(box) if getattr(c, "description", "")}
    calls.clear()
    controls["model"].value = "deepseek-v2"   # sets layers, heads, head dim and KV heads at once
    assert len(calls) == 1 and calls[0][:2] == ("deepseek-v2", 128)
    calls.clear()
    controls["query heads"].value = 12        # KV heads re-chosen, model becomes custom
    assert len(calls) == 1 and calls[0][0] == "custom" and 12 % calls[0][1] == 0
    plt.close("all")


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _walk(child)


# --- the exercise checker -----------------------------------------------------------------------

def test_kv_heads_for_budget_checker(capsys):
    from kvlab import check

    assert check.kv_heads_for_budget(8)
    assert not check.kv_heads_for_budget(None)
    assert not check.kv_heads_for_budget(16)
    assert "over the 16 GiB budget" in capsys.readouterr().out
    assert not check.kv_heads_for_budget(5)
    assert "allowed: [1, 2, 4, 8, 16, 32]" in capsys.readouterr().out
    assert not check.kv_heads_for_budget(4)
