"""Scheduler throughput (`kvlab.scheduler`) on this machine: one stream of requests, all waiting at
the start (the engine's capacity, not the arrival rate, sets the time), served one request at a
time, in static batches, and by continuous batching under several policies; the runs interleaved,
CPU time, medians with their spread, every output checked identical to the request generated alone."""

from __future__ import annotations

import random

from ..scheduler import Request, Scheduler, alone, static_batching
from .sweeps import result_row
from .timing import median, time_interleaved

SEQUENTIAL = "one at a time"


def scheduler_stream(encode, n_requests: int = 16, prompt_lens=(16, 128), output_lens=(8, 48),
                     seed: int = 0) -> list[Request]:
    """n_requests requests from windows of the corpus's held-out split: prompt and output lengths
    drawn uniformly from the given (low, high) ranges, all arriving at time 0."""
    from ..pretrained import corpus_text

    text = corpus_text("held_out")
    rng = random.Random(seed)
    out = []
    for _ in range(n_requests):
        start = rng.randrange(0, len(text) - 4 * prompt_lens[1])
        prompt = encode(text[start:start + 4 * prompt_lens[1]])[:rng.randint(*prompt_lens)]
        out.append(Request(prompt, rng.randint(*output_lens)))
    return out


def scheduler_policies(requests: list[Request], block_size: int = 16,
                       static_batch: int = 8) -> dict[str, dict]:
    """Scheduler settings by label: a roomy pool with a large and a small token budget, the large one
    also capped at the static batches' size (so scheduling alone is compared with static batching, not
    a bigger batch), and a pool of about a third of what the stream needs at once, preempting by
    recompute or by swap."""
    need = sum(-(-(len(r.prompt) + r.max_new_tokens) // block_size) for r in requests)
    longest = max(-(-(len(r.prompt) + r.max_new_tokens) // block_size) for r in requests)
    tight = max(longest, need // 3)
    return {"continuous, budget 512": dict(num_blocks=need, token_budget=512),
            f"continuous, budget 512, at most {static_batch} at once":
                dict(num_blocks=need, token_budget=512, max_batch=static_batch),
            "continuous, budget 64": dict(num_blocks=need, token_budget=64),
            f"continuous, {tight} blocks, recompute": dict(num_blocks=tight, token_budget=512),
            f"continuous, {tight} blocks, swap": dict(num_blocks=tight, token_budget=512,
                                                      preemption="swap")}


def sweep_scheduler(model, label: str, requests: list[Request], repeats: int = 3, clock: str = "cpu",
                    static_batch: int = 8, block_size: int = 16, progress: bool = False) -> list[dict]:
    """Rows: output tokens per second of each way of serving `requests` (median of the repeats), the
    speed-up over one request at a time, the median TTFT and TPOT on the run's own clock, the
    preemptions and wasted tokens, and whether every output is the request's own greedy output."""
    reference = [alone(model, r) for r in requests]
    static = f"static, batches of {static_batch}"
    servers = {SEQUENTIAL: lambda: static_batching(requests, model, 1, clock),
               static: lambda: static_batching(requests, model, static_batch, clock)}
    for name, kw in scheduler_policies(requests, block_size, static_batch).items():
        sched = Scheduler(model, block_size=block_size, clock=clock, **kw)
        servers[name] = (lambda sched=sched: sched.run(requests))
    runs: dict = {}

    def timed(name: str):
        def call():
            runs[name] = servers[name]()
        return call

    fns = {name: timed(name) for name in servers}
    device = next(model.parameters()).device
    times = time_interleaved(fns, repeats, 1, device, progress, f"scheduler, {label}", clock)
    tokens = sum(r.max_new_tokens for r in requests)
    base = median(times[SEQUENTIAL])
    rows = []
    for name, t in times.items():
        run = runs[name]
        s = run.summary()
        rows.append(result_row("scheduler", name, t, tokens, model=label, requests=len(requests), clock=clock,
                               speedup_vs_one_at_a_time=base / median(t), ttft_median_s=s["ttft_median"],
                               tpot_median_s=s["tpot_median"], preemptions=s["preemptions"],
                               wasted_tokens=run.wasted_tokens, peak_blocks=s["peak_blocks"],
                               tokens_identical=run.outputs == reference))
    return rows


def scheduler_kvlab_tiny(n_requests: int = 16, repeats: int = 3, clock: str = "cpu", progress: bool = False,
                         device="cpu", quick: bool = False) -> list[dict]:
    """sweep_scheduler on kvlab-tiny (byte tokens)."""
    from ..generate import encode_bytes
    from ..pretrained import load

    model = load("kvlab-tiny", device=device)
    lens = dict(prompt_lens=(4, 16), output_lens=(2, 8)) if quick else {}
    requests = scheduler_stream(encode_bytes, 4 if quick else n_requests, **lens)
    return sweep_scheduler(model, "kvlab-tiny", requests, repeats, clock, progress=progress)


def scheduler_real_model(n_requests: int = 6, repeats: int = 2, clock: str = "cpu", progress: bool = False,
                         device=None, quick: bool = False) -> list[dict]:
    """sweep_scheduler on the course's real model, a small stream (prompts 16–64 tokens, answers 8–24)."""
    from ..course_model import load_course_model

    model, tokenizer = load_course_model(device=device)

    def encode(text: str) -> list[int]:
        return tokenizer(text)["input_ids"]

    lens = dict(prompt_lens=(4, 8), output_lens=(2, 4)) if quick else dict(prompt_lens=(16, 64),
                                                                           output_lens=(8, 24))
    requests = scheduler_stream(encode, 2 if quick else n_requests, **lens)
    return sweep_scheduler(model, model.config.name or "real model", requests, repeats, clock,
                           static_batch=4, progress=progress)
