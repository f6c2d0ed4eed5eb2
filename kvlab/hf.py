"""`from_hf`: a kvlab Transformer with the weights of a `transformers` Llama-family model.

Llama, Mistral and Qwen2 share kvlab's architecture (RMSNorm, RoPE in the rotate-half layout,
SwiGLU, GQA; Qwen2 adds biases on Q, K, V), so the weights copy over one to one; kvlab only
fuses Q/K/V and gate/up into single matrices. `transformers` is an optional dependency.
"""

from __future__ import annotations

import warnings

import torch

from .config import ModelConfig
from .model import Transformer

SUPPORTED = ("llama", "mistral", "qwen2")


def config_from_hf(hf_config) -> ModelConfig:
    """Translate a transformers config into a ModelConfig, refusing what kvlab cannot reproduce."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in SUPPORTED:
        raise ValueError(f"model_type={kind!r} is not supported; allowed: {', '.join(SUPPORTED)}")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or rope
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise ValueError(f"rope scaling {scaling.get('rope_type', scaling.get('type'))!r} is not "
                         "supported; kvlab implements plain RoPE (rope_type='default')")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and \
            window < hf_config.max_position_embeddings:
        warnings.warn(f"sliding_window={window}: kvlab attends to the whole context, so results "
                      f"match only for sequences of at most {window} tokens", stacklevel=3)
    n_heads = hf_config.num_attention_heads
    return ModelConfig(
        n_layers=hf_config.num_hidden_layers,
        d_model=hf_config.hidden_size,
        n_heads=n_heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
        d_ff=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_seq_len=hf_config.max_position_embeddings,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads,
        rope_theta=float(theta),
        norm_eps=hf_config.rms_norm_eps,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        name=getattr(hf_config, "_name_or_path", "") or kind,
        source="transformers config",
    )


def from_hf(hf_model) -> Transformer:
    """Build a kvlab Transformer holding a copy of hf_model's weights (same dtype and device)."""
    config = config_from_hf(hf_model.config)
    if getattr(hf_model.config, "attention_bias", False) and hf_model.config.model_type == "llama":
        raise ValueError("attention_bias=True with a bias on the output projection is not supported")
    sd = hf_model.state_dict()
    param = next(hf_model.parameters())
    model = Transformer(config).to(dtype=param.dtype, device=param.device)
    ours = {"embed.weight": sd["model.embed_tokens.weight"],
            "norm.weight": sd["model.norm.weight"],
            "lm_head.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"])}
    for i in range(config.n_layers):
        hf, kv = f"model.layers.{i}.", f"layers.{i}."
        ours[kv + "attn_norm.weight"] = sd[hf + "input_layernorm.weight"]
        ours[kv + "ffn_norm.weight"] = sd[hf + "post_attention_layernorm.weight"]
        ours[kv + "attn.qkv.weight"] = torch.cat(
            [sd[hf + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        if config.qkv_bias:
            ours[kv + "attn.qkv.bias"] = torch.cat(
                [sd[hf + f"self_attn.{p}_proj.bias"] for p in "qkv"])
        ours[kv + "attn.out.weight"] = sd[hf + "self_attn.o_proj.weight"]
        ours[kv + "ffn.gate_up.weight"] = torch.cat(
            [sd[hf + "mlp.gate_proj.weight"], sd[hf + "mlp.up_proj.weight"]])
        ours[kv + "ffn.down.weight"] = sd[hf + "mlp.down_proj.weight"]
    model.load_state_dict(ours)
    return model.eval()
