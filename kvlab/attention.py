"""Attention maths: the explicit teaching version, the fast path, the causal mask and `repeat_kv`.

Shapes: q is (B, H, T, D); k and v are (B, H_kv, S, D) with S >= T (S - T earlier tokens come
from the cache). A boolean mask is True where a query may look at a key.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import validate


def causal_mask(q_len: int, k_len: int, device=None) -> torch.Tensor:
    """(q_len, k_len) bool mask: the last q_len of k_len positions each see themselves and earlier."""
    q_len = validate.integer("q_len", q_len, low=0)
    k_len = validate.integer("k_len", k_len, low=0)
    if q_len > k_len:
        raise ValueError(f"q_len={q_len} must be <= k_len={k_len}")
    offset = k_len - q_len
    rows = torch.arange(q_len, device=device)[:, None] + offset
    cols = torch.arange(k_len, device=device)[None, :]
    return cols <= rows


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> (B, H_kv * n_rep, S, D): each KV head serves n_rep query heads (GQA)."""
    if n_rep == 1:
        return x
    n_rep = validate.integer("n_rep", n_rep)
    b, h_kv, s, d = x.shape
    return x[:, :, None].expand(b, h_kv, n_rep, s, d).reshape(b, h_kv * n_rep, s, d)


def naive_attention(q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ / √d) V written out step by step, for teaching."""
    _check_shapes(q, k, v)
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return weights @ v  # (B, H, T, D)


# PyTorch >= 2.5 lets scaled_dot_product_attention share K/V heads itself (enable_gqa), with no copy.
_SDPA_SHARES_HEADS = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def shares_heads_without_copy(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `attention` hands K/V with H_kv heads straight to SDPA (enable_gqa=True) instead of
    copying them to H heads with `repeat_kv`. On the CPU always (PyTorch >= 2.5): chapter 04 measured
    the copy making a GQA step several times slower. On a GPU only without a mask: with a mask its
    fused kernels may not take enable_gqa, and the fallback is the unfused maths."""
    return _SDPA_SHARES_HEADS and (q.device.type == "cpu" or mask is None)


def attention(q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The same maths through PyTorch's fused `scaled_dot_product_attention`. With GQA (fewer K/V
    heads than query heads) the kernel maps query head h to K/V head h // n_rep itself where it can
    (see `shares_heads_without_copy`), so the cache is read once per group, not copied."""
    _check_shapes(q, k, v)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1 and shares_heads_without_copy(q, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                          attn_mask=mask)


def _check_shapes(q, k, v) -> None:
    """Refuse q, k, v that cannot be attended (a few integer comparisons: cheap next to attention)."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ValueError(f"q, k, v must be (batch, heads, tokens, head_dim); got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} cannot attend over k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "k and v must match, share q's batch and head_dim, and have a number of heads "
                         "that divides q's")
