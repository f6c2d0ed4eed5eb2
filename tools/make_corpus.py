"""Write the generated part of kvlab-tiny's corpus: worked KV-cache arithmetic from templates.

    .venv/bin/python tools/make_corpus.py            # rewrite kvlab/data/corpus/generated/*.txt
    .venv/bin/python tools/make_corpus.py --check    # exit 1 if the stored files differ

The hand-written part lives in kvlab/data/corpus/handwritten/. This script adds documents in
English and Chinese that size caches of the published model shapes in `kvlab.PRESETS`, count the
naive decoder's work, plan GPU capacity and time decode steps, each with varied numbers and sentence
frames. Every figure is computed here with `kvlab.memory`, never typed. It is deterministic: one
seeded `random.Random`, presets and GPUs in their stored order. Documents are separated by a line
`===` (see `kvlab.pretrained.documents`).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from kvlab import PRESETS, memory

OUT = Path(__file__).resolve().parent.parent / "kvlab" / "data" / "corpus" / "generated"
TARGET_BYTES = {"en": 125_000, "zh": 100_000}  # UTF-8 bytes per language
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
LENGTHS = (512, 1024, 2048, 3000, 4096, 6000, 8192, 16384, 32768, 65536, 131072)
# Head-based caches only (an MLA preset caches a latent, not heads).
MODELS = {name: c for name, c in PRESETS.items() if c.kv_latent_dim is None}
# Published models only, for weights, GPUs and time (a tiny model's weights round to 0.00 GB).
BIG = [name for name in MODELS if not name.startswith("tiny-")]


def n(x: int) -> str:
    """1234567 -> '1,234,567'."""
    return f"{x:,}"


def binary(x: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: '512 KiB', '1.75 GiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= size:
            v = x / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{x:.0f} bytes"


def plural(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


def per_token(c, dtype: str) -> int:
    return memory.kv_cache_bytes(c, 1, 1, dtype)


def shape(c) -> tuple[int, int, int, int]:
    return c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim


# ---------------------------------------------------------------- English templates
def sizing_case(r: random.Random):
    """The figures both languages' sizing texts use: a model, a dtype, its shape, bytes per element and
    per token (drawn from r in the same order for both)."""
    name = r.choice(list(MODELS))
    c, dtype = MODELS[name], r.choice(["fp16", "fp16", "bf16", "fp32", "int8"])
    return (name, c, dtype, *shape(c), BYTES[dtype], per_token(c, dtype))


def gqa_case(r: random.Random):
    """A model with grouped KV heads, its shape, bytes per token grouped and as MHA, and a length."""
    name = r.choice([k for k, c in MODELS.items() if c.n_kv_heads < c.n_heads])
    c = MODELS[name]
    L, H, KV, D = shape(c)
    return name, c, L, H, KV, D, per_token(c, "fp16"), 2 * L * H * D * 2, r.choice(LENGTHS)


def en_sizing(r: random.Random) -> str:
    name, c, dtype, L, H, KV, D, b, tok = sizing_case(r)
    title = r.choice([f"Sizing the cache of {name}", f"{name}: the cache in numbers",
                      f"How much cache does {name} need?"])
    intro = r.choice([
        f"{name} has {L} layers, {H} query heads and {KV} key-value heads of dimension {D}.",
        f"The shape of {name} that matters for the cache: {L} layers, {plural(KV, 'key-value head')} "
        f"(against {H} query heads), head dimension {D}.",
        f"Take {name}: {L} layers, {H} attention heads, {KV} for keys and values, "
        f"each head {D} wide."])
    lines = [title, "", intro + f" In {dtype} each number takes {plural(b, 'byte')}.", ""]
    lines.append(f"Per token: 2 × {L} layers × {plural(KV, 'KV head')} × {D} × {plural(b, 'byte')} = "
                 f"{n(tok)} bytes"
                 + (f", which is {binary(tok)}." if tok >= 1024 else "."))
    for seq in sorted(r.sample(LENGTHS, 3)):
        batch = r.choice([1, 1, 4, 8, 16, 32])
        total = memory.kv_cache_bytes(c, seq, batch, dtype)
        who = "one sequence" if batch == 1 else f"a batch of {batch}"
        lines.append(r.choice([
            f"For {who} of {n(seq)} tokens: {n(tok)} × {n(seq)}" + (f" × {batch}" if batch > 1 else "")
            + f" = {n(total)} bytes, {binary(total)}.",
            f"At {n(seq)} tokens and {who}, the cache holds {n(total)} bytes ({binary(total)}).",
            f"{n(seq)} tokens" + (f" for each of {batch} sequences" if batch > 1 else "")
            + f" need {binary(total)} of cache."]))
    w = memory.weight_bytes(c, "fp16")
    lines += ["", f"For comparison, the weights of {name} in fp16 take {n(w)} bytes ({binary(w)}), "
              f"2 bytes for each of its {n(memory.param_count(c))} parameters."]
    return "\n".join(lines)


def en_gqa(r: random.Random) -> str:
    name, c, L, H, KV, D, grouped, full, seq = gqa_case(r)
    return "\n".join([
        r.choice([f"Grouped heads in {name}", f"What grouped-query attention saves in {name}"]), "",
        f"{name} shares each key-value head among {H // KV} query heads: {H} query heads, "
        f"{KV} key-value heads.",
        f"Per token in fp16 the cache is 2 × {L} × {KV} × {D} × 2 = {n(grouped)} bytes ({binary(grouped)}).",
        r.choice([f"With one key-value head per query head it would be 2 × {L} × {H} × {D} × 2 = "
                  f"{n(full)} bytes ({binary(full)}), {H // KV} times as much.",
                  f"Full multi-head attention would store {n(full)} bytes a token ({binary(full)}); "
                  f"the ratio is {H} / {KV} = {H // KV}."]),
        f"At {n(seq)} tokens that is {binary(grouped * seq)} instead of {binary(full * seq)}."])


def en_count(r: random.Random) -> str:
    steps = r.choice([10, 16, 50, 100, 128, 256, 500, 1000, 2048, 4096, 10000])
    name = r.choice(list(MODELS))
    L = MODELS[name].n_layers
    naive = steps * (steps + 1) // 2
    return "\n".join([
        r.choice(["Counting the naive decoder's work",
                  "Rows of keys and values, with and without a cache"]), "",
        f"To generate {n(steps)} tokens, the naive decoder computes 1 + 2 + ... + {n(steps)} = "
        f"{n(steps)} × {n(steps + 1)} / 2 = {n(naive)} rows of keys and values in each layer.",
        f"The cached decoder computes {n(steps)} rows, one a step: {naive / steps:,.1f} times fewer.",
        f"In {name}, with {L} layers, that is {n(L * naive)} rows against {n(L * steps)}."])


def en_capacity(r: random.Random) -> str:
    for _ in range(50):
        name, gname = r.choice(BIG), r.choice(list(memory.GPUS))
        c, g = MODELS[name], memory.GPUS[gname]
        w, reserve = memory.weight_bytes(c, "fp16"), 2 * 2**30
        free = g.memory_bytes - w - reserve
        if free > 0:
            break
    else:
        return en_count(r)
    tok = per_token(c, "fp16")
    tokens = free // tok
    seq = r.choice([s for s in LENGTHS if s <= 32768])
    return "\n".join([
        f"How many users of {name} fit on one {gname}?", "",
        f"The {gname} holds {n(g.memory_bytes)} bytes ({binary(g.memory_bytes)}). The fp16 weights of "
        f"{name} take {n(w)} bytes; keep 2 GiB for activations and the framework.",
        f"That leaves {n(free)} bytes ({binary(free)}) for the cache.",
        f"One token of cache costs {n(tok)} bytes, so {n(free)} // {n(tok)} = {n(tokens)} tokens fit.",
        f"With {n(seq)} tokens reserved for each user, {n(tokens // seq)} users fit"
        + (f"; with half that, {n(tokens // (seq // 2))}." if seq >= 1024 else ".")])


def en_int8(r: random.Random) -> str:
    name = r.choice(list(MODELS))
    c = MODELS[name]
    L, H, KV, D = shape(c)
    data, scales, fp16 = 2 * L * KV * D, 2 * L * KV * 2, per_token(c, "fp16")
    return "\n".join([
        f"An int8 cache for {name}", "",
        f"In int8 each of the 2 × {L} × {KV} × {D} = {n(data)} numbers of a token takes one byte: "
        f"{n(data)} bytes.",
        f"One fp16 scale per token, head and K or V adds 2 × {L} × {KV} × 2 = {n(scales)} bytes.",
        f"In all {n(data + scales)} bytes against {n(fp16)} in fp16: {100 * (data + scales) / fp16:.1f} %."])


def en_decode(r: random.Random) -> str:
    name, gname = r.choice(BIG), r.choice(list(memory.GPUS))
    c, g = MODELS[name], memory.GPUS[gname]
    seq, batch = r.choice([1024, 2048, 4096, 8192]), r.choice([1, 1, 8, 32])
    w, cache = memory.weight_bytes(c, "fp16"), memory.kv_cache_bytes(c, seq, batch, "fp16")
    ms = (w + cache) / g.bandwidth_bytes_per_s * 1e3
    return "\n".join([
        f"A decode step of {name} on one {gname}", "",
        f"Each step reads the fp16 weights, {w / 1e9:.2f} GB, and the cache of {batch} "
        f"sequence{'s' if batch > 1 else ''} of {n(seq)} tokens, {cache / 1e9:.2f} GB.",
        f"At {g.bandwidth_bytes_per_s / 1e12:.2f} TB/s that takes at least {ms:.2f} ms, so at most "
        f"{batch * 1e3 / ms:,.0f} tokens per second for the batch."])


def en_dialogue(r: random.Random) -> str:
    name = r.choice(list(MODELS))
    c = MODELS[name]
    L, _, KV, D = shape(c)
    dtype = r.choice(["fp16", "bf16", "int8", "fp32"])
    b = BYTES[dtype]
    seq = r.choice(LENGTHS)
    tok = per_token(c, dtype)
    return "\n".join([
        f"Learner: How big is the cache of {name} in {dtype}?",
        "Teacher: What is its shape?",
        f"Learner: {L} layers, {plural(KV, 'key-value head')}, head dimension {D}.",
        "Teacher: Then multiply, keys and values included.",
        f"Learner: 2 × {L} is {2 * L}, times {KV} is {n(2 * L * KV)}, times {D} is {n(2 * L * KV * D)}, "
        f"times {plural(b, 'byte')} is {n(tok)} bytes a token.",
        f"Teacher: And at {n(seq)} tokens?",
        f"Learner: {n(tok)} × {n(seq)} = {n(tok * seq)} bytes, {binary(tok * seq)}.",
        r.choice(["Teacher: Right.", "Teacher: Correct. Now try a batch of two.",
                  "Teacher: Good, and remember the two."])])


# ---------------------------------------------------------------- Chinese templates
def zh_sizing(r: random.Random) -> str:
    name, c, dtype, L, H, KV, D, b, tok = sizing_case(r)
    lines = [r.choice([f"{name} 的缓存有多大", f"算一算 {name} 的 KV 缓存"]), "",
             r.choice([f"{name} 有 {L} 层、{H} 个查询头、{KV} 个键值头，头维度 {D}。",
                       f"和缓存有关的形状：{name} 共 {L} 层，{KV} 个键值头（查询头 {H} 个），"
                       f"每个头 {D} 维。"])
             + f"用 {dtype} 存，每个数 {b} 个字节。", "",
             f"每个词元：2 × {L} 层 × {KV} 个键值头 × {D} × {b} 字节 = {n(tok)} 字节"
             + (f"，即 {binary(tok)}。" if tok >= 1024 else "。")]
    for seq in sorted(r.sample(LENGTHS, 3)):
        batch = r.choice([1, 1, 4, 8, 16])
        total = memory.kv_cache_bytes(c, seq, batch, dtype)
        who = "一个序列" if batch == 1 else f"{batch} 个序列"
        lines.append(r.choice([f"{who}、每个 {n(seq)} 个词元：共 {n(total)} 字节，{binary(total)}。",
                               f"上下文 {n(seq)} 个词元、{who}时，缓存是 {binary(total)}。"]))
    w = memory.weight_bytes(c, "fp16")
    lines += ["", f"作为对比，{name} 的 fp16 权重是 {n(w)} 字节（{binary(w)}），"
              f"{n(memory.param_count(c))} 个参数各占 2 字节。"]
    return "\n".join(lines)


def zh_gqa(r: random.Random) -> str:
    name, c, L, H, KV, D, grouped, full, seq = gqa_case(r)
    return "\n".join([
        f"{name} 的分组查询注意力", "",
        f"{name} 让每 {H // KV} 个查询头共用一个键值头：{H} 个查询头，{KV} 个键值头。",
        f"fp16 下每个词元的缓存是 2 × {L} × {KV} × {D} × 2 = {n(grouped)} 字节（{binary(grouped)}）。",
        f"如果每个查询头都有自己的键值头，就是 2 × {L} × {H} × {D} × 2 = {n(full)} 字节（{binary(full)}），"
        f"是现在的 {H // KV} 倍。",
        f"{n(seq)} 个词元时，是 {binary(grouped * seq)}，而不是 {binary(full * seq)}。"])


def zh_count(r: random.Random) -> str:
    steps = r.choice([10, 16, 50, 100, 128, 256, 500, 1000, 2048, 4096, 10000])
    naive = steps * (steps + 1) // 2
    return "\n".join([
        "数一数朴素解码器的工作量", "",
        f"生成 {n(steps)} 个词元，朴素解码器每一层要算 1 + 2 + … + {n(steps)} = "
        f"{n(steps)} × {n(steps + 1)} ÷ 2 = {n(naive)} 行键和值。",
        f"带缓存的解码器每步只算一行，共 {n(steps)} 行，少了 {naive / steps:,.1f} 倍。"])


def zh_capacity(r: random.Random) -> str:
    for _ in range(50):
        name, gname = r.choice(BIG), r.choice(list(memory.GPUS))
        c, g = MODELS[name], memory.GPUS[gname]
        w = memory.weight_bytes(c, "fp16")
        free = g.memory_bytes - w - 2 * 2**30
        if free > 0:
            break
    else:
        return zh_count(r)
    tok = per_token(c, "fp16")
    tokens, seq = free // tok, r.choice([s for s in LENGTHS if s <= 32768])
    return "\n".join([
        f"一块 {gname} 能服务多少个 {name} 的用户？", "",
        f"{gname} 有 {n(g.memory_bytes)} 字节（{binary(g.memory_bytes)}）显存。{name} 的 fp16 权重占 "
        f"{n(w)} 字节，再留 2 GiB 给激活值和框架，剩下 {n(free)} 字节（{binary(free)}）给缓存。",
        f"每个词元的缓存是 {n(tok)} 字节，所以能放 {n(tokens)} 个词元。",
        f"每个用户预留 {n(seq)} 个词元的话，能容纳 {n(tokens // seq)} 个用户。"])


def zh_int8(r: random.Random) -> str:
    name = r.choice(list(MODELS))
    c = MODELS[name]
    L, _, KV, D = shape(c)
    data, scales, fp16 = 2 * L * KV * D, 2 * L * KV * 2, per_token(c, "fp16")
    return "\n".join([
        f"{name} 的 int8 缓存", "",
        f"int8 下，一个词元的 2 × {L} × {KV} × {D} = {n(data)} 个数各占一个字节，共 {n(data)} 字节。",
        f"每个词元、每个头、K 和 V 各一个 fp16 缩放因子，再加 2 × {L} × {KV} × 2 = {n(scales)} 字节。",
        f"合计 {n(data + scales)} 字节，fp16 是 {n(fp16)} 字节，"
        f"比例为 {100 * (data + scales) / fp16:.1f}%。"])


def zh_dialogue(r: random.Random) -> str:
    name = r.choice(list(MODELS))
    c = MODELS[name]
    L, _, KV, D = shape(c)
    dtype = r.choice(["fp16", "bf16", "int8", "fp32"])
    b, seq = BYTES[dtype], r.choice(LENGTHS)
    tok = per_token(c, dtype)
    return "\n".join([
        f"学生：{name} 用 {dtype} 的话，缓存有多大？",
        "老师：它的形状是什么？",
        f"学生：{L} 层，{KV} 个键值头，头维度 {D}。",
        "老师：那就乘起来，别忘了键和值是两份。",
        f"学生：2 乘 {L} 是 {2 * L}，乘 {KV} 是 {n(2 * L * KV)}，乘 {D} 是 {n(2 * L * KV * D)}，"
        f"再乘 {b} 字节，每个词元 {n(tok)} 字节。",
        f"老师：{n(seq)} 个词元呢？",
        f"学生：{n(tok)} × {n(seq)} = {n(tok * seq)} 字节，也就是 {binary(tok * seq)}。",
        r.choice(["老师：对。", "老师：没错。再算一算批大小为二的情况。", "老师：很好，记住那个二。"])])


KINDS = {"en": [en_sizing, en_sizing, en_gqa, en_count, en_capacity, en_int8, en_decode, en_dialogue],
         "zh": [zh_sizing, zh_sizing, zh_gqa, zh_count, zh_capacity, zh_int8, zh_dialogue]}


def generate(seed: int = 0) -> dict[str, str]:
    """{file name: text} of the generated corpus; the same seed gives the same text."""
    r = random.Random(seed)
    files = {}
    for lang, target in TARGET_BYTES.items():
        docs, size = [], 0
        while size < target:
            # Two or three items of one kind make a document of about a kilobyte.
            kind = r.choice(KINDS[lang])
            doc = "\n\n".join(kind(r) for _ in range(r.choice([2, 3])))
            docs.append(doc)
            size += len(doc.encode("utf-8")) + 5
        files[f"{lang}_arithmetic.txt"] = "\n===\n".join(docs) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the stored files, write nothing")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    files = generate(args.seed)
    if args.check:
        stale = [f for f, t in files.items() if not (OUT / f).exists() or (OUT / f).read_text("utf-8") != t]
        print("stale: " + ", ".join(stale) if stale else "generated corpus is up to date")
        return 1 if stale else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for f, text in files.items():
        (OUT / f).write_text(text, encoding="utf-8")
        print(f"{OUT / f}: {len(text.encode('utf-8')):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
