"""kvlab.quality: the no-window simulation of a quantized cache and the per-sequence losses."""

import pytest
import torch

from kvlab import PRESETS, quality, quant
from kvlab.cache import QuantizedKVCache
from kvlab.model import Transformer


def _model_and_tokens(batch=2, length=40):
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny-mha"]).eval()
    tokens = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(1))
    return model, tokens


def test_per_token_keys_simulated_equal_the_real_cache():
    # Per-token keys have no window, so the simulation must give exactly what the real cache gives.
    model, tokens = _model_and_tokens()
    r = quality.compare_caches(model, tokens, 8, {
        "real": dict(storage="int8", key_granularity="token"),
        "simulated": dict(storage="int8", key_granularity="token", key_window=False)})
    for key in ("k_relative_rms_error", "v_relative_rms_error", "logits_relative_rms_error"):
        assert r["simulated"][key] == pytest.approx(r["real"][key], rel=1e-5)


def test_without_the_window_every_key_is_quantized():
    model, tokens = _model_and_tokens(length=45)     # 45 = one full block of 32 + 13 unfinished
    cache = quality.NoWindowQuantizedKVCache(model.config, 2, 45)
    real = quality._storage_cache(model, tokens, "int8")
    with torch.inference_mode():
        model(tokens, cache=cache)
        model(tokens, cache=real)
    k_sim, _ = cache.read(0)
    k_real, _ = real.read(0)
    k_exact = cache.k[0, :, :, :45]
    assert torch.equal(k_real[:, :, 32:], k_exact[:, :, 32:])          # the real window: exact
    assert not torch.equal(k_sim[:, :, 32:], k_exact[:, :, 32:])       # simulated: quantized too
    rows = k_exact[:, :, 32:].transpose(1, 2).reshape(2, 13, -1)
    expected = quant.fake_quantize(rows, "channel", 8, torch.float16)
    torch.testing.assert_close(k_sim[:, :, 32:].transpose(1, 2).reshape(2, 13, -1), expected)
    torch.testing.assert_close(k_sim[:, :, :32], k_real[:, :, :32], rtol=0, atol=1e-6)


def test_per_sequence_losses_average_to_the_loss():
    model, tokens = _model_and_tokens(batch=3)
    r = quality.compare_caches(model, tokens, 4, {"int8": dict(storage="int8")})["int8"]
    assert r["loss_exact_per_sequence"].shape == (3,)
    assert r["loss_quant_per_sequence"].mean().item() == pytest.approx(r["loss_quant"], rel=1e-5)
    assert r["loss_exact_per_sequence"].mean().item() == pytest.approx(r["loss_exact"], rel=1e-5)


def test_key_window_applies_to_integer_storage_only():
    model, tokens = _model_and_tokens()
    with pytest.raises(ValueError, match="only apply to int8 / int4"):
        quality.compare_caches(model, tokens, 4, {"fp16": dict(storage="fp16", key_window=False)})
    with pytest.raises(ValueError, match="key_granularity"):
        quality.compare_caches(model, tokens, 4, {"x": dict(storage="int8", key_window=False,
                                                            key_granularity="tensor")})


def test_the_no_window_cache_rounds_each_block_as_if_read_from_scratch():
    # It keeps what the model reads up to date block by block: the same values as rounding every
    # block (the unfinished one with the scales of its tokens so far) at each read.
    model, _ = _model_and_tokens()
    cfg, g = model.config, torch.Generator().manual_seed(2)
    cache = quality.NoWindowQuantizedKVCache(cfg, 2, 100)
    for t in (45, 1, 1, 17, 1, 20):          # a prefill, single tokens, block boundaries crossed
        k, v = (torch.randn(2, cfg.n_kv_heads, t, cfg.head_dim, generator=g) for _ in "kv")
        k_read, v_read = cache.update(0, k, v)
        n = cache.lengths[0]
        assert torch.equal(k_read, quality._fake_blocks(cache.k[0, :, :, :n], "channel", 32, 8))
        assert torch.equal(v_read, quality._fake_blocks(cache.v[0, :, :, :n], "token", 1, 8))


def test_decoding_losses_match_the_one_pass_losses_and_windows_may_come_in_batches():
    model, tokens = _model_and_tokens(batch=3, length=48)
    int4 = {"exact": None, "int4": lambda b, t: QuantizedKVCache(model.config, b, t, bits=4)}
    one_pass = quality.window_losses(model, tokens, int4, score_from=20)
    in_twos = quality.window_losses(model, tokens, int4, score_from=20, batch_size=2)
    decoded = quality.decoding_losses(model, tokens, int4, score_from=20)
    for name in int4:
        assert one_pass[name].shape == (3,)
        torch.testing.assert_close(in_twos[name], one_pass[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(decoded[name], one_pass[name], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(one_pass["int4"], one_pass["exact"], atol=1e-4)   # int4 does change it
    with pytest.raises(ValueError, match="score_from=48"):
        quality.decoding_losses(model, tokens, int4, score_from=48)


def test_t_critical_matches_the_t_table():
    for df, table in ((1, 12.706), (5, 2.571), (30, 2.042), (10_000, 1.960)):
        assert quality.t_critical(df) == pytest.approx(table, abs=1e-3)
    assert quality.t_critical(5, level=0.90) == pytest.approx(2.015, abs=1e-3)
    with pytest.raises(ValueError, match="level=1.5"):
        quality.t_critical(5, level=1.5)
    with pytest.raises(ValueError, match="df=0"):
        quality.t_critical(0)


def test_the_small_run_measures_a_calibrated_per_tensor_scale():
    tensor = quality.small_run_errors("int4", calibrated=True)
    per_channel = quality.small_run_errors("int4")
    assert tensor["k_rounding_error"] > per_channel["k_rounding_error"] > 0
    with pytest.raises(ValueError, match="storage='fp16'"):
        quality.small_run_errors("fp16", calibrated=True)
    with pytest.raises(ValueError, match="no other cache options"):
        quality.small_run_errors("int8", calibrated=True, residual=4)
