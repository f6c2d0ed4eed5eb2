"""A fast cached decoder: the gpt-fast technique on kvlab's model.

The model's own cached forward (`Transformer.forward` with a cache) grows its view of the cache by
one position a step, so every step has new tensor shapes, and Python decides a few things per step
(slice bounds, masks). That is fine for teaching, but a GPU cannot replay such a step as one
recorded graph.

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
works everywhere, the CPU included. On a GPU the weights are the model's own tensors; on the CPU the
decoder may keep an (in, out) copy of them (below).
This is a path of its own, named as such (`fast_generate`), beside `kvlab.generate.generate`, which
runs the model's forward with any cache; both drive the one loop of `kvlab.sampling.decode_loop`, and
in fp32 they give the same greedy tokens. The decoder counts the positions it has filled itself
(`seq_len`), outside the recorded step.

Two choices made for the CPU, where a batch-1 step is a chain of matrix-vector products that stream
the weights from memory (`python -m kvlab.bench --sweeps profile --real-model` profiles both paths on
SmolLM2-135M, operator by operator; benchmarks/ records it):

* **Weight layout.** `F.linear(x, W)` reads W as stored, (out, in). For a matrix with short rows and
  many of them (SmolLM2's 49,152 × 576 output layer, its 3,072 × 576 gate/up projection) the CPU's
  BLAS streams that layout at about half the bandwidth it reaches on the transposed one, (in, out),
  multiplied as `x @ W_t` (measured on this project's 2-core CPU, one thread: 12 ms against 7 ms for
  the output layer). So on the CPU the decoder keeps its own contiguous (in, out) copy of every
  weight matrix (`weight_layout="input-major"`: as many bytes again as the model's matrices, reported
  by `weight_copy_bytes`; build the decoder after the weights are final), unless the model stores its
  weights that way already (`Transformer.store_weights_input_major`, which `kvlab.bench` calls before
  timing batch-1 decoding on the CPU): then the decoder reads the model's own. On a GPU it multiplies by
  a transposed *view* of the model's own weights (`"model"`: no copy, the same kernel as
  `F.linear`).
* **Attention on one thread.** The attention of one new token over a few hundred cached positions is
  a few microseconds of arithmetic; split over two threads, every call waits for the second thread to
  be scheduled, which on a busy machine costs far more than the work. The eager step runs it on one
  thread (a compiled step leaves the choice to the compiler).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cache.base import allocate
from .env import cpp_compiler
from .model import Transformer
from .sampling import as_batch, check_generate_args, check_model, check_sampling, decode_loop, make_generator
from .validate import choice, integer

MODES = ("eager", "graph", "compile")
WEIGHT_LAYOUTS = ("auto", "input-major", "model")


class FastDecoder(nn.Module):
    """A static KV cache on the model's device plus a fixed-shape step over it.

    `step(ids, input_pos)` feeds ids (B, T) at positions input_pos (T,) and returns the logits of
    the last position (B, vocab). Prefill calls it with the whole prompt (T = prompt length),
    decoding with T = 1. The cache buffers are registered buffers of this module, so a CUDA graph
    or `torch.compile` sees them as fixed addresses it may update in place. `seq_len` counts the
    positions written so far (kept in Python by `fast_generate`, since a replayed graph runs no
    Python).
    """

    def __init__(self, model: Transformer, batch_size: int, max_seq_len: int,
                 weight_layout: str = "auto"):
        super().__init__()
        choice("weight_layout", weight_layout, WEIGHT_LAYOUTS)
        cfg = check_model(model).config
        batch_size = integer("batch_size", batch_size, 1)
        max_seq_len = integer("max_seq_len", max_seq_len, 1)
        if max_seq_len > cfg.max_seq_len:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's "
                             f"max_seq_len={cfg.max_seq_len}")
        self.model = model
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        param = next(model.parameters())
        if weight_layout == "auto":  # see the module docstring: the CPU streams (in, out) faster
            weight_layout = "input-major" if param.device.type == "cpu" else "model"
        self.weight_layout = weight_layout
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_seq_len, cfg.head_dim)
        k = allocate(shape, param.dtype, param.device, "the fast decoder's K cache")
        v = torch.zeros_like(k)
        self.seq_len = 0
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", v, persistent=False)
        # Made once: positions 0..S_max-1 as a row (the mask of a step is `slots <= position`), and
        # the RoPE tables in the compute dtype, cos and sin stacked, (S, 2, 1, D), so one lookup a
        # step serves both and they broadcast over heads. `apply_rope` rotates (x1, x2) to
        # (x1·cos − x2·sin, x2·cos + x1·sin); the step gets (−x2, x1)·sin as (x2, x1)·(−sin, sin),
        # one `roll` instead of two slices, a negation and a concatenation, with the same rounding.
        half = cfg.head_dim // 2
        cos, sin = (t[:max_seq_len, None].to(param.dtype) for t in (model.rope_cos, model.rope_sin))
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        self.register_buffer("slots", torch.arange(max_seq_len, device=param.device)[None, :],
                             persistent=False)
        self.register_buffer("rope", torch.stack([cos, sin], dim=1), persistent=False)
        # Each layer's weights looked up once: an nn.Module attribute lookup costs about as much as
        # a small tensor operation, and a decode step would do dozens. Each matrix is kept as the
        # right-hand operand R of y = x @ R, (in, out): a copy or a view (module docstring).
        copy = weight_layout == "input-major"
        self.layer_weights = [_LayerWeights.of(block, copy) for block in model.layers]
        self.head = _right_operand(model.lm_head.weight, copy)

    @property
    def nbytes(self) -> int:
        """Bytes the K and V buffers hold (all S_max positions, used or not)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def weight_copy_bytes(self) -> int:
        """Bytes of the decoder's own copy of the weight matrices: 0 when it uses the model's (a GPU;
        or a model whose weights are stored input-major already, `Transformer.store_weights_input_major`)."""
        model = self.model
        owned = {p.untyped_storage().data_ptr() for p in model.parameters()}
        mats = [self.head, *(w for lw in self.layer_weights for w in (lw.qkv, lw.out, lw.gate_up, lw.down))]
        return sum(w.nbytes for w in mats if w.untyped_storage().data_ptr() not in owned)

    def step(self, ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One forward pass over fixed shapes: write K, V at input_pos, attend over all S_max slots.

        The same maths as `Transformer.forward`, with fewer, larger operations per layer (fused
        RMSNorm, RoPE on Q and K in one go, grouped-query attention without copying K and V), because
        at decode time the cost of a small model is the number of operations, not their size.
        """
        m, cfg = self.model, self.model.config
        b, t = ids.shape
        n_q, n_kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        n_rep = n_q // n_kv
        rope = self.rope[input_pos]                            # (T, 2, 1, D)
        cos, sin = rope[:, 0], rope[:, 1]
        # The n_rep query heads that share a K/V head are stacked along the query axis, so one plain
        # attention call per K/V head serves them all, with no copies of K and V. (SDPA's own
        # enable_gqa does the same sharing, but with a mask a GPU may fall back to its unfused
        # kernels.) Why the row order is right: query head h uses K/V head h // n_rep (as
        # `repeat_kv` lays them out), so viewing the H query heads as (n_kv, n_rep) puts each group
        # under its K/V head; stacking (n_rep, T) makes row r·T + t hold query t of head r, and
        # `.repeat(n_rep, 1)` tiles the (T, S_max) mask the same way, so row r·T + t gets query t's
        # mask (written and not later). The output is unstacked by the inverse permutation.
        # With T = 1 all of this is a free view, and the one mask row broadcasts over the n_rep rows.
        mask = self.slots <= input_pos[:, None]                # (T, S_max)
        if t > 1:
            mask = mask.repeat(n_rep, 1)                       # (n_rep·T, S_max)
        x = F.embedding(ids, m.embed.weight)
        for i, w in enumerate(self.layer_weights):
            qkv = _linear(_rms_norm(x, w.attn_norm, w.eps), w.qkv, w.qkv_bias).view(b, t, -1, d)
            qk = qkv[:, :, :n_q + n_kv]                        # rotate Q and K at once
            qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
            k = qk[:, :, n_q:].transpose(1, 2)                 # (B, H_kv, T, D)
            v = qkv[:, :, n_q + n_kv:].transpose(1, 2)
            if t == 1:
                q = qk[:, 0, :n_q].view(b, n_kv, n_rep, d)
            else:
                q = qk[:, :, :n_q].view(b, t, n_kv, n_rep, d).permute(0, 2, 3, 1, 4).reshape(b, n_kv, -1, d)
            k_all, v_all = self.k[i], self.v[i]                # views (B, H_kv, S_max, D)
            k_all.index_copy_(2, input_pos, k)                 # in place: fixed address, fixed shape
            v_all.index_copy_(2, input_pos, v)
            y = _attend(q, k_all, v_all, mask)                 # (B, H_kv, n_rep·T, D)
            if t == 1:
                y = y.reshape(b, 1, -1)
            else:
                y = y.view(b, n_kv, n_rep, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, -1)  # heads in order
            x = x + _linear(y, w.out, w.out_bias)
            gate, up = _linear(_rms_norm(x, w.ffn_norm, w.eps), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, w.down, w.down_bias)
        return _linear(_rms_norm(x[:, -1], m.norm.weight, m.norm.eps), self.head, m.lm_head.bias)

    def reset(self) -> None:
        """Clear the cache (not needed for correctness: the mask hides old positions)."""
        self.k.zero_()
        self.v.zero_()
        self.seq_len = 0


class _LayerWeights(NamedTuple):
    """The tensors one decoder block computes with (a bias is None when the model has none); each
    weight matrix as the right operand of x @ R, shaped (in, out) (`_right_operand`)."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    eps: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    out: torch.Tensor
    out_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None

    @classmethod
    def of(cls, block, copy: bool) -> _LayerWeights:
        a, f = block.attn, block.ffn
        r = [_right_operand(lin.weight, copy) for lin in (a.qkv, a.out, f.gate_up, f.down)]
        return cls(block.attn_norm.weight, block.ffn_norm.weight, block.attn_norm.eps,
                   r[0], a.qkv.bias, r[1], a.out.bias, r[2], f.gate_up.bias, r[3], f.down.bias)


def _right_operand(weight: torch.Tensor, copy: bool) -> torch.Tensor:
    """W (out, in) as R = Wᵀ (in, out), so x @ R == F.linear(x, W): a contiguous copy, or a view."""
    return weight.detach().t().contiguous() if copy else weight.detach().t()


def _linear(x: torch.Tensor, right: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear with the weight given as its right operand (in, out)."""
    y = x @ right
    return y if bias is None else y + bias


def _attend(q, k, v, mask) -> torch.Tensor:
    """Masked attention; on the CPU, outside a compiled graph, on one thread (module docstring)."""
    if torch.compiler.is_compiling() or q.device.type != "cpu" or torch.get_num_threads() == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    finally:
        torch.set_num_threads(threads)


# torch >= 2.4 has a fused RMSNorm; on older versions the step writes it out.
_FUSED_RMS_NORM = hasattr(F, "rms_norm")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm (computed in float32, scaled in x's dtype), fused where torch has it."""
    if not _FUSED_RMS_NORM:
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if x.dtype == torch.float32:  # one operation: normalise and scale
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


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
    choice("mode", mode, MODES)
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
def fast_generate(model: Transformer, input_ids, max_new_tokens: int, *, mode: str = "eager",
                  decoder: FastDecoder | None = None, step_fn=None, temperature: float = 0.0,
                  top_k: int | None = None, seed: int | None = None,
                  eos_token_id: int | None = None) -> FastGeneration:
    """Generate max_new_tokens after input_ids with the fixed-shape decoder.

    Greedy (temperature 0) gives exactly the tokens of `kvlab.generate.generate(..., cache="static")`
    in fp32 (both run `kvlab.sampling.decode_loop` over `FastDecoder.step`). mode "graph" records a
    CUDA graph, "compile" uses torch.compile (see `make_step`). Pass `decoder` and `step_fn` (from
    `FastDecoder` and `make_step`) to reuse a captured or compiled step across calls, as a server
    (or a benchmark) does; their batch size must match. A decoder needs no reset between calls.
    """
    choice("mode", mode, MODES)
    device = next(check_model(model).parameters()).device
    ids = as_batch(input_ids, device)
    max_new_tokens = check_generate_args(model.config, ids, max_new_tokens, eos_token_id)
    temperature, top_k, seed = check_sampling(temperature, top_k, seed)
    batch, prompt_len = ids.shape
    total = prompt_len + max_new_tokens
    if decoder is None:
        decoder = FastDecoder(model, batch, total)
    if not isinstance(decoder, FastDecoder) or decoder.model is not model:
        raise ValueError(f"decoder={decoder!r:.60} must be a FastDecoder of this model "
                         "(FastDecoder(model, batch_size, max_seq_len)), or None")
    if step_fn is not None and not callable(step_fn):
        raise ValueError(f"step_fn={step_fn!r:.60} must be the function make_step(decoder, mode) "
                         "returned, or None")
    if decoder.batch_size != batch or decoder.max_seq_len < total:
        raise ValueError(f"decoder holds batch {decoder.batch_size} x {decoder.max_seq_len} positions; "
                         f"this call needs batch {batch} x {total}")
    step_fn = step_fn or make_step(decoder, mode)
    times = []

    decoder.seq_len = 0

    def forward(feed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The prefill (T = prompt length) runs eagerly: a graph or compiled step is for T = 1.
        decoder.seq_len += feed.shape[1]  # counted here, outside the step a graph replays
        return (step_fn if feed.shape[1] == 1 else decoder.step)(feed, positions)

    def after_prefill(step: int, _ids: torch.Tensor) -> None:
        if step == 0:
            _sync(device)
            times.append(time.perf_counter())

    _sync(device)
    t0 = time.perf_counter()
    tokens = decode_loop(forward, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                         generator=make_generator(seed, device), eos_token_id=eos_token_id,
                         on_token=after_prefill)
    _sync(device)
    t2 = time.perf_counter()
    return FastGeneration(tokens, prompt_len, times[0] - t0, t2 - times[0], mode)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
