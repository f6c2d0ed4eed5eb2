"""Recorded benchmark results, shipped inside the package so that a notebook opened alone (on Colab,
with no repository around it) reads them.

`python -m kvlab.bench` writes its results to the repository's benchmarks/ folder; `make bench`
(or `make bench-data` after copying a GPU result there) copies every benchmarks/*.json into
kvlab/data/benchmarks/, and tests/test_results.py checks that the two agree.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def folder():
    """Where the shipped results lie (a folder inside the installed package)."""
    return resources.files("kvlab") / "data" / "benchmarks"


def recorded(where: str | Path | None = None) -> list[dict]:
    """Every recorded result, oldest first: the JSON `python -m kvlab.bench` wrote, plus "name" (its
    file name without .json). Each has "machine" (device, cpu, gpu, torch, transformers, threads,
    date …) and "rows". `where` reads another folder (e.g. the repository's benchmarks/)."""
    base = folder() if where is None else Path(where)
    if where is not None and not base.is_dir():
        raise ValueError(f"where={str(where)!r} is not a folder")
    results = []
    for entry in sorted((e for e in base.iterdir() if e.name.endswith(".json")), key=lambda e: e.name):
        name = entry.name[: -len(".json")]
        try:
            result = json.loads(entry.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{name}.json is not valid JSON: {err}") from None
        if not isinstance(result, dict) or not isinstance(result.get("machine"), dict) \
                or not isinstance(result.get("rows"), list):
            raise ValueError(f"{name}.json is not a benchmark result: it needs a 'machine' object and "
                             "a 'rows' list")
        results.append({"name": name, **result})
    return sorted(results, key=lambda r: (str(r["machine"].get("date", "")), r["name"]))


def gpu(results: list[dict]) -> list[dict]:
    """The results measured on a GPU (machine device "cuda")."""
    return [r for r in results if r["machine"].get("device") == "cuda"]
