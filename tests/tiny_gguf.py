"""Write a small random Llama as a GGUF file, laid out as llama.cpp's converter lays it out, so the GGUF
path (transformers' reader, kvlab's conversion and cache) can be tested in seconds and without a download.

llama.cpp stores the Q and K projections with each head's rows interleaved for its rotary layout
(`permute` in its convert_hf_to_gguf.py); transformers undoes that when reading. Writing the permuted
rows here and comparing against the model they came from checks that round trip end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, the two rotary halves interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, hf_model, tokenizer) -> Path:
    """Save a transformers LlamaForCausalLM (float32) and its byte-level BPE tokenizer as one GGUF file."""
    import gguf

    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("kvlab test llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    rope = getattr(c, "rope_parameters", None) or {}  # transformers 5; 4.x: rope_theta
    writer.add_rope_freq_base(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    _add_tokenizer(writer, tokenizer)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}": f"blk.{i}.{ours}" for hf, ours in parts.items()}
    for key, tensor in hf_model.state_dict().items():
        module = key.removesuffix(".weight")
        if module == "lm_head" and c.tie_word_embeddings:
            continue
        w = tensor.detach().float().numpy()
        if module.endswith("q_proj"):
            w = permute(w, c.num_attention_heads)
        elif module.endswith("k_proj"):
            w = permute(w, c.num_key_value_heads)
        writer.add_tensor(names[module] + ".weight", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, tokenizer) -> None:
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in special else 1 for token, _ in vocab])  # 3: control
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
