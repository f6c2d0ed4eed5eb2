"""Where a decode step's time goes: `torch.profiler` over decode steps of both of kvlab's paths.

The model's forward with a static cache (what `generate(cache="static")` runs) and the fixed-shape
step (`fast_generate`) each decode `steps` tokens after a prompt, profiled; the rows say, per path and
per PyTorch operator, how many calls a step makes and how much of the step's CPU time the operator
itself takes (self time, so nested calls are not counted twice). On the CPU a batch-1 step is a chain
of matrix-vector products (`aten::mm`, `aten::addmm`) plus hundreds of small operations around
them: the table shows how the time splits between the two.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from ..cache import make_cache
from ..fast import FastDecoder
from ..model import Transformer

GENERATE = "generate (static cache): the model's forward"
FAST = "fast_generate (eager): the fixed-shape step"
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")


@torch.inference_mode()
def decode_profile(model: Transformer, prompt_len: int = 64, steps: int = 16, top: int = 10) -> list[dict]:
    """Rows (sweep "profile") for each path: its `top` operators by self CPU time per step, then one
    row "all operators" with the step's total and the share of it spent in matrix products."""
    device, vocab = model.embed.weight.device, model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    total = prompt_len + steps + 4
    cache, decoder = make_cache("static", model.config, 1, total, model.embed.weight.dtype, device), \
        FastDecoder(model, 1, total)
    model(ids, cache=cache)
    decoder.step(ids, torch.arange(prompt_len, device=device))
    token = ids[:, -1:]
    paths = {GENERATE: lambda pos: model(token, cache=cache),
             FAST: lambda pos: decoder.step(token, torch.tensor([pos], device=device))}
    rows = []
    for method, step in paths.items():
        step(prompt_len)  # warm-up, outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                step(prompt_len + 1 + i)
        rows += _rows(method, prof.key_averages(), steps, top)
    return rows


def _rows(method: str, events, steps: int, top: int) -> list[dict]:
    per_step = sorted(((e.key, e.count / steps, e.self_cpu_time_total / 1e3 / steps) for e in events),
                      key=lambda r: -r[2])
    total_ms = sum(ms for _, _, ms in per_step)
    matmul_ms = sum(ms for op, _, ms in per_step if op in MATMULS)
    rows = [{"sweep": "profile", "method": method, "operator": op, "calls_per_step": calls,
             "self_ms_per_step": ms, "share_of_step": ms / total_ms} for op, calls, ms in per_step[:top]]
    rows.append({"sweep": "profile", "method": method, "operator": "all operators",
                 "calls_per_step": sum(calls for _, calls, _ in per_step), "self_ms_per_step": total_ms,
                 "share_of_step": 1.0, "matmul_share": matmul_ms / total_ms})
    return rows
