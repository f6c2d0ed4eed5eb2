"""kvlab's model against transformers' on the same random weights (no download)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

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
