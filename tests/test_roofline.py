"""kvlab.roofline: the memory roof reproduces the published bounds, the compute roof and the ridge
point follow from their definitions, and the memory-bound batch is where the two roofs cross."""

import pytest

from kvlab import PRESETS, memory, roofline

LLAMA = PRESETS["llama-2-7b"]


def test_memory_roof_reproduces_the_published_bounds():
    # REFERENCE.md: Llama-2-7B FP16, batch 1: T4 ≈ 24 tok/s, A100-80 ≈ 151, H100 ≈ 249. Those divide
    # the bandwidth by all the weights; a step reads one row of the input embedding, not its 32,000,
    # so kvlab's bound is 2 % higher (as gpt-fast, whose model size leaves out nn.Embedding).
    table = 32000 * 4096 * 2
    for name, published in (("T4 16GB", 24), ("A100 80GB", 151), ("H100 80GB", 249)):
        bw = memory.GPUS[name].bandwidth_bytes_per_s
        assert round(bw / memory.weight_bytes(LLAMA)) == published
        bound = roofline.roofline(LLAMA, bw).tokens_per_s
        assert bound == pytest.approx(bw / (memory.weight_bytes(LLAMA) - table + 4096 * 2))
        assert 1.01 < bound / (bw / memory.weight_bytes(LLAMA)) < 1.03


def test_bytes_per_step_are_the_weights_plus_the_cache_read():
    r = roofline.roofline(LLAMA, 1e12, context=4096, batch_size=2)
    unread_embedding_rows = (32000 - 2) * 4096 * 2          # each of the 2 sequences looks up one row
    assert r.bytes_per_step == (memory.weight_bytes(LLAMA) - unread_embedding_rows
                                + memory.kv_cache_bytes(LLAMA, 4096, 2))
    assert r.bytes_per_step == roofline.decode_step_bytes(LLAMA, 4096, 2)
    assert r.tokens_per_s == pytest.approx(2 / r.seconds_per_step)
    assert r.bound == "memory" and r.compute_seconds == 0  # no peak given: only the memory roof
    with pytest.raises(ValueError, match=r"bandwidth_bytes_per_s=0\S* must be a number > 0"):
        roofline.roofline(LLAMA, 0)


def test_flops_are_two_per_parameter_plus_attention_over_the_cache():
    params = memory.param_count(LLAMA) - 32000 * 4096      # the embedding lookup does no arithmetic
    assert roofline.decode_step_flops(LLAMA, 0) == 2 * params
    # q·Kᵀ and the weighted sum of V: 2 × 2 FLOPs per layer, head, head dim and cached position.
    extra = roofline.decode_step_flops(LLAMA, 1000) - roofline.decode_step_flops(LLAMA, 0)
    assert extra == 4 * 32 * 32 * 128 * 1000
    one = roofline.decode_step_flops(LLAMA, 1000)
    assert roofline.decode_step_flops(LLAMA, 1000, batch_size=3) == 3 * one
    with pytest.raises(ValueError, match="context=-1"):
        roofline.decode_step_flops(LLAMA, -1)


def test_batch_one_fp16_decoding_does_about_one_flop_per_byte():
    r = roofline.roofline(LLAMA, 2e12, peak_flops_per_s=312e12)
    assert r.arithmetic_intensity == pytest.approx(1.0, rel=0.01)  # 2 FLOPs per 2-byte weight
    assert r.bound == "memory" and r.memory_seconds > 100 * r.compute_seconds


def test_ridge_point_and_the_batch_where_decoding_turns_compute_bound():
    a100 = memory.GPUS["A100 80GB"]
    peak = roofline.PEAK_FP16_FLOPS["A100 80GB"]
    ridge = roofline.ridge_point(peak, a100.bandwidth_bytes_per_s)
    assert ridge == pytest.approx(312e12 / 2039e9) and 150 < ridge < 160
    b = roofline.memory_bound_batch(LLAMA, peak, a100.bandwidth_bytes_per_s)
    assert b is not None
    below = roofline.roofline(LLAMA, a100.bandwidth_bytes_per_s, 0, b - 1, peak_flops_per_s=peak)
    at = roofline.roofline(LLAMA, a100.bandwidth_bytes_per_s, 0, b, peak_flops_per_s=peak)
    assert below.bound == "memory" and at.arithmetic_intensity >= ridge > below.arithmetic_intensity
    # With no context the intensity is about the batch size, so the crossing is near the ridge point.
    assert abs(b - ridge) < 0.05 * ridge


def test_a_long_context_cache_keeps_decoding_memory_bound_at_any_batch():
    # Llama-2-7B (MHA) at 32K tokens: each sequence's cache (16 GiB) costs more bytes than its FLOPs cover.
    a100 = memory.GPUS["A100 80GB"]
    assert roofline.memory_bound_batch(LLAMA, 312e12, a100.bandwidth_bytes_per_s, context=32768) is None


def test_achieved_fraction_is_bytes_moved_per_second_over_bandwidth():
    r = roofline.roofline(LLAMA, 1e12, context=100)
    assert roofline.achieved_fraction(LLAMA, r.tokens_per_s, 1e12, 100) == pytest.approx(1.0)
    assert roofline.achieved_fraction(LLAMA, r.tokens_per_s / 2, 1e12, 100) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="tokens_per_s=-1"):
        roofline.achieved_fraction(LLAMA, -1, 1e12, 100)


def test_the_peak_table_covers_only_known_gpus():
    assert set(roofline.PEAK_FP16_FLOPS) <= set(memory.GPUS)
    with pytest.raises(ValueError, match="peak_flops_per_s=0"):
        roofline.roofline(LLAMA, 1e12, peak_flops_per_s=0)


def test_tied_embeddings_are_read_whole_as_the_output_layer():
    tied = LLAMA.with_(tie_embeddings=True)
    assert roofline.decode_step_bytes(tied, 0) == memory.weight_bytes(tied)
    assert roofline.decode_step_flops(tied, 0) == 2 * memory.param_count(tied)
