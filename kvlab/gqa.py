"""Sharing K and V across query heads: MHA → GQA → MQA, converting a model, and MLA for comparison.

Multi-head attention (MHA) gives every query head its own key and value head; grouped-query
attention (GQA) lets a group of n_rep query heads share one KV head; multi-query attention (MQA)
is the extreme where all query heads share a single KV head. The cache only stores KV heads, so it
shrinks by n_heads / n_kv_heads. Query head h reads KV head h // n_rep (the layout of
`kvlab.attention.repeat_kv`).

`mha_to_gqa` turns a trained model's KV heads into fewer by mean-pooling the K and V projection
heads of each group: the initialisation the GQA paper (Ainslie et al. 2023, arXiv:2305.13245)
uses before *uptraining* (continued training with about 5 % of the pre-training compute). Without
uptraining the pooled model is worse than a model trained with GQA from the start.
"""

from __future__ import annotations

import torch

from . import validate
from .config import ModelConfig, divisors, resolve
from .memory import kv_elements_per_token
from .model import Transformer
from .sampling import check_model


def kv_head_of(query_head: int, n_heads: int, n_kv_heads: int) -> int:
    """The KV head that query head `query_head` reads (same layout as `repeat_kv`)."""
    n_heads = validate.integer("n_heads", n_heads)
    n_kv_heads = _check_divides(n_kv_heads, n_heads)
    query_head = validate.integer("query_head", query_head, low=0, high=n_heads - 1)
    return query_head // (n_heads // n_kv_heads)


def kv_groups(n_heads: int, n_kv_heads: int) -> list[list[int]]:
    """For each KV head, the query heads it serves: kv_groups(8, 2) = [[0, 1, 2, 3], [4, 5, 6, 7]]."""
    n_heads = validate.integer("n_heads", n_heads)
    n_kv_heads = _check_divides(n_kv_heads, n_heads)
    n_rep = n_heads // n_kv_heads
    return [list(range(g * n_rep, (g + 1) * n_rep)) for g in range(n_kv_heads)]


def variants(config: ModelConfig) -> dict[str, ModelConfig]:
    """The same shape with MHA, with its own KV-head count (when that is GQA), with MQA, and, for an
    MLA model, the model itself: what chapter 04 compares.

    Keys are labels: "MHA (64 KV heads)", "GQA (8 KV heads)", "MQA (1 KV head)",
    "MLA (576-element latent)". The MHA/GQA/MQA entries drop an MLA model's latent; a model with one
    query head has one entry, its MHA being its MQA.
    """
    config = resolve(config)
    plain = config.with_(kv_latent_dim=None)
    h, kv = config.n_heads, config.n_kv_heads
    out = {f"MHA ({h} KV head{'s' * (h > 1)})": plain.with_(n_kv_heads=h)}
    if 1 < kv < h:
        out[f"GQA ({kv} KV heads)"] = plain
    if h > 1:
        out["MQA (1 KV head)"] = plain.with_(n_kv_heads=1)
    if config.kv_latent_dim is not None:
        out[f"MLA ({config.kv_latent_dim}-element latent)"] = config
    return out


def gqa_equivalent_kv_heads(config: ModelConfig) -> float:
    """How many KV heads of this head_dim cache as many elements as the model does per layer.

    For an MLA model (DeepSeek-V2: 576-element latent, head_dim 128) this is 576 / (2 × 128) = 2.25:
    its cache is that of GQA with 2.25 groups.
    """
    config = resolve(config)
    per_layer = kv_elements_per_token(config) / config.n_layers
    return per_layer / (2 * config.head_dim)


def mha_ratio(config: ModelConfig) -> float:
    """How many times smaller the cache is than MHA at the same shape (MHA → 1, Llama-2-70B → 8)."""
    config = resolve(config)
    mha = config.with_(n_kv_heads=config.n_heads, kv_latent_dim=None)
    return kv_elements_per_token(mha) / kv_elements_per_token(config)


def pool_kv_heads(weight: torch.Tensor, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Mean-pool the rows of a K or V projection (n_old × head_dim rows) into n_kv_heads heads.

    Works for a weight (rows, d_model) and a bias (rows,). Consecutive old heads form a group, so
    pooled head g stands for the old heads that served the query heads now reading head g.
    """
    rows = weight.shape[0]
    if rows % head_dim:
        raise ValueError(f"{rows} rows is not a whole number of heads of head_dim={head_dim}")
    n_old = rows // head_dim
    n_kv_heads = _check_divides(n_kv_heads, n_old, what="the heads in weight")
    grouped = weight.reshape(n_kv_heads, n_old // n_kv_heads, head_dim, *weight.shape[1:])
    return grouped.mean(dim=1).reshape(n_kv_heads * head_dim, *weight.shape[1:])


def repeat_kv_heads(weight: torch.Tensor, n_rep: int, head_dim: int) -> torch.Tensor:
    """Copy each head's rows of a K or V projection n_rep times (the inverse of pooling copies)."""
    if n_rep < 1:
        raise ValueError(f"n_rep={n_rep} must be >= 1")
    n_old = weight.shape[0] // head_dim
    grouped = weight.reshape(n_old, 1, head_dim, *weight.shape[1:])
    grouped = grouped.expand(n_old, n_rep, head_dim, *weight.shape[1:])
    return grouped.reshape(n_old * n_rep * head_dim, *weight.shape[1:]).clone()


def mha_to_gqa(model: Transformer, n_kv_heads: int) -> Transformer:
    """A copy of `model` with n_kv_heads KV heads, each the mean of the K/V heads of its group.

    Every other weight is copied unchanged. n_kv_heads must divide the model's current number of KV
    heads (for an MHA model: n_heads); n_kv_heads equal to it returns an exact copy.
    """
    cfg = check_model(model).config
    n_kv_heads = _check_divides(n_kv_heads, cfg.n_heads)
    _check_divides(n_kv_heads, cfg.n_kv_heads, what="the model's n_kv_heads")
    return _rebuild(model, cfg.with_(n_kv_heads=n_kv_heads),
                    lambda w: pool_kv_heads(w, n_kv_heads, cfg.head_dim))


def uptrain(model: Transformer, steps: int, text: str, lr: float = 3e-4, batch_size: int = 16,
            context: int = 256, seed: int = 0) -> Transformer:
    """A copy of `model` trained `steps` more steps on `text` (the GQA paper's uptraining after
    pooling; give an unconverted model the same steps as the control). The input is left as it is.

    Plain AdamW at a constant `lr` (the default is kvlab.train's final learning rate), weight decay
    0.1, gradients clipped to norm 1, no dropout; the random windows come from `seed`, so two
    models uptrained with the same seed see the same bytes.
    """

    from .generate import encode_bytes
    from .train import batches, train_step

    check_model(model)
    steps = validate.integer("steps", steps, low=0)
    lr = validate.number("lr", lr, low=0)
    batch_size = validate.integer("batch_size", batch_size)
    context = validate.integer("context", context, high=model.config.max_seq_len)
    student = _rebuild(model, model.config, lambda w: w).train()
    device = next(student.parameters()).device
    data = torch.tensor(encode_bytes(text), dtype=torch.long)
    if data.numel() < context + 2:
        raise ValueError(f"text has {data.numel()} bytes; context={context} needs at least {context + 2}")
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    stream = batches(data, batch_size, context, torch.Generator().manual_seed(seed))
    for _ in range(steps):
        x, y = (t.to(device) for t in next(stream))
        train_step(student, opt, x, y)
    return student.eval()


def gqa_to_mha(model: Transformer) -> Transformer:
    """An MHA copy of a GQA/MQA model: each KV head copied to every query head of its group.

    Exact: the MHA model computes the same attention, just storing each KV head n_rep times.
    """
    cfg = check_model(model).config
    return _rebuild(model, cfg.with_(n_kv_heads=cfg.n_heads),
                    lambda w: repeat_kv_heads(w, cfg.n_rep, cfg.head_dim))


def _rebuild(model: Transformer, new_cfg: ModelConfig, convert) -> Transformer:
    """A new Transformer(new_cfg) holding model's weights, with `convert` applied to K and V rows."""
    cfg = model.config
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            q, k, v = tensor.split([q_rows, kv_rows, kv_rows], dim=0)
            tensor = torch.cat([q, convert(k), convert(v)], dim=0)
        state[name] = tensor.clone()
    param = next(model.parameters())
    with torch.device(param.device):
        new = Transformer(new_cfg).to(param.dtype)
    new.load_state_dict(state)
    return new.train(model.training)


def _check_divides(n_kv_heads, n: int, what: str = "n_heads") -> int:
    """n_kv_heads as an int when it is a positive divisor of n; refused otherwise, listing the
    allowed ones."""
    try:
        n_kv_heads = validate.integer("n_kv_heads", n_kv_heads)
    except ValueError as err:
        raise ValueError(f"{err}; allowed: {divisors(n)}") from None
    if n % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide {what}={n}; allowed: {divisors(n)}")
    return n_kv_heads
