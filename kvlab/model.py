"""A small Llama-style decoder: RMSNorm, RoPE, SwiGLU and grouped-query attention.

Read it top to bottom: `Transformer.forward` embeds tokens, runs `n_layers` blocks and projects
to logits. The only line the KV cache adds is in `Attention.forward`, marked `# KV cache`: the
new keys and values go into the cache, and attention runs over what the cache hands back. The
cache also says which of those keys each new query may see (`kvlab.cache.base`), and the mask is
built from that, so every kind of cache (bounded ones included) gets the right attention.

Attention is split at a seam: `Attention.project` makes q, k, v; `Attention.attend(q, k, v, mask)`
does the attention itself. `attend_with(model, fn)` swaps in another `attend` for a while (the
explicit attention of chapter 01, a recorder of attention weights, the oracle's probes) without
touching the rest of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import attention, causal_mask
from .config import ModelConfig, resolve


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (as Llama does), then scale in the input's dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position × frequency, (max_seq_len, head_dim), computed once.

    RoPE turns each pair of channels by an angle position · θ_i, with θ_i = theta^(-2i/D) for
    i = 0 … D/2 - 1: the first pairs turn fast (fine position), the last slowly (far context), and
    the dot product of a rotated query and key depends only on their distance. The D/2 angles are
    written twice, [θ_0 … θ_{D/2-1}, θ_0 … θ_{D/2-1}], because apply_rope pairs channel i with
    channel i + D/2 (the "half-split" layout of Hugging Face's Llama, whose checkpoints permute
    the Q and K weights for it), not with channel i + 1 as the RoPE paper writes: the same
    rotation on another channel order, and the one that makes kvlab's logits match transformers'.
    The exponents are made as int64 then float, as transformers makes them, so the tables match.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of x (B, H, T, D) by their position's angle:
    (a, b) -> (a·cos - b·sin, b·cos + a·sin), written for all pairs at once with `rotated`."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads, config.n_kv_heads, config.head_dim)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv = nn.Linear(config.d_model, sum(self.split), bias=config.qkv_bias)  # fused Q, K, V
        self.out = nn.Linear(q_size, config.d_model, bias=False)
        self.attend = attention  # (q, k, v, mask) -> output: the seam `attend_with` swaps

    def project(self, x, cos, sin):
        """q (B, H, T, D), k and v (B, H_kv, T, D) of x (B, T, d_model), q and k rotated by RoPE."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)      # (B, H, T, D)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)   # (B, H_kv, T, D)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, masking: _Masking, cache=None, layer: int = 0):
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            if cache.needs_queries:
                cache.receive_queries(layer, q)
            k, v = cache.update(layer, k, v)  # KV cache: store the new K, V; get what to attend over
        y = self.attend(q, k, v, masking(cache, layer))
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class _Masking:
    """Which keys each new query may see in one forward pass: causal order, the cache's own rule
    (a window's band), padding. A cache that returns keys 0..S-1 in order gets one mask for every
    layer (None when a single new token may see them all)."""

    def __init__(self, start: int, t: int, device, keep: torch.Tensor | None, n_rep: int):
        self.start, self.t, self.device = start, t, device
        self.keep, self.n_rep = keep, n_rep  # keep: (B, start + T) bool, False for padding
        self.shared: tuple[torch.Tensor | None] | None = None

    def __call__(self, cache, layer: int) -> torch.Tensor | None:
        positions = None if cache is None else cache.key_positions(layer)
        if positions is None:
            if self.shared is None:  # the same in every layer: built once
                self.shared = (self._in_order(),)
            return self.shared[0]
        q = torch.arange(self.start, self.start + self.t, device=self.device)
        mask = cache.visible(q, positions, layer)          # (T, S) or (B, H_kv, T, S)
        if self.keep is not None:
            if positions.dim() == 1:
                real = self.keep[:, positions][:, None, None, :]                 # (B, 1, 1, S)
            else:
                b, h, s = positions.shape
                real = self.keep.gather(1, positions.reshape(b, -1)).view(b, h, 1, s)
            # A padding query would see no key (softmax over nothing is NaN): it sees itself.
            padding = ~self.keep[:, self.start:self.start + self.t][:, None, :, None]  # (B, 1, T, 1)
            mask = (mask & real) | ((positions[..., None, :] == q[:, None]) & padding)
        if mask.dim() == 4 and mask.shape[1] > 1 and self.n_rep > 1:
            mask = mask.repeat_interleave(self.n_rep, dim=1)  # per KV head -> per query head
        return mask

    def _in_order(self) -> torch.Tensor | None:
        t, s = self.t, self.start + self.t
        mask = causal_mask(t, s, self.device) if t > 1 else None
        if self.keep is None:
            return mask  # one new token may look at every cached one: no mask needed
        # Padding keys are hidden; a padding query sees itself (softmax over nothing would be NaN).
        keys, queries = torch.arange(s, device=self.device), torch.arange(self.start, s, device=self.device)
        itself = keys == queries[:, None]
        real = self.keep[:, None, None, :s] | itself
        return real if mask is None else mask & real


@contextmanager
def attend_with(model: Transformer, fn: Callable) -> Iterator[Transformer]:
    """`with attend_with(model, fn): …` runs every layer's attention as fn(layer, q, k, v, mask)
    instead of kvlab.attention.attention (fn may call it): q (B, H, T, D), k and v (B, H_kv, S, D)
    as the cache hands them back, mask (bool, True = may see) or None."""
    def at(layer: int):
        return lambda q, k, v, mask: fn(layer, q, k, v, mask)

    saved = [block.attn.attend for block in model.layers]
    try:
        for i, block in enumerate(model.layers):
            block.attn.attend = at(i)
        yield model
    finally:
        for block, attend in zip(model.layers, saved, strict=True):
            block.attn.attend = attend


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matrix."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.ffn = FeedForward(config)

    def forward(self, x, cos, sin, masking, cache=None, layer: int = 0):
        x = x + self.attn(self.attn_norm(x), cos, sin, masking, cache, layer)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """The decoder. `config` is a ModelConfig or the name of a preset ("tiny-mha")."""

    def __init__(self, config: ModelConfig | str):
        super().__init__()
        config = resolve(config)
        if config.kv_latent_dim is not None:
            raise ValueError(
                f"{config.name or 'this config'} has kv_latent_dim={config.kv_latent_dim} (MLA, "
                "multi-head latent attention), which kvlab's model does not implement: it would "
                "build plain attention with a cache far larger than the latent one. Size an MLA "
                "cache with kvlab.memory.kv_cache_bytes(config, …), or drop kv_latent_dim to "
                "build the plain-attention model of this shape")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        # Not part of the weights: rebuilt from the config, so not saved in state_dict.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, cache=None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for input_ids (B, T).

        With a cache, input_ids are the tokens after those already cached (a prompt to prefill,
        or one new token to decode). `attention_mask` (B, cached + T), 1 for real tokens and 0 for
        padding, lets a batch hold prompts of different lengths (left-padded). A cache that must
        evict between tokens (`cache.max_chunk`) is fed in several passes; the logits are the same
        as one pass would give.
        """
        input_ids = self._check_ids(input_ids)
        b, t = input_ids.shape
        if attention_mask is not None:
            attention_mask = _check_padding(attention_mask, (b, (cache.seq_len if cache else 0) + t),
                                            input_ids.device)
        if cache is None:
            return self._forward(input_ids, None, attention_mask)
        if not callable(getattr(cache, "check_compatible", None)):  # a kind name, a number, ...
            raise ValueError(f"cache={cache!r:.60} is not a kvlab cache: build one (e.g. "
                             "kvlab.cache.make_cache('static', model.config, batch, max_len)) or pass None")
        cache.check_compatible(self.config, b, self.embed.weight.dtype, input_ids.device)
        if cache.renumbers_positions and attention_mask is not None:
            raise ValueError(f"{type(cache).__name__} numbers positions by their place in the cache, "
                             "which padding would shift: it takes no attention_mask (use one sequence "
                             "a cache, or positions='original')")
        logits, done = [], 0
        while done < t:  # one pass, unless the cache must evict between tokens
            n = cache.max_chunk(t - done)
            seen = cache.seq_len + n
            logits.append(self._forward(input_ids[:, done:done + n], cache,
                                        None if attention_mask is None else attention_mask[:, :seen]))
            done += n
        return logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)

    def _forward(self, input_ids, cache, attention_mask) -> torch.Tensor:
        b, t = input_ids.shape
        device = input_ids.device
        start = 0 if cache is None else cache.seq_len  # stream position of the first new token
        positions, keep = self._rope_positions(b, t, start, cache, attention_mask, device)
        # The last RoPE position: the stream's, unless the cache renumbers them (then read it).
        last = int(positions[-1]) if cache is not None and cache.renumbers_positions else start + t - 1
        if last >= self.config.max_seq_len:
            raise ValueError(f"sequence of {last + 1} tokens exceeds "
                             f"max_seq_len={self.config.max_seq_len}")
        cos = self.rope_cos[positions].to(self.embed.weight.dtype)
        sin = self.rope_sin[positions].to(self.embed.weight.dtype)
        masking = _Masking(start, t, device, keep, self.config.n_rep)
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, masking, cache, i)
        return self.lm_head(self.norm(x))

    def _check_ids(self, input_ids) -> torch.Tensor:
        """input_ids when they are a valid (B, T) batch of token ids (as int64 or int32), or a clear
        error: a list, a 1-D tensor, an empty batch, floats or ids outside the vocabulary would
        otherwise fail deep inside PyTorch, or (floats) be truncated to other tokens."""
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError(f"input_ids must be a (batch, tokens) tensor of token ids; got a "
                             f"{type(input_ids).__name__} (wrap a list: torch.tensor([ids]))")
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            hint = " (add a batch dimension: ids[None])" if input_ids.dim() == 1 else ""
            raise ValueError(f"input_ids must be (batch, tokens) with at least one of each; got "
                             f"shape {tuple(input_ids.shape)}{hint}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids; got dtype {input_ids.dtype}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            input_ids = input_ids.long()
        if not torch.compiler.is_compiling():
            if input_ids.numel() == 1:  # the decode step of one sequence: one read, not a reduction
                low = high = int(input_ids)
            else:
                low, high = (int(x) for x in torch.aminmax(input_ids))
            vocab = self.config.vocab_size
            if low < 0 or high >= vocab:
                raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary: "
                                 f"allowed 0..{vocab - 1}")
        return input_ids

    def _rope_positions(self, b, t, start, cache, keep, device):
        """RoPE positions of the new tokens, (T,) or (B, 1, T), and the padding mask (B, start + T)
        as given (None without one). Padding does not count: a row's first real token is position 0."""
        if keep is None:
            positions = (torch.arange(start, start + t, device=device) if cache is None
                         else cache.rope_positions(t, device))
            return positions, None
        return (keep.long().cumsum(-1) - 1).clamp(min=0)[:, None, start:], keep

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def store_weights_input_major(self) -> Transformer:
        """Keep every weight matrix in memory transposed, as (in, out) rows, with its shape and values
        unchanged (a transposed view of a transposed copy). Why: a decode step on the CPU is a chain of
        matrix-vector products that stream the weights, and the CPU's BLAS streams short-row matrices
        up to twice as fast in that layout (SmolLM2's 49,152 × 576 output layer: 12 ms a step as
        stored by PyTorch, 7 ms transposed). For a few rows at once the CPU's BLAS may pick slower
        kernels in this layout (six rows: 49 ms against 34 for that layer), so it is a choice for
        batch-1 decoding, not a default. Same logits; costs one copy while it runs. Returns self."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.is_contiguous():
                module.weight.data = module.weight.data.t().contiguous().t()
        return self


def _check_padding(attention_mask, shape: tuple[int, int], device) -> torch.Tensor:
    """attention_mask (1 = token, 0 = padding, on the left) as a bool tensor of `shape`, or a clear
    error: wrong shape or values, right padding, a row that is all padding."""
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a tensor; got a {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; "
                         f"expected (batch, cached + new) = {shape}")
    keep = attention_mask.to(device=device, dtype=torch.bool)
    if not torch.equal(keep, attention_mask.to(device)):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (a real token)")
    # Positions count the real tokens from the left: right padding would put a padding row where
    # the next token goes, and give that row a wrong continuation without a word.
    right_padded = (keep[:, :-1] & ~keep[:, 1:]).any(dim=1)
    if bool(right_padded.any()):
        row = int(right_padded.nonzero()[0, 0])
        raise ValueError(f"attention_mask row {row} has a 0 after a 1 (right padding); pad on "
                         "the left: zeros first, then the tokens")
    if not bool(keep[:, -1].all()):
        row = int((~keep[:, -1]).nonzero()[0, 0])
        raise ValueError(f"attention_mask row {row} is all padding: every sequence needs at least "
                         "one real token")
    return keep
