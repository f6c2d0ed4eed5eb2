"""Sampling from a language model: the one decode loop that `kvlab.generate` and `kvlab.fast` share.

`decode_loop` turns a forward function (tokens in, logits of the last position out) into a
continuation: feed the prompt, choose the next token, feed it back, repeat. How a forward pass is
computed (no cache, a cache object, the fixed-shape step of `kvlab.fast`) is the caller's business;
how the next token is chosen is `pick_next_token`'s (greedy, or sampled with a temperature and top-k).
The prompt and the sampling arguments are checked here too, once, for both callers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .model import Transformer
from .validate import integer, number

# Below this a temperature only pushes logits / temperature towards float overflow (softmax of inf
# is NaN): at 1e-4 sampling already picks the top token unless another logit is within ~1e-3 of it.
MIN_TEMPERATURE = 1e-4
# torch.Generator takes 0 … 2**64 - 1 and silently wraps negative seeds; kvlab accepts the seeds
# every 64-bit integer type holds, so a seed means the same thing wherever it is stored.
MAX_SEED = 2**63 - 1

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_model(model) -> Transformer:
    """`model` when it is a kvlab Transformer; a name, a config or None is refused up front (it
    would otherwise fail on its first attribute with an AttributeError)."""
    if not isinstance(model, Transformer):
        raise ValueError(f"model={_short(model)} must be a kvlab Transformer "
                         "(e.g. kvlab.pretrained.load('kvlab-tiny'))")
    return model


def token_ids(model, input_ids) -> torch.Tensor:
    """input_ids as a checked (B, T) long tensor on the model's device, every id in the model's
    vocabulary (text, floats and ragged rows are refused, as generate refuses them)."""
    ids = as_batch(input_ids, next(check_model(model).parameters()).device)
    vocab = model.config.vocab_size
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must lie in 0..{vocab - 1}; got min {lo}, max {hi}")
    return ids


def as_batch(input_ids, device=None) -> torch.Tensor:
    """Accept a list of token ids, a list of equal-length lists, a 1-D or a (B, T) integer tensor;
    return a (B, T) long tensor. Anything else is refused with a message saying what to do."""
    if isinstance(input_ids, (str, bytes)):
        raise ValueError(f"input_ids={_short(input_ids)} is text, not token ids: encode it first, "
                         "e.g. kvlab.generate.encode_bytes(text) for the byte-level kvlab-tiny")
    try:
        ids = torch.as_tensor(input_ids, device=device)
    except (ValueError, TypeError, RuntimeError) as err:
        lengths = _row_lengths(input_ids)
        if lengths is not None and len(set(lengths)) > 1:
            raise ValueError(f"input_ids rows have different lengths {lengths}: pad them on the left "
                             "to one length and pass an attention_mask (1 = token, 0 = padding)") from None
        raise ValueError(f"input_ids={_short(input_ids)} is not a list or tensor of token ids "
                         f"({err})") from None
    if ids.numel() and (ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex()):
        raise ValueError(f"token ids must be integers; got dtype {ids.dtype} "
                         f"(e.g. {_short(ids.flatten()[:3].tolist())}): pass ints or a long tensor")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}; expected a list of ids (T,) "
                         "or a batch (B, T)")
    if ids.shape[0] == 0:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}: a batch of 0 sequences; "
                         "pass at least one")
    if ids.shape[1] == 0:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}: an empty prompt; "
                         "pass at least one token")
    return ids.long()


def check_generate_args(config, ids: torch.Tensor, max_new_tokens, eos_token_id=None) -> int:
    """Refuse ids outside the vocabulary, a bad max_new_tokens or EOS id, or a total beyond the
    model's max_seq_len. Returns max_new_tokens as an int."""
    max_new_tokens = integer("max_new_tokens", max_new_tokens, 1)
    vocab = config.vocab_size
    if eos_token_id is not None:
        integer("eos_token_id", eos_token_id, 0, vocab - 1)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must lie in 0..{vocab - 1}; got min {lo}, max {hi}")
    total = ids.shape[1] + max_new_tokens
    if total > config.max_seq_len:
        raise ValueError(f"prompt of {ids.shape[1]} + max_new_tokens={max_new_tokens} = {total} "
                         f"tokens exceeds the model's max_seq_len={config.max_seq_len}")
    return max_new_tokens


def check_sampling(temperature, top_k, seed) -> tuple[float, int | None, int | None]:
    """temperature 0 (greedy) or >= MIN_TEMPERATURE, finite; top_k None or an integer >= 1;
    seed None or an integer in [0, 2**63 - 1]."""
    temperature = number("temperature", temperature, 0.0)
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature={temperature!r} is too small to sample with: use 0 for greedy "
                         f"decoding, or a temperature >= {MIN_TEMPERATURE}")
    top_k = None if top_k is None else integer("top_k", top_k, 1)
    seed = None if seed is None else integer("seed", seed, 0, MAX_SEED)
    return temperature, top_k, seed


def make_generator(seed: int | None, device) -> torch.Generator | None:
    """A random generator seeded with `seed` on `device` (None: PyTorch's global one)."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def pick_next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token id of each sequence from its logits (B, vocab): the largest at temperature 0,
    otherwise drawn from softmax(logits / temperature), restricted to the top_k largest if given."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def decode_loop(forward: Forward, prompt: torch.Tensor, max_new_tokens: int, *, naive: bool = False,
                temperature: float = 0.0, top_k: int | None = None,
                generator: torch.Generator | None = None, eos_token_id: int | None = None,
                on_token: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Tokens (B, T_prompt + T_new): the prompt, then up to max_new_tokens chosen one at a time.

    forward(feed, positions) gets tokens feed (B, T) at positions (T,) and returns the logits of
    the last one (B, vocab). The first call feeds the prompt (prefill); later calls feed the token
    just chosen (cached decoding) or, with naive=True, the whole sequence so far (no cache).
    With eos_token_id, a finished row keeps getting it, and the loop stops once every row is done.
    on_token(step, new_ids) is called after each step. Nothing here waits for a GPU except the
    EOS check (one small sync a step) and what on_token does.
    """
    batch, prompt_len = prompt.shape
    out = torch.empty(batch, prompt_len + max_new_tokens, dtype=torch.long, device=prompt.device)
    out[:, :prompt_len] = prompt
    done = None if eos_token_id is None else torch.zeros(batch, dtype=torch.bool, device=prompt.device)
    feed, positions = prompt, torch.arange(prompt_len, device=prompt.device)
    for step in range(max_new_tokens):
        nxt = pick_next_token(forward(feed, positions), temperature, top_k, generator)
        if done is not None:
            nxt = nxt.masked_fill(done, eos_token_id)
            done |= nxt == eos_token_id
        t = prompt_len + step
        out[:, t] = nxt
        if on_token is not None:
            on_token(step, nxt)
        if done is not None and bool(done.all()):
            return out[:, :t + 1].contiguous()
        if naive:  # everything again
            feed = out[:, :t + 1]
        else:      # the new token only, at the next position (updated in place: no new tensor)
            feed = nxt[:, None]
            positions = positions[-1:] + 1 if step == 0 else positions.add_(1)
    return out


def _row_lengths(rows) -> list[int] | None:
    try:
        return [len(r) for r in rows]
    except TypeError:
        return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

