"""kvlab against `transformers` on the same weights: generate side by side, interleaved in one process,
medians, and a check that both produce the same tokens.

Same tokens, checked the way that means something (chapter 05): two free generations are not compared
position by position, since after the first differing token each continues from a different text.
Each row says where its tokens first differ from transformers' (`first_divergence`, None when they never
do) and, for kvlab, its **teacher-forced agreement**: its decode step is fed transformers' tokens, never
its own, and at every position its argmax is compared with transformers' next token.

transformers compiles `generate` by itself on a GPU when the cache is static
(`_valid_auto_compile_criteria`): its eager rows disable that explicitly, a compiled row is labelled as
such, and transformers' own decision is recorded for every timed call and checked against the label.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from .. import env, roofline
from ..cache import make_cache
from ..config import ModelConfig
from ..fast import FastDecoder, fast_generate, make_step
from ..generate import generate
from ..model import Transformer
from .sweeps import CPU_CONFIG, TORCH_DTYPE_NAMES, random_prompt, result_row
from .timing import median, time_interleaved

HF_DYNAMIC = "transformers generate (dynamic cache)"
HF_STATIC = "transformers generate (static cache, eager)"
HF_COMPILED = "transformers generate (static cache, compiled)"
KVLAB_GENERATE = "kvlab generate (static cache)"


def hf_twin(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """A random-weight `transformers` LlamaForCausalLM of this shape (no download) and the kvlab
    model built from it by `from_hf`: the same weights in both. Both are built on `device` directly
    (a 7B model initialised on the CPU would take minutes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..hf import from_hf

    hf_cfg = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.d_model,
                         intermediate_size=config.d_ff, num_hidden_layers=config.n_layers,
                         num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
                         head_dim=config.head_dim, max_position_embeddings=config.max_seq_len,
                         rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
                         tie_word_embeddings=config.tie_embeddings,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        hf_model = LlamaForCausalLM(hf_cfg).to(dtype=dtype).eval()
        kv_model = from_hf(hf_model)
    plain_greedy(hf_model, pad_token_id=0)
    return hf_model, kv_model


def plain_greedy(hf_model, pad_token_id: int) -> None:
    """Give hf_model a generation config with nothing in it but a padding id: no end-of-sequence
    token (both sides generate exactly max_new_tokens) and none of a checkpoint's own settings
    (a repetition penalty, say) that kvlab's greedy decoding does not apply."""
    from transformers import GenerationConfig

    hf_model.generation_config = GenerationConfig(pad_token_id=pad_token_id)


def hf_generate_kwargs(device, compiled: bool) -> dict[str, dict]:
    """The transformers rows: label -> the keyword arguments its `generate` call gets.

    The eager rows set `disable_compile=True`: without it, transformers compiles the forward pass of a
    static-cache `generate` on a GPU by itself. The compiled row passes transformers' default
    `CompileConfig` (inductor, mode "reduce-overhead"); off a GPU transformers compiles only when the
    config says `_compile_all_devices`."""
    rows = {HF_DYNAMIC: {"disable_compile": True},
            HF_STATIC: {"cache_implementation": "static", "disable_compile": True}}
    if compiled:
        from transformers import CompileConfig

        config = CompileConfig()
        if torch.device(device).type != "cuda":
            config._compile_all_devices = True
        rows[HF_COMPILED] = {"cache_implementation": "static", "compile_config": config}
    return rows


@contextmanager
def compile_decisions(hf_model, assume_device: str | None = None) -> Iterator[list[bool]]:
    """Record, for every `generate` call inside, transformers' own decision whether to compile its
    forward pass (`_valid_auto_compile_criteria`), in the list this yields. assume_device="cuda"
    records the decision it would take on a GPU (where it compiles a static cache unless told not
    to); the call itself still runs, and compiles or not, as on the model's real device. Yields an
    empty list with a transformers that has no such decision (older than 4.48: it never compiles)."""
    decide = getattr(type(hf_model), "_valid_auto_compile_criteria", None)
    decisions: list[bool] = []
    if decide is None:
        yield decisions
        return
    # The decision reads only the model's device, config and a few optional attributes (quantizer,
    # device map), so a stand-in with another device gets the decision transformers would take there.
    judged = hf_model if assume_device is None else types.SimpleNamespace(
        device=torch.device(assume_device), config=hf_model.config)

    def spy(model_kwargs, generation_config):
        real = bool(decide(hf_model, model_kwargs, generation_config))
        there = real if judged is hf_model else bool(decide(judged, model_kwargs, generation_config))
        decisions.append(there)
        return real

    hf_model._valid_auto_compile_criteria = spy  # an instance attribute: generate calls it
    try:
        yield decisions
    finally:
        del hf_model._valid_auto_compile_criteria


def hf_compiles(hf_model, generate_kwargs: dict, assume_device: str | None = None) -> bool:
    """Would transformers compile `generate` with these keyword arguments (on assume_device, by
    default the model's own)? Asked of transformers itself, in a two-token generate."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=hf_model.device)
    with compile_decisions(hf_model, assume_device) as decisions, torch.inference_mode():
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                          **generate_kwargs)
    return any(decisions)


def first_divergence(tokens: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> int | None:
    """Index (0 = the first new token) of the first generated position at which tokens differ from
    reference in any row of the batch; None when they are identical."""
    if tokens.shape != reference.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and reference {tuple(reference.shape)} differ in "
                         "shape: compare generations of the same prompt and length")
    differs = (tokens[:, prompt_len:].cpu() != reference[:, prompt_len:].cpu()).any(dim=0)
    return int(differs.nonzero()[0]) if bool(differs.any()) else None


@torch.inference_mode()
def teacher_forced_agreement(decoder: FastDecoder, tokens: torch.Tensor, prompt_len: int,
                             step_fn=None) -> float:
    """The share of generated positions at which the decoder, fed `tokens` themselves (the prompt,
    then each of their tokens in turn, never its own choices), picks the same next token as
    `tokens`. One early near-tie cannot spoil the positions after it, as it does in a position-by-
    position comparison of two free generations. step_fn: the decoder's graphed or compiled step
    (`make_step`) for one token; the prompt is fed through `decoder.step`, as `fast_generate` does."""
    batch, total = tokens.shape
    if decoder.batch_size != batch or decoder.max_seq_len < total - 1 or not 0 < prompt_len < total:
        raise ValueError(f"tokens {tuple(tokens.shape)} with prompt_len={prompt_len} need a decoder of "
                         f"batch {batch} and at least {total - 1} positions, and 0 < prompt_len < "
                         f"{total}; the decoder has batch {decoder.batch_size}, {decoder.max_seq_len} "
                         "positions")
    device = decoder.k.device
    step_fn = step_fn or decoder.step
    return _agreement(tokens.to(device), prompt_len,
                      lambda ids: decoder.step(ids, torch.arange(prompt_len, device=device)),
                      lambda ids, t: step_fn(ids, torch.tensor([t], device=device)))


@torch.inference_mode()
def model_teacher_forced_agreement(model: Transformer, tokens: torch.Tensor, prompt_len: int,
                                   cache: str = "static") -> float:
    """`teacher_forced_agreement` of the model's own forward with a cache of kind `cache` (the path
    `generate` times), fed `tokens` one position at a time after the prompt."""
    batch, total = tokens.shape
    if not 0 < prompt_len < total:
        raise ValueError(f"prompt_len={prompt_len} must be between 1 and {total - 1} for tokens "
                         f"{tuple(tokens.shape)}")
    weight = model.embed.weight
    kv = make_cache(cache, model.config, batch, total, dtype=weight.dtype, device=weight.device)
    return _agreement(tokens.to(weight.device), prompt_len,
                      lambda ids: model(ids, cache=kv)[:, -1], lambda ids, t: model(ids, cache=kv)[:, -1])


def _agreement(tokens: torch.Tensor, prompt_len: int, prefill, step) -> float:
    """prefill(prompt ids) and step(one token's ids, its position) each return the next-token logits
    (B, vocab); the share of positions after the prompt where their argmax is tokens' next token."""
    logits, hits = prefill(tokens[:, :prompt_len]), []
    for t in range(prompt_len, tokens.shape[1]):
        hits.append(logits.argmax(-1) == tokens[:, t])
        if t + 1 < tokens.shape[1]:
            logits = step(tokens[:, t:t + 1], t)
    return torch.stack(hits).float().mean().item()


def compare_hf(config: ModelConfig = CPU_CONFIG, new_tokens: int = 64, prompt_len: int = 16,
               repeats: int = 5, device=None, dtype: torch.dtype | None = None,
               progress: bool = False, clock: str = "wall", fast_modes: Sequence[str] = ("eager",),
               hf_compiled: bool | None = None, bandwidth_bytes_per_s: float | None = None,
               measured_bandwidth_bytes_per_s: float | None = None) -> list[dict]:
    """kvlab vs `transformers` generate on the same random weights of this shape (`hf_twin`), batch 1,
    greedy, interleaved: see `compare_models`, whose rows this returns."""
    device = torch.device(device) if device is not None else env.device()
    dtype = dtype or env.half_dtype(device)
    hf_model, kv_model = hf_twin(config, 0, dtype, device)
    ids = random_prompt(config, 1, prompt_len, device)
    return compare_models(hf_model, kv_model, ids, new_tokens, model_name=config.name, repeats=repeats,
                          progress=progress, clock=clock, fast_modes=fast_modes, hf_compiled=hf_compiled,
                          bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                          measured_bandwidth_bytes_per_s=measured_bandwidth_bytes_per_s)


def compare_real_model(new_tokens: int = 64, prompt_len: int = 64, repeats: int = 5, device=None,
                       dtype: torch.dtype | None = None, progress: bool = False, clock: str = "wall",
                       fast_modes: Sequence[str] = ("eager",), hf_compiled: bool | None = None,
                       bandwidth_bytes_per_s: float | None = None,
                       measured_bandwidth_bytes_per_s: float | None = None) -> list[dict]:
    """kvlab vs `transformers` on the course's real model (`kvlab.course_model.load_course_model`, both
    sides with the same weights), prompted with prompt_len tokens of the course's held-out English text.
    Raises `kvlab.hf.ModelUnavailableError` when the model cannot be loaded."""
    from .. import course_model, pretrained

    device = torch.device(device) if device is not None else env.device()
    dtype = dtype or env.half_dtype(device)
    kv_model, tokenizer, hf_model = course_model.load_course_model(dtype=dtype, device=device,
                                                                   transformers_too=True)
    text_ids = tokenizer(pretrained.corpus_text("held_out"), return_tensors="pt").input_ids
    if text_ids.shape[1] < prompt_len:
        raise ValueError(f"prompt_len={prompt_len} is more than the {text_ids.shape[1]} tokens of the "
                         "held-out text")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    plain_greedy(hf_model, pad_token_id=pad if pad is not None else 0)
    return compare_models(hf_model, kv_model, text_ids[:, :prompt_len].to(device), new_tokens,
                          sweep="compare_real", model_name=course_model.course_model_name(),
                          repeats=repeats,
                          progress=progress, clock=clock, fast_modes=fast_modes, hf_compiled=hf_compiled,
                          bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                          measured_bandwidth_bytes_per_s=measured_bandwidth_bytes_per_s)


def compare_models(hf_model, kv_model, ids: torch.Tensor, new_tokens: int, *, sweep: str = "compare_hf",
                   model_name: str | None = None, repeats: int = 5, progress: bool = False,
                   clock: str = "wall", fast_modes: Sequence[str] = ("eager",),
                   hf_compiled: bool | None = None, bandwidth_bytes_per_s: float | None = None,
                   measured_bandwidth_bytes_per_s: float | None = None) -> list[dict]:
    """kvlab cached decoding vs `transformers` generate on the same weights (hf_model and kv_model =
    `from_hf(hf_model)`), batch 1, greedy, runs interleaved; one row a method with the median, min and
    max time, ratios to each transformers row, and the token checks (module docstring). On the CPU
    kv_model's weights are first stored input-major (`Transformer.store_weights_input_major`: the
    same values in the layout the CPU's BLAS streams fastest for a batch of one; transformers keeps
    its own layout).

    fast_modes: the `kvlab.fast` modes to time too ("graph" needs a GPU); each keeps one decoder and
    one captured/compiled step across calls, as transformers keeps its static cache.
    hf_compiled: add transformers' compiled static-cache row (default: on a GPU, where transformers
    users get it by default). bandwidth_bytes_per_s (and a measured one): when given, each row also
    reports the share of it the decoding used (`kvlab.roofline.achieved_fraction` at the mean
    context of the run)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if ids.shape[0] != 1:
        raise ValueError(f"the comparison is at batch 1; ids has shape {tuple(ids.shape)}")
    device, dtype = kv_model.embed.weight.device, kv_model.embed.weight.dtype
    config, prompt_len = kv_model.config, ids.shape[1]
    hf_compiled = device.type == "cuda" if hf_compiled is None else hf_compiled
    if device.type == "cpu":  # batch-1 decoding streams the weights: kvlab's CPU layout for it
        kv_model.store_weights_input_major()
    mask = torch.ones_like(ids)
    outputs: dict[str, torch.Tensor] = {}
    decisions: dict[str, list[bool]] = {}
    decoders: dict[str, tuple] = {}  # the fast path's decoders and steps, by label

    def run_hf(label, kwargs):
        with compile_decisions(hf_model) as seen, torch.inference_mode():
            outputs[label] = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                               do_sample=False, **kwargs)
        decisions.setdefault(label, []).extend(seen)

    def run_kvlab_generate():
        outputs[KVLAB_GENERATE] = generate(kv_model, ids, new_tokens, cache="static").tokens

    def run_fast(label, mode, dec, step):
        outputs[label] = fast_generate(kv_model, ids, new_tokens, mode=mode, decoder=dec, step_fn=step).tokens

    fns = {KVLAB_GENERATE: run_kvlab_generate}
    hf_rows = hf_generate_kwargs(device, hf_compiled)
    for label, kwargs in hf_rows.items():
        fns[label] = lambda label=label, kwargs=kwargs: run_hf(label, kwargs)
    for mode in fast_modes:
        label = f"kvlab fast {mode}"
        dec = FastDecoder(kv_model, 1, prompt_len + new_tokens)
        with torch.inference_mode():
            step = make_step(dec, mode)
        decoders[label] = (dec, step)
        fns[label] = lambda label=label, mode=mode, dec=dec, step=step: run_fast(label, mode, dec, step)
    times = time_interleaved(fns, repeats, 1, device, progress, "kvlab vs transformers", clock)
    _check_compile_labels(decisions)
    reference = outputs[HF_DYNAMIC]
    base = {k: median(v) for k, v in times.items()}

    def execution(label: str) -> str:
        if label in hf_rows:
            return "torch.compile (transformers' CompileConfig)" if label == HF_COMPILED else "eager"
        return {"graph": "CUDA graph", "compile": "torch.compile"}.get(label.rsplit(" ", 1)[-1], "eager")

    def token_checks(label: str) -> dict:
        checks = {"tokens_identical": bool(torch.equal(outputs[label].cpu(), reference.cpu())),
                  "first_divergence": first_divergence(outputs[label], reference, prompt_len),
                  "teacher_forced_agreement": None}
        if label == KVLAB_GENERATE:  # the model's forward, the path generate times
            agreement = model_teacher_forced_agreement(kv_model, reference, prompt_len)
            checks["teacher_forced_agreement"] = agreement
        elif label in decoders:
            dec, step = decoders[label]
            checks["teacher_forced_agreement"] = teacher_forced_agreement(dec, reference, prompt_len, step)
        return checks

    def ratios(label: str) -> dict:
        out = {"speedup_vs_hf_dynamic": base[HF_DYNAMIC] / base[label],
               "speedup_vs_hf_static": base[HF_STATIC] / base[label]}
        if HF_COMPILED in base:
            out["speedup_vs_hf_compiled"] = base[HF_COMPILED] / base[label]
        return out

    def slots_read(label: str) -> int:
        # The cached positions a decode step reads, on average over the run: the filled ones for
        # the model's forward and transformers; all S_max slots of its buffer for kvlab.fast.
        return prompt_len + (new_tokens if label in decoders else new_tokens // 2)

    def bandwidth_share(label: str, seconds: float) -> dict:
        out = {"kv_slots_read_per_step": slots_read(label)}
        for key, bandwidth in (("", bandwidth_bytes_per_s), ("measured_", measured_bandwidth_bytes_per_s)):
            if bandwidth is not None:
                out[f"fraction_of_{key}bandwidth"] = roofline.achieved_fraction(
                    config, new_tokens / seconds, bandwidth, slots_read(label), 1,
                    TORCH_DTYPE_NAMES[dtype])
                out[f"{key}bandwidth_bytes_per_s"] = bandwidth
        return out

    shape = f"L{config.n_layers} d{config.d_model} H{config.n_heads}/{config.n_kv_heads} V{config.vocab_size}"
    return [result_row(sweep, k, v, new_tokens, execution=execution(k), new_tokens=new_tokens, batch=1,
                       prompt_len=prompt_len, clock=clock, dtype=TORCH_DTYPE_NAMES[dtype], model=shape,
                       config=model_name or config.name, **token_checks(k), **ratios(k),
                       **bandwidth_share(k, base[k]))
            for k, v in times.items()]


def _check_compile_labels(decisions: dict[str, list[bool]]) -> None:
    """Refuse a row whose label says eager (or compiled) when transformers decided otherwise."""
    for label, seen in decisions.items():
        want = label == HF_COMPILED
        if seen and any(d != want for d in seen):
            raise RuntimeError(f"{label!r}: transformers decided compile={not want} in some timed call, "
                               "so the row would be mislabelled; check its generate arguments "
                               "(hf_generate_kwargs)")
