"""Timing done right: warm-up, CUDA events and synchronize on a GPU, medians, interleaved runs, and
two ways to see a step's fixed cost (counting its operations, fitting time against work)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


def median(values: Sequence[float]) -> float:
    """The middle value (mean of the two middle ones for an even count): robust to outliers."""
    if len(values) == 0:
        raise ValueError("median of no values: time at least one repeat")
    return float(statistics.median(values))


CLOCKS = ("wall", "cpu")


def time_call(fn: Callable[[], object], device: torch.device | str = "cpu", clock: str = "wall") -> float:
    """Seconds one call of fn takes, the GPU's work included (CUDA events + synchronize).

    clock="cpu" (CPU only) counts the CPU time this process used instead of wall time: on a machine
    shared with other busy programs, wall time also counts the time the others held the cores."""
    device = torch.device(device)
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r} is not known; allowed: {', '.join(CLOCKS)}")
    if clock == "cpu":
        if device.type == "cuda":
            raise ValueError("clock='cpu' measures CPU work; GPU timing needs clock='wall'")
        t0 = time.process_time()
        fn()
        return time.process_time() - t0
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                     device: torch.device | str = "cpu", progress: bool = False,
                     desc: str = "", clock: str = "wall") -> dict[str, list[float]]:
    """Time several functions round-robin (A B C, B C A, …): warm-up rounds first, then `repeats`
    timed rounds. Returns every timing, so a caller can take medians and ratios."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    rounds = range(warmup + repeats)
    if progress:
        from tqdm.auto import tqdm
        rounds = tqdm(rounds, desc=desc or "timing", leave=False)
    for r in rounds:
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: nobody always goes first
        for name in order:
            seconds = time_call(fns[name], device, clock)
            if r >= warmup:
                times[name].append(seconds)
    return times


# Operations that change only a tensor's metadata (shape, strides, autograd flags) although their
# schema does not mark them as views: like views, they run no kernel.
_METADATA_ONLY = {"aten::detach", "aten::detach_", "aten::lift_fresh"}


def op_counts(fn: Callable[[], object]) -> dict[str, int]:
    """The PyTorch operations one call of fn dispatches: "total", "views" (a view, a slice or a
    reshape of a contiguous tensor only computes new shape and strides: no kernel runs) and
    "launching", the rest, each of which runs at least one kernel (on a GPU: at least one launch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list = []

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with _Recorder():
        fn()
    views = sum(f.is_view or f.name() in _METADATA_ONLY for f in seen)
    return {"total": len(seen), "views": views, "launching": len(seen) - views}



def fit_step_time(fed_tokens: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares line seconds ≈ overhead + per_token × fed_tokens over naive decoding steps.
    The intercept is the fixed cost of any step (Python, dispatch, launches); the slope is the cost
    of one more token of work. Returns (overhead_s, per_token_s)."""
    if len(fed_tokens) != len(seconds) or len(fed_tokens) < 2:
        raise ValueError(f"need two or more (fed_tokens, seconds) pairs; got {len(fed_tokens)} "
                         f"and {len(seconds)}")
    x = torch.tensor(fed_tokens, dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1)
    overhead, per_token = torch.linalg.lstsq(design, y[:, None]).solution[:, 0].tolist()
    return overhead, per_token
