"""kvlab's model against transformers' on the same random weights (no download)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvlab import course_model  # noqa: E402
from kvlab import hf as hf_mod  # noqa: E402
from kvlab.generate import generate  # noqa: E402
from kvlab.hf import config_from_hf, from_hf  # noqa: E402

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256)


def random_hf(kind: str, n_kv_heads: int, seed: int = 0, **extra):
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config}[kind]
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM}[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**SMALL, num_key_value_heads=n_kv_heads, **extra)).eval()
    with torch.no_grad():  # weights large enough that greedy choices are not near-ties
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith("bias"):
                p.normal_(0.0, 0.12)
    return model


CASES = [("llama", 4), ("llama", 2), ("llama", 1), ("mistral", 2), ("qwen2", 2)]


@pytest.mark.parametrize("kind, n_kv_heads", CASES)
def test_logits_equal_transformers(kind, n_kv_heads):
    hf = random_hf(kind, n_kv_heads)
    ours = from_hf(hf)
    ids = torch.randint(0, 160, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind, n_kv_heads", CASES)
def test_cached_greedy_tokens_equal_transformers_generate(kind, n_kv_heads):
    hf = random_hf(kind, n_kv_heads, seed=1)
    ours = from_hf(hf)
    ids = torch.randint(0, 160, (2, 7))
    hf.generation_config.eos_token_id = None  # no early stop: compare all 72 steps
    theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=72,
                         do_sample=False, pad_token_id=0)
    assert theirs.shape == (2, 7 + 72)
    assert torch.equal(generate(ours, ids, 72, cache="static").tokens, theirs)
    assert torch.equal(generate(ours, ids, 72, cache="dynamic").tokens, theirs)


def test_config_translation():
    hf = random_hf("llama", 2, tie_word_embeddings=True, rope_theta=500000.0)
    cfg = config_from_hf(hf.config)
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.tie_embeddings and cfg.rope_theta == 500000.0
    ours = from_hf(hf)
    assert ours.lm_head.weight is ours.embed.weight


def test_unsupported_models_are_refused():
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)
    message = "model_type='gpt2' is not supported; allowed: llama, mistral, qwen2"
    with pytest.raises(ValueError, match=message):
        config_from_hf(gpt2)
    scaled = transformers.LlamaConfig(**SMALL, num_key_value_heads=4,
                                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="rope scaling 'linear' is not supported"):
        config_from_hf(scaled)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("extra, message", [
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(mlp_bias=True), "mlp_bias=True is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported.*o_proj"),
    (dict(rope_parameters=LLAMA3_ROPE), "rope scaling 'llama3' is not supported"),
], ids=["hidden_act", "mlp_bias", "attention_bias", "rope_llama3"])
def test_refusals_name_the_field_and_value(extra, message):
    hf = random_hf("llama", 2, **extra)  # transformers runs each; kvlab must not pretend to
    with pytest.raises(ValueError, match=message):
        from_hf(hf)


def test_swish_is_silu_and_accepted():
    hf = random_hf("llama", 2, hidden_act="swish")
    ids = torch.randint(0, 160, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(from_hf(hf)(ids), hf(ids).logits, rtol=0, atol=1e-4)


def test_a_weight_without_a_place_is_refused_by_name():
    hf = random_hf("llama", 2)
    hf.model.layers[1].self_attn.o_proj.bias = torch.nn.Parameter(torch.ones(64))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.bias"):
        from_hf(hf)


def test_head_dim_other_than_hidden_over_heads():
    hf = random_hf("llama", 2, head_dim=32)  # 4 heads x 32 = 128 != hidden 64
    ours = from_hf(hf)
    assert ours.config.head_dim == 32
    ids = torch.randint(0, 160, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind, extra", [("mistral", dict(sliding_window=24)),
                                         ("qwen2", dict(use_sliding_window=True, sliding_window=24,
                                                        max_window_layers=0))])
def test_sliding_window_caps_the_context_at_the_window(kind, extra):
    hf = random_hf(kind, 2, **extra)
    ours = from_hf(hf)
    assert ours.config.max_seq_len == 24 and "sliding_window=24" in ours.config.source
    ids = torch.randint(0, 160, (1, 24))  # a full window: still exactly full attention
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=1e-4)
        longer = torch.randint(0, 160, (1, 30))
        assert not torch.allclose(hf(longer).logits[:, -1], hf_full_attention(kind, hf)(longer).logits[:, -1],
                                  atol=1e-3)  # beyond the window transformers differs from full attention
        with pytest.raises(ValueError, match="exceeds max_seq_len=24"):
            ours(longer)


def hf_full_attention(kind, hf):
    config = hf.config.to_dict() | {"sliding_window": None, "use_sliding_window": False,
                                    "layer_types": None}
    twin = type(hf)(type(hf.config).from_dict(config)).eval()
    twin.load_state_dict(hf.state_dict())
    return twin


def test_a_sliding_window_longer_than_the_context_changes_nothing():
    hf = random_hf("mistral", 2, sliding_window=4096)  # larger than max_position_embeddings=256
    assert from_hf(hf).config.max_seq_len == 256


# --- loading a checkpoint folder (saved here, never downloaded) -------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return hf_mod.save_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", seed=3)


def test_load_folder_matches_transformers(checkpoint):
    ours, tokenizer = hf_mod.load(checkpoint)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    text = "The cache keeps every key and value. 缓存"
    ids = torch.tensor([tokenizer.encode(text)])
    assert tokenizer.decode(ids[0]) == text  # the checkpoint's own tokenizer, 中文 included
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-4)
    assert theirs.generation_config.eos_token_id is None  # all 40 steps compared
    expected = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                               do_sample=False, pad_token_id=0)
    assert torch.equal(generate(ours, ids, 40, cache="static").tokens, expected)


def test_load_dtype_and_bad_dtype(checkpoint):
    ours, _ = hf_mod.load(checkpoint, dtype="bf16", device="cpu")
    assert ours.embed.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='int3' is not allowed"):
        hf_mod.load(checkpoint, dtype="int3")


def test_course_model_follows_the_environment_variable(checkpoint, monkeypatch):
    monkeypatch.setenv("KVLAB_REAL_MODEL", str(checkpoint))
    assert course_model.course_model_name() == str(checkpoint)
    ours, tokenizer, theirs = course_model.load_course_model(transformers_too=True)
    assert ours.config.n_layers == theirs.config.num_hidden_layers == 2
    ids = torch.tensor([tokenizer.encode("The cache keeps every key and value.")])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-4)
    monkeypatch.delenv("KVLAB_REAL_MODEL")
    name = course_model.course_model_name()
    assert name == course_model.COURSE_MODEL.name == "SmolLM2-135M-Instruct (Q4_1)"


def test_missing_model_says_what_can_be_loaded():
    with pytest.raises(hf_mod.ModelUnavailableError, match="a folder saved with save_pretrained"):
        hf_mod.load("kvlab-test/no-such-model", local_files_only=True)



# --- GGUF files (written here, as llama.cpp's converter writes them) ----------------------------

@pytest.mark.parametrize("tied, n_kv_heads", [(False, 2), (True, 1)], ids=["untied-gqa", "tied-mqa"])
def test_a_gguf_file_loads_as_the_model_it_came_from(tmp_path, tied, n_kv_heads):
    from tiny_gguf import write_gguf

    tokenizer = hf_mod.train_tokenizer()
    theirs = hf_mod.random_hf_model(seed=5, vocab_size=len(tokenizer), num_key_value_heads=n_kv_heads,
                                    tie_word_embeddings=tied)
    write_gguf(tmp_path / "tiny.gguf", theirs, tokenizer)
    ours, gguf_tokenizer = hf_mod.load(tmp_path, gguf_file="tiny.gguf", device="cpu")
    same, _ = hf_mod.load(tmp_path / "tiny.gguf", device="cpu")  # a path to the file works too
    assert ours.config.tie_embeddings is tied and ours.config.n_kv_heads == n_kv_heads
    text = "The cache keeps every key and value. 缓存"
    assert gguf_tokenizer.encode(text) == tokenizer.encode(text)
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():  # float32 weights: the GGUF round trip (Q/K rows permuted and back) is exact
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(same(ids), ours(ids), rtol=0, atol=0)
