"""A real model, the same code: kvlab Transformers with the weights of `transformers` checkpoints.

Llama, Mistral and Qwen2 share kvlab's architecture (RMSNorm, RoPE in the rotate-half layout,
SwiGLU, GQA; Qwen2 adds biases on Q, K, V), so the weights copy over one to one; kvlab only
fuses Q/K/V and gate/up into single matrices. Anything else a config can switch on (other
activations, MLP or output biases, scaled RoPE, unknown weights) is refused with a message naming
the field, never run approximately. `transformers` is an optional dependency (`pip install kvlab[hf]`,
which also brings `gguf` and `accelerate`, with which transformers reads GGUF files).

    model, tokenizer = kvlab.hf.load("path/to/folder")                   # saved with save_pretrained
    model, tokenizer = kvlab.hf.load("path/to/folder", gguf_file="x.gguf")  # any Llama-family GGUF
    model, tokenizer = kvlab.course_model.load_course_model()   # the course's real model, offline

`save_random_checkpoint(folder)` writes a small random-weights Llama and a tokenizer trained on the
course corpus, so everything here can be tried (and tested) without any download.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from .config import ModelConfig
from .model import Transformer

SUPPORTED = ("llama", "mistral", "qwen2")
REAL_MODEL_ENV = "KVLAB_REAL_MODEL"  # a local folder or .gguf file to use instead of the course's model
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
          "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


class ModelUnavailableError(RuntimeError):
    """The checkpoint could not be loaded (not installed, offline and not cached, no such folder)."""


class CorruptModelError(ModelUnavailableError):
    """The model file is not the one expected: its sha256 differs."""


class NotEnoughMemoryError(MemoryError):
    """Loading would need more memory than the machine has available now."""


def config_from_hf(hf_config) -> ModelConfig:
    """Translate a transformers config into a ModelConfig, refusing what kvlab cannot reproduce.

    A sliding attention window (Mistral, Qwen2 with use_sliding_window) changes nothing for
    sequences that fit in it, so kvlab's max_seq_len is capped at the window: longer sequences are
    refused by the model instead of being answered with full attention.
    """
    kind = getattr(hf_config, "model_type", None)
    if kind not in SUPPORTED:
        raise ValueError(f"model_type={kind!r} is not supported; allowed: {', '.join(SUPPORTED)}")
    _refuse_what_kvlab_does_not_compute(hf_config)
    n_heads = hf_config.num_attention_heads
    max_seq_len, source = hf_config.max_position_embeddings, "transformers config"
    window = _sliding_window(hf_config)
    if window is not None and window < max_seq_len:
        max_seq_len, source = window, f"transformers config; max_seq_len capped at sliding_window={window}"
    return ModelConfig(
        n_layers=hf_config.num_hidden_layers,
        d_model=hf_config.hidden_size,
        n_heads=n_heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
        d_ff=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_seq_len=max_seq_len,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads,
        rope_theta=float(_rope(hf_config).get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
        norm_eps=hf_config.rms_norm_eps,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2",
        name=getattr(hf_config, "_name_or_path", "") or kind,
        source=source,
    )


def _rope(hf_config) -> dict:
    # transformers 5 keeps RoPE settings in `rope_parameters`; 4.x in `rope_scaling` + `rope_theta`.
    return getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}


def _refuse_what_kvlab_does_not_compute(hf_config) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' "swish" is SiLU too
        raise ValueError(f"hidden_act={act!r} is not supported; kvlab's feed-forward is SwiGLU "
                         "(hidden_act='silu')")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported; kvlab's feed-forward has no biases")
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported; it adds a bias to the output "
                         "projection (o_proj), which kvlab's attention does not have")
    rope = _rope(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"rope scaling {rope_type!r} is not supported; kvlab implements plain "
                         "RoPE (rope_type='default')")


def _sliding_window(hf_config) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if not window or not getattr(hf_config, "use_sliding_window", True):
        return None
    layer_types = getattr(hf_config, "layer_types", None)  # Qwen2: only some layers may slide
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def from_hf(hf_model) -> Transformer:
    """Build a kvlab Transformer holding a copy of hf_model's weights (same dtype and device).

    Every weight of hf_model must find its place in kvlab's model: one that does not (a bias
    kvlab has no slot for, say) is refused by name rather than dropped.
    """
    return from_hf_weights(hf_model.config, dict(hf_model.state_dict()))


def from_hf_weights(hf_config, sd: dict[str, torch.Tensor]) -> Transformer:
    """from_hf without building the transformers model: its config and its weights by name, as
    save_pretrained stores them (a tied lm_head may be left out). Dtype and device follow the weights."""
    config = config_from_hf(hf_config)
    used: set[str] = set()

    def take(*names: str) -> torch.Tensor:
        missing = [n for n in names if n not in sd]
        if missing:
            raise ValueError(f"the transformers weights lack {missing[0]!r}, which kvlab's model needs")
        used.update(names)
        return torch.cat([sd[n] for n in names]) if len(names) > 1 else sd[names[0]]

    embed = take("model.embed_tokens.weight")
    with _skip_init():  # every weight is overwritten by load_state_dict (strict) below
        model = Transformer(config).to(dtype=embed.dtype, device=embed.device)
    ours = {"embed.weight": embed, "norm.weight": take("model.norm.weight"),
            "lm_head.weight": take("lm_head.weight") if "lm_head.weight" in sd or not config.tie_embeddings
            else embed}
    for i in range(config.n_layers):
        hf, kv = f"model.layers.{i}.", f"layers.{i}."
        ours[kv + "attn_norm.weight"] = take(hf + "input_layernorm.weight")
        ours[kv + "ffn_norm.weight"] = take(hf + "post_attention_layernorm.weight")
        ours[kv + "attn.qkv.weight"] = take(*(hf + f"self_attn.{p}_proj.weight" for p in "qkv"))
        if config.qkv_bias:
            ours[kv + "attn.qkv.bias"] = take(*(hf + f"self_attn.{p}_proj.bias" for p in "qkv"))
        ours[kv + "attn.out.weight"] = take(hf + "self_attn.o_proj.weight")
        ours[kv + "ffn.gate_up.weight"] = take(hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
        ours[kv + "ffn.down.weight"] = take(hf + "mlp.down_proj.weight")
    left = sorted(set(sd) - used)
    if left:
        raise ValueError(f"{len(left)} weights of the transformers model have no place in kvlab's "
                         f"model, e.g. {left[0]!r}; kvlab would ignore them, so it refuses")
    model.load_state_dict(ours)
    return model.eval()


@contextlib.contextmanager
def _skip_init():
    """torch's weight initialisers as no-ops: random weights that load_state_dict overwrites at once
    cost 3 s for 135 M parameters on two cores. (transformers' no_init_weights does the same, but
    importing it takes over a second.)"""
    names = ("uniform_", "normal_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    try:
        for name in names:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, init in saved.items():
            setattr(torch.nn.init, name, init)


def as_dtype(dtype) -> torch.dtype:
    """The torch dtype for None (float32), a torch.dtype, or a name such as "bf16"."""
    if dtype is None:
        return torch.float32  # exact comparisons; 135 M parameters are 0.5 GiB in fp32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed; allowed: a torch.dtype or "
                         f"{', '.join(map(repr, DTYPES))}")
    return DTYPES[dtype]


def load_transformers(name_or_path: str | os.PathLike, dtype=None, device=None,
                      local_files_only: bool = False, gguf_file: str | None = None):
    """(transformers model, tokenizer) of a checkpoint: a local folder, the local cache or the hub.

    gguf_file: the name of a GGUF file in that folder (or repository), which transformers
    dequantizes to `dtype` (it needs the gguf and accelerate packages); a path to a .gguf file
    works too. The local cache is tried first, so a model downloaded once loads offline. Raises
    ModelUnavailableError, saying how to make it available, when it cannot be loaded.
    """
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise ModelUnavailableError("kvlab.hf needs transformers: pip install 'kvlab[hf]'") from err
    dtype, name = as_dtype(dtype), str(name_or_path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if gguf_file is None and name.endswith(".gguf"):
        name, gguf_file = str(Path(name).expanduser().parent), Path(name).name
    if gguf_file is not None:
        _require_gguf_readers(gguf_file)
    if Path(name).expanduser().is_dir():
        name, tries = str(Path(name).expanduser()), (True,)
    else:
        tries = (True,) if local_files_only else (True, False)  # cache first, then the hub
    for only_local in tries:
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=only_local, gguf_file=gguf_file)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=only_local,
                                                         gguf_file=gguf_file)
            return _dequantized(model).to(device).eval(), tokenizer
        except Exception as err:  # only the "cannot get the files" kinds are caught (below)
            if not _unavailable(err):
                raise
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    what = f"{gguf_file!r} in {name!r}" if gguf_file else repr(name)
    raise ModelUnavailableError(
        f"could not load {what} ({reason[:160]}). Give a folder saved with save_pretrained, a folder "
        "and the name of a GGUF file in it, or a model on the hub while online")


def _require_gguf_readers(gguf_file: str) -> None:
    import importlib.util

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelUnavailableError(f"reading {gguf_file} needs the package{'s' * (len(missing) > 1)} "
                                    f"{' and '.join(missing)}: pip install {' '.join(missing)}")


def _dequantized(model):
    """A model read from GGUF holds float weights but stays marked as quantized, which stops
    save_pretrained: drop the mark (transformers' own method)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and quantizer.quantization_config.quant_method == "gguf":
        quantizer.remove_quantization_config(model)
    return model


def _unavailable(err: Exception) -> bool:
    """Does err mean the files could not be had (not cached, offline, no such repo or folder)?"""
    network = type(err).__module__.split(".")[0] in ("httpx", "requests", "urllib3", "huggingface_hub")
    return isinstance(err, (OSError, ValueError)) or network


def load(name_or_path: str | os.PathLike, dtype=None, device=None, local_files_only: bool = False,
         gguf_file: str | None = None) -> tuple[Transformer, object]:
    """(kvlab Transformer, the checkpoint's own tokenizer) for a Llama/Mistral/Qwen2 checkpoint.

    name_or_path: a folder saved with save_pretrained, a hub name, or a .gguf file; gguf_file: the
    name of a GGUF file inside the folder. dtype: None (float32), a torch.dtype or
    "fp32"/"fp16"/"bf16"; device: None picks CUDA when present. Raises ModelUnavailableError when
    the checkpoint cannot be loaded, ValueError when kvlab cannot run it exactly.
    """
    hf_model, tokenizer = load_transformers(name_or_path, dtype, device, local_files_only, gguf_file)
    return from_hf(hf_model), tokenizer


def random_hf_model(seed: int = 0, vocab_size: int = 320, **config):
    """A small random-weights transformers LlamaForCausalLM (no download), for trying the API."""
    import transformers

    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None) | config
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    with torch.no_grad():  # weights large enough that greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.12)
    return model


def train_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on the course corpus with `tokenizers` (any text encodes)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from .pretrained import corpus_text

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus_text("train").split("\n\n"), vocab_size=vocab_size - 1,
                            min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")


def save_random_checkpoint(folder: str | os.PathLike, seed: int = 0, **config) -> Path:
    """Save a random-weights Llama and a trained tokenizer to `folder`, as the hub would serve them.

    `load(folder)` then works offline: the course's "On a real model" sections run on it when
    KVLAB_REAL_MODEL points at the folder (the numbers are a random model's, the code the same).
    """
    folder = Path(folder)
    tokenizer = train_tokenizer()
    model = random_hf_model(seed, vocab_size=len(tokenizer), **config)
    model.config.eos_token_id = model.generation_config.eos_token_id = None  # never stop early
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
