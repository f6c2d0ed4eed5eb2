"""Benchmark result files: JSON, CSV and a markdown summary per run, and `benchmarks/README.md`, the
index of every recorded run."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def write_results(result: dict, out_dir: str | Path, stem: str | None = None) -> dict[str, Path]:
    """Write result (with "machine" and "rows") as JSON, CSV (machine columns on every row) and a
    markdown summary; refresh out_dir/README.md, the index of every result there."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    m = result["machine"]
    if stem is None:
        kind = "cpu" if m["device"] != "cuda" else "gpu-" + _slug(m["gpu"] or "cuda")
        stem = f"{kind}-{m['date'][:10]}"
    paths = {"json": out / f"{stem}.json", "csv": out / f"{stem}.csv", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    keys: list[str] = []
    for row in result["rows"]:
        keys += [k for k in row if k not in keys]
    mkeys = ["device", "cpu", "gpu", "torch", "transformers", "threads", "date"]
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + [f"machine_{k}" for k in mkeys])
        w.writeheader()
        for row in result["rows"]:
            w.writerow({**row, **{f"machine_{k}": m.get(k) for k in mkeys}})
    paths["md"].write_text(summary_markdown(result))
    paths["index"] = write_index(out)
    return paths


def _slug(text: str) -> str:
    words = [w for w in "".join(c if c.isalnum() else " " for c in text.lower()).split()
             if w not in ("nvidia", "tesla")]
    return "-".join(words)[:40] or "gpu"


def _fmt(value) -> str:
    if value is None:  # a column a row has no value for (first_divergence: the tokens never differ)
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


_COMPARE_COLUMNS = ["method", "execution", "model", "config", "dtype", "prompt_len", "new_tokens", "clock",
                    "tokens_per_s", "median_s", "min_s", "max_s", "speedup_vs_hf_dynamic",
                    "speedup_vs_hf_static", "speedup_vs_hf_compiled", "tokens_identical", "first_divergence",
                    "teacher_forced_agreement", "fraction_of_bandwidth", "fraction_of_measured_bandwidth",
                    "repeats"]
COMPARISONS = ("compare_hf", "compare_real")

SECTIONS = {
    "compare_hf": ("kvlab vs transformers (same random weights, batch 1, greedy)", _COMPARE_COLUMNS),
    "compare_real": ("kvlab vs transformers on the real model (same weights, batch 1, greedy)",
                     _COMPARE_COLUMNS),
    "lengths": ("Naive vs cached decoding across generated lengths (batch 1)",
                ["method", "new_tokens", "clock", "tokens_per_s", "median_s", "min_s", "max_s", "repeats"]),
    "modes": ("Fixed-shape decode step: eager vs graphed / compiled",
              ["method", "batch", "new_tokens", "clock", "tokens_per_s", "median_s", "min_s", "max_s",
               "setup_s", "repeats"]),
    "batch": ("Batch size (tokens/s of the whole batch)",
              ["method", "batch", "new_tokens", "clock", "tokens_per_s", "median_s", "min_s", "max_s",
               "repeats"]),
    "memory": ("Cache memory: measured vs kvlab.memory's formula",
               ["method", "mode", "batch", "seq_len", "dtype", "cache_bytes", "predicted_cache_bytes",
                "cache_allocated_bytes", "weight_bytes", "predicted_weight_bytes", "peak_allocated_bytes",
                "peak_vs_predicted"]),
    "speculative": ("Speculative vs plain greedy decoding (batch 1, static cache)",
                    ["model", "text", "method", "k", "prompts", "new_tokens", "clock", "tokens_per_s",
                     "median_s", "min_s", "max_s", "speedup_vs_plain", "tokens_identical",
                     "first_divergence", "accepted_fraction", "per_token_acceptance", "tokens_per_pass",
                     "draft_cost", "verify_cost", "expected_speedup", "expected_speedup_measured_verify",
                     "repeats"]),
    "scheduler": ("Serving a stream of requests: one at a time, static batches, continuous batching",
                  ["model", "method", "requests", "clock", "tokens_per_s", "median_s", "min_s", "max_s",
                   "speedup_vs_one_at_a_time", "ttft_median_s", "tpot_median_s", "preemptions",
                   "wasted_tokens", "peak_blocks", "tokens_identical", "repeats"]),
    "profile": ("Where a decode step's time goes (torch.profiler, self CPU time per step)",
                ["method", "operator", "calls_per_step", "self_ms_per_step", "share_of_step",
                 "matmul_share"]),
    "roofline": ("Roofline: bytes per decode step ÷ bandwidth",
                 ["method", "batch", "new_tokens", "tokens_per_s", "bound_tokens_per_s",
                  "bytes_per_step", "fraction_of_bandwidth", "bandwidth_source",
                  "fraction_of_measured_bandwidth"]),
}
NOTES = {
    "compare_hf": "first_divergence: the first new token (0-based) at which a method's free generation "
                  "differs from transformers' with its dynamic cache (— for none); "
                  "teacher_forced_agreement: each kvlab row's own code path (the model's forward for "
                  "generate, the fixed-shape step for the fast rows) fed transformers' tokens, the share of "
                  "positions at which its argmax is transformers' next token. speedup_vs_hf_*: "
                  "transformers' median time ÷ this method's; its eager rows run with "
                  "disable_compile=True, its compiled row with transformers' own CompileConfig. On the CPU "
                  "kvlab's model stores its weights input-major (Transformer.store_weights_input_major), "
                  "the layout the CPU's BLAS streams fastest for batch-1 decoding.",
    "profile": "Each path decodes 16 tokens (--quick: 2) after a 64-token prompt (8) under torch.profiler; "
               "per operator, its "
               "calls and its own (self) CPU time per step, the ten largest, then all operators together "
               "with matmul_share, the part of the step in matrix products (aten::mm / addmm / bmm / "
               "matmul). The profiler's own overhead adds to the small operators.",
    "speculative": "One timed call decodes every prompt of its text. speedup_vs_plain: plain greedy "
                   "decoding's median time ÷ this row's; accepted_fraction: accepted ÷ proposed guesses "
                   "(not α: guesses after a rejection are never judged); per_token_acceptance: accepted "
                   "÷ (accepted + first rejections), the α of Leviathan et al.; draft_cost: one guess's "
                   "cost in target decode steps (c); verify_cost: the target's pass over k + 1 tokens in "
                   "decode steps; expected_speedup: (1 - α^(k+1)) / (1 - α) / (k·c + 1), the paper's "
                   "formula, and with verify_cost in place of 1.",
    "scheduler": "Every request waits at the start; one timed call serves the whole stream "
                 "(kvlab.scheduler). "
                 "tokens_per_s: output tokens ÷ median time; ttft/tpot: medians over the requests on "
                 "the run's own clock; wasted_tokens: tokens fed beyond each request's prompt + output "
                 "− 1 (padding of static batches, recomputation after preemption); tokens_identical: "
                 "every output is the request's greedy output generated alone.",
}


def summary_markdown(result: dict) -> str:
    """A short human summary: the machine, the model, one table a sweep, and the notes."""
    m = result["machine"]
    where = m["gpu"] if m["device"] == "cuda" else f"CPU only ({m['cpu']}), no GPU in this run"
    lines = [f"# kvlab benchmark — {where}", "",
             f"Recorded by `python -m kvlab.bench {result.get('args', '')}`".rstrip() + ".", "",
             "| machine | |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in m.items() if v is not None]
    lines += ["", f"Model for the sweeps: {result.get('model', '')}. "
              "Times are medians of the repeats; runs of things compared with each other were "
              "interleaved in one process."]
    for key, (title, cols) in SECTIONS.items():
        rows = [r for r in result["rows"] if r["sweep"] == key]
        if rows:
            lines += ["", f"## {title}", "", _table(rows, [c for c in cols if any(c in r for r in rows)])]
            note = NOTES.get("compare_hf" if key in COMPARISONS else key)
            if note:
                lines += ["", note]
    lines += _target_lines(result)
    for note in result.get("notes", []):
        lines += ["", f"> {note}"]
    return "\n".join(lines) + "\n"


def token_failures(result: dict) -> list[str]:
    """The fp32 comparison rows whose tokens are not transformers' (same weights, same maths: in fp32
    they must be identical; in half precision a near-tie may round the other way)."""
    return [f"{r.get('config') or r.get('model')}, {r['method']}: first divergence at new token "
            f"{r['first_divergence']}, teacher-forced agreement "
            f"{_fmt(r.get('teacher_forced_agreement'))}"
            for r in result["rows"]
            if r["sweep"] in COMPARISONS and r.get("dtype") == "fp32" and not r["tokens_identical"]]


def scheduler_failures(result: dict) -> list[str]:
    """The scheduler rows whose outputs are not each request's own greedy output (they must be)."""
    return [f"{r['model']}, {r['method']}: an output differs from generating the request alone"
            for r in result["rows"] if r["sweep"] == "scheduler" and r.get("tokens_identical") is False]


def speculative_failures(result: dict) -> list[str]:
    """The speculative rows whose tokens are not plain greedy decoding's (they must be identical)."""
    return [f"{r['model']}, {r['text']}, {r['method']} k={r['k']}: first divergence from plain greedy "
            f"decoding at new token {r['first_divergence']}"
            for r in result["rows"] if r["sweep"] == "speculative" and r.get("tokens_identical") is False]


def _fastest_hf(row: dict) -> float:
    """This row's speed-up over the fastest transformers row measured beside it."""
    return min(row[k] for k in ("speedup_vs_hf_dynamic", "speedup_vs_hf_static", "speedup_vs_hf_compiled")
               if k in row)


def _target_lines(result: dict) -> list[str]:
    """The targets of issues 2, 6, 12, 26 and 30, checked against this result's numbers."""
    on_gpu = result["machine"]["device"] == "cuda"
    rows = {r["method"]: r for r in result["rows"] if r["sweep"] == "compare_hf"}
    real = [r for r in result["rows"] if r["sweep"] == "compare_real" and r["method"].startswith("kvlab")]
    roof = [r for r in result["rows"] if r["sweep"] == "roofline" and r["batch"] == 1]
    speculative = any(r["sweep"] == "speculative" for r in result["rows"])
    if not rows and not real and not (on_gpu and roof) and not speculative:
        return []
    out = ["", "## Targets"]
    if not on_gpu:
        # Issue 12: on the overhead-bound small model, at least 1.8× transformers' generate with its
        # default (dynamic) cache, aim 2×; on the bandwidth-bound 25M model, at least parity.
        floor, aim = (1.0, 1.0) if any(r.get("config") == "bench-25m" for r in rows.values()) else (1.8, 2.0)
        for name, r in rows.items():
            if name.startswith("kvlab"):
                ratio = r["speedup_vs_hf_dynamic"]
                verdict = ("NOT met" if ratio < floor else "met" if aim == floor else
                           f"met, and the {aim:g}× aim too" if ratio >= aim else
                           f"met, the {aim:g}× aim not reached")
                share = (f"; {r['fraction_of_bandwidth']:.0%} of the measured matrix-vector bandwidth"
                         if "fraction_of_bandwidth" in r else "")
                out.append(f"- CPU, {name}: at least {floor:g}× `transformers` generate with its dynamic "
                           f"cache: {ratio:.2f}× ({r['speedup_vs_hf_static']:.2f}× vs its static cache) — "
                           f"{verdict}{share}.")
        # Issue 26, item 6: on the real model, at least 1.3× transformers and at least half of the
        # measured matrix-vector bandwidth; judged against the fastest transformers row (its compiled
        # one when run), the stricter reading, with the eager comparison shown beside it.
        for r in real:
            share = r.get("fraction_of_bandwidth")
            ok = _fastest_hf(r) >= 1.3 and share is not None and share >= 0.5
            reached = f"{share:.0%}" if share is not None else "not measured"
            eager = min(r["speedup_vs_hf_dynamic"], r["speedup_vs_hf_static"])  # vs its faster eager cache
            out.append(f"- CPU, real model, {r['method']}: at least 1.3× the fastest `transformers` row "
                       f"and 50 % of the matrix-vector bandwidth: {_fastest_hf(r):.2f}× "
                       f"({eager:.2f}× its faster eager cache), {reached} — {'met' if ok else 'NOT met'}.")
    fast = [r for name, r in rows.items() if name.startswith("kvlab fast")]
    if on_gpu and fast:
        key = "speedup_vs_hf_compiled" if all("speedup_vs_hf_compiled" in r for r in fast) \
            else "speedup_vs_hf_static"
        against = "its compiled static cache" if key == "speedup_vs_hf_compiled" else "its static cache"
        best = max(fast, key=lambda r: r[key])
        out.append(f"- GPU: faster than `transformers` generate with {against}: best "
                   f"{best['method']} at {best[key]:.2f}× — {'met' if best[key] > 1 else 'NOT met'}.")
    if on_gpu and roof:
        best = max(roof, key=lambda r: r["fraction_of_bandwidth"])
        frac = best["fraction_of_bandwidth"]
        measured = (f" ({best['fraction_of_measured_bandwidth']:.0%} of the measured copy bandwidth)"
                    if "fraction_of_measured_bandwidth" in best else "")
        out.append(f"- GPU, batch 1: at least 60 % of the bandwidth roofline: best {best['method']} "
                   f"reached {frac:.0%}{measured} — {'met' if frac >= 0.6 else 'NOT met'}.")
    if any(r["sweep"] == "speculative" for r in result["rows"]):
        failures = speculative_failures(result)
        out.append("- speculative decoding gives plain greedy decoding's tokens (required): "
                   + ("met." if not failures else "NOT met: " + "; ".join(failures) + "."))
    compared = [r for r in result["rows"] if r["sweep"] in COMPARISONS and r.get("dtype") == "fp32"]
    if compared:
        failures = token_failures(result)
        out.append("- fp32: identical tokens from kvlab and transformers (required): "
                   + ("met." if not failures else "NOT met: " + "; ".join(failures) + "."))
    return out


def _scheduler_speedups(rows: list[dict]) -> list[str]:
    """Per model of a scheduler sweep: continuous batching (budget 512) and static batches, each as a
    speed-up over one request at a time. The continuous run may run every request at once (its cap,
    64 rows, is above the stream), the static one only a batch: the two caps differ; a continuous run
    capped at the static batch size, where recorded, compares like with like."""
    sched = [r for r in rows if r["sweep"] == "scheduler"]
    out = []
    for model in dict.fromkeys(r["model"] for r in sched):
        mine = {r["method"]: r for r in sched if r["model"] == model}
        cont = mine.get("continuous, budget 512")
        static = next((r for m, r in mine.items() if m.startswith("static")), None)
        capped = next((r for m, r in mine.items() if m.startswith("continuous, budget 512, at most")), None)
        if cont and static:
            same_cap = (f"continuous, {capped['method'].rsplit(', ', 1)[1]} "
                        f"{capped['speedup_vs_one_at_a_time']:.2f}× / " if capped else "")
            out.append(f"scheduler, {model.split(' (')[0]}: continuous (up to all {cont['requests']} "
                       f"requests at once) {cont['speedup_vs_one_at_a_time']:.2f}× / {same_cap}"
                       f"{static['method']} {static['speedup_vs_one_at_a_time']:.2f}×")
    return out


def write_index(out_dir: str | Path) -> Path:
    """benchmarks/README.md: one line per recorded result, and whether any GPU result exists."""
    out = Path(out_dir)
    results = []
    for path in sorted(out.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            results.append((path, data["machine"], data["rows"]))
        except (ValueError, KeyError):
            continue
    lines = ["# Recorded benchmarks", "",
             "Written by `python -m kvlab.bench` (see `kvlab/bench/` for the method: warm-up, "
             "medians of several repeats, CUDA events on a GPU, interleaved comparisons).", "",
             "| result | device | CPU / GPU | torch | threads | date "
             "| kvlab vs transformers (its dynamic / static cache, eager); scheduler vs one at a time |",
             "|---|---|---|---|---|---|---|"]
    for path, m, rows in results:
        ratios = [f"{'real model ' if r['sweep'] == 'compare_real' else ''}"
                  f"{r['method'].replace('kvlab ', '')}: {r['speedup_vs_hf_dynamic']:.2f}× / "
                  f"{r['speedup_vs_hf_static']:.2f}×"
                  for r in rows if r["sweep"] in COMPARISONS and r["method"].startswith("kvlab")]
        ratios += _scheduler_speedups(rows)
        lines.append(f"| [{path.stem}]({path.stem}.md) | {m['device']} | {m['gpu'] or m['cpu']} | "
                     f"{m['torch']} | {m['threads']} | {m['date']} | {'; '.join(ratios) or '—'} |")
    if not any(m["device"] == "cuda" for _, m, _ in results):
        lines += ["", "No GPU result has been recorded yet: every result above was measured on a CPU. "
                  "Run `python -m kvlab.bench --compare-hf` on a GPU machine to add one, or "
                  "`bash tools/gpu_check.sh`, which also runs the GPU tests and the chapters' GPU branches "
                  "there."]
    path = out / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path
