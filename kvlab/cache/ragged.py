"""Many sequences of different lengths in one forward pass: a packed view of a paged pool.

A scheduler that batches continuously feeds, in one forward pass, one new token of each decoding
request and a chunk of each prompt being prefilled: rows of different lengths, each already holding
a different number of cached positions. Padding them into a rectangle would compute tokens nobody
asked for. Instead the new tokens of every row are packed end to end into one sequence (batch 1, as
vLLM's flattened batch), and this cache says, through the contract, which key each packed query may
see: only keys of its own row, at or before its own position.

    cache = RaggedPagedKVCache(store)           # store: a PrefixKVStore (the pool and its blocks)
    cache.plan([(table_a, 5, 1), (table_b, 0, 7)])  # row a: 5 cached, 1 new; row b: 7 new
    logits = model(packed_ids, cache=cache)     # packed_ids (1, 8): a's token, then b's seven

Per pass: `update` writes each new K/V into its row's slots (block table × block size + offset) and
hands back the keys of every row end to end; `key_positions` numbers those keys 0..S-1 and
`visible` answers with the plan's mask (same row, key position <= query position). RoPE turns each
token by its position in its own row (`rope_positions`), so `renumbers_positions` is True. The rows'
blocks are owned by whoever made the plan (`kvlab.scheduler`): this view holds no state between
passes, so `crop` and `fork` are refused.
"""

from __future__ import annotations

import torch

from .. import validate
from .base import KVCache
from .paged import blocks_needed
from .prefix import PrefixKVStore


class RaggedPagedKVCache(KVCache):
    """Rows of their own lengths in one packed pass over a PrefixKVStore's pool (see the module)."""

    renumbers_positions = True  # a token's RoPE position is its place in its own row

    def __init__(self, store: PrefixKVStore):
        if not isinstance(store, PrefixKVStore):
            raise ValueError(f"store must be a kvlab.cache.PrefixKVStore (the pool); got "
                             f"{type(store).__name__}")
        self.store, self.config = store, store.config
        self.batch_size, self.dtype, self.device = 1, store.k.dtype, store.k.device
        self.lengths = [0] * store.config.n_layers
        self.allocations = self.bytes_copied = 0
        self.plan([])

    def plan(self, rows) -> None:
        """The next pass: one (block table, cached positions, new tokens) per row, in packed order.
        The table must hold blocks for every position up to cached + new."""
        bs, dev = self.store.block_size, self.device
        new_slots, key_slots, q_row, q_pos, k_row, k_pos = [], [], [], [], [], []
        for i, (table, cached, new) in enumerate(rows):
            cached = validate.integer("cached", cached, low=0)
            new = validate.integer("new", new)
            if len(table) < blocks_needed(cached + new, bs):
                raise ValueError(f"row {i}: its block table has {len(table)} blocks, too few for "
                                 f"{cached + new} positions in blocks of {bs}; take blocks first")
            pos = torch.arange(cached + new, device=dev)
            slots = torch.tensor(table, dtype=torch.long, device=dev)[pos // bs] * bs + pos % bs
            new_slots.append(slots[cached:])
            key_slots.append(slots)
            q_row.append(torch.full((new,), i, device=dev))
            q_pos.append(pos[cached:])
            k_row.append(torch.full((cached + new,), i, device=dev))
            k_pos.append(pos)
        empty = torch.zeros(0, dtype=torch.long, device=dev)

        def cat(xs):
            return torch.cat(xs) if xs else empty

        self.new_slots, self.key_slots = cat(new_slots), cat(key_slots)
        self.positions = cat(q_pos)                                  # (T,) RoPE position of each new token
        q_row, k_row, k_pos = cat(q_row), cat(k_row), cat(k_pos)
        # A query sees the keys of its own row at or before its own position: causal, row by row.
        self.mask = (k_row[None, :] == q_row[:, None]) & (k_pos[None, :] <= self.positions[:, None])
        self.lengths = [0] * self.config.n_layers                     # nothing of this pass fed yet

    @property
    def new_tokens(self) -> int:
        return self.new_slots.numel()

    def update(self, layer, k, v):
        t = self._check_update(layer, k, v)
        if t != self.new_tokens:
            raise ValueError(f"this pass was planned for {self.new_tokens} new tokens, the model fed "
                             f"{t}; call plan() with the rows of this batch first")
        h, d = k.shape[1], k.shape[3]
        k_flat = self.store.k[layer].view(-1, h, d)   # (num_blocks * block_size, H_kv, D)
        v_flat = self.store.v[layer].view(-1, h, d)
        k_flat[self.new_slots] = k[0].transpose(0, 1).to(k_flat.dtype)
        v_flat[self.new_slots] = v[0].transpose(0, 1).to(v_flat.dtype)
        self.lengths[layer] = t
        self.bytes_copied += k.nbytes + v.nbytes
        # Every row's keys end to end: (S, H_kv, D) -> (1, H_kv, S, D).
        return k_flat[self.key_slots].transpose(0, 1)[None], v_flat[self.key_slots].transpose(0, 1)[None]

    def key_positions(self, layer: int) -> torch.Tensor:
        """The keys handed back, numbered 0..S-1 in packed order (`visible` knows their rows)."""
        return torch.arange(self.key_slots.numel(), device=self.device)

    def visible(self, query_positions, key_positions, layer=None) -> torch.Tensor:
        """The plan's mask (T, S): same row, key at or before the query."""
        return self.mask

    def rope_positions(self, t: int, device=None) -> torch.Tensor:
        if t != self.new_tokens:
            raise ValueError(f"this pass was planned for {self.new_tokens} new tokens, not {t}")
        return self.positions.to(device) if device is not None else self.positions

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def crop(self, n: int) -> None:
        raise NotImplementedError("a RaggedPagedKVCache is a view for one pass: its rows' blocks "
                                  "belong to the scheduler, which frees or keeps them itself")

    def fork(self):
        raise NotImplementedError("a RaggedPagedKVCache is a view for one pass and cannot fork; "
                                  "fork the rows' sequences in the store's manager instead")
