"""What a bounded cache costs in quality: next-token loss with a window, sinks or heavy hitters.

The caches themselves are `kvlab.cache.window.SlidingWindowKVCache` and
`kvlab.cache.heavy_hitters.HeavyHitterKVCache`. Here:

- `token_losses(model, ids, cache)`: next-token loss at every position, with a cache (fed through
  the model, which feeds a bounded cache as its contract asks) or with full attention;
- `POLICIES`, `bounded_cache`, `loss_vs_budget`: the policies compared at one budget of positions;
- `paired_difference`: the mean loss difference of two policies on the same tokens, with its
  standard error over streams or blocks of positions;
- `attention_maps`: the attention weights of every layer, recorded through the model's attention
  seam (`kvlab.model.attend_with`), e.g. to see attention sinks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import validate
from .attention import attention, repeat_kv
from .cache import HeavyHitterKVCache, KVCache, SlidingWindowKVCache
from .cache.window import POSITIONS
from .config import ModelConfig
from .model import attend_with
from .sampling import token_ids


def token_losses(model, input_ids, cache: KVCache | None = None) -> torch.Tensor:
    """Next-token cross-entropy (nats) at every position of input_ids (B, T): (B, T - 1).
    Without a cache the whole sequence goes through the model in one pass (full attention); with one,
    too (a bounded cache that must evict between tokens is fed as its `max_chunk` says)."""
    ids = token_ids(model, input_ids)
    with torch.inference_mode():
        logits = model(ids, cache=cache)
    logits = logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                           reduction="none").view(ids.shape[0], -1)


@torch.inference_mode()
def attention_maps(model, input_ids) -> list[torch.Tensor]:
    """Attention weights of every layer for input_ids (B, T) with full causal attention:
    one (B, H, T, T) tensor a layer (row: query, column: key), recorded at the attention seam."""
    ids = token_ids(model, input_ids)
    maps: list[torch.Tensor] = []

    def record(layer, q, k, v, mask):
        k_all = repeat_kv(k, q.shape[1] // k.shape[1])
        scores = q.float() @ k_all.float().transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        maps.append(torch.softmax(scores, dim=-1))
        return attention(q, k, v, mask)

    with attend_with(model, record):
        model(ids)
    return maps


# ---- comparing policies at one budget ------------------------------------------------------------

# "full" keeps everything; the others keep `budget` positions. By default every policy keeps each key
# at its place in the text (positions="original"), as the heavy-hitter cache always does, so policies
# compared at one budget differ only in which keys they keep. positions="cache" numbers the window
# policies' keys by their place in the cache (StreamingLLM's choice, which lets a stream run past the
# model's trained length); ask for it explicitly. Heavy hitters keep half the budget for the most
# recent tokens (as H2O's experiments do) and choose the other half by score.
POLICIES = ("full", "window", "sinks + window", "heavy hitters")


def bounded_cache(policy: str, config: ModelConfig, batch_size: int, budget: int, sinks: int = 4,
                  dtype=torch.float32, device="cpu", positions: str = "original") -> KVCache | None:
    """The cache of `policy` holding `budget` positions (None for "full": no cache, full attention).
    `positions` ("original" or "cache") is how the window policies number their keys (heavy hitters
    always keep original positions)."""
    validate.choice("policy", policy, POLICIES)
    budget = validate.integer("budget", budget, low=2)
    validate.choice("positions", positions, POSITIONS)
    if policy == "full":
        return None
    if policy == "window":
        return SlidingWindowKVCache(config, batch_size, budget, 0, dtype, device, positions=positions)
    if policy == "sinks + window":
        sinks = validate.integer("sinks", sinks, low=1, high=budget - 1)
        return SlidingWindowKVCache(config, batch_size, budget - sinks, sinks, dtype, device,
                                    positions=positions)
    return HeavyHitterKVCache(config, batch_size, budget, recent=budget // 2, dtype=dtype, device=device)


def loss_vs_budget(model, input_ids, budgets, policies=POLICIES, sinks: int = 4,
                   positions: str = "original", per_stream: bool = False) -> dict[str, list]:
    """Next-token loss (nats) at each position of input_ids (B, T), averaged over the batch, for each
    policy and budget: {policy: [tensor (T - 1,) for each budget]} ("full" is computed once and
    repeated). `.mean()` of one gives the loss over the whole stream. per_stream=True keeps every
    stream: tensors (B, T - 1), for `paired_difference`. `positions` as in `bounded_cache`: the
    default keeps every policy's keys at their original positions (a fair comparison)."""
    ids = token_ids(model, input_ids)
    param = next(model.parameters())
    budgets, policies = _listed("budgets", budgets), _listed("policies", policies)
    budgets = [validate.integer("budget", b, low=2) for b in budgets]
    for policy in policies:  # all checked before the first (slow) pass
        validate.choice("policy", policy, POLICIES)
    validate.choice("positions", positions, POSITIONS)
    per_stream = validate.boolean("per_stream", per_stream)

    def reduce(losses):
        return losses if per_stream else losses.mean(0)

    out: dict[str, list] = {}
    for policy in policies:
        if policy == "full":
            out[policy] = [reduce(token_losses(model, ids))] * len(budgets)
            continue
        out[policy] = [reduce(token_losses(model, ids, bounded_cache(
            policy, model.config, ids.shape[0], b, sinks, param.dtype, param.device, positions)))
            for b in budgets]
    return out


def paired_difference(losses, reference, start: int = 0,
                      block: int | None = None) -> tuple[float, float, int]:
    """Mean of losses - reference (two (B, T) tensors of per-position losses on the same tokens) over
    positions start.., with its standard error: (mean, standard error, units). The units are the
    streams (rows), or with `block` the blocks of `block` consecutive positions of every stream
    (more units from few streams; neighbouring blocks are close to independent, neighbouring
    tokens are not). A trailing part block is left out."""
    a, b = torch.as_tensor(losses, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"losses {tuple(a.shape)} and reference {tuple(b.shape)} must be two (B, T) "
                         "tensors of the same shape (per_stream=True in loss_vs_budget)")
    start = validate.integer("start", start, low=0, high=a.shape[1] - 1)
    d = (a - b)[:, start:]
    if block is not None:
        block = validate.integer("block", block, high=d.shape[1])
        n = d.shape[1] // block
        d = d[:, :n * block].reshape(-1, block)
    units = d.mean(1)
    if units.numel() < 2:
        raise ValueError(f"a standard error needs at least 2 units; got {units.numel()} (use more "
                         "streams or a smaller block)")
    return units.mean().item(), (units.std() / units.numel() ** 0.5).item(), units.numel()


def _listed(name: str, values) -> list:
    """values as a list, refusing one number or one name where a list of them is asked for."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name}={values!r:.60} must be a list, e.g. {name}={EXAMPLES[name]}")
    return list(values)


EXAMPLES = {"budgets": "[16, 64]", "policies": "['full', 'window']"}
