"""Train kvlab-tiny, the byte-level model that `kvlab.pretrained.load("kvlab-tiny")` returns.

    python -m kvlab.train                       # the shipped checkpoint (700 steps, see below)
    python -m kvlab.train --steps 50 --output /tmp/tiny   # a quick smoke run elsewhere

It reads `kvlab/data/corpus.txt` (training split only: every tenth paragraph is held out, see
`kvlab.pretrained.corpus_text`), trains a 4-layer Llama-style MHA decoder (d_model 96, 4 heads)
on random 256-byte windows with AdamW and a cosine learning rate, and writes to the output folder
(default `kvlab/data/`):

- `kvlab-tiny.pt`: the state dict in fp16 (about 1 MB; `load` converts it back to fp32),
- `kvlab-tiny.json`: config, steps, seed, train and held-out loss in nats per byte (measured on the
  fp16-rounded weights that ship), a greedy sample from a fixed prompt, and the torch version.

Time: about 0.5 s a step on one free CPU core (≈ 6 minutes); the shipped run took 18 minutes on a
shared, heavily loaded machine (`train_seconds` in the record).
Same seed, steps and thread count give the same weights on the same torch build. One thread is the
default: on a busy shared machine it is faster than two, and it keeps the result reproducible.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import pretrained
from .config import ModelConfig
from .generate import decode_bytes, encode_bytes, generate
from .model import Transformer

CONFIG = ModelConfig(n_layers=4, d_model=96, n_heads=4, n_kv_heads=4, d_ff=256, vocab_size=256,
                     max_seq_len=1024, name="kvlab-tiny",
                     source="kvlab: python -m kvlab.train on kvlab/data/corpus.txt")
SAMPLE_PROMPT = "The KV cache"
SAMPLE_TOKENS = 160


def batches(data: torch.Tensor, batch_size: int, context: int, generator: torch.Generator):
    """Endless random windows: inputs (B, context) and their next bytes (B, context)."""
    while True:
        starts = torch.randint(0, data.numel() - context - 1, (batch_size,), generator=generator)
        window = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def cosine_lr(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(steps: int = 700, seed: int = 0, batch_size: int = 8, context: int = 256,
          lr: float = 3e-3, threads: int = 1, output: Path = pretrained.DATA_DIR) -> dict:
    """Train, save `kvlab-tiny.pt` and `kvlab-tiny.json` into `output`, return the record."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    data = torch.tensor(encode_bytes(pretrained.corpus_text("train")), dtype=torch.long)
    model = Transformer(CONFIG).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    start = time.perf_counter()
    stream = batches(data, batch_size, context, generator)
    bar = tqdm(range(steps), desc="training kvlab-tiny")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, lr, warmup=min(50, steps // 10 + 1))
        x, y = next(stream)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    seconds = time.perf_counter() - start
    return save(model, steps, seed, batch_size, context, lr, threads, seconds, Path(output))


def save(model: Transformer, steps, seed, batch_size, context, lr, threads, seconds,
         output: Path) -> dict:
    """Store the weights in fp16 and record losses measured on exactly those weights."""
    output.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    shipped = Transformer(CONFIG)
    shipped.load_state_dict({k: v.float() for k, v in state.items()})
    shipped.eval()
    prompt = encode_bytes(SAMPLE_PROMPT)
    sample = generate(shipped, prompt, SAMPLE_TOKENS, cache="static").tokens[0].tolist()
    cfg = {k: getattr(CONFIG, k) for k in CONFIG.__dataclass_fields__}
    record = {
        "name": CONFIG.name,
        "config": cfg,
        "n_params": shipped.num_params(),
        "steps": steps, "seed": seed, "batch_size": batch_size, "context": context,
        "peak_lr": lr, "threads": threads, "train_seconds": round(seconds, 1),
        "train_loss": round(pretrained.loss(shipped, pretrained.corpus_text("train"), context), 4),
        "held_out_loss": round(pretrained.loss(shipped, pretrained.corpus_text("held_out"), context), 4),
        "loss_unit": "nats per byte (mean next-byte cross-entropy, windows of `context` bytes)",
        "sample_prompt": SAMPLE_PROMPT,
        "sample": decode_bytes(sample),
        "sample_tokens": sample,
        "torch_version": torch.__version__,
    }
    torch.save(state, output / f"{CONFIG.name}.pt")
    (output / f"{CONFIG.name}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=700, help="optimizer steps (default 700)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per step (default 8)")
    parser.add_argument("--context", type=int, default=256, help="bytes per window (default 256)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--output", type=Path, default=pretrained.DATA_DIR,
                        help="folder for kvlab-tiny.pt and kvlab-tiny.json (default kvlab/data)")
    args = parser.parse_args(argv)
    record = train(args.steps, args.seed, args.batch_size, args.context, args.lr, args.threads,
                   args.output)
    print(f"held-out loss {record['held_out_loss']:.3f} nats/byte, "
          f"train {record['train_loss']:.3f}, {record['train_seconds']:.0f} s")
    print(f"sample: {record['sample']!r}")


if __name__ == "__main__":
    main()
