"""Speculative decoding against plain greedy decoding (`kvlab.speculative`), side by side: the runs
interleaved, medians with their spread, the tokens checked identical, the acceptance measured, and the
speed-up that Leviathan et al.'s formula expects from that acceptance and the measured pass costs.

Two texts: `held-out` (windows of the corpus's held-out split) and `repeating` (each window, a blank
line, then its start again, so that the continuation copies text the prompt holds, as a summary
quoting its source or a code edit does: where prompt lookup shines)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch

from ..cache import make_cache
from ..drafters import Drafter
from ..generate import generate
from ..pretrained import corpus_text
from ..speculative import expected_speedup, speculative_generate
from .compare import first_divergence
from .sweeps import result_row
from .timing import median, time_interleaved

TEXTS = ("held-out", "repeating")
PLAIN = "plain greedy"


def speculative_prompts(text: str, encode: Callable[[str], list[int]], n_prompts: int, prompt_len: int,
                        repeat_start: int = 8, window_chars: int = 1000) -> list[list[int]]:
    """n_prompts prompts of `text`, from windows spread evenly over the held-out split: "held-out",
    prompt_len tokens of a window; "repeating", a passage of prompt_len tokens, a blank line, then its
    first repeat_start tokens again (a continuation can copy prompt_len - repeat_start tokens)."""
    if text not in TEXTS:
        raise ValueError(f"text={text!r} is not allowed; allowed: {', '.join(map(repr, TEXTS))}")
    source = corpus_text("held_out")
    step = (len(source) - window_chars) // n_prompts
    prompts = []
    for i in range(n_prompts):
        passage = encode(source[i * step:i * step + window_chars])[:prompt_len]
        prompts.append(passage if text == "held-out" else passage + encode("\n\n") + passage[:repeat_start])
    return prompts


def pass_costs(model, drafters: dict[str, Drafter], ks: Sequence[int], context: list[int],
               repeats: int = 5, clock: str = "cpu", calls: int = 20) -> dict:
    """The costs the formula needs, in target decode steps, measured at `context`: `verify[k]`, the
    target's pass over k + 1 tokens; `draft[name][k]`, one `propose(context, k)` of each drafter.
    Timed interleaved, `calls` each a round; each cost is the median over the rounds of its ratio
    to the same round's one-token pass."""
    device = next(model.parameters()).device
    times = time_interleaved(_cost_fns(model, drafters, ks, context, calls), repeats, 1, device, clock=clock)
    return _costs(times, drafters, ks, calls)


def _cost_fns(model, drafters: dict[str, Drafter], ks: Sequence[int], context: list[int],
              calls: int) -> dict:
    """The timed calls behind `pass_costs`, keyed ("pass", "verify", t) for the target's pass over
    t tokens and ("pass", "draft", name, k) for a drafter's propose of k guesses; each makes `calls`
    of them. Every drafter is a shallow copy with its own cache, so that speculative runs timed
    between these calls leave it as it was."""
    device = next(model.parameters()).device
    n = len(context)
    cache = make_cache("static", model.config, 1, n + max(ks) + 1, next(model.parameters()).dtype, device)
    ids = torch.tensor([context], device=device)
    with torch.inference_mode():
        model(ids, cache=cache)

    def target(t: int):
        feed = ids[:, -t:]

        @torch.inference_mode()
        def run():
            for _ in range(calls):
                cache.crop(n - t)
                model(feed, cache=cache)
        return run

    def draft(drafter: Drafter, k: int):
        drafter = copy.copy(drafter)
        drafter.reset(n + k)
        drafter.propose(context, k)  # its cache now holds the context: each call guesses afresh
        return lambda: [drafter.propose(context, k) for _ in range(calls)]

    fns = {("pass", "verify", 1): target(1)}
    fns.update({("pass", "verify", k + 1): target(k + 1) for k in ks})
    fns.update({("pass", "draft", name, k): draft(d, k) for name, d in drafters.items() for k in ks})
    return fns


def _costs(times: dict, drafters: dict[str, Drafter], ks: Sequence[int], calls: int) -> dict:
    """pass_costs' result from the timings of `_cost_fns`' calls: per-round ratios to the one-token
    pass (a round's load is shared by everything timed in it), medians."""
    step = times["pass", "verify", 1]

    def steps(key) -> float:
        return median([t / s for t, s in zip(times[key], step, strict=True)])

    return {"step_s": median(step) / calls,
            "verify": {k: steps(("pass", "verify", k + 1)) for k in ks},
            "draft": {name: {k: steps(("pass", "draft", name, k)) for k in ks} for name in drafters}}


def sweep_speculative(model, label: str, drafters: dict[str, Drafter], prompts: dict[str, list[list[int]]],
                      ks: Sequence[int], new_tokens: int, repeats: int = 3, clock: str = "cpu",
                      progress: bool = False, calls: int = 20) -> list[dict]:
    """Plain greedy decoding vs speculative decoding with each drafter and k, on each text's prompts
    (one timed call decodes all of them): rows with medians, speed-up, tokens checked, acceptance, and
    the formula's expected speed-up from the measured acceptance and pass costs (`pass_costs` at the
    text's first prompt, `calls` a round). The pass costs are timed in the same interleaved rounds as
    the runs, and every ratio is the median of the rounds' ratios: a change of load between rounds
    moves both sides of a ratio alike."""
    rows = []
    for text, batch in prompts.items():
        cost_fns = _cost_fns(model, drafters, ks, batch[0], calls)
        times, results = _time_runs(model, drafters, batch, ks, new_tokens, repeats, clock, progress,
                                    f"speculative, {label}, {text}", cost_fns)
        costs = _costs(times, drafters, ks, calls)
        common = dict(model=label, text=text, prompts=len(batch), new_tokens=new_tokens, clock=clock)
        base = times[PLAIN]
        rows.append(result_row("speculative", PLAIN, base, len(batch) * new_tokens, **common,
                               speedup_vs_plain=1.0))
        for name, k in ((name, k) for name in drafters for k in ks):
            t, runs = times[name, k], results[name, k]
            diverged = [first_divergence(r.tokens, p, len(q))
                        for r, p, q in zip(runs, results[PLAIN], batch, strict=True)]
            accepted, proposed = sum(r.accepted for r in runs), sum(r.proposed for r in runs)
            judged = accepted + sum(len(r.rejections) for r in runs)
            alpha = accepted / judged if judged else float("nan")
            passes = sum(len(r.steps) for r in runs)
            c = costs["draft"][name][k] / k
            rows.append(result_row(
                "speculative", f"speculative, {name}", t, len(batch) * new_tokens, **common, drafter=name,
                k=k, speedup_vs_plain=median([b / x for b, x in zip(base, t, strict=True)]),
                tokens_identical=all(d is None for d in diverged),
                first_divergence=min((d for d in diverged if d is not None), default=None),
                accepted_fraction=accepted / proposed if proposed else float("nan"),
                per_token_acceptance=alpha,
                tokens_per_pass=sum(s.new_tokens for r in runs for s in r.steps) / passes,
                draft_cost=c, verify_cost=costs["verify"][k],
                expected_speedup=expected_speedup(alpha, k, c) if judged else float("nan"),
                expected_speedup_measured_verify=(expected_speedup(alpha, k, c, costs["verify"][k])
                                                  if judged else float("nan"))))
    return rows


def _time_runs(model, drafters: dict[str, Drafter], batch: list[list[int]], ks: Sequence[int],
               new_tokens: int, repeats: int, clock: str, progress: bool, desc: str, also: dict):
    """Time plain decoding of every prompt of `batch`, speculative decoding with each drafter and k,
    and the calls of `also`, interleaved; return the times and the last run's results, by method."""
    results: dict = {}

    def plain():
        results[PLAIN] = [generate(model, p, new_tokens).tokens for p in batch]

    def speculative(name: str, k: int):
        def run():
            results[name, k] = [speculative_generate(model, p, new_tokens, drafters[name], k=k)
                                for p in batch]
        return run

    fns = {PLAIN: plain, **{(name, k): speculative(name, k) for name in drafters for k in ks}, **also}
    device = next(model.parameters()).device
    return time_interleaved(fns, repeats, 1, device, progress, desc, clock), results


def speculative_kvlab_tiny(ks: Sequence[int], new_tokens: int, n_prompts: int = 4, prompt_len: int = 128,
                           repeats: int = 3, clock: str = "cpu", progress: bool = False,
                           device="cpu") -> list[dict]:
    """sweep_speculative on kvlab-tiny with prompt lookup and the kvlab-tiny-draft model."""
    from ..drafters import ModelDrafter, PromptLookupDrafter
    from ..generate import encode_bytes
    from ..pretrained import load

    model = load("kvlab-tiny", device=device)
    drafters = {"prompt lookup": PromptLookupDrafter(), "kvlab-tiny-draft":
                ModelDrafter(load("kvlab-tiny-draft", device=device))}
    prompts = {t: speculative_prompts(t, encode_bytes, n_prompts, prompt_len) for t in TEXTS}
    return sweep_speculative(model, "kvlab-tiny", drafters, prompts, ks, new_tokens, repeats, clock,
                             progress)


def speculative_real_model(ks: Sequence[int], new_tokens: int, n_prompts: int = 2, prompt_len: int = 96,
                           repeats: int = 3, clock: str = "cpu", progress: bool = False,
                           device=None) -> list[dict]:
    """sweep_speculative on the course's real model (kvlab.course_model.load_course_model), with
    prompt lookup and its own first layers as the draft (early exit after 1/2 and 5/6 of its layers)."""
    from ..course_model import load_course_model
    from ..drafters import ModelDrafter, PromptLookupDrafter, early_exit

    model, tokenizer = load_course_model(device=device)
    n = model.config.n_layers
    drafters = {"prompt lookup": PromptLookupDrafter()}
    for layers in sorted({max(1, n // 2), max(1, n * 5 // 6)}):
        drafters[f"first {layers} of {n} layers"] = ModelDrafter(early_exit(model, layers))
    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    prompts = {t: speculative_prompts(t, encode, n_prompts, prompt_len) for t in TEXTS}
    return sweep_speculative(model, model.config.name or "real model", drafters, prompts, ks, new_tokens,
                             repeats, clock, progress)
