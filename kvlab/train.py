"""Train kvlab-tiny (MHA), kvlab-tiny-gqa (its GQA twin) and kvlab-tiny-draft (the draft model of
speculative decoding), the byte-level models that `kvlab.pretrained.load(name)` returns.

    python -m kvlab.train                                  # every shipped checkpoint, one after another
    python -m kvlab.train --model kvlab-tiny-gqa           # one of them
    python -m kvlab.train --steps 20 --output /tmp/tiny    # a quick smoke run elsewhere

It trains on the corpus's train split (`kvlab.pretrained.corpus_text("train")`), random 256-byte
windows, with AdamW (weight decay 0.1), a cosine learning rate and dropout 0.1 on the embeddings
and on each attention and feed-forward output (applied by forward hooks during training only, so
`kvlab.model` stays the plain inference model). Every `eval_every` steps it measures the loss on
the validation split and keeps the best weights; it stops when that loss has not improved for
`patience` evaluations (early stopping), so the model does not learn its text by heart. The
held-out split is used only at the end, to report.

The first two share everything but the attention: the twin has 2 KV heads instead of 4 and a
wider feed-forward layer (d_ff 395 instead of 352), so both hold about 870 thousand parameters.
kvlab-tiny-draft has kvlab-tiny's bytes and head size but one layer, d_model 96 and d_ff 256: 160
thousand parameters, a decode step about a third of kvlab-tiny's on the CPU (`kvlab.speculative`).

Output (default `kvlab/data/`), per model:
- `<name>.safetensors`: the weights in fp16 (about 1.7 MB, the draft 0.3 MB; `load` converts them back),
- `<name>.json`: config, parameter count, steps, seed, wall and CPU time, train / validation /
  held-out loss in nats per byte with standard errors (over 256-byte windows, measured on the fp16
  weights that ship), corpus size and SHA-256, greedy samples from fixed prompts, torch version.

Time: the shipped runs of kvlab-tiny and kvlab-tiny-gqa (500 steps each) took 373 and 402 s of CPU
on one thread, 14 and 15 minutes of wall time on a 2-core machine shared with other work; kvlab-tiny-draft
(1500 steps) took 224 s of CPU, 7 minutes of wall time (`train_seconds`, `train_cpu_seconds` in the
records). Same seed, steps and thread count give the same weights on the same torch build; one
thread is the default, which keeps the result reproducible (and is no slower on a busy machine).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import pretrained, validate
from .config import ModelConfig
from .generate import decode_bytes, encode_bytes, generate
from .model import Transformer

_SOURCE = "kvlab: python -m kvlab.train on kvlab/data/corpus (train split)"
CONFIGS = {
    "kvlab-tiny": ModelConfig(n_layers=4, d_model=128, n_heads=4, n_kv_heads=4, d_ff=352,
                              vocab_size=256, max_seq_len=1024, name="kvlab-tiny", source=_SOURCE),
    "kvlab-tiny-gqa": ModelConfig(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, d_ff=395,
                                  vocab_size=256, max_seq_len=1024, name="kvlab-tiny-gqa", source=_SOURCE),
    # The draft model of speculative decoding (kvlab.speculative): kvlab-tiny's tokenizer (bytes) and
    # head size, one layer and a narrower stream, so one decode step costs a fraction of kvlab-tiny's.
    "kvlab-tiny-draft": ModelConfig(n_layers=1, d_model=96, n_heads=3, n_kv_heads=3, d_ff=256,
                                    vocab_size=256, max_seq_len=1024, name="kvlab-tiny-draft",
                                    source=_SOURCE),
}
# Most optimizer steps of each shipped run (early stopping may end it sooner): the draft model is
# about a fifth of kvlab-tiny's size, so three times the steps cost less than kvlab-tiny's run.
STEPS = {"kvlab-tiny": 500, "kvlab-tiny-gqa": 500, "kvlab-tiny-draft": 1500}
SAMPLE_PROMPTS = ("The KV cache", "KV 缓存")
SAMPLE_TOKENS = 200


def batches(data: torch.Tensor, batch_size: int, context: int, generator: torch.Generator):
    """Endless random windows: inputs (B, context) and their next bytes (B, context)."""
    while True:
        starts = torch.randint(0, data.numel() - context - 1, (batch_size,), generator=generator)
        window = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def train_step(model, optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One optimisation step of next-byte prediction on a batch (x, y); returns the batch loss. Gradients
    are clipped to norm 1, as in pre-training (and in `kvlab.gqa.uptrain`)."""
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def cosine_lr(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def add_dropout(model: Transformer, p: float) -> list:
    """Dropout on the embedding output and on each residual branch, active only in train mode.
    Returns the hook handles (remove them to get the plain model back)."""
    def hook(module, inputs, output):
        return F.dropout(output, p, module.training)
    modules = [model.embed] + [m for block in model.layers for m in (block.attn, block.ffn)]
    return [m.register_forward_hook(hook) for m in modules]


def train(name: str = "kvlab-tiny", steps: int | None = None, seed: int = 0, batch_size: int = 16,
          context: int = 256, lr: float = 3e-3, weight_decay: float = 0.1, dropout: float = 0.1,
          eval_every: int = 25, patience: int = 4, threads: int = 1,
          output: Path | str = pretrained.DATA_DIR, train_text: str | None = None,
          validation_text: str | None = None, save_files: bool = True) -> dict:
    """Train one model, save `<name>.safetensors` and `<name>.json` into `output`, return the record.

    `train_text` / `validation_text` replace the corpus splits (the tests train on a tiny slice);
    `save_files=False` returns the record with the trained model under "model", writing nothing.
    """
    validate.choice("name", name, CONFIGS)
    steps = validate.integer("steps", STEPS[name] if steps is None else steps, low=1)
    batch_size = validate.integer("batch_size", batch_size, low=1)
    eval_every = validate.integer("eval_every", eval_every, low=1)
    patience = validate.integer("patience", patience, low=1)
    dropout = validate.number("dropout", dropout, low=0, high=1)
    config = CONFIGS[name]
    context = validate.integer("context", context, low=1, high=config.max_seq_len)
    torch.set_num_threads(validate.integer("threads", threads, low=1))
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    train_text = pretrained.corpus_text("train") if train_text is None else train_text
    validation_text = pretrained.corpus_text("validation") if validation_text is None else validation_text
    data = torch.tensor(encode_bytes(train_text), dtype=torch.long)
    if data.numel() < context + 2:
        raise ValueError(f"the training text has {data.numel()} bytes; context={context} needs "
                         f"at least {context + 2}")
    model = Transformer(config).train()
    hooks = add_dropout(model, dropout)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    wall, cpu = time.perf_counter(), time.process_time()
    stream = batches(data, batch_size, context, generator)
    best = (math.inf, 0, copy.deepcopy(model.state_dict()))
    curve, since_best = [], 0
    bar = tqdm(range(1, steps + 1), desc=f"training {name}")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step - 1, steps, lr, warmup=min(50, steps // 10 + 1))
        x, y = next(stream)
        loss = train_step(model, opt, x, y)
        if step % eval_every == 0 or step == steps:
            val = pretrained.loss(model.eval(), validation_text, context)
            model.train()
            curve.append({"step": step, "train_batch_loss": round(loss.item(), 4),
                          "validation_loss": round(val, 4)})
            since_best = 0 if val < best[0] else since_best + 1
            if val < best[0]:
                best = (val, step, copy.deepcopy(model.state_dict()))
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val:.3f}", best=best[1])
            if since_best >= patience:
                break
    for h in hooks:
        h.remove()
    settings = {"steps_max": steps, "steps_run": step, "best_step": best[1], "seed": seed,
                "batch_size": batch_size, "context": context, "peak_lr": lr, "weight_decay": weight_decay,
                "dropout": dropout, "eval_every": eval_every, "patience": patience, "threads": threads,
                "train_seconds": round(time.perf_counter() - wall, 1),
                "train_cpu_seconds": round(time.process_time() - cpu, 1), "validation_curve": curve}
    model.load_state_dict(best[2])
    return save(name, model, settings, Path(output), save_files, train_text, validation_text)


def fp16_copy(name: str, model: Transformer) -> tuple[dict, Transformer]:
    """The fp16 state dict that ships, and a float32 model built from exactly those weights."""
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    shipped = Transformer(CONFIGS[name])
    shipped.load_state_dict({k: v.float() for k, v in state.items()})
    return state, shipped.eval()


def _loss_entry(model, text: str, context: int) -> dict:
    mean, se = pretrained.loss_and_error(model, text, context)
    return {"loss": round(mean, 4), "standard_error": round(se, 4), "bytes": len(text.encode("utf-8"))}


def save(name: str, model: Transformer, settings: dict, output: Path, save_files: bool = True,
         train_text: str | None = None, validation_text: str | None = None) -> dict:
    """Record losses (with standard errors) measured on the fp16 weights, samples, the corpus; write."""
    state, shipped = fp16_copy(name, model)
    context = settings["context"]
    cfg = CONFIGS[name]
    samples = []
    for prompt in SAMPLE_PROMPTS:
        tokens = generate(shipped, encode_bytes(prompt), SAMPLE_TOKENS, cache="static").tokens[0].tolist()
        samples.append({"prompt": prompt, "text": decode_bytes(tokens), "tokens": tokens})
    losses = {"train": _loss_entry(shipped, train_text or pretrained.corpus_text("train"), context),
              "validation": _loss_entry(shipped, validation_text or pretrained.corpus_text("validation"),
                                        context)}
    if save_files:  # the held-out split is measured only for the shipped models
        losses["held_out"] = _loss_entry(shipped, pretrained.corpus_text("held_out"), context)
        for source in pretrained.SOURCES:
            text = pretrained.corpus_text("held_out", source)
            losses[f"held_out_{source}"] = _loss_entry(shipped, text, context)
    sizes = {s: len(pretrained.corpus_text(s).encode("utf-8")) for s in pretrained.SPLITS}
    sizes.update({src: sum(len(d.text.encode("utf-8")) for d in pretrained.documents() if d.source == src)
                  for src in pretrained.SOURCES})
    record = {
        "name": name,
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "n_params": shipped.num_params(),
        "steps": settings["best_step"],  # the weights that ship: the best validation loss
        **settings,
        "train_loss": losses["train"]["loss"],
        "held_out_loss": losses.get("held_out", {}).get("loss"),
        "held_out_loss_se": losses.get("held_out", {}).get("standard_error"),
        "losses": losses,
        "loss_unit": "nats per byte (mean next-byte cross-entropy over consecutive windows of `context` "
                     "bytes; standard error = std of the per-window means / sqrt(windows))",
        "corpus": {"bytes": sizes, "documents": len(pretrained.documents()),
                   "sha256": pretrained.corpus_sha256(),
                   "split_rule": f"sha256(document name) % 100: < {pretrained.HELD_OUT_PERCENT} held_out, "
                                 f"< {pretrained.HELD_OUT_PERCENT + pretrained.VALIDATION_PERCENT} "
                                 "validation"},
        "sample_prompt": samples[0]["prompt"], "sample": samples[0]["text"],
        "sample_tokens": samples[0]["tokens"],
        "samples": samples,
        "stored_dtype": "fp16",
        "torch_version": torch.__version__,
    }
    if not save_files:
        return {**record, "model": shipped}
    from safetensors.torch import save_file

    output.mkdir(parents=True, exist_ok=True)
    save_file(state, str(output / f"{name}.safetensors"), metadata={"name": name, "format": "pt"})
    text = json.dumps(record, indent=1, ensure_ascii=False) + "\n"
    (output / f"{name}.json").write_text(text, encoding="utf-8")
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[*CONFIGS, "all"], default="all", help="which model (default all)")
    parser.add_argument("--steps", type=int, default=None,
                        help="most optimizer steps (default: the shipped run's, kvlab.train.STEPS)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per step (default 16)")
    parser.add_argument("--context", type=int, default=256, help="bytes per window (default 256)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout probability (default 0.1)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--output", type=Path, default=pretrained.DATA_DIR,
                        help="folder for <name>.safetensors and <name>.json (default kvlab/data)")
    args = parser.parse_args(argv)
    for name in CONFIGS if args.model == "all" else [args.model]:
        record = train(name, args.steps, args.seed, args.batch_size, args.context, args.lr,
                       dropout=args.dropout, threads=args.threads, output=args.output)
        print(f"{name}: held-out {record['held_out_loss']:.3f} ± {record['held_out_loss_se']:.3f}, "
              f"train {record['train_loss']:.3f} nats/byte; best step {record['best_step']}, "
              f"{record['train_seconds']:.0f} s")
        print(f"sample: {record['sample']!r}")


if __name__ == "__main__":
    main()
