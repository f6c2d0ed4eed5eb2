"""kvlab-tiny: a tiny byte-level Llama-style model shipped with the package, so generation prints
readable text offline (no model hub).

Token ids are UTF-8 bytes (vocabulary 256): one id per ASCII letter, three per Chinese character.
The model was trained by `python -m kvlab.train` on `kvlab/data/corpus.txt`, prose this project
wrote about generation and the KV cache, in English and Chinese. Every tenth paragraph of the
corpus is held out: training never sees it, so its loss measures the model honestly.

    model = kvlab.pretrained.load("kvlab-tiny")
    kvlab.pretrained.loss(model, kvlab.pretrained.corpus_text("held_out"))   # nats per byte
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .generate import encode_bytes
from .model import Transformer

DATA_DIR = Path(__file__).parent / "data"
CORPUS = DATA_DIR / "corpus.txt"
MODELS = ("kvlab-tiny",)
HELD_OUT_EVERY = 10  # paragraph i is held out when i % 10 == 9
SPLITS = ("train", "held_out")


def _check_name(name: str) -> None:
    if name not in MODELS:
        raise ValueError(f"unknown pretrained model {name!r}; allowed: {', '.join(map(repr, MODELS))}")


def info(name: str = "kvlab-tiny") -> dict:
    """What was recorded when the model was trained: config, steps, seed, losses, a sample."""
    _check_name(name)
    path = DATA_DIR / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path.name} is missing; build it with `python -m kvlab.train`")
    return json.loads(path.read_text(encoding="utf-8"))


def config(name: str = "kvlab-tiny") -> ModelConfig:
    """The ModelConfig the checkpoint was trained with."""
    return ModelConfig(**info(name)["config"])


def load(name: str = "kvlab-tiny", device="cpu", dtype: torch.dtype = torch.float32) -> Transformer:
    """The pretrained model, in eval mode, on `device` in `dtype` (stored in fp16, loaded as asked)."""
    cfg = config(name)
    state = torch.load(DATA_DIR / f"{name}.pt", map_location="cpu", weights_only=True)
    model = Transformer(cfg)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    return model.to(device=device, dtype=dtype).eval()


def corpus_text(split: str = "train") -> str:
    """The training text ("train") or the paragraphs training never saw ("held_out")."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not known; allowed: {', '.join(map(repr, SPLITS))}")
    paragraphs = [p.strip() for p in CORPUS.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    held = split == "held_out"
    keep = [p for i, p in enumerate(paragraphs) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held]
    return "\n\n".join(keep) + "\n"


@torch.inference_mode()
def loss(model: Transformer, text: str, context: int = 256, batch_size: int = 16) -> float:
    """Mean next-byte cross-entropy of `model` on `text`, in nats per byte.

    The text is cut into consecutive windows of `context` bytes; inside a window each byte is
    predicted from the bytes before it in that window. ln(256) ≈ 5.55 is a uniform guess.
    """
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context={context!r} must be a positive integer")
    if context > model.config.max_seq_len:
        raise ValueError(f"context={context} exceeds the model's max_seq_len={model.config.max_seq_len}")
    device = next(model.parameters()).device
    ids = torch.tensor(encode_bytes(text), dtype=torch.long, device=device)
    if ids.numel() < 2:
        raise ValueError(f"text must hold at least 2 bytes to predict one; got {ids.numel()}")
    inputs, targets = ids[:-1], ids[1:]
    n_full = inputs.numel() // context
    chunks = []
    if n_full:
        chunks += [(inputs[:n_full * context].view(n_full, context)[i:i + batch_size],
                    targets[:n_full * context].view(n_full, context)[i:i + batch_size])
                   for i in range(0, n_full, batch_size)]
    if inputs.numel() % context:
        chunks.append((inputs[n_full * context:][None], targets[n_full * context:][None]))
    total = 0.0
    for x, y in chunks:
        logits = model(x).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                 reduction="sum").item()
    return total / targets.numel()
