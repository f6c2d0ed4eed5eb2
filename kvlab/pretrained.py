"""kvlab-tiny and kvlab-tiny-gqa: tiny byte-level Llama-style models shipped with the package, so
generation prints readable text offline (no model hub); and kvlab-tiny-draft, a one-layer model of the
same bytes, kvlab-tiny's draft model in speculative decoding (`kvlab.speculative`).

Token ids are UTF-8 bytes (vocabulary 256): one id per ASCII letter, three per Chinese character.
All three were trained by `python -m kvlab.train` on a corpus this project wrote, in English and
Chinese (`kvlab/data/corpus/`): hand-written documents (`handwritten/`) and worked KV-cache arithmetic
generated from templates by `tools/make_corpus.py` (`generated/`). Whole documents are split, by a
hash of their name, into train (80 %), validation (5 %, used to stop training early) and held-out
(15 %, never seen in training nor used to choose anything), so the held-out loss measures the models
honestly.

    model = kvlab.pretrained.load("kvlab-tiny")            # MHA: 4 query heads, 4 KV heads
    twin = kvlab.pretrained.load("kvlab-tiny-gqa")         # same budget, 2 KV heads, trained natively
    draft = kvlab.pretrained.load("kvlab-tiny-draft")      # 1 layer, d_model 96: cheap guesses
    kvlab.pretrained.loss(model, kvlab.pretrained.corpus_text("held_out"))   # nats per byte
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import validate
from .config import ModelConfig
from .generate import encode_bytes
from .model import Transformer

DATA_DIR = Path(__file__).parent / "data"
CORPUS_DIR = DATA_DIR / "corpus"
SOURCES = ("handwritten", "generated")
MODELS = ("kvlab-tiny", "kvlab-tiny-gqa", "kvlab-tiny-draft")
SPLITS = ("train", "validation", "held_out")
SEPARATOR = "\n===\n"  # a line `===` ends a document inside a corpus file
HELD_OUT_PERCENT, VALIDATION_PERCENT = 15, 5
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
RECORD_KEYS = ("config", "n_params", "context")


@dataclass(frozen=True)
class Document:
    name: str     # "handwritten/en_kv_cache.txt#3": file and position in it
    source: str   # "handwritten" or "generated"
    text: str

    @property
    def split(self) -> str:
        return split_of(self.name)


def split_of(name: str) -> str:
    """Which split a document belongs to: a fixed rule on a hash of its name, so adding text to one
    document never moves another."""
    bucket = int(hashlib.sha256(name.encode("utf-8")).hexdigest()[:8], 16) % 100
    if bucket < HELD_OUT_PERCENT:
        return "held_out"
    return "validation" if bucket < HELD_OUT_PERCENT + VALIDATION_PERCENT else "train"


def corpus_files() -> list[Path]:
    return sorted(p for source in SOURCES for p in (CORPUS_DIR / source).glob("*.txt"))


def documents() -> list[Document]:
    """Every document of the corpus, in a fixed order (file name, then position)."""
    docs = []
    for path in corpus_files():
        parts = path.read_text(encoding="utf-8").split(SEPARATOR)
        for i, text in enumerate(parts):
            if text.strip():
                docs.append(Document(f"{path.parent.name}/{path.name}#{i}", path.parent.name, text.strip()))
    return docs


def corpus_text(split: str = "train", source: str | None = None) -> str:
    """The documents of one split ("train", "validation" or "held_out"), optionally of one source
    ("handwritten" or "generated"), joined by blank lines."""
    validate.choice("split", split, SPLITS)
    if source is not None:
        validate.choice("source", source, SOURCES)
    keep = [d.text for d in documents() if d.split == split and source in (None, d.source)]
    return "\n\n".join(keep) + "\n"


def corpus_sha256() -> str:
    """SHA-256 over every corpus file (its relative path and bytes), the corpus's fingerprint."""
    h = hashlib.sha256()
    for path in corpus_files():
        h.update(f"{path.parent.name}/{path.name}\n".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _check_name(name: str) -> str:
    return validate.choice("name", name, MODELS)


def _read_record(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; build it with `python -m kvlab.train`")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a valid JSON training record: {e}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path} holds a {type(record).__name__}, not a JSON object (a training record)")
    missing = [k for k in RECORD_KEYS if k not in record]
    if missing:
        raise ValueError(f"{path} lacks the keys {missing} of a training record")
    return record


def info(name: str = "kvlab-tiny", directory: Path | str | None = None) -> dict:
    """What was recorded when the model was trained: config, steps, seed, losses with standard
    errors, corpus size and hash, wall time, a sample."""
    _check_name(name)
    return _read_record(Path(directory or DATA_DIR) / f"{name}.json")


def config(name: str = "kvlab-tiny", directory: Path | str | None = None) -> ModelConfig:
    """The ModelConfig the checkpoint was trained with."""
    path = Path(directory or DATA_DIR) / f"{name}.json"
    try:
        return ModelConfig(**info(name, directory)["config"])
    except (TypeError, ValueError) as e:
        if isinstance(e, ValueError) and str(path) in str(e):
            raise
        raise ValueError(f"{path}: its 'config' is not a valid ModelConfig: {e}") from None


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(map(repr, DTYPES))} "
                     "or the matching torch dtypes")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or a ValueError naming the file and what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; build it with `python -m kvlab.train`")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty (0 bytes), not a safetensors checkpoint")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path} is not a readable safetensors checkpoint (truncated or another "
                         f"format?): {e}") from None


def load(name: str = "kvlab-tiny", device="cpu", dtype: torch.dtype | str = torch.float32,
         directory: Path | str | None = None) -> Transformer:
    """The pretrained model, in eval mode, on `device` in `dtype` ("fp32", "fp16", "bf16" or a torch
    dtype). Stored in fp16; `directory` defaults to the package's data folder."""
    _check_name(name)
    dtype = _torch_dtype(dtype)
    device = validate.device("device", device)
    folder = Path(directory or DATA_DIR)
    cfg = config(name, folder)
    path = folder / f"{name}.safetensors"
    state = read_weights(path)
    model = Transformer(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"{path} does not hold the weights of {name}: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(f"{path}: {key} has shape {tuple(tensor.shape)}, the config in "
                             f"{name}.json needs {tuple(expected[key].shape)}")
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    return model.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def window_losses(model: Transformer, text: str, context: int = 256, batch_size: int = 16) -> torch.Tensor:
    """Summed next-byte cross-entropy (nats) and byte count of each window: a (n_windows, 2) tensor.

    The text is cut into consecutive windows of `context` bytes; inside a window each byte is
    predicted from the bytes before it in that window. The last window may be shorter.
    """
    context = validate.integer("context", context, low=1, high=model.config.max_seq_len)
    batch_size = validate.integer("batch_size", batch_size, low=1)
    if not isinstance(text, str):
        raise ValueError(f"text must be a str; got {type(text).__name__}")
    device = next(model.parameters()).device
    ids = torch.tensor(encode_bytes(text), dtype=torch.long, device=device)
    if ids.numel() < 2:
        raise ValueError(f"text must hold at least 2 bytes to predict one; got {ids.numel()}")
    inputs, targets = ids[:-1], ids[1:]
    n_full = inputs.numel() // context
    full_x = inputs[:n_full * context].view(n_full, context)
    full_y = targets[:n_full * context].view(n_full, context)
    chunks = [(full_x[i:i + batch_size], full_y[i:i + batch_size]) for i in range(0, n_full, batch_size)]
    if inputs.numel() % context:
        chunks.append((inputs[n_full * context:][None], targets[n_full * context:][None]))
    rows = []
    for x, y in chunks:
        logits = model(x).float()
        nats = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(dim=1)
        rows += [(s, y.shape[1]) for s in nats.tolist()]
    return torch.tensor(rows, dtype=torch.float64)


def loss(model: Transformer, text: str, context: int = 256, batch_size: int = 16) -> float:
    """Mean next-byte cross-entropy of `model` on `text`, in nats per byte (every byte after the
    first counted once). ln(256) ≈ 5.55 is a uniform guess."""
    rows = window_losses(model, text, context, batch_size)
    return (rows[:, 0].sum() / rows[:, 1].sum()).item()


def loss_and_error(model: Transformer, text: str, context: int = 256,
                   batch_size: int = 16) -> tuple[float, float]:
    """The loss (nats per byte) and its standard error: the spread of the per-window mean losses
    divided by the square root of the number of windows (needs at least 2 windows)."""
    rows = window_losses(model, text, context, batch_size)
    if len(rows) < 2:
        raise ValueError(f"a standard error needs at least 2 windows of context={context}; "
                         f"the text has {int(rows[:, 1].sum()) + 1} bytes")
    per_window = rows[:, 0] / rows[:, 1]
    mean = (rows[:, 0].sum() / rows[:, 1].sum()).item()
    return mean, per_window.std(unbiased=True).item() / math.sqrt(len(rows))


def loss_comparison(models: dict, text: str, reference: str, context: int = 256):
    """Held-out loss of each model (nats per byte) with its standard error over windows, and its
    difference from the `reference` model's with the *paired* standard error (the spread of the
    per-window differences / √windows): a DataFrame, one row a model.

    Both models read the same windows, so the paired error is much smaller than either loss's own:
    the windows differ far more from each other than two models do on the same window.
    """
    import math

    import pandas as pd


    if reference not in models:
        raise ValueError(f"reference={reference!r} is not one of the models: {', '.join(models)}")
    per_window = {}
    for label, model in models.items():
        rows = window_losses(model, text, context)
        per_window[label] = (rows[:, 0] / rows[:, 1], (rows[:, 0].sum() / rows[:, 1].sum()).item())
    ref, ref_mean = per_window[reference]
    n = len(ref)
    table = []
    for label, (w, mean) in per_window.items():
        diff = w - ref
        table.append({"model": label, "loss": mean, "SE": w.std().item() / math.sqrt(n),
                      f"Δ vs {reference}": mean - ref_mean, "paired SE": diff.std().item() / math.sqrt(n)})
    out = pd.DataFrame(table).set_index("model")
    out.attrs["per_window"] = per_window   # for paired_difference between any two of the models
    return out


def paired_difference(table, label: str, reference: str) -> str:
    """One line: `label`'s held-out loss minus `reference`'s, ± the paired standard error, and
    whether it is significant (more than 2 SE from zero). `table` is a loss_comparison result."""
    import math

    per_window = table.attrs["per_window"]
    for name in (label, reference):
        if name not in per_window:
            raise ValueError(f"{name!r} is not in the table; allowed: {', '.join(per_window)}")
    (w, mean), (ref, ref_mean) = per_window[label], per_window[reference]
    se = (w - ref).std().item() / math.sqrt(len(w))
    delta = mean - ref_mean
    z = abs(delta) / se if se else math.inf
    verdict = "significant" if z > 2 else "not significant (within 2 paired SE)"
    return (f"{label} vs {reference}: {delta:+.4f} ± {se:.4f} nats/byte "
            f"({'lower' if delta < 0 else 'higher'}, {z:.1f} SE): {verdict}")
