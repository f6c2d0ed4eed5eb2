"""The scheduler (kvlab.scheduler), through its public API: every request's output is its greedy
output generated alone, whatever the arrivals, lengths, budget, pool, batch limit and policy
(hypothesis, float64); the pool is empty at the end and no step breaks its limits; preemption by
recompute re-feeds tokens and by swap does not; the clocks; static batching's padding; refusals."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab import PRESETS, memory, roofline
from kvlab.cache import PrefixKVStore, RaggedPagedKVCache
from kvlab.config import ModelConfig
from kvlab.generate import generate
from kvlab.model import Transformer
from kvlab.scheduler import (
    Request,
    RooflineClock,
    Scheduler,
    alone,
    gpu_pool_blocks,
    poisson_arrivals,
    static_batching,
)

VOCAB = 10
H100_BANDWIDTH = memory.GPUS["H100 80GB"].bandwidth_bytes_per_s
CFG = ModelConfig(n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=VOCAB,
                  max_seq_len=96, name="sched-test")


def random_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(CFG).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.4)
    return model


MODEL = random_model()


def references(model, requests) -> list[list[int]]:
    """Each request's output generated alone: one generate per distinct prompt, at its longest."""
    longest: dict[tuple, int] = {}
    for r in requests:
        longest[tuple(r.prompt)] = max(longest.get(tuple(r.prompt), 0), r.max_new_tokens)
    outs = {p: generate(model, [list(p)], n, cache="static").new_tokens[0].tolist()
            for p, n in longest.items()}
    return [outs[tuple(r.prompt)][:r.max_new_tokens] for r in requests]


@st.composite
def streams(draw):
    """A stream of requests (some sharing a prefix) and a scheduler that can serve them."""
    prefix = draw(st.lists(st.integers(0, VOCAB - 1), max_size=10))
    n = draw(st.integers(1, 6))
    requests = []
    for _ in range(n):
        own = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if prefix else 1, max_size=12))
        prompt = (prefix if draw(st.booleans()) else []) + own or [0]
        requests.append(Request(prompt, draw(st.integers(1, 10)), draw(st.integers(0, 12))))
    block_size = draw(st.integers(1, 5))
    need = max(-(-(len(r.prompt) + r.max_new_tokens - 1) // block_size) for r in requests)
    kw = dict(block_size=block_size, num_blocks=need + draw(st.integers(0, 3 * need)),
              token_budget=draw(st.integers(1, 24)), max_batch=draw(st.integers(1, 6)),
              chunked_prefill=draw(st.booleans()), preemption=draw(st.sampled_from(["recompute", "swap"])),
              prefix_caching=draw(st.booleans()), clock="steps")
    if not kw["chunked_prefill"]:   # a prompt (or a recomputation) must fit one step
        whole = [len(r.prompt) + (0 if kw["preemption"] == "swap" else r.max_new_tokens - 1)
                 for r in requests]
        kw["token_budget"] = max(kw["token_budget"], *whole)
    return requests, kw


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_every_request_gets_its_greedy_output_alone(case):
    requests, kw = case
    sched = Scheduler(MODEL, **kw)
    run = sched.run(requests)
    assert run.outputs == references(MODEL, requests), kw
    # the pool is empty again (cached prefix blocks aside) and no step broke a limit
    assert sched.manager.num_in_use == 0
    for step in run.steps:
        assert 1 <= step.tokens <= kw["token_budget"]
        assert step.running <= kw["max_batch"] and step.blocks_used <= kw["num_blocks"]
    for r in run.results:
        assert r.token_times == sorted(r.token_times) and r.ttft >= 1  # a step costs 1 on this clock
        assert r.token_times[0] >= r.request.arrival
    assert run.fed_tokens == sum(s.tokens for s in run.steps)
    if not kw["prefix_caching"]:
        assert run.wasted_tokens == sum(r.recomputed_tokens for r in run.results) >= 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.integers(1, 4))
def test_static_batching_gives_the_same_outputs(case, batch):
    requests, _ = case
    run = static_batching(requests, MODEL, batch_size=batch, clock="steps")
    assert run.outputs == references(MODEL, requests)
    assert run.wasted_tokens >= 0


def tight_stream():
    """Six requests arriving together into a pool that holds about two of them."""
    prompts = [[1, 2, 3, 4, 5, 6], [2, 3], [3, 1, 4, 1, 5], [9, 8, 7, 6], [5, 5, 5], [0, 1]]
    return [Request(p, 12) for p in prompts]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_when_the_pool_runs_out(mode):
    requests = tight_stream()
    run = Scheduler(MODEL, num_blocks=10, block_size=2, token_budget=16, preemption=mode,
                    clock="steps").run(requests)
    assert run.outputs == references(MODEL, requests)
    kinds = {kind for s in run.steps for _, kind, _ in s.events}
    assert run.preemptions > 0 and max(s.blocks_used for s in run.steps) == 10
    if mode == "swap":
        assert {"swap-out", "swap-in"} <= kinds and run.wasted_tokens == 0
    else:
        assert "preempt" in kinds and run.wasted_tokens > 0
        assert run.wasted_tokens == sum(r.recomputed_tokens for r in run.results)


def test_a_large_pool_never_preempts_and_continuous_batching_needs_fewer_steps():
    requests = tight_stream()
    run = Scheduler(MODEL, num_blocks=64, block_size=2, token_budget=64, clock="steps").run(requests)
    assert run.preemptions == 0 and run.wasted_tokens == 0
    static = static_batching(requests, MODEL, batch_size=6, clock="steps")
    assert len(run.steps) <= len(static.steps) and static.waste > 0


def test_prefix_caching_skips_the_shared_prompt():
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    requests = [Request(shared + [9], 3), Request(shared + [0], 3, arrival=5)]
    run = Scheduler(MODEL, num_blocks=16, block_size=4, token_budget=32, prefix_caching=True,
                    clock="steps").run(requests)
    assert [r.cached_tokens for r in run.results] == [0, 8]
    assert run.fed_tokens == run.useful_tokens - 8
    assert run.outputs == references(MODEL, requests)


def test_chunked_prefill_ttft_and_tpot_on_the_step_clock():
    # a prompt of 10 tokens, 4 a step: three steps to the first token, then one token a step
    run = Scheduler(MODEL, num_blocks=8, block_size=4, token_budget=4, clock="steps").run(
        [Request(list(range(10)), 5)])
    (r,) = run.results
    assert r.ttft == 3 and r.tpot == 1 and [s.prefill_tokens for s in run.steps[:3]] == [4, 4, 2]
    whole = Scheduler(MODEL, num_blocks=8, block_size=4, token_budget=16, chunked_prefill=False,
                      clock="steps").run([Request(list(range(10)), 5)])
    assert whole.results[0].ttft == 1


def test_static_batching_padding_waste():
    requests = [Request([1, 2], 3), Request([1, 2, 3, 4, 5], 1)]
    run = static_batching(requests, MODEL, batch_size=2, clock="steps")
    # a 2 × 5 prefill, then 2 decode steps for both rows: 14 tokens, 4 + 5 of them useful
    assert run.fed_tokens == 14 and run.useful_tokens == 9 and math.isclose(run.waste, 5 / 14)
    assert run.outputs == references(MODEL, requests)


def test_the_measured_clock_counts_cpu_seconds():
    run = Scheduler(MODEL, num_blocks=16, block_size=4, clock="cpu").run(tight_stream()[:2])
    assert all(s.seconds >= 0 for s in run.steps) and run.makespan == pytest.approx(
        sum(s.seconds for s in run.steps))


@pytest.mark.parametrize("serve", [
    lambda rs: Scheduler(MODEL, num_blocks=16, block_size=4, max_batch=1, clock="steps").run(rs),
    lambda rs: static_batching(rs, MODEL, batch_size=1, clock="steps")])
def test_waiting_counts_only_requests_that_have_arrived(serve):
    requests = [Request([1], 3), Request([2], 3), Request([3], 3, arrival=100)]
    run = serve(requests)
    first = run.steps[0]   # the third request is 100 steps away: only the second one waits
    assert first.waiting == 1
    for s in run.steps:
        arrived = sum(1 for r in run.results if r.request.arrival <= s.start + s.seconds)
        assert s.waiting + s.running <= arrived


def test_idle_time_jumps_to_the_next_arrival():
    run = Scheduler(MODEL, num_blocks=16, block_size=4, clock="steps").run(
        [Request([1], 2), Request([2], 2, arrival=100)])
    assert run.results[1].ttft == 1 and run.steps[-1].start == 101


# ---- the simulated GPU ---------------------------------------------------------------------------

def test_roofline_clock_decode_step_is_the_memory_roof():
    llama = PRESETS["llama-3-8b"]
    clock = RooflineClock(llama, "H100 80GB")
    for context in (0, 1000, 8000):
        # one token over `context` cached ones reads context + 1 keys and writes one
        want = roofline.decode_step_bytes(llama, context + 2, 1) / H100_BANDWIDTH
        assert clock.step_seconds([(context, 1)]) == pytest.approx(want)
    # a long prefill is compute-bound: FLOPs over the peak. forward_flops charges the LM head on every
    # fed token and attention over the whole 4096 × 4096 rectangle; the clock charges the head once
    # (only the last token's logits are needed) and only the causal pairs (4096 · 4097 / 2)
    peak = roofline.PEAK_FP16_FLOPS["H100 80GB"]
    dense = roofline.forward_flops(llama, 4096, 4096)
    head = 2 * llama.d_model * llama.vocab_size
    flops = dense.linear - 4095 * head + dense.attention * (4096 * 4097 / 2) / 4096**2
    assert clock.step_seconds([(0, 4096)]) == pytest.approx(flops / peak)
    assert flops < 0.9 * dense.total
    # the same prompt in two chunks of one step: the same causal pairs, one LM head more
    two = clock.step_seconds([(0, 2048), (2048, 2048)])
    assert two - clock.step_seconds([(0, 4096)]) == pytest.approx(head / peak)
    assert clock.swap_seconds(1000) == pytest.approx(1000 * 131072 / (32e9 * 16 * 128 / 130 / 8))


def test_gpu_pool_blocks_fill_what_the_weights_leave():
    llama = PRESETS["llama-3-8b"]
    blocks = gpu_pool_blocks(llama, "H100 80GB", block_size=16)
    free = 0.9 * memory.GPUS["H100 80GB"].memory_bytes - memory.weight_bytes(llama, "fp16")
    per_block = 16 * memory.kv_bytes_per_token(llama, "fp16")
    assert blocks * per_block <= free < (blocks + 1) * per_block
    with pytest.raises(ValueError, match="do not fit"):
        gpu_pool_blocks("llama-2-70b", "T4 16GB")


def test_hundreds_of_users_simulated_on_an_h100():
    llama = PRESETS["llama-3-8b"]
    blocks = gpu_pool_blocks(llama, "H100 80GB")
    arrivals = poisson_arrivals(400, rate=200.0, seed=1)
    requests = [Request([i % 7] * (200 + 37 * i % 300), 50 + 13 * i % 100, a) for i, a in enumerate(arrivals)]
    run = Scheduler(None, config=llama, num_blocks=blocks, token_budget=2048, max_batch=256,
                    clock=RooflineClock(llama, "H100 80GB")).run(requests)
    assert max(s.running for s in run.steps) > 100 and run.preemptions == 0
    assert all(len(r.output) == r.request.max_new_tokens for r in run.results)


# ---- the ragged cache --------------------------------------------------------------------------------

def test_ragged_cache_rows_see_only_their_own_keys():
    store = PrefixKVStore(CFG, num_blocks=8, block_size=2, dtype=torch.float64)
    a, b = [1, 2, 3], [4, 5]
    sa, sb = store.manager.new_sequence(a, reuse=False), store.manager.new_sequence(b, reuse=False)
    cache = RaggedPagedKVCache(store)
    cache.plan([(sa.table, 0, 3), (sb.table, 0, 2)])
    with torch.inference_mode():
        packed = MODEL(torch.tensor([a + b]), cache=cache)[0]
        torch.testing.assert_close(packed[:3], MODEL(torch.tensor([a]))[0])
        torch.testing.assert_close(packed[3:], MODEL(torch.tensor([b]))[0])
    with pytest.raises(ValueError, match="planned for 5 new tokens"):
        MODEL(torch.tensor([[1, 2]]), cache=cache)
    with pytest.raises(ValueError, match="too few"):
        cache.plan([(sb.table, 4, 3)])
    with pytest.raises(NotImplementedError, match="view for one pass"):
        cache.crop(0)


# ---- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(num_blocks=0), "num_blocks"),
    (dict(token_budget=0), "token_budget"),
    (dict(max_batch=-1), "max_batch"),
    (dict(preemption="evict"), "preemption"),
    (dict(clock="gpu"), "clock='gpu' is not known"),
    (dict(chunked_prefill="yes"), "chunked_prefill"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scheduler(MODEL, **kwargs)


def test_simulation_needs_a_config_and_a_clock_that_does_not_measure():
    with pytest.raises(ValueError, match="give config="):
        Scheduler(None)
    with pytest.raises(ValueError, match="no model"):
        Scheduler(None, config="llama-3-8b", clock="cpu")
    with pytest.raises(ValueError, match="no model"):
        static_batching([Request([1], 1)], None, config="llama-3-8b", clock="wall")


@pytest.mark.parametrize("requests, match", [
    ([], "empty"),
    (Request([1], 1), "a list"),
    ([([1], 1)], "not a Request"),
    ([Request([], 1)], "prompt is empty"),
    ([Request("hello", 1)], "is text"),
    ([Request([1, VOCAB], 1)], "outside the vocabulary"),
    ([Request([1], 0)], "max_new_tokens"),
    ([Request([1], 1, arrival=-1)], "arrival"),
    ([Request([1], 1, arrival=float("nan"))], "arrival"),
    ([Request([1] * 90, 10)], "max_seq_len=96"),
])
def test_bad_requests_are_refused(requests, match):
    with pytest.raises(ValueError, match=match):
        Scheduler(MODEL, clock="steps").run(requests)


def test_requests_that_could_never_run_are_refused():
    with pytest.raises(ValueError, match="the pool has num_blocks=2"):
        Scheduler(MODEL, num_blocks=2, block_size=4, clock="steps").run([Request([1] * 8, 4)])
    with pytest.raises(ValueError, match="token_budget=4"):
        Scheduler(MODEL, num_blocks=8, token_budget=4, chunked_prefill=False, clock="steps").run(
            [Request([1] * 6, 2)])
    with pytest.raises(ValueError, match="output included after a recompute"):
        Scheduler(MODEL, num_blocks=8, token_budget=6, chunked_prefill=False, clock="steps").run(
            [Request([1] * 6, 2)])


def test_alone_is_generate():
    r = Request([1, 2, 3], 5)
    assert alone(MODEL, r) == generate(MODEL, [[1, 2, 3]], 5, cache="static").new_tokens[0].tolist()
