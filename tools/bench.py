"""`make bench`: run `python -m kvlab.bench`, say what it is doing and which files it changed, keep a log.

    python tools/bench.py [kvlab.bench options]       # e.g. --quick, --compare-hf

The benchmark rewrites result files in benchmarks/ (and its README.md index); `make bench` then ships
them in the package (tools/bench_data.py, which names what it copies). This wrapper prints a line
before the run, the benchmark's own output while it runs, and at the end every file it added or
changed. Progress bars (tqdm, redrawn in place with carriage returns) reach a terminal as they are;
in the log, _build/bench.log, and on a screen that is not a terminal they become one line each at
most every PROGRESS_EVERY_S seconds, so the log reads line by line instead of one endless line.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WATCHED = (ROOT / "benchmarks",)  # what `python -m kvlab.bench` writes (bench_data.py reports the rest)
LOG = ROOT / "_build" / "bench.log"
PROGRESS_EVERY_S = 15.0
BAR = re.compile(r"\d+%\|")  # tqdm's "  40%|████      | 4/10 [00:02<00:03, ...]"
ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # cursor moves between nested bars


def snapshot(folders=WATCHED) -> dict[Path, str]:
    """Every file under the folders, with a hash of its content."""
    return {p: hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in folders if folder.is_dir() for p in sorted(folder.rglob("*")) if p.is_file()}


def changes(before: dict[Path, str], after: dict[Path, str]) -> list[str]:
    """'new …', 'changed …', 'removed …' for every file that differs, as paths relative to the repo."""
    rel = lambda p: p.relative_to(ROOT) if p.is_relative_to(ROOT) else p  # noqa: E731
    return ([f"new {rel(p)}" for p in after if p not in before]
            + [f"changed {rel(p)}" for p in after if p in before and after[p] != before[p]]
            + [f"removed {rel(p)}" for p in before if p not in after])


class Progress:
    """Turn a stream with carriage-return progress bars into lines: text lines pass, a bar's redraws
    are kept to one line every `every` seconds (and its last state before other text)."""

    def __init__(self, every: float = PROGRESS_EVERY_S, clock=time.monotonic):
        self.every, self.clock = every, clock
        self.pending = ""      # the text after the last line break or carriage return
        self.last_bar = None   # the newest bar state not printed yet
        self.shown_at = None

    def feed(self, text: str) -> list[str]:
        lines = []
        parts = re.split(r"(\r\n|\r|\n)", ESCAPE.sub("", self.pending + text))
        self.pending = parts.pop()  # unterminated: wait for the rest
        for piece, end in zip(parts[::2], parts[1::2], strict=True):
            if BAR.search(piece):
                self.last_bar = piece.strip()
                now = self.clock()
                if self.shown_at is None or now - self.shown_at >= self.every:
                    lines.append(self.last_bar)
                    self.last_bar, self.shown_at = None, now
            elif piece.strip() or end != "\r":
                if self.last_bar:
                    lines.append(self.last_bar)
                self.last_bar, self.shown_at = None, None
                lines.append(piece.rstrip())
        return lines

    def close(self) -> list[str]:
        rest = [self.last_bar] if self.last_bar else []
        return rest + ([self.pending.rstrip()] if self.pending.strip() else [])


def watched(args: list[str]) -> tuple[Path, ...]:
    """The folder the benchmark writes into: its --out (default: benchmarks/)."""
    for i, arg in enumerate(args):
        if arg == "--out" and i + 1 < len(args):
            return (Path(args[i + 1]).resolve(),)
        if arg.startswith("--out="):
            return (Path(arg.split("=", 1)[1]).resolve(),)
    return WATCHED


def run(args: list[str], log_path: Path = LOG, out=sys.stdout) -> int:
    """Run the benchmark with args; return its exit code. Writes the log, then lists changed files."""
    cmd = [sys.executable, "-u", "-m", "kvlab.bench", *args]
    terminal = out.isatty()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    folders = watched(args)
    before = snapshot(folders)
    shown = log_path.relative_to(ROOT) if log_path.is_relative_to(ROOT) else log_path
    print(f"bench: running {' '.join(['python -m kvlab.bench', *args])} (minutes on a CPU; log: {shown})",
          file=out, flush=True)
    progress = Progress()
    with log_path.open("w", encoding="utf-8") as log, \
            subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        while chunk := proc.stdout.read1(4096):
            text = chunk.decode("utf-8", errors="replace")
            lines = progress.feed(text)
            if terminal:
                out.write(text)
                out.flush()
            for line in lines:
                log.write(line + "\n")
                if not terminal:
                    print(line, file=out, flush=True)
        for line in progress.close():
            log.write(line + "\n")
            if not terminal:
                print(line, file=out)
    changed = changes(before, snapshot(folders))
    print(f"bench: exit code {proc.returncode}; " + (f"files: {', '.join(changed)}" if changed
                                                    else "no file changed"), file=out, flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
