"""Set-up that speaks: the long make targets say what they are doing, `make lab` runs as offline as
`make test`, and `make bench` (tools/bench.py) names the files it changed and keeps a readable log."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest
from needs import ROOT, load_tool

bench = load_tool("bench")
MAKEFILE = (ROOT / "Makefile").read_text()


def recipe(target: str) -> str:
    return MAKEFILE.split(f"\n{target}: ", 1)[1].split("\n\n", 1)[0]


def test_every_pip_step_of_the_install_is_announced():
    lines = recipe("$(STAMP)").splitlines()[1:]
    for i, line in enumerate(lines):
        if "pip install" in line or "-m venv" in line:
            assert lines[i - 1].strip().startswith("@echo"), f"no line printed before: {line.strip()}"


def test_lab_runs_with_the_offline_settings_of_test():
    offline = re.search(r"^OFFLINE := (.+)$", MAKEFILE, flags=re.M)
    assert offline and "HF_HUB_OFFLINE=1" in offline.group(1)
    for target in ("lab", "test", "notebooks", "notebook", "bench"):
        assert "$(OFFLINE) " in recipe(target), f"make {target} does not set $(OFFLINE)"


def test_test_site_and_bench_say_what_they_do():
    assert "@echo" in recipe("test") and "minutes" in recipe("test")
    assert "tools/bench.py" in recipe("bench")
    assert "tools/slides.py --decks" in recipe("slides")
    # tools/site.py prints Sphinx's progress: tests/test_site.py checks the lines of its build


def test_progress_bars_become_one_line_every_few_seconds_in_the_log():
    now = [0.0]
    progress = bench.Progress(every=10, clock=lambda: now[0])
    lines = progress.feed("bench: lengths\n")
    for step in range(0, 101, 5):  # tqdm redraws its bar in place: carriage return, no newline
        now[0] = step * 0.4
        lines += progress.feed(f"\rlength 64:  {step}%|###   | {step}/100 [00:0{step // 50}<00:01]")
    lines += progress.feed("\r          \r\x1b[A")  # tqdm(leave=False) clears its line
    lines += progress.feed("written: benchmarks/cpu.json\n")
    lines += progress.close()
    bars = [ln for ln in lines if "%|" in ln]
    assert lines[0] == "bench: lengths" and lines[-1] == "written: benchmarks/cpu.json"
    assert 4 <= len(bars) <= 6 and bars[-1].startswith("length 64:  100%"), bars  # 40 s, one a 10 s
    assert all("\r" not in ln and "\x1b" not in ln for ln in lines)


def test_the_changed_files_are_named(tmp_path):
    (tmp_path / "old.json").write_text("1")
    (tmp_path / "same.md").write_text("a")
    before = bench.snapshot([tmp_path])
    (tmp_path / "old.json").write_text("2")
    (tmp_path / "new.csv").write_text("x")
    assert bench.changes(before, bench.snapshot([tmp_path])) == [
        f"new {tmp_path / 'new.csv'}", f"changed {tmp_path / 'old.json'}"]


@pytest.mark.skipif(sys.platform != "linux", reason="the quick benchmark is timed on the course machine")
def test_a_quick_benchmark_run_reports_its_files_and_logs_line_by_line(tmp_path):
    out, log = io.StringIO(), tmp_path / "bench.log"
    code = bench.run(["--quick", "--sweeps", "lengths", "--out", str(tmp_path / "results")], log, out)
    said = out.getvalue()
    assert code == 0, said[-2000:]
    assert said.startswith("bench: running python -m kvlab.bench --quick")
    last = said.strip().splitlines()[-1]
    assert last.startswith("bench: exit code 0; files: new ") and "README.md" in last and ".json" in last
    text = log.read_text()
    assert "\r" not in text and "%|" in text  # the progress, one bar state a line
    assert all(line.count("%|") <= 1 for line in text.splitlines())


def test_make_lab_exports_the_offline_settings():
    """What `make lab` runs, printed by make itself (no JupyterLab started)."""
    if subprocess.run(["make", "--version"], capture_output=True).returncode != 0:
        pytest.skip("make not installed")
    shown = subprocess.run(["make", "-n", "-o", ".venv/.kvlab-installed", "lab"],
                           cwd=ROOT, capture_output=True, text=True).stdout
    assert re.search(r"^HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \S+/jupyter lab ", shown, flags=re.M), shown
