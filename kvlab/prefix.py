"""Prefix caching at work: serving requests through a shared-block store, and what sharing saves.

The cache itself (reference-counted blocks, the prefix index, copy-on-write, LRU eviction) is
`kvlab.cache.prefix`. Here:

- `run_request`: one greedy request through a `PrefixKVStore`: look up the longest cached prefix,
  prefill only the rest, decode, index the new full blocks;
- `sharing` / `prefill_flops`: the arithmetic of blocks, bytes and prefill work saved (moving blocks
  to host memory instead: `kvlab.offload`);
- `sample_stream` / `simulate_stream`: the index's hit rate on a stream of requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import validate
from .cache.paged import blocks_needed
from .cache.prefix import PrefixBlockManager, PrefixKVStore, Sequence, SharedPagedKVCache, token_list
from .config import ModelConfig, resolve
from .memory import kv_bytes_per_token
from .roofline import forward_flops
from .sampling import as_batch, check_generate_args, check_model


@dataclass
class Request:
    """What `run_request` did: the new tokens and how many prompt tokens were computed."""

    new_tokens: list[int]
    prompt_len: int
    cached_tokens: int     # prompt tokens whose K/V came from the prefix cache
    computed_tokens: int   # prompt tokens fed through the model (K/V rows computed per layer)
    cache: SharedPagedKVCache


@torch.inference_mode()
def run_request(model, store: PrefixKVStore, prompt, max_new_tokens: int, reuse: bool = True,
                keep: bool = False) -> Request:
    """Greedy decoding of one request through `store`: look up the prompt's longest cached prefix,
    prefill only the tokens after it, decode max_new_tokens, then index the request's full blocks
    for later requests. The request's blocks are released unless `keep` (then call
    `result.cache.release()` when done)."""
    device = next(check_model(model).parameters()).device
    if not isinstance(store, PrefixKVStore):
        raise ValueError(f"store={store!r:.60} is not a PrefixKVStore; build one with "
                         "kvlab.cache.PrefixKVStore(model.config, num_blocks, block_size)")
    prompt = token_list("prompt", prompt)
    keep = validate.boolean("keep", keep)
    # Checked before the store hands out any block: a refused prompt takes nothing from the pool.
    check_generate_args(model.config, as_batch([prompt], device), max_new_tokens)
    cache = store.cache_for(prompt, validate.boolean("reuse", reuse))
    try:
        start = cache.seq_len
        feed = torch.tensor([prompt[start:]], device=device)
        new: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(model(feed, cache=cache)[0, -1].argmax())
            new.append(nxt)
            feed = torch.tensor([[nxt]], device=device)
        cache.finish(prompt + new)
    except BaseException:
        cache.release()  # a failed request gives its blocks back
        raise
    if not keep:
        cache.release()
    return Request(new, len(prompt), start, len(prompt) - start, cache)


# ---- arithmetic: blocks, bytes, prefill work -----------------------------------------------------

@dataclass(frozen=True)
class Sharing:
    """Blocks, bytes and prefill work for `users` requests of prefix + suffix tokens."""

    blocks_alone: int
    blocks_shared: int
    bytes_alone: int
    bytes_shared: int
    prefill_tokens_alone: int
    prefill_tokens_shared: int

    @property
    def saved_fraction(self) -> float:
        return 1 - self.blocks_shared / self.blocks_alone


def sharing(users: int, prefix_len: int, suffix_len: int, block_size: int = 16,
            config: ModelConfig | None = None, dtype: str = "fp16") -> Sharing:
    """Without sharing every user holds ceil((prefix + suffix) / block_size) blocks. With it, the
    prefix's full blocks are held once; each user still has its own blocks from the first block
    that is not a full prefix block on. Bytes use `config`'s K/V bytes per token (0 without)."""
    users = validate.integer("users", users)
    prefix_len = validate.integer("prefix_len", prefix_len, low=0)
    suffix_len = validate.integer("suffix_len", suffix_len)
    block_size = validate.integer("block_size", block_size)
    total = blocks_needed(prefix_len + suffix_len, block_size)
    shared_full = prefix_len // block_size
    alone = users * total
    shared = shared_full + users * (total - shared_full)
    per_block = block_size * (kv_bytes_per_token(config, dtype) if config is not None else 0)
    tokens_alone = users * (prefix_len + suffix_len)
    tokens_shared = tokens_alone - (users - 1) * shared_full * block_size
    return Sharing(alone, shared, alone * per_block, shared * per_block, tokens_alone, tokens_shared)


def prefill_flops(config: ModelConfig | str, n_tokens: int) -> int:
    """FLOPs to compute the K/V of n_tokens (a prefill of them): 2 per weight (a multiply and an
    add) of every layer's matrices per token, as `kvlab.roofline.forward_flops` counts them, without
    the LM head (K and V do not need the logits) and without the embedding (a lookup). Attention's own
    score and weighted-sum work, which grows with the context, is left out (for a 512-token prefix of
    Llama-3-8B about 2 % of this total as `forward_flops` counts it, 1 % counting only the causal
    half)."""
    config, n_tokens = resolve(config), validate.integer("n_tokens", n_tokens, low=0)
    if n_tokens == 0:
        return 0
    lm_head = 2 * config.d_model * config.vocab_size * n_tokens
    return forward_flops(config, n_tokens).linear - lm_head


# ---- a stream of requests: the index's hit rate --------------------------------------------------

def sample_stream(n_requests: int, n_prefixes: int = 8, prefix_len: int = 512, suffix_len: int = 64,
                  skew: float = 1.0, seed: int = 0, vocab: int = 32000) -> list[list[int]]:
    """Token lists: each request picks one of n_prefixes shared prefixes (system prompts) with a
    Zipf-like popularity (prefix i chosen with weight 1 / (i + 1)**skew) and adds a suffix of
    random tokens of its own. An assumption of this course, not a measured workload."""
    n_requests = validate.integer("n_requests", n_requests)
    n_prefixes = validate.integer("n_prefixes", n_prefixes)
    prefix_len = validate.integer("prefix_len", prefix_len, low=0)
    suffix_len = validate.integer("suffix_len", suffix_len)
    skew = validate.number("skew", skew, low=0)
    vocab = validate.integer("vocab", vocab)
    rng = np.random.default_rng(None if seed is None else validate.integer("seed", seed, low=0))
    prefixes = rng.integers(0, vocab, size=(n_prefixes, prefix_len)).tolist()
    weights = 1 / np.arange(1, n_prefixes + 1) ** skew
    picks = rng.choice(n_prefixes, size=n_requests, p=weights / weights.sum())
    return [prefixes[i] + rng.integers(0, vocab, size=suffix_len).tolist() for i in picks]


@dataclass(frozen=True)
class StreamResult:
    hit_rate: float        # prompt tokens found in the index ÷ prompt tokens
    computed_tokens: int   # prompt tokens whose K/V had to be computed
    prompt_tokens: int
    evictions: int


def simulate_stream(requests, num_blocks: int, block_size: int = 16, output_len: int = 0,
                    concurrent: int = 1) -> StreamResult:
    """Serve `requests` (token lists) in order, `concurrent` at a time, through a
    PrefixBlockManager of num_blocks blocks: each looks up its longest cached prefix, takes
    blocks for the rest, generates output_len tokens (new tokens, never shared), indexes its full
    blocks and ends. Only block bookkeeping: no K/V is computed."""
    concurrent = validate.integer("concurrent", concurrent)
    output_len = validate.integer("output_len", output_len, low=0)
    requests = _request_list(requests)
    m = PrefixBlockManager(num_blocks, block_size)
    running: list[Sequence] = []
    fresh = 1 << 40  # generated tokens: ids no prompt uses
    for tokens in requests:
        if len(running) == concurrent:
            m.free(running.pop(0))
        seq = m.new_sequence(tokens)
        m.register(seq)
        for _ in range(output_len):
            m.append(seq, fresh)
            fresh += 1
        m.register(seq)
        running.append(seq)
    prompt = m.queried_tokens
    return StreamResult(m.hit_rate, prompt - m.hit_tokens, prompt, m.evictions)


def _request_list(requests) -> list:
    """requests as a list of token lists; one list of ids (a single request), text or a number is
    refused: each request must be a list of ids of its own."""
    rows = (list, tuple, torch.Tensor, np.ndarray)
    listed = None if isinstance(requests, (str, bytes)) or not hasattr(requests, "__iter__") \
        else list(requests)
    if listed is None or not all(isinstance(r, rows) for r in listed):
        raise ValueError(f"requests={requests!r:.60} must be a list of requests, each a list of token "
                         "ids (sample_stream makes one)")
    return listed
