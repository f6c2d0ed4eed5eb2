"""Chapter 11, Review: the quiz over the misconceptions and formulas, the capacity curve and the
capacity-planning exercises. Numeric answers are computed with kvlab.memory, so the quiz and the course
always agree."""

from __future__ import annotations

from .. import memory
from ..config import PRESETS
from ..memory import GiB
from .style import Verdict, as_number, close, new_figure, numeric, report, shown, tokens_label

# ---- the quiz -------------------------------------------------------------------------------------
# Multiple-choice answers are letters; every quiz checker prints a hint (and returns a false Verdict)
# for None or an answer of the wrong type; none of them raises.


# name -> (the right letter, what the ✓ says, the hint)
QUIZ_CHOICES: dict[str, tuple[str, str, str]] = {
    "check_cache_not_weights": (
        "b", "Right: the cache is built during inference from this request's tokens and thrown away when "
             "the request ends; the weights never change.",
        "which of these changes from one prompt to the next? The weights do not."),
    "check_k_and_v": (
        "c", "Right: the scores need K, the output is a weighted sum of V; drop V from the cache and every "
             "step recomputes the values of all earlier tokens.",
        "softmax(q·Kᵀ/√d) gives weights; what are they multiplied with?"),
    "check_bigger_cache": (
        "d", "Right: reserved cache memory is taken from the batch (and from activations); size the cache "
             "for the context you need, no more.",
        "memory on a GPU is fixed: what else needs the bytes a cache reserves?"),
    "check_prefix_sharing": (
        "b", "Right: in causal attention a token's K and V depend only on the tokens up to it, so the "
             "shared blocks hold exactly what the request's own prefill would compute.",
        "what does the K and V of token i depend on in causal attention?"),
    "check_continuous_batching": (
        "c", "Right: the batch is re-formed every step, so a finished request's place goes to a waiting "
             "one at once; each request's tokens are the ones it would get alone.",
        "with static batching, what does the GPU do for a short request once it has finished but the "
        "longest one in its batch has not?"),
    "check_chunked_prefill": (
        "b", "Right: the prompt is fed a chunk a step within the token budget, next to the running "
             "decodes, so their time per output token stays bounded; its own first token comes later.",
        "a step's cost grows with the tokens it feeds: what happens to the 30 decoding users in a step "
        "that also feeds 10,000 prompt tokens?"),
    "check_preemption": (
        "c", "Right: recompute drops the blocks and feeds the tokens again later (compute for memory); "
             "swap copies the blocks to CPU memory and back (PCIe traffic); both give the same tokens.",
        "which of the two keeps the K/V somewhere, and which has to compute it again?"),
    "check_speculative_identical": (
        "b", "Right: every token kept is the target's own greedy choice after the tokens before it, so "
             "the drafter changes the speed, never the output.",
        "after a rejection, whose token does the step add: the drafter's or the target's?"),
    "check_rollback_refused": (
        "d", "Right: a heavy-hitter cache has already added the rejected queries' attention to its "
             "scores and may have evicted keys for them; a crop cannot undo that, so it refuses.",
        "which cache's state depends on the queries it has seen, not only on the positions it holds?"),
}


def _letter(answer) -> str | None:
    if isinstance(answer, str) and answer.strip().strip("().").lower() in ("a", "b", "c", "d"):
        return answer.strip().strip("().").lower()
    return None


def _choice(name: str, answer) -> Verdict:
    right, success, hint = QUIZ_CHOICES[name]
    letter = _letter(answer)
    if letter is None:
        return report(False, "", f"answer with one letter as a string, e.g. answer = 'a' "
                                 f"(got {shown(answer)}).")
    return report(letter == right, success, hint)


def check_cache_not_weights(answer) -> Verdict:
    """Misconception 1: the KV cache is made at inference time from the input, not stored in weights."""
    return _choice("check_cache_not_weights", answer)


def check_k_and_v(answer) -> Verdict:
    """Misconception 2: attention needs both K (for the scores) and V (for the weighted sum)."""
    return _choice("check_k_and_v", answer)


def check_bigger_cache(answer) -> Verdict:
    """Misconception 3: a larger cache reservation is not free; it takes memory from everything else."""
    return _choice("check_bigger_cache", answer)


def check_prefix_sharing(answer) -> Verdict:
    """Chapter 09: a request that reuses a shared prefix's K/V blocks generates exactly the same tokens."""
    return _choice("check_prefix_sharing", answer)


def check_continuous_batching(answer) -> Verdict:
    """Chapter 08: continuous batching refills the batch every step instead of waiting for the longest."""
    return _choice("check_continuous_batching", answer)


def check_chunked_prefill(answer) -> Verdict:
    """Chapter 08: chunked prefill bounds what a long prompt does to the running decodes."""
    return _choice("check_chunked_prefill", answer)


def check_preemption(answer) -> Verdict:
    """Chapter 08: preemption by recompute vs by swap."""
    return _choice("check_preemption", answer)


# Chapter 08's latencies: a request's first token and its last, seconds after it arrived.
TPOT_FIRST_S, TPOT_LAST_S, TPOT_TOKENS = 0.8, 10.75, 200


def check_tpot(answer) -> Verdict:
    """Chapter 08: time per output token (TPOT) in ms: the time after the first token over the tokens
    after it, (10.75 - 0.8) / (200 - 1) s."""
    tpot = (TPOT_LAST_S - TPOT_FIRST_S) / (TPOT_TOKENS - 1) * 1000
    with_first = [TPOT_LAST_S / TPOT_TOKENS * 1000, (TPOT_LAST_S - TPOT_FIRST_S) / TPOT_TOKENS * 1000]
    if any(close(answer, wrong, 1e-3) for wrong in with_first):
        return report(False, "", "TPOT leaves out the first token (its wait is the TTFT): divide the time "
                                 "after it by the 199 tokens after it.")
    return numeric(answer, tpot, 1e-3, f"Right: {TPOT_LAST_S - TPOT_FIRST_S:.2f} s over "
                                       f"{TPOT_TOKENS - 1} tokens = {tpot:.0f} ms a token; the TTFT "
                                       f"was {TPOT_FIRST_S * 1000:.0f} ms.",
                   "TPOT = (time of the last token − time of the first) ÷ (tokens − 1), in ms.")


def check_speculative_identical(answer) -> Verdict:
    """Chapter 10: greedy speculative decoding gives exactly plain greedy decoding's tokens."""
    return _choice("check_speculative_identical", answer)


def check_rollback_refused(answer) -> Verdict:
    """Chapter 10: which cache kind cannot roll back after a rejection."""
    return _choice("check_rollback_refused", answer)


SPEC_ALPHA, SPEC_K, SPEC_COST = 0.7, 3, 0.1   # chapter 10's speed-up question


def check_speculative_speedup(answer) -> Verdict:
    """Chapter 10: Leviathan et al.'s expected speed-up for α = 0.7, k = 3, a draft pass costing 0.1
    target steps and a verify pass costing one step."""
    from ..speculative import expected_speedup, expected_tokens_per_step

    a, k, c = SPEC_ALPHA, SPEC_K, SPEC_COST
    tokens = expected_tokens_per_step(a, k)
    wrong = {tokens: "that is the tokens a step yields; a step also costs more than one target step: "
                     "divide by k·c + 1.",
             expected_tokens_per_step(a, k - 1) / (k * c + 1):
                 "your sum stops at α^(k−1) = α²: k guesses plus the target's token make k + 1 terms, "
                 "1 + α + … + α^k.",
             tokens / (c + 1): "a step runs k draft passes: they cost k·c, not c.",
             tokens / (k * c): "add the verify pass: a step costs k·c + 1 target steps."}
    for value, hint in wrong.items():
        if close(answer, value, 1e-3):
            return report(False, "", hint)
    return numeric(answer, expected_speedup(a, k, c), 1e-3,
                   f"Right: E = (1 − 0.7⁴)/(1 − 0.7) = {tokens:.3f} tokens a step, over a step's cost "
                   f"3 × 0.1 + 1 = 1.3 target steps.",
                   "E = (1 − α^(k+1))/(1 − α) tokens a step, divided by what a step costs: k draft passes of "
                   "c each plus one verify pass.")


def check_window_cache(answer) -> Verdict:
    """Chapter 09: Mistral-7B keeps a 4,096-token sliding window; one stream has reached 100,000 tokens.
    Its FP16 cache in GiB: only the window is stored."""
    if close(answer, memory.kv_cache_bytes(PRESETS["mistral-7b"], 100_000, 1, "fp16") / GiB, 1e-3):
        return report(False, "", "that is all 100,000 tokens; a sliding window keeps only the last 4,096.")
    return _cache_gib(answer, "mistral-7b", 4096, 1, "fp16",
                      "Right: the window, not the stream, sets the size: 4,096 positions, however long "
                      "it runs.",
                      "bytes per token (Mistral-7B: 32 layers, 8 KV heads, head_dim 128) × 4,096, ÷ 1024**3.")


def check_bytes_per_token(answer) -> Verdict:
    """Llama-2-7B, FP16: KV-cache bytes per token, all layers (2 × L × H_kv × D × 2 bytes)."""
    return numeric(answer, memory.kv_bytes_per_token(PRESETS["llama-2-7b"], "fp16"), 1e-9,
                   "Right: 2 × 32 layers × 32 KV heads × 128 × 2 bytes.",
                   "2 (K and V) × layers × KV heads × head_dim × bytes per element, in bytes.")


def check_total_cache(answer) -> Verdict:
    """Llama-3-8B, 8,192 tokens, batch 4, FP16: the whole KV cache in GiB."""
    return _cache_gib(answer, "llama-3-8b", 8192, 4, "fp16", "Right: bytes per token × tokens × sequences.",
                      "bytes per token (Llama-3-8B has 8 KV heads) × 8,192 × 4, divided by 1024**3.")


def _cache_gib(answer, model: str, seq_len: int, batch_size: int, dtype: str, success: str,
               hint: str) -> Verdict:
    """A quiz answer in GiB: the KV cache of `model` for batch_size sequences of seq_len tokens."""
    expected = memory.kv_cache_bytes(PRESETS[model], seq_len, batch_size, dtype) / GiB
    return numeric(answer, expected, 1e-2, success, hint,
                   "that looks like bytes: the question asks for GiB (divide by 1024**3).")


def check_rows_naive(answer) -> Verdict:
    """K/V rows computed without a cache for N = 4,096 tokens: 1 + 2 + … + N = N(N+1)/2."""
    n = 4096
    return numeric(answer, n * (n + 1) // 2, 1e-9, "Right: N(N+1)/2, quadratic in N.",
                   "step t recomputes K and V for all t tokens so far; add up 1 + 2 + … + N.")


def check_rows_cached(answer) -> Verdict:
    """K/V rows computed with a cache for N = 4,096 tokens: each token's K and V once."""
    return numeric(answer, 4096, 1e-9, "Right: one row a token, linear in N.",
                   "with a cache, how many times is each token's K and V computed?")


def check_gqa_ratio(answer) -> Verdict:
    """Llama-2-70B: how many times smaller its GQA cache (8 KV heads) is than with MHA (64)."""
    gqa = PRESETS["llama-2-70b"]
    mha = gqa.with_(n_kv_heads=gqa.n_heads)
    return numeric(answer, memory.kv_bytes_per_token(mha) / memory.kv_bytes_per_token(gqa), 1e-6,
                   "Right: the cache scales with the number of KV heads, n_heads / n_kv_heads.",
                   "the cache is proportional to n_kv_heads; compare 64 with 8.")


def check_int8_cache(answer) -> Verdict:
    """Llama-3-8B at 32,768 tokens, batch 1: the INT8 KV cache in GiB (scales ignored)."""
    return _cache_gib(answer, "llama-3-8b", 32768, 1, "int8", "Right: one byte an element, half of FP16.",
                      "compute the FP16 size in GiB, then one byte an element instead of two.")


PAGING_BLOCK = 16        # tokens a block (vLLM's default block size)
PAGING_TOKENS = 1000     # tokens the request ends up holding
PAGING_RESERVED = 4096   # what a pre-paging server reserves for it (the model's max length)


def check_paging_blocks(answer) -> Verdict:
    """Blocks a 1,000-token sequence occupies with 16-token blocks: ceil(1000 / 16)."""
    blocks = -(-PAGING_TOKENS // PAGING_BLOCK)
    return numeric(answer, blocks, 1e-9,
                   f"Right: only the last block is partly empty ({blocks * PAGING_BLOCK - PAGING_TOKENS} "
                   "unused slots).",
                   "divide by the block size and round up: a partly filled block still counts.")


# Exercise with chapter 07's simulator: the same request mix, served with a 4,096-token limit.
SIM_EXERCISE = {"n": 1000, "seed": 0, "max_len": 4096, "capacity": 32 * 4096}


def _sim(policy: str):
    from .. import fragmentation

    e = SIM_EXERCISE
    prompt, output = fragmentation.sample_requests(e["n"], fragmentation.RequestMix(max_len=e["max_len"]),
                                                   seed=e["seed"])
    return fragmentation.simulate(prompt, output, policy, capacity=e["capacity"], max_len=e["max_len"])


def check_sim_reserved_waste(answer) -> Verdict:
    """Chapter 07's simulator, 1,000 requests of the default mix with max_len 4,096, 32 × 4,096 slots:
    the share of KV memory that holds no token when every request reserves 4,096 (Orca (Max))."""
    value = as_number(answer)
    hint = ("sample the requests with kvlab.fragmentation.sample_requests(1000, RequestMix(max_len=4096), "
            "seed=0), run simulate(..., 'max', capacity=32 * 4096, max_len=4096) and read .waste.")
    if value is None:
        return report(False, "", f"answer with a number between 0 and 1 (got {shown(answer)}). {hint}")
    result = _sim("max")
    if 1 < value <= 100 and close(value / 100, result.waste, 1e-2):
        return report(False, "", "that looks like a percentage: answer as a fraction between 0 and 1.")
    if close(value, result.used, 1e-2):
        return report(False, "", "that is the share that holds tokens (.used); the question asks for "
                                 "the rest, .waste.")
    if close(value, _sim("paged").waste, 1e-2):
        return report(False, "", "that is the paged policy; the question asks about reserving 4,096 "
                                 "slots a request ('max').")
    return report(close(value, result.waste, 1e-2),
                  f"Right: {result.waste:.1%} of the memory holds no token; the 2,048-token limit of "
                  "chapter 07 wasted less with the same requests: the longer the reservation, the more "
                  "it wastes.", hint)


# ---- capacity planning ----------------------------------------------------------------------------


def plot_capacity_curve(config, gpu_names=None, dtype: str = "fp16", weight_dtype: str = "fp16",
                        reserve_fraction: float = 0.1, seq_lens=None):
    """How many sequences of each length fit next to the weights, one line per GPU (log-log); GPUs
    within one sequence (or 1 %) of each other at every length share a line, labelled "A ≈ B".

    A GPU whose memory the weights (plus reserve) already fill gets no line, and the legend says so.
    """
    gpu_names = list(memory.GPUS) if gpu_names is None else list(gpu_names)
    seq_lens = [2**k for k in range(9, 18)] if seq_lens is None else list(seq_lens)
    curves: list[tuple[tuple, list[str]]] = []   # (sequences that fit at each length, GPUs)
    for name in gpu_names:
        batches = tuple(memory.plan(config, name, s, 1, dtype, weight_dtype, reserve_fraction).max_batch
                        for s in seq_lens)
        # GPUs of (nearly) the same memory share one line: A100 80GB and H100 80GB differ by at most
        # one sequence, and two such lines would hide one another
        same = [c for c in curves if all((a == 0) == (b == 0) and abs(a - b) <= max(1, 0.01 * b)
                                         for a, b in zip(c[0], batches, strict=True))]
        if same:
            same[0][1].append(name)
        else:
            curves.append((batches, [name]))
    fig, ax = new_figure(7.5, 4.2)
    for batches, names in curves:
        label = " ≈ ".join(names)
        if not any(batches):
            ax.plot([], [], linestyle="none", marker="x", color="grey",
                    label=f"{label}: the weights do not fit")
            continue
        xs = [s for s, b in zip(seq_lens, batches, strict=True) if b > 0]
        ax.plot(xs, [b for b in batches if b > 0], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seq_lens, [tokens_label(s) for s in seq_lens])
    ax.set_xlabel("tokens per sequence (prompt + output)")
    ax.set_ylabel("sequences that fit at once")
    name = config.name or "model"
    ax.set_title(f"{name}: weights {weight_dtype}, cache {dtype}, {reserve_fraction:.0%} of memory reserved")
    ax.legend(fontsize=8)
    return fig


def check_plan_max_batch(answer) -> Verdict:
    """Llama-3-8B on an A100 80GB, FP16, 10 % reserve: how many 8,192-token sequences fit."""
    expected = memory.plan(PRESETS["llama-3-8b"], "A100 80GB", 8192, 1, "fp16", "fp16", 0.1).max_batch
    return numeric(answer, expected, 1e-9, "Right: free memory ÷ bytes of one full sequence, rounded down.",
                   "(GPU memory − weights − reserve) ÷ (bytes per token × 8,192), rounded down; "
                   "or read it from kvlab.memory.plan(...).max_batch.")


def check_plan_70b_int8(answer) -> Verdict:
    """Llama-2-70B on an H200 with INT8 weights, FP16 cache, 10 % reserve: 4,096-token sequences."""
    expected = memory.plan(PRESETS["llama-2-70b"], "H200 141GB", 4096, 1, "fp16", "int8", 0.1).max_batch
    return numeric(answer, expected, 1e-9, "Right: halving the weights' bytes is what makes room.",
                   "call kvlab.memory.plan with weight_dtype='int8' and read .max_batch.")
