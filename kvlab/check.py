"""Exercise checkers: `check.<exercise>(answer)` prints ✓ or a friendly hint and returns a bool.

Each checker computes the right answer with kvlab itself, so it never disagrees with the course.
"""

from __future__ import annotations


class Verdict:
    """A checker's result: true or false for `assert`, and silent as a cell's last value (the
    checker has already printed ✓ or its hint, so the notebook shows no stray `False`)."""

    def __init__(self, ok: bool):
        self.ok = bool(ok)

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"Verdict({self.ok})"

    def _ipython_display_(self) -> None:
        pass


def _report(ok: bool, success: str, hint: str) -> Verdict:
    print(f"✓ {success}" if ok else f"✗ Not yet. Hint: {hint}")
    return Verdict(ok)


def _close(answer, expected, rel: float = 1e-6) -> bool:
    try:
        return abs(float(answer) - float(expected)) <= rel * max(1.0, abs(float(expected)))
    except (TypeError, ValueError):
        return False


# ---- Chapter 08: the review quiz --------------------------------------------------------------
# Multiple-choice answers are letters; numeric answers are computed here with kvlab.memory, so the
# quiz and the course always agree. Every quiz checker returns False (and prints a hint) on None or
# on an answer of the wrong type; none of them raises.

QUIZ_CHOICES: dict[str, str] = {
    "quiz_cache_not_weights": "b",
    "quiz_k_and_v": "c",
    "quiz_bigger_cache": "d",
}


def _letter(answer) -> str | None:
    if isinstance(answer, str) and answer.strip().strip("().").lower() in ("a", "b", "c", "d"):
        return answer.strip().strip("().").lower()
    return None


def _choice(name: str, answer, success: str, hint: str) -> Verdict:
    letter = _letter(answer)
    if letter is None:
        return _report(False, "", f"answer with one letter as a string, e.g. answer = 'a' (got {answer!r}).")
    return _report(letter == QUIZ_CHOICES[name], success, hint)


def _number(answer) -> float | None:
    """A number from an int, float, 0-d tensor or a string like '8,390,656'; None if it is not one."""
    if isinstance(answer, bool) or answer is None:
        return None
    if isinstance(answer, str):
        answer = answer.replace(",", "").replace("_", "").strip()
    try:
        return float(answer)
    except (TypeError, ValueError):
        return None


def _numeric(answer, expected: float, rel: float, success: str, hint: str,
             unit_hint: str | None = None) -> Verdict:
    value = _number(answer)
    if value is None:
        return _report(False, "", f"answer with a number (got {answer!r}). {hint}")
    ok = _close(value, expected, rel)
    if not ok and unit_hint and _close(value, expected * 1024**3, rel):
        return _report(False, "", unit_hint)
    return _report(ok, success, hint)


def _preset(name: str):
    from .config import PRESETS

    return PRESETS[name]


def quiz_cache_not_weights(answer) -> Verdict:
    """Misconception 1: the KV cache is made at inference time from the input, not stored in weights."""
    return _choice("quiz_cache_not_weights", answer,
                   "Right: the cache is built during inference from this request's tokens and thrown "
                   "away when the request ends; the weights never change.",
                   "which of these changes from one prompt to the next? The weights do not.")


def quiz_k_and_v(answer) -> Verdict:
    """Misconception 2: attention needs both K (for the scores) and V (for the weighted sum)."""
    return _choice("quiz_k_and_v", answer,
                   "Right: the scores need K, the output is a weighted sum of V; drop V from the cache "
                   "and every step recomputes the values of all earlier tokens.",
                   "softmax(q·Kᵀ/√d) gives weights; what are they multiplied with?")


def quiz_bigger_cache(answer) -> Verdict:
    """Misconception 3: a larger cache reservation is not free; it takes memory from everything else."""
    return _choice("quiz_bigger_cache", answer,
                   "Right: reserved cache memory is taken from the batch (and from activations); size "
                   "the cache for the context you need, no more.",
                   "memory on a GPU is fixed: what else needs the bytes a cache reserves?")


def quiz_bytes_per_token(answer) -> Verdict:
    """Llama-2-7B, FP16: KV-cache bytes per token, all layers (2 × L × H_kv × D × 2 bytes)."""
    from .memory import kv_bytes_per_token

    return _numeric(answer, kv_bytes_per_token(_preset("llama-2-7b"), "fp16"), 1e-9,
                    "Right: 2 × 32 layers × 32 KV heads × 128 × 2 bytes.",
                    "2 (K and V) × layers × KV heads × head_dim × bytes per element, in bytes.")


def quiz_total_cache(answer) -> Verdict:
    """Llama-3-8B, 8,192 tokens, batch 4, FP16: the whole KV cache in GiB."""
    from .memory import GiB, kv_cache_bytes

    expected = kv_cache_bytes(_preset("llama-3-8b"), 8192, 4, "fp16") / GiB
    return _numeric(answer, expected, 1e-2, "Right: bytes per token × tokens × sequences.",
                    "bytes per token (Llama-3-8B has 8 KV heads) × 8,192 × 4, divided by 1024**3.",
                    "that looks like bytes: the question asks for GiB (divide by 1024**3).")


def quiz_rows_naive(answer) -> Verdict:
    """K/V rows computed without a cache for N = 4,096 tokens: 1 + 2 + … + N = N(N+1)/2."""
    n = 4096
    return _numeric(answer, n * (n + 1) // 2, 1e-9, "Right: N(N+1)/2, quadratic in N.",
                    "step t recomputes K and V for all t tokens so far; add up 1 + 2 + … + N.")


def quiz_rows_cached(answer) -> Verdict:
    """K/V rows computed with a cache for N = 4,096 tokens: each token's K and V once."""
    return _numeric(answer, 4096, 1e-9, "Right: one row a token, linear in N.",
                    "with a cache, how many times is each token's K and V computed?")


def quiz_gqa_ratio(answer) -> Verdict:
    """Llama-2-70B: how many times smaller its GQA cache (8 KV heads) is than with MHA (64)."""
    from .memory import kv_bytes_per_token

    gqa = _preset("llama-2-70b")
    mha = gqa.with_(n_kv_heads=gqa.n_heads)
    return _numeric(answer, kv_bytes_per_token(mha) / kv_bytes_per_token(gqa), 1e-6,
                    "Right: the cache scales with the number of KV heads, n_heads / n_kv_heads.",
                    "the cache is proportional to n_kv_heads; compare 64 with 8.")


def quiz_int8_cache(answer) -> Verdict:
    """Llama-3-8B at 32,768 tokens, batch 1: the INT8 KV cache in GiB (scales ignored)."""
    from .memory import GiB, kv_cache_bytes

    expected = kv_cache_bytes(_preset("llama-3-8b"), 32768, 1, "int8") / GiB
    return _numeric(answer, expected, 1e-2, "Right: one byte an element, half of FP16.",
                    "compute the FP16 size in GiB, then one byte an element instead of two.",
                    "that looks like bytes: the question asks for GiB (divide by 1024**3).")


PAGING_BLOCK = 16        # tokens a block (vLLM's default block size)
PAGING_TOKENS = 1000     # tokens the request ends up holding
PAGING_RESERVED = 4096   # what a pre-paging server reserves for it (the model's max length)


def quiz_paging_blocks(answer) -> Verdict:
    """Blocks a 1,000-token sequence occupies with 16-token blocks: ceil(1000 / 16)."""
    blocks = -(-PAGING_TOKENS // PAGING_BLOCK)
    return _numeric(answer, blocks, 1e-9,
                    f"Right: only the last block is partly empty ({blocks * PAGING_BLOCK - PAGING_TOKENS} "
                    "unused slots).",
                    "divide by the block size and round up: a partly filled block still counts.")


def quiz_reserved_waste(answer) -> Verdict:
    """Fraction of a 4,096-token reservation left unused by a 1,000-token request (0..1)."""
    expected = 1 - PAGING_TOKENS / PAGING_RESERVED
    value = _number(answer)
    if value is not None and 1 < value <= 100 and _close(value / 100, expected, 1e-2):
        return _report(False, "", "that looks like a percentage: answer as a fraction between 0 and 1.")
    return _numeric(answer, expected, 1e-2,
                    "Right: this is the over-reservation that paging removes.",
                    "unused slots ÷ reserved slots, a fraction between 0 and 1.")


def plan_max_batch(answer) -> Verdict:
    """Llama-3-8B on an A100 80GB, FP16, 10 % reserve: how many 8,192-token sequences fit."""
    from .memory import plan

    expected = plan(_preset("llama-3-8b"), "A100 80GB", 8192, 1, "fp16", "fp16", 0.1).max_batch
    return _numeric(answer, expected, 1e-9, "Right: free memory ÷ bytes of one full sequence, rounded down.",
                    "(GPU memory − weights − reserve) ÷ (bytes per token × 8,192), rounded down; "
                    "or read it from kvlab.memory.plan(...).max_batch.")


def plan_70b_int8(answer) -> Verdict:
    """Llama-2-70B on an H200 with INT8 weights, FP16 cache, 10 % reserve: 4,096-token sequences."""
    from .memory import plan

    expected = plan(_preset("llama-2-70b"), "H200 141GB", 4096, 1, "fp16", "int8", 0.1).max_batch
    return _numeric(answer, expected, 1e-9, "Right: halving the weights' bytes is what makes room.",
                    "call kvlab.memory.plan with weight_dtype='int8' and read .max_batch.")


# ---- Chapter 03: size the cache ---------------------------------------------------------------
# The exercise's defaults; the checker also takes other settings, so a learner can check variants.
CACHE_SIZE_EXERCISE = {"model": "qwen2.5-7b", "seq_len": 32768, "batch_size": 8, "dtype": "fp16"}


def cache_size(answer, model: str = CACHE_SIZE_EXERCISE["model"],
               seq_len: int = CACHE_SIZE_EXERCISE["seq_len"],
               batch_size: int = CACHE_SIZE_EXERCISE["batch_size"],
               dtype: str = CACHE_SIZE_EXERCISE["dtype"]) -> Verdict:
    """The KV cache of `model` for `batch_size` sequences of `seq_len` tokens, in GiB.

    Recognises the usual slips and says which: K without V, query heads instead of KV heads,
    decimal GB instead of GiB, bytes instead of GiB.
    """
    from .memory import GB, GiB, kv_cache_bytes

    config = _preset(model)
    expected = kv_cache_bytes(config, seq_len, batch_size, dtype)
    value = _number(answer)
    if value is None:
        return _report(False, "", f"answer with a number of GiB (got {answer!r}): 2 (K and V) × "
                       "layers × KV heads × head_dim × tokens × batch × bytes per element ÷ 1024**3.")
    slips = [
        (expected / GiB / 2, "that is half the answer: K alone. The cache holds K and V, a factor 2."),
        (expected / GiB * config.n_rep, f"{model} has {config.n_kv_heads} KV heads (shared by "
         f"{config.n_heads} query heads): use n_kv_heads, not n_heads."),
        (expected / GB, "that is decimal GB (10**9 bytes); the question asks for GiB (1024**3)."),
        (expected, "that looks like bytes: the question asks for GiB (divide by 1024**3)."),
    ]
    if _close(value, expected / GiB, 1e-3):
        return _report(True, f"Right: {expected:,} bytes = {expected / GiB:g} GiB.", "")
    for wrong, hint in slips:
        if wrong != expected / GiB and _close(value, wrong, 1e-3):
            return _report(False, "", hint)
    return _report(False, "", f"2 (K and V) × layers × KV heads × head_dim × {seq_len:,} tokens × "
                   f"batch {batch_size} × bytes per {dtype} element, then ÷ 1024**3. Read the shape "
                   f"from kvlab.PRESETS[{model!r}].")


# ---- Chapter 04: MHA → GQA → MQA ------------------------------------------------------------------

KV_BUDGET_EXERCISE = {"model": "llama-3-8b", "seq_len": 32768, "batch_size": 4, "dtype": "fp16",
                      "budget_gib": 16}


def kv_heads_for_budget(answer) -> Verdict:
    """The most KV heads (a divisor of the query heads) whose cache fits the budget.

    The exercise: a model of Llama-3-8B's shape (32 layers, 32 query heads, head_dim 128) serves
    4 sequences of 32,768 tokens with an fp16 cache, and the cache may use at most 16 GiB.
    """
    from .config import divisors
    from .memory import GiB, kv_cache_bytes

    ex = KV_BUDGET_EXERCISE
    base = _preset(ex["model"])

    def size(k: int) -> int:
        return kv_cache_bytes(base.with_(n_kv_heads=k), ex["seq_len"], ex["batch_size"], ex["dtype"])

    allowed = divisors(base.n_heads)
    fitting = [k for k in allowed if size(k) <= ex["budget_gib"] * GiB]
    expected = max(fitting)
    value = _number(answer)
    if value is None or value != int(value):
        return _report(False, "", f"answer with a whole number of KV heads (got {answer!r}). One KV "
                       f"head costs 2 × layers × head_dim × tokens × batch × 2 bytes.")
    k = int(value)
    if k not in allowed:
        return _report(False, "", f"{k} KV heads cannot be shared evenly by {base.n_heads} query "
                       f"heads; allowed: {allowed}.")
    if k > expected:
        return _report(False, "", f"{k} KV heads need {size(k) / GiB:g} GiB: over the "
                       f"{ex['budget_gib']} GiB budget.")
    if k < expected:
        return _report(False, "", f"{k} KV heads fit ({size(k) / GiB:g} GiB), but a larger divisor "
                       "fits too, and more KV heads usually mean better quality.")
    return _report(True, f"Right: {k} KV heads take {size(k) / GiB:g} GiB, {base.n_heads // k}× "
                   f"less than MHA's {size(base.n_heads) / GiB:g} GiB — Llama-3-8B's own choice.", "")


# ---- Chapter 07: serving many users -----------------------------------------------------------
# Computed with kvlab.paging; the checkers take other settings too, so a learner can try variants.
PAGED_BLOCKS_EXERCISE = {"n_tokens": 1234, "block_size": 32}
PAGED_FIT_EXERCISE = {"num_blocks": 4096, "block_size": 16, "n_tokens": 700, "max_len": 2048}


def paged_blocks(answer, n_tokens: int = PAGED_BLOCKS_EXERCISE["n_tokens"],
                 block_size: int = PAGED_BLOCKS_EXERCISE["block_size"]) -> Verdict:
    """(blocks, wasted slots) of one sequence of n_tokens tokens in blocks of block_size."""
    from .paging import blocks_needed, wasted_slots

    blocks, wasted = blocks_needed(n_tokens, block_size), wasted_slots(n_tokens, block_size)
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return _report(False, "", f"answer with two numbers, (blocks, wasted_slots) "
                                  f"(got {answer!r}).")
    got = [_number(a) for a in answer]
    if got[0] is None or got[1] is None:
        return _report(False, "", f"both parts must be numbers (got {answer!r}).")
    if got[0] == n_tokens // block_size and got[0] != blocks:
        return _report(False, "", "a partly filled last block is still a whole block: round up.")
    if got[0] != blocks:
        return _report(False, "", f"divide {n_tokens:,} tokens by {block_size} tokens a block and "
                                  "round up.")
    return _report(got[1] == wasted,
                   f"Right: {blocks} blocks hold {blocks * block_size:,} slots, {wasted} of them "
                   "empty, all in the last block.",
                   "wasted slots = blocks × block_size − tokens.")


def paged_sequences_fit(answer, num_blocks: int = PAGED_FIT_EXERCISE["num_blocks"],
                        block_size: int = PAGED_FIT_EXERCISE["block_size"],
                        n_tokens: int = PAGED_FIT_EXERCISE["n_tokens"],
                        max_len: int = PAGED_FIT_EXERCISE["max_len"]) -> Verdict:
    """How many sequences of n_tokens fit at once in a pool of num_blocks blocks with paging."""
    from .paging import blocks_needed

    expected = num_blocks // blocks_needed(n_tokens, block_size)
    reserved = num_blocks * block_size // max_len
    value = _number(answer)
    if value is not None and value == reserved:
        return _report(False, "", f"that is how many fit when each reserves {max_len:,} slots; "
                                  "with paging each takes only the blocks its tokens fill.")
    return _numeric(answer, expected, 1e-9,
                    f"Right: {expected} sequences instead of {reserved} with max-length "
                    f"reservation ({expected / reserved:.1f}×).",
                    "blocks in the pool ÷ blocks one sequence needs (rounded up), rounded down.")


# ---- Chapter 05: absmax int8, per channel -------------------------------------------------------

def quantize_keys_per_channel(fn) -> Verdict:
    """The learner's `fn(k) -> (codes, scale)`: absmax int8 of a (tokens, channels) tensor with one
    scale per channel. Compared with kvlab.quant.quantize(k, "channel") on keys with outliers."""
    import torch

    from . import quant

    if fn is None:
        return _report(False, "", "write a function quantize_keys(k) that returns (codes, scale).")
    if not callable(fn):
        return _report(False, "", f"pass the function itself (got a {type(fn).__name__}).")
    g = torch.Generator().manual_seed(5)
    for tokens, channels in ((32, 16), (7, 64)):
        k = torch.randn(tokens, channels, generator=g)
        k[:, 3] *= 25  # an outlier channel, as real keys have
        want = quant.quantize(k, "channel")
        try:
            codes, scale = fn(k.clone())
        except Exception as err:  # noqa: BLE001 - any error in the learner's code becomes a hint
            return _report(False, "", f"your function raised {type(err).__name__}: {err}")
        if not isinstance(codes, torch.Tensor) or not isinstance(scale, torch.Tensor):
            return _report(False, "", "return two tensors: (codes, scale).")
        if codes.dtype != torch.int8 or codes.shape != k.shape:
            return _report(False, "", f"codes must be int8 with k's shape {tuple(k.shape)}; got "
                                      f"{codes.dtype}, {tuple(codes.shape)}.")
        if scale.numel() == 1:
            return _report(False, "", "that is one scale for the whole tensor: take the absmax of "
                                      "each channel (column), over the tokens: k.abs().amax(dim=0).")
        if scale.numel() == tokens and tokens != channels:
            return _report(False, "", "that is one scale per token (row): reduce over the tokens "
                                      "(dim 0) instead, keeping one scale per channel.")
        try:
            scale = scale.float().reshape(1, channels)
        except RuntimeError:
            return _report(False, "", f"scale should hold one value per channel: shape (1, {channels}).")
        if not torch.allclose(scale, want.scale, rtol=1e-4):
            ratio = (scale / want.scale).median().item()
            hint = ("divide the absmax by 127, the largest int8 code you use" if abs(ratio - 1) > 1e-3
                    else "scale = absmax of the channel / 127")
            return _report(False, "", hint + ".")
        if (codes.int() - want.data.int()).abs().max() > 1 or (codes != want.data).float().mean() > 0.01:
            return _report(False, "", "round to the nearest integer (torch.round) before casting to "
                                      "int8; a bare cast truncates toward zero.")
        if (k - codes.float() * scale).abs().max() > 0.5 * scale.max() * 1.001:
            return _report(False, "", "codes × scale should be within half a scale of k.")
    return _report(True, "Right: one scale per channel, so the outlier channel no longer coarsens "
                         "the others; every value is within half a step of the original.", "")


# ---- Chapters 01–02: K/V work of the naive and cached decoders; the decode step ---------------

KV_WORK_EXERCISE = {"prompt_len": 20, "new_tokens": 50}


def _kv_rows(prompt_len: int, new_tokens: int) -> tuple[int, int]:
    """K/V rows one layer computes, (naive, cached), measured by kvlab.generate on a tiny model."""
    import torch

    from .config import ModelConfig
    from .generate import generate
    from .model import Transformer

    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=1, n_kv_heads=1, d_ff=8, vocab_size=2,
                      max_seq_len=prompt_len + new_tokens)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(cfg).eval()
    prompt = [0] * prompt_len
    return (generate(model, prompt, new_tokens, cache=None).kv_rows,
            generate(model, prompt, new_tokens, cache="static").kv_rows)


def kv_work(answer, prompt_len: int = KV_WORK_EXERCISE["prompt_len"],
            new_tokens: int = KV_WORK_EXERCISE["new_tokens"]) -> Verdict:
    """Ch 01: K/V rows one layer computes to generate `new_tokens` tokens after a prompt of
    `prompt_len` tokens; answer = (naive_rows, cached_rows)."""
    p, n = prompt_len, new_tokens
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return _report(False, "", "answer with two numbers: answer = (naive_rows, cached_rows).")
    naive, cached = (_number(a) for a in answer)
    if naive is None or cached is None:
        return _report(False, "", f"both entries must be numbers; got {answer!r}.")
    want_naive, want_cached = _kv_rows(p, n)
    if naive == want_naive and cached == want_cached:
        return _report(True, f"Right: naive {want_naive:,} rows, cached {want_cached:,} rows "
                       f"({want_naive / want_cached:.1f}× less work with the cache).", "")
    if naive != want_naive:
        if naive == n * (n + 1) // 2:
            hint = f"don't forget the prompt: the very first step already feeds all {p} prompt tokens."
        elif naive == sum(p + i for i in range(1, n + 1)):
            hint = ("one step too many: the last new token is picked but never fed back, so step i "
                    f"feeds {p} + i − 1 tokens for i = 1 … {n}.")
        else:
            hint = (f"without a cache step i feeds the whole sequence, {p} + i − 1 tokens, "
                    f"and computes K, V for all of them; add them up for i = 1 … {n}.")
        return _report(False, "", hint)
    if cached == p + n:
        hint = "one too many: the last new token is picked but never fed back through the model."
    else:
        hint = (f"with a cache every token's K and V are computed once: the {p} prompt tokens in "
                "prefill, then one row per decode step.")
    return _report(False, "", hint)


def decode_step(fn) -> Verdict:
    """Ch 02: `fn(q_new, k_new, v_new, k_cache, v_cache) -> (out, k_cache, v_cache)`, the decode step
    of one attention layer, compared with kvlab's cache and attention on random inputs.

    Shapes: q_new (B, H, 1, D); k_new, v_new (B, H, 1, D); caches (B, H, S, D), S may be 0;
    out (B, H, 1, D); the returned caches hold S + 1 positions.
    """
    import math

    import torch

    from .attention import naive_attention
    from .cache import DynamicKVCache
    from .config import ModelConfig

    if not callable(fn):
        return _report(False, "", "pass your function itself: check.decode_step(decode_step).")
    gen = torch.Generator().manual_seed(0)
    for batch, heads, cached, dim in [(1, 2, 5, 8), (2, 4, 11, 16), (1, 1, 0, 4)]:
        q, k, v = (torch.randn(batch, heads, 1, dim, generator=gen) for _ in range(3))
        kc, vc = (torch.randn(batch, heads, cached, dim, generator=gen) for _ in range(2))
        cache = DynamicKVCache(ModelConfig(n_layers=1, d_model=heads * dim, n_heads=heads,
                                           n_kv_heads=heads, d_ff=8, vocab_size=2, max_seq_len=64))
        if cached:
            cache.update(0, kc, vc)
        k_all, v_all = cache.update(0, k, v)
        want = naive_attention(q, k_all, v_all)
        try:
            result = fn(q.clone(), k.clone(), v.clone(), kc.clone(), vc.clone())
        except Exception as exc:  # report the learner's error instead of raising it
            return _report(False, "", f"your function raised {type(exc).__name__}: {exc}")
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            return _report(False, "", "return three things: (out, k_cache, v_cache).")
        out, k_new_cache, v_new_cache = result
        if not all(isinstance(t, torch.Tensor) for t in result):
            return _report(False, "", "out, k_cache and v_cache must all be tensors.")
        if k_new_cache.shape != k_all.shape or v_new_cache.shape != v_all.shape:
            return _report(False, "", f"the caches should grow by one position along dim 2: "
                           f"expected {tuple(k_all.shape)}, got {tuple(k_new_cache.shape)}; use "
                           "torch.cat([k_cache, k_new], dim=2).")
        if not (torch.equal(k_new_cache, k_all) and torch.equal(v_new_cache, v_all)):
            return _report(False, "", "append the new K and V at the end of the caches (old "
                           "positions first, the new one last), K to K and V to V.")
        if out.shape != want.shape:
            return _report(False, "", f"out should have the shape of q_new, {tuple(want.shape)}; "
                           f"got {tuple(out.shape)}.")
        if not torch.allclose(out, want, atol=1e-5, rtol=1e-5):
            unscaled = torch.softmax(q @ k_all.transpose(-2, -1), -1) @ v_all
            if torch.allclose(out, unscaled, atol=1e-5):
                hint = f"scale the scores by 1/√d (here 1/√{dim} = {1 / math.sqrt(dim):.3f})."
            else:
                hint = ("attend with the new query over the whole updated cache: "
                        "softmax(q_new @ k_cacheᵀ / √d) @ v_cache, softmax over the last dimension.")
            return _report(False, "", hint)
    return _report(True, "Your decode step matches kvlab's cache + attention on random inputs.", "")


# ---- chapter 06: a fast decoder ---------------------------------------------------------------

ROOFLINE_EXERCISE = {"model": "llama-3-8b", "gpu": "T4 16GB", "dtype": "fp16"}


def llama3_t4_roofline(answer) -> Verdict:
    """Upper bound on tokens/s for Llama-3-8B in fp16 at batch 1 (short context) on a T4."""
    from .bench import roofline
    from .config import PRESETS
    from .memory import GPUS, weight_bytes

    cfg, gpu = PRESETS[ROOFLINE_EXERCISE["model"]], GPUS[ROOFLINE_EXERCISE["gpu"]]
    bound = roofline(cfg, gpu.bandwidth_bytes_per_s, context=0, dtype=ROOFLINE_EXERCISE["dtype"])
    hint = ("every decode step reads all the weights once: bytes = memory.weight_bytes(config, 'fp16'); "
            "the T4 moves 320 GB/s, so tokens/s ≤ bandwidth ÷ bytes per step")
    if answer is None:
        return _report(False, "", hint)
    if _close(answer, 1 / bound.tokens_per_s, rel=0.02):
        return _report(False, "", "that looks like seconds per token; the question asks for tokens/s")
    return _report(_close(answer, bound.tokens_per_s, rel=0.02),
                   f"{bound.tokens_per_s:.1f} tokens/s at most: {weight_bytes(cfg) / 1e9:.1f} GB of weights "
                   f"÷ {gpu.bandwidth_bytes_per_s / 1e9:.0f} GB/s",
                   hint)


# ---- Chapter 00: warm-up ----------------------------------------------------------------------

def byte_tokens(answer, text: str = "KV cache 缓存") -> Verdict:
    """How many byte-level tokens (UTF-8 bytes) does `text` take?"""
    expected = len(text.encode("utf-8"))
    if answer is None:
        return _report(False, "", "replace None with a number: count the UTF-8 bytes of the text.")
    return _report(_close(answer, expected), f"{text!r} is {expected} byte tokens.",
                   "ASCII letters and spaces take 1 byte each; a Chinese character takes 3.")
