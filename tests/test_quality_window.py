"""kvlab.quality: the no-window simulation of a quantized cache and the per-sequence losses."""

import pytest
import torch

from kvlab import PRESETS, quality, quant
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
