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
    if isinstance(value, bool) or value is None:
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


SECTIONS = {
    "compare_hf": ("kvlab vs transformers (same random weights, batch 1, greedy)",
                   ["method", "model", "dtype", "new_tokens", "clock", "tokens_per_s",
                    "speedup_vs_hf_dynamic", "speedup_vs_hf_static", "tokens_identical", "tokens_agree",
                    "repeats"]),
    "lengths": ("Naive vs cached decoding across generated lengths (batch 1)",
                ["method", "new_tokens", "clock", "tokens_per_s", "median_s", "repeats"]),
    "modes": ("Fixed-shape decode step: eager vs graphed / compiled",
              ["method", "batch", "new_tokens", "clock", "tokens_per_s", "setup_s", "repeats"]),
    "batch": ("Batch size (tokens/s of the whole batch)",
              ["method", "batch", "new_tokens", "clock", "tokens_per_s", "repeats"]),
    "memory": ("Cache memory: measured vs kvlab.memory's formula",
               ["method", "batch", "seq_len", "dtype", "cache_bytes", "predicted_cache_bytes",
                "cache_allocated_bytes", "peak_allocated_bytes", "weight_bytes"]),
    "roofline": ("Roofline: bytes per decode step ÷ bandwidth",
                 ["method", "batch", "new_tokens", "tokens_per_s", "bound_tokens_per_s",
                  "bytes_per_step", "fraction_of_bandwidth", "bandwidth_source"]),
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
    lines += _target_lines(result)
    for note in result.get("notes", []):
        lines += ["", f"> {note}"]
    return "\n".join(lines) + "\n"


def _target_lines(result: dict) -> list[str]:
    """The targets of issues 2 and 6, checked against this result's numbers."""
    rows = {r["method"]: r for r in result["rows"] if r["sweep"] == "compare_hf"}
    if not rows:
        return []
    out = ["", "## Targets"]
    if result["machine"]["device"] != "cuda":
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
    fast = [r for name, r in rows.items() if name.startswith("kvlab fast")]
    if result["machine"]["device"] == "cuda" and fast:
        best = max(fast, key=lambda r: r["speedup_vs_hf_static"])
        out.append(f"- GPU: faster than `transformers` generate with its static cache: best "
                   f"{best['method']} at {best['speedup_vs_hf_static']:.2f}× — "
                   f"{'met' if best['speedup_vs_hf_static'] > 1 else 'NOT met'}.")
    roof = [r for r in result["rows"] if r["sweep"] == "roofline" and r["batch"] == 1]
    if result["machine"]["device"] == "cuda" and roof:
        best = max(roof, key=lambda r: r["fraction_of_bandwidth"])
        frac = best["fraction_of_bandwidth"]
        out.append(f"- GPU, batch 1: at least 60 % of the bandwidth roofline: best {best['method']} "
                   f"reached {frac:.0%} — {'met' if frac >= 0.6 else 'NOT met'}.")
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
             "| kvlab vs transformers (dynamic / static) |",
             "|---|---|---|---|---|---|---|"]
    for path, m, rows in results:
        ratios = [f"{r['method'].replace('kvlab ', '')}: {r['speedup_vs_hf_dynamic']:.2f}× / "
                  f"{r['speedup_vs_hf_static']:.2f}×"
                  for r in rows if r["sweep"] == "compare_hf" and r["method"].startswith("kvlab")]
        lines.append(f"| [{path.stem}]({path.stem}.md) | {m['device']} | {m['gpu'] or m['cpu']} | "
                     f"{m['torch']} | {m['threads']} | {m['date']} | {'; '.join(ratios) or '—'} |")
    if not any(m["device"] == "cuda" for _, m, _ in results):
        lines += ["", "No GPU result has been recorded yet: every result above was measured on a CPU. "
                  "Run `python -m kvlab.bench --compare-hf` on a GPU machine to add one, or "
                  "`bash tools/gpu_check.sh`, which also runs the GPU tests and chapter 06 there."]
    path = out / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path
