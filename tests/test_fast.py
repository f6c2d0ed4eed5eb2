"""The fixed-shape fast decoder (kvlab.fast) gives the eager cached decoder's tokens exactly."""

import pytest
import torch
from needs import require

from kvlab import PRESETS
from kvlab.bench import first_divergence, teacher_forced_agreement
from kvlab.env import cpp_compiler, half_dtype
from kvlab.fast import FastDecoder, fast_generate, make_step
from kvlab.generate import generate
from kvlab.memory import kv_cache_bytes
from kvlab.model import Transformer

CONFIGS = {
    "mha": PRESETS["tiny-mha"],
    "gqa": PRESETS["tiny-gqa"],
    "mqa": PRESETS["tiny-mqa"],
    "deeper-gqa": PRESETS["tiny-gqa"].with_(n_layers=3, d_model=96, n_heads=6, n_kv_heads=3, d_ff=160),
    "tied": PRESETS["tiny-mha"].with_(tie_embeddings=True),
}


def model_for(cfg, seed=0):
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("batch,prompt_len", [(1, 5), (3, 9)])
def test_greedy_tokens_equal_the_eager_cached_decoder(name, batch, prompt_len):
    model = model_for(CONFIGS[name])
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len))
    expected = generate(model, ids, 24, cache="static").tokens
    got = fast_generate(model, ids, 24)
    assert got.tokens.shape == (batch, prompt_len + 24)
    assert torch.equal(got.tokens, expected)
    assert torch.equal(got.new_tokens, expected[:, prompt_len:])
    assert got.mode == "eager" and got.tokens_per_second > 0


def test_step_logits_match_the_model_at_every_position():
    model = model_for(CONFIGS["gqa"])
    ids = torch.randint(0, 256, (2, 12))
    with torch.inference_mode():
        full = model(ids)                              # (B, T, V), no cache
        dec = FastDecoder(model, 2, 16)
        logits = dec.step(ids[:, :4], torch.arange(4))  # prefill 4 tokens
        torch.testing.assert_close(logits, full[:, 3], rtol=1e-5, atol=1e-5)
        for t in range(4, 12):                         # then one token at a time
            logits = dec.step(ids[:, t:t + 1], torch.tensor([t]))
            torch.testing.assert_close(logits, full[:, t], rtol=1e-5, atol=1e-5)


def test_decoder_can_be_reused_without_reset():
    # Stale K/V from a longer earlier request sit in the buffer; the mask must hide them.
    model = model_for(CONFIGS["mha"])
    dec = FastDecoder(model, 1, 40)
    step = make_step(dec)
    long_ids = torch.randint(0, 256, (1, 20))
    short_ids = torch.randint(0, 256, (1, 6))
    fast_generate(model, long_ids, 20, decoder=dec, step_fn=step)
    again = fast_generate(model, short_ids, 10, decoder=dec, step_fn=step)
    assert torch.equal(again.tokens, generate(model, short_ids, 10, cache="static").tokens)


def test_sampling_is_seeded_like_generate():
    model = model_for(CONFIGS["gqa"])
    ids = torch.randint(0, 256, (2, 4))
    a = fast_generate(model, ids, 12, temperature=1.0, top_k=20, seed=7).tokens
    b = fast_generate(model, ids, 12, temperature=1.0, top_k=20, seed=7).tokens
    ref = generate(model, ids, 12, cache="static", temperature=1.0, top_k=20, seed=7).tokens
    assert torch.equal(a, b) and torch.equal(a, ref)


def test_cache_bytes_match_the_formula_and_shape_is_fixed():
    cfg = CONFIGS["gqa"]
    dec = FastDecoder(model_for(cfg), batch_size=3, max_seq_len=50)
    assert dec.k.shape == (cfg.n_layers, 3, cfg.n_kv_heads, 50, cfg.head_dim)
    assert dec.nbytes == kv_cache_bytes(cfg, 50, 3, "fp32")


def test_bad_input_is_refused_clearly(monkeypatch):
    model = model_for(CONFIGS["mha"])
    with pytest.raises(ValueError, match="mode='turbo' is not allowed; allowed: 'eager', 'graph', 'compile'"):
        make_step(FastDecoder(model, 1, 8), "turbo")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_step(FastDecoder(model, 1, 8), "graph")
    with monkeypatch.context() as patch:  # a machine without a C++ compiler
        patch.setenv("PATH", "")
        patch.delenv("CXX", raising=False)
        with pytest.raises(RuntimeError, match="mode='compile' on the CPU needs a C\\+\\+ compiler"):
            make_step(FastDecoder(model, 1, 8), "compile")
    with pytest.raises(ValueError, match="max_seq_len=600 exceeds the model's max_seq_len=512"):
        FastDecoder(model, 1, 600)
    with pytest.raises(ValueError, match="batch_size=0 must be an integer >= 1"):
        FastDecoder(model, 0, 8)
    with pytest.raises(ValueError, match="decoder holds batch 1 x 8 positions; this call needs batch 2 x 10"):
        fast_generate(model, torch.zeros(2, 4, dtype=torch.long), 6, decoder=FastDecoder(model, 1, 8))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        fast_generate(model, [1, 2, 3], 0)


def test_compiled_step_is_one_graph_reused_at_every_position():
    require(None if cpp_compiler() else "no C++ compiler (g++ or clang++) for torch.compile on the CPU",
            "the torch.compile test")
    # What a CUDA graph needs, checked with torch.compile on the CPU: fullgraph=True raises on any
    # graph break, and error_on_recompile raises if a new position or request needed a new graph.
    model = model_for(CONFIGS["gqa"])
    first, second = torch.randint(0, 256, (2, 2, 5))
    torch._dynamo.reset()
    dec = FastDecoder(model, 2, 5 + 12)
    step = make_step(dec, "compile")
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = [fast_generate(model, ids, 12, mode="compile", decoder=dec, step_fn=step)
               for ids in (first, second)]
        with torch.inference_mode():  # as inside fast_generate (other tensors would need a new graph)
            ids, pos = first[:, :1].clone(), torch.tensor([3])
            eager, compiled = dec.step(ids, pos), step(ids, pos)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for ids, gen in zip((first, second), got, strict=True):
        assert gen.mode == "compile"
        assert torch.equal(gen.tokens, generate(model, ids, 12, cache="static").tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", ["graph", "compile"])
def test_gpu_modes_match_eager(mode):
    torch.manual_seed(0)
    model = Transformer(CONFIGS["gqa"]).to("cuda", half_dtype(torch.device("cuda"))).eval()
    ids = torch.randint(0, 256, (2, 6), device="cuda")
    eager = fast_generate(model, ids, 16).tokens
    other = fast_generate(model, ids, 16, mode=mode).tokens
    # Half precision: kernels may round a near-tie the other way, and two free generations then go on
    # from different texts. So the graphed/compiled step is fed eager's tokens (teacher forcing) and must
    # pick eager's next token at nearly every position.
    dec = FastDecoder(model, 2, 6 + 16)
    agree = teacher_forced_agreement(dec, eager, 6, make_step(dec, mode))
    assert agree > 0.9, f"{agree:.0%}; free generations first differ at {first_divergence(other, eager, 6)}"


def test_eos_stops_fast_generate_as_it_stops_generate():
    model = model_for(CONFIGS["gqa"], seed=5)
    ids = torch.randint(0, 256, (2, 4))
    free = generate(model, ids, 16).tokens
    eos = int(free[0, 4 + 3])
    got = fast_generate(model, ids, 16, eos_token_id=eos).tokens
    assert torch.equal(got, generate(model, ids, 16, eos_token_id=eos).tokens)
    assert (got[0, 4 + 3:] == eos).all()


def test_the_decoder_counts_the_positions_it_fills():
    model = model_for(CONFIGS["gqa"])
    dec = FastDecoder(model, 1, 16)
    out = fast_generate(model, [1, 2, 3], 5, decoder=dec)
    assert dec.seq_len == 3 + 5 - 1  # the prompt and every generated token but the last were fed
    assert dec.k[:, :, :, :7].abs().sum() > 0 and dec.k[:, :, :, 7:].abs().sum() == 0
    fast_generate(model, [4, 5], 2, decoder=dec)  # a second request on the same decoder starts over
    assert dec.seq_len == 3 and out.tokens.shape == (1, 8)


def test_both_weight_layouts_give_the_same_tokens_and_the_copy_is_counted():
    model = model_for(CONFIGS["tied"])
    ids = torch.randint(0, 256, (2, 6))
    copied = FastDecoder(model, 2, 30, weight_layout="input-major")
    viewed = FastDecoder(model, 2, 30, weight_layout="model")
    assert FastDecoder(model, 2, 30).weight_layout == "input-major"  # auto, on the CPU
    matrices = sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert copied.weight_copy_bytes == matrices and viewed.weight_copy_bytes == 0
    a = fast_generate(model, ids, 20, decoder=copied).tokens
    b = fast_generate(model, ids, 20, decoder=viewed).tokens
    assert torch.equal(a, b) and torch.equal(a, generate(model, ids, 20, cache="static").tokens)
    with pytest.raises(ValueError, match="weight_layout"):
        FastDecoder(model, 1, 8, weight_layout="columns")
    model.store_weights_input_major()  # the decoder can read the model's own matrices: no copy
    stored = FastDecoder(model, 2, 30, weight_layout="input-major")
    assert stored.weight_copy_bytes == 0
    assert torch.equal(fast_generate(model, ids, 20, decoder=stored).tokens, a)
    assert torch.equal(generate(model, ids, 20, cache="static").tokens, a)
