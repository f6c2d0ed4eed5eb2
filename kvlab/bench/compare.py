"""kvlab against `transformers` on the same random weights: generate side by side, interleaved in one
process, medians, and a check that both produce the same tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import env, roofline
from ..config import ModelConfig
from ..fast import FastDecoder, fast_generate, make_step
from ..generate import generate
from .sweeps import CPU_CONFIG, TORCH_DTYPE_NAMES, random_prompt, result_row
from .timing import median, time_interleaved


def hf_twin(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """A random-weight `transformers` LlamaForCausalLM of this shape (no download) and the kvlab
    model built from it by `from_hf`: the same weights in both."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..hf import from_hf

    hf_cfg = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.d_model,
                         intermediate_size=config.d_ff, num_hidden_layers=config.n_layers,
                         num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
                         head_dim=config.head_dim, max_position_embeddings=config.max_seq_len,
                         rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
                         tie_word_embeddings=config.tie_embeddings,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    hf_model = LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype).eval()
    # No end-of-sequence token: both sides generate exactly max_new_tokens.
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.bos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    return hf_model, from_hf(hf_model)


def compare_hf(config: ModelConfig = CPU_CONFIG, new_tokens: int = 64, prompt_len: int = 16,
               repeats: int = 5, device=None, dtype: torch.dtype | None = None,
               progress: bool = False, clock: str = "wall",
               fast_modes: Sequence[str] = ("eager",),
               bandwidth_bytes_per_s: float | None = None) -> list[dict]:
    """kvlab cached decoding vs `transformers` generate (dynamic and static cache) on the same
    weights, batch 1, greedy, interleaved; rows carry medians, ratios and a token-equality check.

    fast_modes: the `kvlab.fast` modes to time too ("graph" needs a GPU). Each keeps one decoder
    and one captured/compiled step across calls, as transformers keeps its static cache.
    bandwidth_bytes_per_s: when given, each row also reports the share of it the decoding used
    (`kvlab.roofline.achieved_fraction` at the mean context of the run)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    device = torch.device(device) if device is not None else env.device()
    dtype = dtype or env.half_dtype(device)
    hf_model, kv_model = hf_twin(config, 0, dtype, device)
    ids = random_prompt(config, 1, prompt_len, device)
    mask = torch.ones_like(ids)
    outputs: dict[str, torch.Tensor] = {}

    def keep(name, tokens):
        outputs[name] = tokens

    def run_hf(impl):
        kw = {} if impl is None else {"cache_implementation": impl}
        with torch.inference_mode():
            return hf_model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                     **kw)

    fns = {
        "kvlab generate (static cache)":
            lambda: keep("kvlab generate (static cache)",
                         generate(kv_model, ids, new_tokens, cache="static").tokens),
        "transformers generate (dynamic cache)":
            lambda: keep("transformers generate (dynamic cache)", run_hf(None)),
        "transformers generate (static cache)":
            lambda: keep("transformers generate (static cache)", run_hf("static")),
    }
    for mode in fast_modes:
        dec = FastDecoder(kv_model, 1, prompt_len + new_tokens)
        with torch.inference_mode():
            step = make_step(dec, mode)
        fns[f"kvlab fast {mode}"] = lambda m=mode, d=dec, s=step: keep(
            f"kvlab fast {m}", fast_generate(kv_model, ids, new_tokens, mode=m, decoder=d, step_fn=s).tokens)
    times = time_interleaved(fns, repeats, 1, device, progress, "kvlab vs transformers", clock)
    reference = outputs["kvlab generate (static cache)"]
    base = {k: median(v) for k, v in times.items()}
    hf_dyn = base["transformers generate (dynamic cache)"]
    hf_static = base["transformers generate (static cache)"]

    def agreement(tokens):  # exact in fp32; in half precision a near-tie may round the other way
        return (tokens[:, prompt_len:].cpu() == reference[:, prompt_len:].cpu()).float().mean().item()

    def bandwidth_share(seconds: float) -> dict:
        if bandwidth_bytes_per_s is None:
            return {}
        rate = new_tokens / seconds
        return {"fraction_of_bandwidth": roofline.achieved_fraction(
            config, rate, bandwidth_bytes_per_s, prompt_len + new_tokens // 2, 1, TORCH_DTYPE_NAMES[dtype]),
            "bandwidth_bytes_per_s": bandwidth_bytes_per_s}

    shape = f"L{config.n_layers} d{config.d_model} H{config.n_heads}/{config.n_kv_heads} V{config.vocab_size}"
    return [result_row("compare_hf", k, v, new_tokens, new_tokens=new_tokens, batch=1, prompt_len=prompt_len,
                       clock=clock, dtype=TORCH_DTYPE_NAMES[dtype], model=shape, config=config.name,
                       tokens_identical=bool(torch.equal(outputs[k].cpu(), reference.cpu())),
                       tokens_agree=agreement(outputs[k]),
                       speedup_vs_hf_dynamic=hf_dyn / base[k], speedup_vs_hf_static=hf_static / base[k],
                       **bandwidth_share(base[k]))
            for k, v in times.items()]
