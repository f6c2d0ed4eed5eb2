"""kvlab.memory against the hand-checked values in REFERENCE.md (and the llama.cpp log)."""

import pytest
import torch

from kvlab import PRESETS
from kvlab.cache import StaticKVCache
from kvlab.config import PUBLISHED
from kvlab.memory import (
    CUDA_CONTEXT_BYTES,
    DTYPE_BITS,
    GB,
    GPUS,
    DoesNotFitError,
    GiB,
    MiB,
    current_gpu,
    format_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_elements_per_token,
    param_count,
    plan,
    require_fit,
    weight_bytes,
)

KiB = 1024
L7 = PRESETS["llama-7b"]
L70 = PRESETS["llama-2-70b"]

# REFERENCE.md, "Published model shapes": FP16 KV bytes per token, all layers.
PER_TOKEN_FP16 = {
    "llama-7b": 512 * KiB,
    "llama-13b": 800 * KiB,
    "llama-65b": 2.5 * MiB,
    "llama-2-7b": 512 * KiB,
    "llama-2-13b": 800 * KiB,
    "llama-2-70b": 320 * KiB,
    "llama-3-8b": 128 * KiB,
    "llama-3-70b": 320 * KiB,
    "llama-3.1-405b": 504 * KiB,
    "mistral-7b": 128 * KiB,
    "qwen2.5-7b": 56 * KiB,
    "qwen2.5-72b": 320 * KiB,
    "gpt2": 36 * KiB,
    "tinyllama-1.1b": 22 * KiB,
    "smollm2-135m": 22.5 * KiB,
    "deepseek-v2": 67.5 * KiB,
}


def test_every_published_preset_has_a_reference_value():
    assert sorted(PER_TOKEN_FP16) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PER_TOKEN_FP16))
def test_bytes_per_token_match_reference_table(name):
    assert kv_bytes_per_token(PRESETS[name]) == PER_TOKEN_FP16[name]
    assert kv_cache_bytes(PRESETS[name], 1) == PER_TOKEN_FP16[name]


def test_mla_caches_one_latent_per_layer():
    ds = PRESETS["deepseek-v2"]
    assert kv_elements_per_token(ds) == 60 * 576
    # REFERENCE: "cache ≈ GQA with 2.25 groups" (2 × 2.25 × 128 = 576 elements a layer).
    assert kv_elements_per_token(ds) == 60 * 2 * 2.25 * 128


def test_llama_7b_at_2048_tokens_is_1_gib_and_32_mib_per_layer():
    # The source chapter prints 16 MB / 0.5 GB: it drops the factor 2 for K and V.
    total = kv_cache_bytes(L7, 2048)
    assert total == 1 * GiB
    assert total // L7.n_layers == 32 * MiB
    assert total // 2 == 512 * MiB  # K alone: the source's figure


def test_llama_7b_at_8192_tokens_is_4_gib():
    assert kv_cache_bytes(L7, 8192) == 4 * GiB


@pytest.mark.parametrize("seq_len, gib", [(4096, 2), (32768, 16), (131072, 64)])
def test_seed_7b_sizes(seq_len, gib):
    assert kv_cache_bytes(L7, seq_len) == gib * GiB
    assert kv_cache_bytes(PRESETS["llama-2-7b"], seq_len) == gib * GiB


def test_seed_7b_cache_vs_weights_ratio_at_128k():
    cache, weights = kv_cache_bytes(L7, 131072), weight_bytes(L7)
    assert round(cache / GB, 1) == 68.7  # 64 GiB in decimal GB
    assert round(weights / GB, 1) == 13.5
    assert round(cache / weights, 1) == 5.1  # consistent units
    assert 4.5 < 64 / 14 < 4.6  # the source's "4.5×": the GiB count over the GB count


def test_llama_2_70b_with_gqa():
    assert kv_cache_bytes(L70, 4096) == 1.25 * GiB
    assert round(kv_cache_bytes(L70, 4096) / GB, 2) == 1.34
    assert kv_cache_bytes(L70, 131072) == 40 * GiB
    assert kv_cache_bytes(L70, 8192) == 2.5 * GiB
    # The source's "70B, L=80, H=64, D=128": with all 64 heads cached it would be 20 GiB at 8,192.
    assert kv_cache_bytes(L70.with_(n_kv_heads=64), 8192) == 20 * GiB


def test_llama_cpp_log_256_mb_at_n_ctx_512():
    # llama.cpp prints `kv self size = 256.00 MB` for LLaMA-7B at n_ctx = 512 (its MB are MiB).
    assert kv_cache_bytes(L7, 512) == 256 * MiB


def test_weights():
    assert round(param_count(L7) / 1e9, 2) == 6.74
    assert round(weight_bytes(L7, "fp16") / GB, 1) == 13.5
    assert round(param_count(L70) / 1e9) == 69
    assert weight_bytes(L7, "fp32") == 2 * weight_bytes(L7, "fp16") == 4 * weight_bytes(L7, "int8")
    assert param_count(PRESETS["gpt2"]) == 124_000_000  # published count, not Llama-shaped


def test_llama_7b_param_count_from_its_shape():
    d, ff, v, n = 4096, 11008, 32000, 32
    per_layer = 4 * d * d + 3 * d * ff + 2 * d
    assert param_count(L7) == n * per_layer + 2 * v * d + d == 6_738_415_616


@pytest.mark.parametrize("dtype, bits", [("fp32", 32), ("fp16", 16), ("bf16", 16), ("fp8", 8),
                                         ("int8", 8), ("int4", 4)])
def test_dtype_bytes(dtype, bits):
    assert DTYPE_BITS[dtype] == bits
    assert kv_cache_bytes(L7, 2048, dtype=dtype) == GiB * bits // 16


def test_cache_scales_linearly_with_tokens_and_batch():
    one = kv_cache_bytes(L70, 1000)
    assert kv_cache_bytes(L70, 3000, batch_size=5) == 15 * one
    assert kv_cache_bytes(L70, 0) == 0


@pytest.mark.parametrize("torch_dtype, name", [(torch.float32, "fp32"), (torch.float16, "fp16"),
                                               (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa", "tiny-mqa"])
def test_static_cache_nbytes_equals_the_formula(torch_dtype, name, preset):
    config = PRESETS[preset]
    cache = StaticKVCache(config, batch_size=3, max_seq_len=40, dtype=torch_dtype)
    assert cache.k.shape == (config.n_layers, 3, config.n_kv_heads, 40, config.head_dim)
    assert cache.nbytes == kv_cache_bytes(config, 40, batch_size=3, dtype=name)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, "fp16"])
def test_a_cache_refuses_a_dtype_that_cannot_hold_keys(dtype):
    """An integer buffer would truncate every key (0.7 -> 0): quantized storage is QuantizedKVCache."""
    with pytest.raises(ValueError, match="cannot hold keys and values; allowed: a floating-point"):
        StaticKVCache(PRESETS["tiny-mha"], batch_size=1, max_seq_len=8, dtype=dtype)


def test_static_cache_fp8_nbytes_equals_the_formula():
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("this torch has no float8")
    config = PRESETS["tiny-gqa"]
    assert StaticKVCache(config, 2, 16, dtype=fp8).nbytes == kv_cache_bytes(config, 16, 2, "fp8")


def test_gpus_table_holds_memory_as_cuda_reports_it():
    assert list(GPUS) == ["T4 16GB", "A100 40GB", "A100 80GB", "H100 80GB", "H200 141GB"]
    # nvidia-smi totals (docs/references.md): GPU memory is binary, an "80GB" card shows 80 GiB
    assert [g.nvidia_smi_mib for g in GPUS.values()] == [15_360, 40_960, 81_920, 81_559, 143_771]
    # PyTorch's total_memory, the low end of the reported ranges, a little below nvidia-smi's total
    assert [round(g.memory_bytes / GiB, 2) for g in GPUS.values()] == [14.56, 39.4, 79.15, 79.1, 139.8]
    for g in GPUS.values():
        assert 0.95 * g.nvidia_smi_mib * MiB < g.memory_bytes < g.nvidia_smi_mib * MiB
    assert GPUS["A100 80GB"].memory_bytes > 79 * GiB > 80 * GB  # not 80 decimal GB = 74.5 GiB


def test_plan_on_a100_80gb_for_llama_7b():
    p = plan(L7, "A100 80GB", 4096)
    assert p.fits and p.cache_bytes == 2 * GiB and p.weight_bytes == weight_bytes(L7)
    assert p.context_bytes == CUDA_CONTEXT_BYTES == GiB // 2
    assert p.free_for_cache == GPUS["A100 80GB"].memory_bytes - GiB // 2 - weight_bytes(L7)
    assert p.max_context == p.free_for_cache // (512 * KiB)
    assert p.max_batch == p.free_for_cache // (2 * GiB) == 33
    assert kv_cache_bytes(L7, p.max_context) <= p.free_for_cache < kv_cache_bytes(L7, p.max_context + 1)
    # One 128K conversation: 64 GiB of cache + 12.55 GiB of weights = 76.55 GiB < 78.65 GiB left.
    assert plan(L7, "A100 80GB", 131072).fits and plan(L7, "A100 80GB", 131072).max_batch == 1
    assert not plan(L7, "A100 80GB", 131072, 2).fits
    assert plan(L7, "A100 80GB", 4096, context_bytes=0).free_for_cache == p.free_for_cache + GiB // 2


def test_plan_batch_divides_the_context():
    p1, p8 = plan(L7, "H100 80GB", 1024, 1), plan(L7, "H100 80GB", 1024, 8)
    assert p8.max_context == p1.free_for_cache // (8 * 512 * KiB)
    assert p8.max_batch == p1.max_batch  # max_batch counts sequences of seq_len, whatever the batch


def test_plan_reserve_and_weight_dtype():
    p = plan(L70, "H200 141GB", 4096, reserve_fraction=0.1)
    h200 = GPUS["H200 141GB"].memory_bytes
    assert p.reserve_bytes == int(h200 * 0.1)
    assert p.free_for_cache == h200 - GiB // 2 - weight_bytes(L70) - p.reserve_bytes
    assert p.total_bytes == p.context_bytes + p.weight_bytes + p.reserve_bytes + p.cache_bytes
    assert plan(L70, "A100 80GB", 4096).free_for_cache < 0  # fp16 70B weights alone: 128 GiB
    assert plan(L70, "A100 80GB", 4096, weight_dtype="int8").fits


def test_plan_counts_half_bytes_per_token_in_int4():
    # One layer, one latent element per token: 4 bits = half a byte a token, not 0 (which divided
    # by zero) and 3 elements = 1.5 bytes, not 1 (which promised a context that does not fit).
    one = PRESETS["tiny-mha"].with_(n_layers=1, kv_latent_dim=1)
    three = one.with_(kv_latent_dim=3)
    assert kv_bytes_per_token(one, "int4") == 0.5 and kv_bytes_per_token(three, "int4") == 1.5
    assert kv_cache_bytes(three, 3, 1, "int4") == 5  # 4.5 bytes take 5
    p = plan(three, "T4 16GB", 1000, dtype="int4")
    assert p.max_context == p.free_for_cache * 8 // 12
    assert kv_cache_bytes(three, p.max_context, 1, "int4") <= p.free_for_cache
    assert plan(one, "T4 16GB", 1, dtype="int4").max_context == plan(one, "T4 16GB", 1).free_for_cache * 2


def test_a_preset_name_works_where_a_config_is_expected():
    assert kv_cache_bytes("llama-2-7b", 4096) == kv_cache_bytes(PRESETS["llama-2-7b"], 4096) == 2 * GiB
    assert plan("llama-2-7b", "A100 80GB", 4096) == plan(PRESETS["llama-2-7b"], "A100 80GB", 4096)
    assert param_count("LLaMA-2-7B") == param_count(PRESETS["llama-2-7b"])
    with pytest.raises(ValueError, match="config='llama-9b' is not allowed; allowed: 'llama-7b'"):
        kv_cache_bytes("llama-9b", 4096)
    with pytest.raises(ValueError, match="config=42 is not a ModelConfig"):
        kv_cache_bytes(42, 4096)


def test_current_gpu_reads_cuda_or_says_there_is_none():
    if torch.cuda.is_available():
        g = current_gpu()
        free, total = torch.cuda.mem_get_info()
        assert g.memory_bytes == total and plan(L7, g, 1024).gpu is g
    else:
        with pytest.raises(ValueError, match="needs a CUDA GPU and none is available"):
            current_gpu()


@pytest.mark.parametrize("name, gib, bandwidth", [
    ("NVIDIA H100 PCIe", 79.2, 2.0e12),            # not the SXM part's 3.35 TB/s
    ("NVIDIA H100 80GB HBM3", 79.1, 3.35e12),
    ("NVIDIA A100 80GB PCIe", 79.15, 1935e9),      # not the SXM part's 2,039 GB/s
    ("NVIDIA GH200 480GB", 94.5, None),            # unknown: nan, not the H200's figure
])
def test_current_gpu_takes_the_bandwidth_of_the_model_its_full_name_and_memory_identify(
        monkeypatch, name, gib, bandwidth):
    total = round(gib * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total // 2, total))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    g = current_gpu()
    assert g.name == name and g.memory_bytes == total
    if bandwidth is None:
        assert g.bandwidth_bytes_per_s != g.bandwidth_bytes_per_s  # nan
    else:
        assert g.bandwidth_bytes_per_s == bandwidth


def test_weights_alone_do_not_fit():
    p = plan(PRESETS["llama-3.1-405b"], "T4 16GB", 128)
    assert not p.fits and p.free_for_cache < 0 and p.max_context == 0 and p.max_batch == 0


def test_require_fit_returns_the_plan_or_refuses_clearly():
    assert require_fit(L7, "A100 80GB", 4096) == plan(L7, "A100 80GB", 4096)
    with pytest.raises(DoesNotFitError) as err:
        require_fit(L7, "A100 80GB", 262144)
    msg = str(err.value)
    for part in ("llama-7b", "seq_len=262,144", "128.00 GiB", "A100 80GB (79.15 GiB)",
                 "CUDA context (0.50 GiB)", "12.55 GiB of weights", "longest context at this batch: "
                 f"{plan(L7, 'A100 80GB', 1).max_context:,} tokens", "most sequences of this length: 0"):
        assert part in msg, (part, msg)
    assert isinstance(err.value, ValueError)


def test_require_fit_refuses_when_the_weights_alone_do_not_fit():
    with pytest.raises(DoesNotFitError, match=r"T4 16GB \(14\.56 GiB\) has 0\.00 GiB left after "
                                              r"the CUDA context \(0\.50 GiB\), 755\.96 GiB"):
        require_fit(PRESETS["llama-3.1-405b"], "T4 16GB", 128)


@pytest.mark.parametrize("kwargs, message", [
    ({"seq_len": -1}, "seq_len=-1 must be an integer >= 0"),
    ({"seq_len": 2.5}, "seq_len=2.5 must be an integer >= 0"),
    ({"seq_len": 10, "batch_size": 0}, "batch_size=0 must be an integer >= 1"),
    ({"seq_len": 10, "batch_size": True}, "batch_size=True must be an integer >= 1"),
    ({"seq_len": 10, "dtype": "fp64"}, "dtype='fp64' is not supported; allowed: fp32, fp16, bf16, fp8"),
])
def test_bad_inputs_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        kv_cache_bytes(L7, **kwargs)


def test_bad_plan_inputs():
    with pytest.raises(ValueError, match=r"gpu='V100' is not allowed; allowed: 'T4 16GB', 'A100 40GB'"):
        plan(L7, "V100", 128)
    with pytest.raises(ValueError, match=r"reserve_fraction=1\.0 must be a number in \[0, 1\)"):
        plan(L7, "T4 16GB", 128, reserve_fraction=1.0)
    with pytest.raises(ValueError, match="dtype='int3'"):
        weight_bytes(L7, "int3")
    with pytest.raises(ValueError, match=r"seq_len=0 must be an integer in \[1, 1099511627776\]"):
        plan(L7, "T4 16GB", 0)
    with pytest.raises(ValueError, match=r"reserve_fraction=nan must be a finite number in \[0, 1\)"):
        plan(L7, "T4 16GB", 128, reserve_fraction=float("nan"))
    with pytest.raises(ValueError, match=r"dtype=\['fp16'\] is not supported"):
        kv_cache_bytes(L7, 128, dtype=["fp16"])


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (512 * KiB, "512.00 KiB"),
                                     (32 * MiB, "32.00 MiB"), (GiB, "1.00 GiB"),
                                     (80 * GB, "74.51 GiB"), (512 * 1024**4, "512.00 TiB"),
                                     (-2 * GiB, "-2.00 GiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_format_bytes_refuses_non_numbers():
    with pytest.raises(ValueError, match="n='1 GiB' must be a finite number"):
        format_bytes("1 GiB")
