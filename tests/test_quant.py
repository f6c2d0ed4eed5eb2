from types import SimpleNamespace

import pytest
import torch

from kvlab import PRESETS, quality, quant
from kvlab.cache import CACHE_KINDS, QuantizedKVCache, StaticKVCache, make_cache, quantized_cache_bytes
from kvlab.generate import generate
from kvlab.model import Transformer

CFG = PRESETS["tiny-mha"]  # 2 layers, 4 KV heads, head_dim 16


def outlier_keys(tokens=64, channels=64, seed=0):
    """Keys shaped like real ones: a few channels much larger than the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, channels, generator=g)
    x[..., 17] *= 30
    return x


@pytest.mark.parametrize("granularity", quant.GRANULARITIES)
@pytest.mark.parametrize("bits", quant.BITS)
def test_round_trip_error_is_at_most_half_a_scale(granularity, bits):
    x = outlier_keys()
    q = quant.quantize(x, granularity, bits)
    assert q.data.dtype == torch.int8 and q.data.shape == x.shape
    assert int(q.data.abs().max()) <= quant.qmax(bits)
    err = (x - q.dequantize()).abs()
    assert torch.all(err <= q.scale.float() / 2 * (1 + 1e-5) + 1e-12)


def test_scale_shapes_follow_the_granularity():
    x = torch.randn(3, 5, 7)
    assert quant.quantize(x, "tensor").scale.shape == (1, 1, 1)
    assert quant.quantize(x, "token").scale.shape == (3, 5, 1)
    assert quant.quantize(x, "channel").scale.shape == (3, 1, 7)
    assert quant.qmax(8) == 127 and quant.qmax(4) == 7


def test_scales_in_fp16_keep_the_bound_and_halve_their_bytes():
    x = outlier_keys()
    q32, q16 = quant.quantize(x, "token"), quant.quantize(x, "token", scale_dtype=torch.float16)
    assert q16.scale.dtype == torch.float16 and q16.scale.nbytes * 2 == q32.scale.nbytes
    assert torch.all((x - q16.dequantize()).abs() <= q16.scale.float() / 2 * (1 + 1e-3))


def test_per_channel_beats_per_token_and_per_tensor_on_outlier_channels():
    x = outlier_keys()
    err = {g: quant.relative_rms_error(x, quant.fake_quantize(x, g)) for g in quant.GRANULARITIES}
    assert err["channel"] < err["token"] / 2
    assert err["channel"] < err["tensor"] / 2
    normal = [c for c in range(x.shape[-1]) if c != 17]  # the small channels suffer most
    err = {g: quant.relative_rms_error(x[..., normal], quant.fake_quantize(x, g)[..., normal])
           for g in quant.GRANULARITIES}
    assert err["channel"] < err["token"] / 10


def test_int4_is_coarser_than_int8_and_packs_two_a_byte():
    x = outlier_keys()
    e8 = quant.relative_rms_error(x, quant.fake_quantize(x, "channel", 8))
    e4 = quant.relative_rms_error(x, quant.fake_quantize(x, "channel", 4))
    assert e4 > 5 * e8
    codes = quant.quantize(x, "channel", 4).data
    packed = quant.pack_int4(codes)
    assert packed.dtype == torch.int8 and packed.numel() * 2 == codes.numel()
    assert torch.equal(quant.unpack_int4(packed), codes)
    q = quant.quantize(x, "token", 4)
    assert q.nbytes == x.numel() // 2 + q.scale.nbytes


def test_zeros_quantize_to_zeros():
    x = torch.zeros(2, 4, 8)
    for g in quant.GRANULARITIES:
        assert torch.equal(quant.fake_quantize(x, g), x)
    assert quant.relative_rms_error(x, x) == 0 and quant.snr_db(x, x) == float("inf")


def test_error_metrics_on_a_known_example():
    x = torch.tensor([3.0, 4.0])
    y = torch.tensor([3.0, 4.5])
    assert quant.max_abs_error(x, y) == pytest.approx(0.5)
    assert quant.relative_rms_error(x, y) == pytest.approx(0.1)
    assert quant.snr_db(x, y) == pytest.approx(20.0)
    assert quant.cosine_similarity(x, 2 * x) == pytest.approx(1.0)
    assert set(quant.error_report(x, y)) == {"max_abs_error", "relative_rms_error", "snr_db",
                                             "cosine_similarity"}


@pytest.mark.parametrize("kwargs, match", [
    (dict(granularity="row"), "granularity='row' is not known; allowed: 'tensor', 'token', 'channel'"),
    (dict(bits=3), "bits=3 is not supported; allowed: 8, 4"),
    (dict(bits=True), "bits=True"),
])
def test_bad_arguments_are_refused_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quant.quantize(torch.randn(4, 4), **kwargs)


def test_bad_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="floating-point"):
        quant.quantize(torch.ones(4, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens, channels"):
        quant.quantize(torch.randn(8), "channel")
    with pytest.raises(ValueError, match="even last dim"):
        quant.pack_int4(torch.zeros(3, dtype=torch.int8))


# --- QuantizedKVCache -----------------------------------------------------------------------------

def kv(t, batch=1, cfg=CFG):
    shape = (batch, cfg.n_kv_heads, t, cfg.head_dim)
    return torch.randn(shape), torch.randn(shape)


@pytest.mark.parametrize("kwargs", [dict(), dict(residual=5), dict(group_size=4),
                                    dict(key_granularity="tensor", value_granularity="channel"),
                                    dict(key_granularity="token", bits=4)])
def test_quantized_cache_reads_back_what_was_stored_within_tolerance(kwargs):
    cache = QuantizedKVCache(CFG, 2, 100, **kwargs)
    ks, vs = [], []
    for t in (13, 1, 1, 20, 1, 7):  # a prefill, then decode steps and chunks
        k, v = kv(t, batch=2)
        ks.append(k)
        vs.append(v)
        returned, _ = cache.update(0, k, v)
        # what attention reads: every position as held now, then (for a chunk of several tokens
        # that completes blocks) the views its earlier queries need; read() gives the first part
        assert torch.equal(returned[:, :, :cache.lengths[0]], cache.read(0)[0])
    k_all, v_all = cache.read(0)
    k_ref, v_ref = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    assert k_all.shape == k_ref.shape and k_all.dtype == torch.float32
    assert cache.lengths[0] == 43
    tol = 0.6 if kwargs.get("bits") == 4 else 0.06  # half a scale: absmax of normals / 2qmax
    assert (k_all - k_ref).abs().max() < tol and (v_all - v_ref).abs().max() < tol
    assert quant.relative_rms_error(v_ref, v_all) > 0  # it really was quantized


def test_the_newest_unfinished_key_block_and_the_residual_window_are_exact():
    cache = QuantizedKVCache(CFG, 1, 100, group_size=8, residual=3)
    k, v = kv(21)
    cache.update(0, k, v)
    k_all, v_all = cache.read(0)  # as held after the pass
    # keys: 21 - 3 = 18 tokens could be quantized, in whole blocks of 8: 16; the last 5 are exact
    assert torch.equal(k_all[:, :, 16:], k[:, :, 16:]) and not torch.equal(k_all[:, :, :16], k[:, :, :16])
    # values (per token): everything but the 3 most recent is quantized
    assert torch.equal(v_all[:, :, 18:], v[:, :, 18:]) and not torch.equal(v_all[:, :, 17], v[:, :, 17])


def test_quantized_cache_bytes_are_about_half_of_fp16():
    cfg = CFG.with_(max_seq_len=4096)
    for seq in (2048, 4096):
        q = QuantizedKVCache(cfg, 1, seq, dtype=torch.float16)
        fp16 = StaticKVCache(cfg, 1, seq, dtype=torch.float16)
        assert 0.5 * fp16.nbytes < q.nbytes <= 0.55 * fp16.nbytes
    # the codes alone are exactly half; scales: fp16, one per token for V, one per channel per block
    width, layers = cfg.n_kv_heads * cfg.head_dim, cfg.n_layers
    expected = layers * (2 * 4096 * width + 4096 * 2 + 4096 // 32 * width * 2 + 31 * width * 2)
    assert q.nbytes == expected
    q4 = QuantizedKVCache(cfg, 1, 4096, dtype=torch.float16, bits=4)
    assert q4.nbytes < 0.3 * fp16.nbytes


def test_quantized_cache_has_the_cache_interface_and_errors():
    cache = make_cache("int8", CFG, 1, 10)
    assert CACHE_KINDS["int8"] is QuantizedKVCache and isinstance(cache, QuantizedKVCache)
    assert cache.seq_len == 0
    for layer in range(CFG.n_layers):
        cache.update(layer, *kv(10))
    assert cache.seq_len == 10
    with pytest.raises(ValueError, match="cache is full: 10 of 10 positions used, 1 more requested"):
        cache.update(0, *kv(1))
    with pytest.raises(IndexError, match="layer=2 out of range"):
        cache.update(2, *kv(1))
    cache.reset()
    assert cache.seq_len == 0
    cache.update(0, *kv(4))


@pytest.mark.parametrize("kwargs, match", [
    (dict(key_granularity="block"), "granularity='block' is not allowed"),
    (dict(bits=2), "bits=2 is not supported"),
    (dict(group_size=0), "group_size=0 must be an integer >= 1"),
    (dict(residual=-1), "residual=-1 must be an integer >= 0"),
])
def test_quantized_cache_refuses_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizedKVCache(CFG, 1, 10, **kwargs)


def teacher_forced_logits(model, tokens, cache, prompt_len):
    """Logits of every position, fed through `cache` as a prefill then one token a step."""
    with torch.no_grad():
        out = [model(tokens[:, :prompt_len], cache=cache)]
        out += [model(tokens[:, i:i + 1], cache=cache) for i in range(prompt_len, tokens.shape[1])]
    return torch.cat(out, dim=1)


def assert_same_greedy_tokens_within_tolerance(model, prompt, new_tokens):
    cfg = model.config
    ref = generate(model, prompt, new_tokens, cache="static").tokens
    total = ref.shape[1] - 1
    a = teacher_forced_logits(model, ref[:, :-1], StaticKVCache(cfg, ref.shape[0], total), prompt.shape[1])
    b = teacher_forced_logits(model, ref[:, :-1], QuantizedKVCache(cfg, ref.shape[0], total),
                              prompt.shape[1])
    err = (a - b).abs().max()
    assert err < 0.05 * a.std()
    # Greedy picks may differ only where the FP top two were closer than the quantization error.
    top2 = a.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    differ = a.argmax(-1) != b.argmax(-1)
    assert torch.all(margin[differ] <= 2 * err)
    assert differ.float().mean() < 0.05


def test_quantized_cache_gives_the_same_greedy_tokens_on_a_random_model():
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    prompt = torch.randint(0, CFG.vocab_size, (2, 16))
    assert_same_greedy_tokens_within_tolerance(model, prompt, 80)


def test_quantized_cache_gives_the_same_greedy_tokens_on_kvlab_tiny():
    from kvlab import pretrained
    from kvlab.generate import encode_bytes

    model = pretrained.load("kvlab-tiny")  # ships with the package: a missing checkpoint is a failure
    prompt = torch.tensor([encode_bytes("The KV cache stores ")])
    assert_same_greedy_tokens_within_tolerance(model, prompt, 100)
    # and through generate() itself: greedy text agrees for a modest length
    fp = generate(model, prompt, 60, cache="static").new_tokens
    q = generate(model, prompt, 60, cache="int8").new_tokens
    assert (fp == q).float().mean() >= 0.9


def test_generate_accepts_cache_int8():
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    out = generate(model, [1, 2, 3, 4], 10, cache="int8")
    assert out.tokens.shape == (1, 14)


@pytest.mark.parametrize("kwargs", [dict(), dict(bits=4, residual=7, key_granularity="tensor"),
                                    dict(value_granularity="channel", group_size=5)])
@pytest.mark.parametrize("seq", [1, 100, 2048])
def test_quantized_cache_bytes_formula_matches_the_cache(kwargs, seq):
    cache = QuantizedKVCache(CFG, 2, seq, dtype=torch.float16, **kwargs)
    assert quantized_cache_bytes(CFG, seq, 2, **kwargs) == cache.nbytes


def test_measure_cache_error_is_zero_for_fp32_and_small_for_int8():
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    tokens = torch.randint(0, CFG.vocab_size, (2, 40))
    exact = quality.measure_cache_error(model, tokens, 8, storage="fp32")
    assert exact["k_relative_rms_error"] == 0 and exact["logits_max_abs_error"] == 0
    assert exact["top1_agreement"] == 1.0 and exact["loss_exact"] == exact["loss_quant"]
    r8 = quality.measure_cache_error(model, tokens, 8, storage="int8")
    r4 = quality.measure_cache_error(model, tokens, 8, storage="int4")
    f16 = quality.measure_cache_error(model, tokens, 8, storage="fp16")
    assert 0 < f16["k_relative_rms_error"] < r8["k_relative_rms_error"] < 0.02 < r4["k_relative_rms_error"]
    assert r8["logits_relative_rms_error"] < r4["logits_relative_rms_error"]
    with pytest.raises(ValueError, match="storage='int3' is not allowed"):
        quality.measure_cache_error(model, tokens, 8, storage="int3")
    with pytest.raises(ValueError, match="only apply to int8 / int4"):
        quality.measure_cache_error(model, tokens, 8, storage="fp16", group_size=4)


def test_compare_caches_labels_each_setting_and_counts_its_bytes():
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    tokens = torch.randint(0, CFG.vocab_size, (1, 24))
    out = quality.compare_caches(model, tokens, 4, {"kivi": dict(storage="int8"),
                                                    "per-token K": dict(storage="int8",
                                                                        key_granularity="token")})
    assert set(out) == {"kivi", "per-token K"}
    assert out["kivi"]["cache_nbytes"] == quantized_cache_bytes(CFG, 24, window_bytes=4, scale_bytes=2)
    assert out["kivi"]["tokens"] == 23 and 0 < out["kivi"]["top1_agreement"] <= 1


def test_the_layout_is_worked_out_once():
    from kvlab.cache.quantized import quantized_layout

    layout = quantized_layout(CFG, 100, "channel", bits=4, group_size=32, residual=5)
    assert (layout.width, layout.code_width, layout.n_blocks, layout.scale_width) == (64, 32, 4, 64)
    assert layout.window_capacity == 5 + 31  # the residual window plus an unfinished block
    cache = QuantizedKVCache(CFG, 1, 100, bits=4, residual=5)
    assert cache.sides["k"].layout == layout
    assert cache.sides["k"].codes.shape[-1] == layout.code_width
    odd = SimpleNamespace(n_kv_heads=1, head_dim=3)  # no valid ModelConfig is odd (RoPE pairs)
    with pytest.raises(ValueError, match="n_kv_heads × head_dim = 3 must be even"):
        quantized_layout(odd, 8, "token", 4)


# --- refusals: bad scales, groups and shapes name the value and what is allowed ------------------

def test_quantized_refuses_a_scale_of_the_wrong_shape_or_kind():
    x = outlier_keys()
    q = quant.quantize(x, "channel")
    assert quant.Quantized(q.data, q.scale.half(), 8, "channel").dequantize().shape == x.shape
    with pytest.raises(ValueError, match=r"shape \(2, 64, 1\); allowed: \(2, 1, 64\)"):
        quant.Quantized(q.data, q.scale.transpose(-1, -2), 8, "channel")
    with pytest.raises(ValueError, match="real floating-point.*complex64"):
        quant.Quantized(q.data, q.scale.to(torch.complex64), 8, "channel")
    with pytest.raises(ValueError, match="finite and >= 0"):
        quant.Quantized(q.data, -q.scale, 8, "channel")
    with pytest.raises(ValueError, match="int8 codes; got dtype torch.float32"):
        quant.Quantized(q.data.float(), q.scale, 8, "channel")
    with pytest.raises(ValueError, match=r"codes reach 127, beyond ±7"):
        quant.Quantized(q.data, q.scale, 4, "channel")
    with pytest.raises(ValueError, match="granularity='row' is not known"):
        quant.Quantized(q.data, q.scale, 8, "row")
    with pytest.raises(ValueError, match="needs a kvlab.quant.Quantized"):
        quant.dequantize((q.data, q.scale))


def test_check_scale_refuses_sparse_meta_and_non_broadcasting_scales():
    x = torch.randn(3, 5, 8)
    assert quant.check_scale(0.5, x).shape == ()
    for bad, message in ((torch.ones(3, 5, 8).to_sparse(), "dense"),
                         (torch.ones(1, device="meta"), "dense"),
                         (torch.ones(4, 1, 1), r"does not broadcast against x of shape \(3, 5, 8\)"),
                         (torch.ones(3, 5, 8, 1), "does not broadcast"),
                         (torch.tensor([float("nan")]), "finite"),
                         (torch.ones(2, dtype=torch.int32), "real floating-point"), ("0.5", "torch.Tensor")):
        with pytest.raises(ValueError, match=message):
            quant.check_scale(bad, x)


@pytest.mark.parametrize("fmt, limit, worst", [("e4m3", 448.0, 2 ** -4), ("e5m2", 57344.0, 2 ** -3)])
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_round_trip_keeps_the_formats_relative_precision(fmt, limit, worst, per_head):
    x = torch.randn(2, 3, 40, 16, generator=torch.Generator().manual_seed(1))
    scale = quant.fp8_scale(x, fmt, per_head)
    assert quant.fp8_max(fmt) == limit
    assert scale.shape == ((1, 3, 1, 1) if per_head else (1, 1, 1, 1))
    codes = quant.to_fp8(x, scale, fmt)
    assert codes.element_size() == 1 and codes.dtype == quant.FP8_FORMATS[fmt]
    y = quant.from_fp8(codes, scale)
    normal = x.abs() / scale > 2 ** -6        # above the format's subnormals: relative precision holds
    # within half the spacing 2^-m of m mantissa bits
    assert torch.all(((x - y).abs() / x.abs())[normal] <= worst + 1e-6)
    # beyond the calibrated range: saturated to the largest value, never inf
    big = quant.fake_quantize_fp8(x * 1000, scale, fmt)
    assert torch.isfinite(big).all() and big.abs().max() <= limit * scale.max() * (1 + 1e-6)


def test_fp8_refuses_unknown_formats_and_zero_scales():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="fmt='e3m4'.*'e4m3', 'e5m2'"):
        quant.to_fp8(x, 1.0, "e3m4")
    with pytest.raises(ValueError, match="> 0 for FP8"):
        quant.to_fp8(x, 0.0)
    with pytest.raises(ValueError, match="per_head=True needs"):
        quant.fp8_scale(x, per_head=True)
    with pytest.raises(ValueError, match="FP8 tensor"):
        quant.from_fp8(x, 1.0)


@pytest.mark.parametrize("bits", quant.MINMAX_BITS)
@pytest.mark.parametrize("granularity, group_size", [("token", None), ("token", 16), ("channel", None)])
def test_minmax_error_is_within_half_a_step(bits, granularity, group_size):
    x = outlier_keys() + 3.0                    # not centred on zero: the zero point pays off
    y = quant.fake_quantize_minmax(x, bits, granularity, group_size)
    dim = -1 if granularity == "token" else -2
    groups = x if granularity == "channel" else x.reshape(*x.shape[:-1], -1, group_size or x.shape[-1])
    step = (groups.amax(dim, keepdim=True) - groups.amin(dim, keepdim=True)) / (2 ** bits - 1)
    bound = (step / 2 * 1.002 + groups.abs().amax(dim, keepdim=True) * 2 ** -11).expand_as(groups)
    assert torch.all((x - y).abs() <= bound.reshape(x.shape))
    assert len(torch.unique(y[0, :, 0] if granularity == "channel" else y[0, 0])) <= 2 ** bits * 4


def test_minmax_beats_absmax_at_the_same_bits_on_values_off_centre():
    x = torch.rand(64, 32, generator=torch.Generator().manual_seed(2)) + 1.0   # all in [1, 2]
    asym = quant.relative_rms_error(x, quant.fake_quantize_minmax(x, 4, "token"))
    sym = quant.relative_rms_error(x, quant.fake_quantize(x, "token", 4))
    assert asym < sym / 3


def test_minmax_refuses_bad_bits_and_groups():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="bits=3 is not supported; allowed: 2, 4, 8"):
        quant.fake_quantize_minmax(x, 3)
    with pytest.raises(ValueError, match="group_size=24 does not divide the 64 channels"):
        quant.fake_quantize_minmax(x, 2, "token", 24)
    with pytest.raises(ValueError, match="group_size"):
        quant.fake_quantize_minmax(x, 2, "token", 0)
    with pytest.raises(ValueError, match="group_size applies to granularity='token'"):
        quant.fake_quantize_minmax(x, 2, "channel", 32)
    with pytest.raises(ValueError, match="granularity='tensor'"):
        quant.fake_quantize_minmax(x, 2, "tensor")
    with pytest.raises(ValueError, match=r"needs a \(\.\.\., tokens, channels\) tensor"):
        quant.fake_quantize_minmax(torch.randn(8), 2, "token")


# --- quality: FP8 with fixed scales and KIVI's 2-bit, measured like the int8 cache -----------------

def _tiny_model():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def _decoded_one_at_a_time(model, ids, cache, prompt=8):
    with torch.inference_mode():
        steps = [model(ids[:, :prompt], cache=cache)]
        steps += [model(ids[:, i:i + 1], cache=cache) for i in range(prompt, ids.shape[1])]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("residual", [0, 16])
def test_kivi_cache_gives_the_same_logits_in_one_pass_as_decoding(residual):
    model = _tiny_model()
    ids = torch.randint(0, CFG.vocab_size, (2, 80), generator=torch.Generator().manual_seed(3))
    make = lambda: quality.KIVIKVCache(CFG, 2, 80, group_size=8, residual=residual)  # noqa: E731
    with torch.inference_mode():
        one_pass = model(ids, cache=make())
        exact = model(ids)
    torch.testing.assert_close(one_pass, _decoded_one_at_a_time(model, ids, make()), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(one_pass, exact, atol=1e-3)     # 2 bits do change the logits
    k, v = make().read(0)
    assert k.shape[2] == 0 and v.shape[2] == 0


def test_kivi_cache_keeps_the_residual_exact_and_rounds_older_values():
    cache = quality.KIVIKVCache(CFG, 1, 64, group_size=8, residual=16)
    k = torch.randn(1, CFG.n_kv_heads, 40, CFG.head_dim)
    v = torch.randn(1, CFG.n_kv_heads, 40, CFG.head_dim)
    cache.update(0, k, v)
    k_read, v_read = cache.read(0)
    assert torch.equal(v_read[:, :, -16:], v[:, :, -16:])
    assert torch.equal(k_read[:, :, -16:], k[:, :, -16:])
    assert not torch.equal(v_read[:, :, :24], v[:, :, :24])
    assert not torch.equal(k_read[:, :, :24], k[:, :, :24])
    assert len(torch.unique(k_read[0, 0, :8, 0])) <= 4                 # 2 bits: at most 4 levels
    assert cache.format_nbytes == quality.kivi_cache_bytes(CFG, 64, 1, 2, 8, 16)


def test_fixed_scale_cache_rounds_each_token_on_arrival_and_saturates():
    model = _tiny_model()
    calib = torch.randint(0, CFG.vocab_size, (1, 48), generator=torch.Generator().manual_seed(4))
    ka, va = quality.kv_absmax(model, calib, per_head=True)
    assert ka.shape == (CFG.n_layers, CFG.n_kv_heads, 1, 1)
    cache = quality.FixedScaleKVCache(CFG, 1, 16, fmt="e4m3", k_absmax=ka, v_absmax=va)
    k = torch.randn(1, CFG.n_kv_heads, 4, CFG.head_dim) * ka[0].max()
    k_read, _ = cache.update(0, k * 10, k)
    assert k_read.abs().amax(dim=(0, 2, 3)).tolist() == pytest.approx(ka[0].flatten().tolist(), rel=1e-6)
    assert cache.format_nbytes == 2 * CFG.n_layers * 16 * CFG.n_kv_heads * CFG.head_dim + 4 * 2 * ka.numel()
    with pytest.raises(ValueError, match=r"k_absmax has shape \(3, 1, 1, 1\); allowed: \(2, 1 or 4, 1, 1\)"):
        quality.FixedScaleKVCache(CFG, 1, 16, fmt="e5m2", k_absmax=torch.ones(3, 1, 1, 1), v_absmax=va)
    with pytest.raises(ValueError, match="fmt='int3'"):
        quality.FixedScaleKVCache(CFG, 1, 16, fmt="int3", k_absmax=ka, v_absmax=va)


@pytest.mark.parametrize("fmt, q", [("int8", 127), ("int4", 7)])
def test_fixed_scale_integer_cache_uses_one_calibrated_scale_per_layer(fmt, q):
    ka, va = torch.full((CFG.n_layers, 1, 1, 1), 2.0), torch.full((CFG.n_layers, 1, 1, 1), 4.0)
    cache = quality.FixedScaleKVCache(CFG, 1, 16, fmt=fmt, k_absmax=ka, v_absmax=va)
    k = torch.randn(1, CFG.n_kv_heads, 5, CFG.head_dim, generator=torch.Generator().manual_seed(7))
    k_read, v_read = cache.update(0, k, 3 * k)
    torch.testing.assert_close(k_read, torch.round(k / (2.0 / q)).clamp(-q, q) * (2.0 / q))
    assert len(torch.unique(v_read)) <= 2 * q + 1                       # one grid for the tensor
    numbers = 2 * CFG.n_layers * 16 * CFG.n_kv_heads * CFG.head_dim
    assert cache.format_nbytes == numbers // (8 // (4 if fmt == "int4" else 8)) + 4 * 2 * CFG.n_layers


def test_window_losses_match_teacher_forced_decoding_and_pair_the_windows():
    model = _tiny_model()
    ids = torch.randint(0, CFG.vocab_size, (3, 48), generator=torch.Generator().manual_seed(5))
    losses = quality.window_losses(model, ids, {"exact": None,
                                                "int4": lambda b, t: QuantizedKVCache(CFG, b, t, bits=4)})
    forced = quality.compare_caches(model, ids, 8, {"int4": dict(storage="int4")})["int4"]
    torch.testing.assert_close(losses["int4"], forced["loss_quant_per_sequence"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses["exact"], forced["loss_exact_per_sequence"], rtol=1e-4, atol=1e-5)
    d, se = quality.paired_change(losses["int4"], losses["exact"])
    assert d == pytest.approx((losses["int4"] - losses["exact"]).mean().item()) and se > 0
    with pytest.raises(ValueError, match="2 or more windows"):
        quality.paired_change(losses["int4"][:1], losses["exact"][:1])


def test_compare_caches_separates_a_caches_own_rounding_from_what_earlier_layers_carry():
    model = _tiny_model()
    ids = torch.randint(0, CFG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(6))
    r = quality.compare_caches(model, ids, 8, {"int8": dict(storage="int8", key_granularity="token")})["int8"]
    assert 0 < r["v_rounding_error"] < 0.02 and 0 < r["k_rounding_error"] < 0.02
    # against the exact run, layer 1 also carries what layer 0's rounding changed
    assert r["v_relative_rms_error"] > r["v_rounding_error"]
