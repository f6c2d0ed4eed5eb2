"""Attention maths: the explicit teaching version, the fast path, the causal mask and `repeat_kv`.

Shapes: q is (B, H, T, D); k and v are (B, H_kv, S, D) with S >= T (S - T earlier tokens come
from the cache). A boolean mask is True where a query may look at a key.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def causal_mask(q_len: int, k_len: int, device=None) -> torch.Tensor:
    """(q_len, k_len) bool mask: the last q_len of k_len positions each see themselves and earlier."""
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
    b, h_kv, s, d = x.shape
    return x[:, :, None].expand(b, h_kv, n_rep, s, d).reshape(b, h_kv * n_rep, s, d)


def naive_attention(q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ / √d) V written out step by step, for teaching."""
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return weights @ v  # (B, H, T, D)


def attention(q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The same maths through PyTorch's fused `scaled_dot_product_attention`."""
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                          attn_mask=mask)
