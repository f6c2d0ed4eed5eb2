"""A cached decode, recorded step by step: what the cache holds and what the new token looks at.

`record(model, prompt, max_new_tokens)` runs greedy generation with a cache (the same loop as
`generate(..., cache="dynamic")`: prefill the prompt, then one token a step) and keeps, for every
step, what a learner wants to see:

- the tokens so far and the token fed at this step (the newest one);
- every layer's K and V cache rows (one row per position: the prompt's rows from the prefill, then
  one more per decode step; rows never change once written, which is why caching works);
- the newest token's attention weights over all cached positions, per layer and query head,
  recomputed from its query and the cached keys with kvlab's own maths (RoPE, `repeat_kv`);
- running counts: K/V rows computed so far by the naive decoder (every token again at every step)
  and by the cached one (each token once), and the bytes the cache holds.

Frame 0 is the prefill (the newest token is the prompt's last); frame j feeds the j-th generated
token. `len(trace)` = max_new_tokens frames (the last generated token is never fed back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import validate
from .attention import attention, repeat_kv
from .cache import DynamicKVCache
from .generate import generate
from .model import Transformer, attend_with
from .sampling import as_batch, check_model


@dataclass(frozen=True)
class Frame:
    """The state after one step of a cached decode (see `DecodeTrace`)."""

    step: int                  # 0 = prefill, j = j-th decode step
    tokens: list[int]          # every token fed so far (prompt + generated ones fed back)
    fed: int                   # how many tokens this step fed (the prompt length, then 1)
    next_token: int            # the token this step predicted (greedy)
    keys: torch.Tensor         # (layers, KV heads, positions, head_dim): the K cache after the step
    values: torch.Tensor       # same shape: the V cache
    attention: torch.Tensor    # (layers, query heads, positions): the newest token's weights
    naive_rows: int            # K/V rows per layer the naive decoder computed up to this step
    cached_rows: int           # K/V rows per layer the cached decoder computed up to this step
    cache_bytes: int           # bytes the cache holds after this step (K and V, all layers)

    @property
    def positions(self) -> int:
        """Positions in the cache: one row per token fed so far."""
        return len(self.tokens)


@dataclass(frozen=True)
class DecodeTrace:
    """All frames of one recorded decode; index it like a list: `trace[step]` is a Frame."""

    prompt_len: int
    tokens: list[int]           # prompt + every generated token
    keys: torch.Tensor          # (layers, KV heads, all positions, head_dim), the final cache
    values: torch.Tensor
    attention: torch.Tensor     # (steps, layers, query heads, all positions); 0 beyond each step's
    cache_bytes: list[int]      # per step
    n_rep: int                  # query heads per KV head (GQA)

    def __len__(self) -> int:
        return self.attention.shape[0]

    def __getitem__(self, step: int) -> Frame:
        step = validate.integer("step", step, low=0, high=len(self) - 1)
        filled = self.prompt_len + step
        return Frame(step=step, tokens=self.tokens[:filled], fed=self.prompt_len if step == 0 else 1,
                     next_token=self.tokens[filled], keys=self.keys[:, :, :filled],
                     values=self.values[:, :, :filled], attention=self.attention[step, :, :, :filled],
                     naive_rows=naive_rows(self.prompt_len, step), cached_rows=filled,
                     cache_bytes=self.cache_bytes[step])

    def kv_head(self, head: int) -> int:
        """The KV head whose keys and values query head `head` reads."""
        return head // self.n_rep


def naive_rows(prompt_len: int, step: int) -> int:
    """K/V rows per layer the naive decoder computes in steps 0..step: P + (P+1) + … + (P+step)."""
    return (step + 1) * prompt_len + step * (step + 1) // 2


def attention_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax(q Kᵀ / √d) for queries q (B, H, T, D) over keys k (B, H_kv, S, D), without a mask:
    the weights of the *last* query, which may look at every cached position."""
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1)


@torch.inference_mode()
def record(model: Transformer, prompt, max_new_tokens: int) -> DecodeTrace:
    """Record a greedy cached decode of `prompt` (token ids, one sequence) for max_new_tokens steps."""
    max_new_tokens = validate.integer("max_new_tokens", max_new_tokens, low=1)
    ids = as_batch(prompt, next(check_model(model).parameters()).device)
    if ids.shape[0] != 1:
        raise ValueError(f"record() follows one sequence; the prompt has batch {ids.shape[0]}")
    expected = generate(model, ids, max_new_tokens, cache="dynamic")  # checks the arguments too
    cache = DynamicKVCache(model.config)
    newest: dict[int, torch.Tensor] = {}

    def recorder(layer, q, k, v, mask):  # the newest token's query against every cached key
        newest[layer] = attention_weights(q[:, :, -1:], k)[0, :, 0]
        return attention(q, k, v, mask)

    weights, sizes, feed, tokens = [], [], ids, ids[0].tolist()
    with attend_with(model, recorder):
        for _ in range(max_new_tokens):
            nxt = int(model(feed, cache=cache)[0, -1].argmax())
            weights.append(torch.stack([newest[i] for i in range(model.config.n_layers)]))
            sizes.append(cache.nbytes)
            tokens.append(nxt)
            feed = torch.tensor([[nxt]], device=ids.device)
    if tokens != expected.tokens[0].tolist():  # the recording must be the decode it claims to be
        raise RuntimeError("the recorded decode differs from generate(); please report this")
    total = ids.shape[1] + max_new_tokens - 1
    attention_all = torch.zeros(max_new_tokens, model.config.n_layers, model.config.n_heads, total)
    for step, w in enumerate(weights):
        attention_all[step, :, :, : w.shape[-1]] = w.cpu()
    keys = torch.stack([k[0] for k in cache.keys]).float().cpu()
    values = torch.stack([v[0] for v in cache.values]).float().cpu()
    return DecodeTrace(prompt_len=ids.shape[1], tokens=tokens, keys=keys, values=values,
                       attention=attention_all, cache_bytes=sizes, n_rep=model.config.n_rep)


# --- byte-level tokens, readably -----------------------------------------------------------------

_SHOWN = {" ": "␣", "\n": "↵", "\t": "⇥"}


def byte_labels(ids) -> list[str]:
    """One short label per byte-level token: the character it is (␣ for a space, ↵ for a newline),
    or, for a byte of a multi-byte UTF-8 character, the character and which byte it is
    ("中 1/3"); bytes of an unfinished or invalid character show as hex ("e4…")."""
    data, labels, i = bytes(int(t) for t in ids), [], 0
    while i < len(data):
        size = _utf8_length(data[i])
        chunk = data[i:i + size] if size else data[i:i + 1]
        valid = size > 0 and all(0x80 <= b < 0xC0 for b in chunk[1:])
        if not valid or (size == 1 and not (chunk.decode() in _SHOWN or chunk.decode().isprintable())):
            labels.append(f"x{data[i]:02x}")  # a control byte, a stray continuation byte, …
            i += 1
        elif len(chunk) < size:              # the first bytes of a character still arriving
            labels += [f"{b:02x} {k + 1}/{size}" for k, b in enumerate(chunk)]
            i += len(chunk)
        elif size == 1:
            labels.append(_SHOWN.get(chunk.decode(), chunk.decode()))
            i += 1
        else:
            char = chunk.decode("utf-8", errors="replace")
            labels += [f"{char} {k + 1}/{size}" for k in range(size)]
            i += size
    return labels


def characters(ids) -> list[tuple[int, int, str]]:
    """Byte-level tokens grouped into what a reader sees: (first token index, tokens, text) per
    character; the first bytes of a character still arriving show as hex ("⟨e5 ad⟩"), a stray or
    control byte as "x80"."""
    labels, out, i = byte_labels(ids), [], 0
    while i < len(labels):
        label = labels[i]
        if " " in label and "/" in label:            # "中 1/3" or, unfinished, "e5 1/3"
            size = int(label.rsplit("/", 1)[1])
            run = min(size, len(labels) - i)
            text = label.split(" ")[0]
            if run < size or "/" not in labels[i + run - 1]:
                text = "⟨" + " ".join(lab.split(" ")[0] for lab in labels[i:i + run]) + "⟩"
            out.append((i, run, text))
            i += run
        else:
            out.append((i, 1, label))
            i += 1
    return out


def readable_text(ids) -> str:
    """Byte-level tokens as text; an unfinished multi-byte character at the end (a Chinese
    character whose first bytes have arrived) shows as its bytes in hex, e.g. "缓存⟨e5 a4⟩"."""
    data = bytes(int(t) for t in ids)
    for cut in range(min(3, len(data)), 0, -1):  # a UTF-8 character has at most 4 bytes
        head, tail = data[:-cut], data[-cut:]
        if _utf8_length(tail[0]) > cut and all(0x80 <= b < 0xC0 for b in tail[1:]):
            return head.decode("utf-8", errors="replace") + "⟨" + " ".join(f"{b:02x}" for b in tail) + "⟩"
    return data.decode("utf-8", errors="replace")


def _utf8_length(first: int) -> int:
    """Bytes in the UTF-8 character that starts with byte `first` (0 for a continuation byte)."""
    if first < 0x80:
        return 1
    if first < 0xC0:
        return 0
    return 2 if first < 0xE0 else 3 if first < 0xF0 else 4
