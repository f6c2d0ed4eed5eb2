"""A fast cached decoder: the gpt-fast technique on kvlab's model.

The eager cached decoder (`kvlab.generate`) grows its view of the cache by one position a step, so
every step has new tensor shapes, and Python decides a few things per step (slice bounds, masks).
That is fine for teaching, but a GPU cannot replay such a step as one recorded graph.

`FastDecoder` keeps K and V in one pre-allocated buffer on the device, shaped (L, B, H_kv, S_max, D),
and decodes with a small pure function over **fixed shapes**:

* the new K and V are written with `index_copy_` at a position *tensor* (not a Python int);
* attention always runs over the whole S_max buffer, with a mask built from that position tensor
  (positions not yet written are masked out, so they change nothing);
* RoPE angles are looked up from the model's pre-computed tables with the same position tensor.

Nothing in a decode step depends on a Python value that changes from step to step, so the step
can be captured once as a CUDA graph (`mode="graph"`) or compiled with
`torch.compile(mode="reduce-overhead")` (`mode="compile"`) and replayed: one launch instead of
hundreds of small ones. `mode="eager"` (the default) runs the same function as plain PyTorch and
works everywhere, the CPU included. The weights are the model's own modules: nothing is copied.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .env import cpp_compiler, half_dtype
from .generate import _check_args, _pick, as_batch
from .model import Transformer, apply_rope

MODES = ("eager", "graph", "compile")


def pick_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The compute dtype the fast path uses: bf16 on GPUs that do it fast, fp16 on older GPUs
    (Colab's T4), fp32 on the CPU. (The same rule as `kvlab.env.half_dtype`.)"""
    return half_dtype(torch.device(device) if device is not None else None)


class FastDecoder(nn.Module):
    """A static KV cache on the model's device plus a fixed-shape step over it.

    `step(ids, input_pos)` feeds ids (B, T) at positions input_pos (T,) and returns the logits of
    the last position (B, vocab). Prefill calls it with the whole prompt (T = prompt length),
    decoding with T = 1. The cache buffers are registered buffers of this module, so a CUDA graph
    or `torch.compile` sees them as fixed addresses it may update in place.
    """

    def __init__(self, model: Transformer, batch_size: int, max_seq_len: int):
        super().__init__()
        cfg = model.config
        for name, value in (("batch_size", batch_size), ("max_seq_len", max_seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if max_seq_len > cfg.max_seq_len:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's "
                             f"max_seq_len={cfg.max_seq_len}")
        self.model = model
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        param = next(model.parameters())
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_seq_len, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=param.dtype, device=param.device),
                             persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=param.dtype, device=param.device),
                             persistent=False)
        # Made once: positions 0..S_max-1 as a row (the mask of a step is `slots <= position`), and
        # the RoPE tables in the compute dtype, shaped (S, 1, D) to broadcast over heads.
        self.register_buffer("slots", torch.arange(max_seq_len, device=param.device)[None, :],
                             persistent=False)
        self.register_buffer("cos", model.rope_cos[:max_seq_len, None].to(param.dtype), persistent=False)
        self.register_buffer("sin", model.rope_sin[:max_seq_len, None].to(param.dtype), persistent=False)

    @property
    def nbytes(self) -> int:
        """Bytes the K and V buffers hold (all S_max positions, used or not)."""
        return self.k.nbytes + self.v.nbytes

    def step(self, ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One forward pass over fixed shapes: write K, V at input_pos, attend over all S_max slots.

        The same maths as `Transformer.forward`, with fewer, larger operations per layer (fused
        RMSNorm, RoPE on Q and K in one go, grouped-query attention without copying K and V), because
        at decode time the cost of a small model is the number of operations, not their size.
        """
        m = self.model
        b, t = ids.shape
        n_q, n_kv, d = m.config.n_heads, m.config.n_kv_heads, m.config.head_dim
        n_rep = n_q // n_kv
        cos, sin = self.cos[input_pos], self.sin[input_pos]    # (T, 1, D)
        # The n_rep query heads that share a K/V head are stacked along the query axis, so one plain
        # attention call per K/V head serves them all, with no copies of K and V. (SDPA's own
        # enable_gqa does the same sharing, but with a mask a GPU may fall back to its unfused
        # kernels.) The mask (written and not later) is repeated to match.
        mask = (self.slots <= input_pos[:, None]).repeat(n_rep, 1)  # (n_rep·T, S_max)
        x = m.embed(ids)
        for i, block in enumerate(m.layers):
            a = block.attn
            qkv = a.qkv(_rms_norm(block.attn_norm, x)).view(b, t, -1, d)   # (B, T, H+2H_kv, D)
            qk = apply_rope(qkv[:, :, :n_q + n_kv], cos, sin)               # rotate Q and K at once
            q = qk[:, :, :n_q].view(b, t, n_kv, n_rep, d).permute(0, 2, 3, 1, 4).reshape(b, n_kv, -1, d)
            k = qk[:, :, n_q:].transpose(1, 2)                              # (B, H_kv, T, D)
            v = qkv[:, :, n_q + n_kv:].transpose(1, 2)
            k_all, v_all = self.k[i], self.v[i]                # views (B, H_kv, S_max, D)
            k_all.index_copy_(2, input_pos, k)                 # in place: fixed address, fixed shape
            v_all.index_copy_(2, input_pos, v)
            y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)  # (B, H_kv, n_rep·T, D)
            y = y.view(b, n_kv, n_rep, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, -1)  # heads back in order
            x = x + a.out(y)
            gate, up = block.ffn.gate_up(_rms_norm(block.ffn_norm, x)).chunk(2, dim=-1)
            x = x + block.ffn.down(F.silu(gate) * up)
        return m.lm_head(_rms_norm(m.norm, x[:, -1]))

    forward = step

    def reset(self) -> None:
        """Clear the cache (not needed for correctness: the mask hides old positions)."""
        self.k.zero_()
        self.v.zero_()


# torch >= 2.4 has a fused RMSNorm; on older versions the step uses the model's own module.
_FUSED_RMS_NORM = hasattr(F, "rms_norm")


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm (computed in float32, scaled in x's dtype) as one fused operation."""
    if not _FUSED_RMS_NORM:
        return norm(x)
    if x.dtype == torch.float32:  # one operation: normalise and scale
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
    return norm.weight * F.rms_norm(x.float(), norm.weight.shape, eps=norm.eps).to(x.dtype)


class _GraphedStep:
    """The decode step (T = 1) recorded once as a CUDA graph, replayed for every token.

    Inputs are copied into fixed tensors before each replay; the logits come back in a fixed
    output tensor. Only for CUDA devices.
    """

    @torch.inference_mode()
    def __init__(self, dec: FastDecoder):
        dev = dec.k.device
        self.ids = torch.zeros(dec.batch_size, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm up outside the graph (lazy init, workspace)
            for _ in range(3):
                dec.step(self.ids, self.pos)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = dec.step(self.ids, self.pos)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.graph.replay()
        return self.logits


def make_step(dec: FastDecoder, mode: str = "eager"):
    """The decode function for `mode`: "eager" (plain PyTorch), "graph" (a CUDA graph, GPU only) or
    "compile" (`torch.compile`; mode "reduce-overhead", i.e. CUDA graphs, on a GPU; on the CPU it
    needs a C++ compiler, and the first call takes 10-30 s to build)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not known; allowed: {', '.join(MODES)}")
    if mode == "eager":
        return dec.step
    if mode == "graph":
        if dec.k.device.type != "cuda":
            raise ValueError(f"mode='graph' needs a CUDA device; the model is on {dec.k.device}. "
                             "Use mode='eager' (or 'compile') on the CPU")
        return _GraphedStep(dec)
    on_gpu = dec.k.device.type == "cuda"
    if not on_gpu and cpp_compiler() is None:
        raise RuntimeError("mode='compile' on the CPU needs a C++ compiler (g++ or clang++, or $CXX) "
                           "and none was found; install one or use mode='eager'")
    if on_gpu and hasattr(torch._dynamo, "mark_static_address"):
        # The cache is updated in place: tell the compiler its address never changes, so CUDA
        # graphs may write to it directly (as transformers' StaticCache does).
        torch._dynamo.mark_static_address(dec.k)
        torch._dynamo.mark_static_address(dec.v)
    return torch.compile(dec.step, mode="reduce-overhead" if on_gpu else "default", fullgraph=True)


@dataclass
class FastGeneration:
    """Tokens (B, T_prompt + T_new) and wall times (GPU work included: synchronized at the end)."""

    tokens: torch.Tensor
    prompt_len: int
    prefill_seconds: float
    decode_seconds: float
    mode: str

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len:]

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """New tokens (all sequences) per second, prefill included, as `Generation` counts them."""
        return self.new_tokens.numel() / self.seconds if self.seconds else float("nan")


@torch.inference_mode()
def fast_generate(model: Transformer, input_ids, max_new_tokens: int, compile: bool = False, *,
                  mode: str | None = None, decoder: FastDecoder | None = None,
                  step_fn=None, temperature: float = 0.0, top_k: int | None = None,
                  seed: int | None = None) -> FastGeneration:
    """Generate max_new_tokens after input_ids with the fixed-shape decoder.

    Greedy (temperature 0) gives exactly the tokens of `kvlab.generate.generate(..., cache="static")`
    in fp32. `compile=True` is short for mode="compile"; mode "graph" records a CUDA graph.
    Pass `decoder` and `step_fn` (from `FastDecoder` and `make_step`) to reuse a captured or compiled
    step across calls, as a server (or a benchmark) does; their batch size must match.
    """
    mode = mode or ("compile" if compile else "eager")
    device = next(model.parameters()).device
    ids = as_batch(input_ids, device)
    _check_args(max_new_tokens, temperature, top_k, ids, model.config)
    batch, prompt_len = ids.shape
    total = prompt_len + max_new_tokens
    if decoder is None:
        decoder = FastDecoder(model, batch, total)
    if decoder.batch_size != batch or decoder.max_seq_len < total:
        raise ValueError(f"decoder holds batch {decoder.batch_size} x {decoder.max_seq_len} positions; "
                         f"this call needs batch {batch} x {total}")
    step_fn = step_fn or make_step(decoder, mode)
    sampler = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    out = torch.empty(batch, total, dtype=torch.long, device=device)
    out[:, :prompt_len] = ids

    _sync(device)
    t0 = time.perf_counter()
    logits = decoder.step(ids, torch.arange(prompt_len, device=device))  # prefill: eager, T varies
    nxt = _pick(logits, temperature, top_k, sampler)
    out[:, prompt_len] = nxt
    _sync(device)
    t1 = time.perf_counter()
    pos = torch.tensor([prompt_len], device=device)
    for i in range(prompt_len + 1, total):  # no CPU-GPU sync inside: the GPU queue stays full
        logits = step_fn(nxt[:, None], pos)
        nxt = _pick(logits, temperature, top_k, sampler)
        out[:, i] = nxt
        pos += 1
    _sync(device)
    t2 = time.perf_counter()
    return FastGeneration(out, prompt_len, t1 - t0, t2 - t1, mode)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
