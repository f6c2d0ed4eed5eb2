"""Ship the recorded benchmark results in the package: `make bench-data` (run by `make bench`).

Copies every benchmarks/*.json into kvlab/data/benchmarks/ (what `kvlab.results` reads, so a notebook
opened alone on Colab finds them) and removes shipped results that benchmarks/ no longer has. It says
what it wrote and removed, and refuses, changing nothing, when benchmarks/ holds no result at all
(emptying the shipped copy would leave chapter 06 without its figures).

    python tools/bench_data.py [--source benchmarks] [--target kvlab/data/benchmarks]
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ship(source: Path, target: Path, log=print) -> list[Path]:
    """Make target's *.json the same as source's; return the files written or removed."""
    results = sorted(Path(source).glob("*.json"))
    if not results:
        raise SystemExit(f"bench-data: refused: {source} holds no *.json result; nothing was changed "
                         "(run `make bench`, or copy a GPU run's result there first)")
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    changed = []
    for path in results:
        dest = target / path.name
        if dest.exists() and filecmp.cmp(path, dest, shallow=False):
            continue
        shutil.copyfile(path, dest)
        log(f"bench-data: wrote {dest}")
        changed.append(dest)
    for stale in sorted(set(target.glob("*.json")) - {target / p.name for p in results}):
        stale.unlink()
        log(f"bench-data: removed {stale} (not in {source} any more)")
        changed.append(stale)
    if not changed:
        log(f"bench-data: {target} already matches {source} ({len(results)} results)")
    return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("--target", type=Path, default=ROOT / "kvlab" / "data" / "benchmarks")
    args = parser.parse_args(argv)
    ship(args.source, args.target)


if __name__ == "__main__":
    main()
