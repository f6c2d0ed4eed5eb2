"""kvlab.results: the recorded benchmark results ship inside the package, equal to benchmarks/*.json."""

import json
import re
from pathlib import Path

import pytest

from kvlab import results

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_ships_exactly_the_recorded_results():
    repo = {p.name: p.read_bytes() for p in (ROOT / "benchmarks").glob("*.json")}
    shipped = {e.name: e.read_bytes() for e in results.folder().iterdir() if e.name.endswith(".json")}
    assert repo, "benchmarks/ holds no recorded result"
    assert shipped == repo, "kvlab/data/benchmarks differs from benchmarks/*.json: run `make bench-data`"


def test_recorded_reads_every_result_with_its_machine_and_rows():
    found = results.recorded()
    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.json"))
    assert sorted(r["name"] for r in found) == names
    for r in found:
        original = json.loads((ROOT / "benchmarks" / f"{r['name']}.json").read_text())
        assert {k: v for k, v in r.items() if k != "name"} == original
        assert r["machine"]["device"] in ("cpu", "cuda") and r["rows"]
    assert results.recorded(ROOT / "benchmarks") == found


def _write(folder: Path, name: str, result) -> None:
    (folder / f"{name}.json").write_text(json.dumps(result))


def test_results_come_oldest_first_and_gpu_picks_the_gpu_ones(tmp_path):
    _write(tmp_path, "b-gpu", {"machine": {"device": "cuda", "date": "2026-11-30 10:00 UTC"}, "rows": []})
    _write(tmp_path, "a-cpu", {"machine": {"device": "cpu", "date": "2026-12-01 09:00 UTC"}, "rows": [1]})
    (tmp_path / "README.md").write_text("not a result")
    found = results.recorded(tmp_path)
    assert [r["name"] for r in found] == ["b-gpu", "a-cpu"]
    assert [r["name"] for r in results.gpu(found)] == ["b-gpu"]


def test_an_empty_folder_has_no_results(tmp_path):
    assert results.recorded(tmp_path) == []


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ('{"rows": []}', "needs a 'machine' object"),
    ('{"machine": {"device": "cpu"}, "rows": {}}', "a 'rows' list"),
])
def test_a_broken_result_file_is_named_in_the_error(tmp_path, content, message):
    (tmp_path / "bad-run.json").write_text(content)
    with pytest.raises(ValueError, match=re.escape("bad-run.json") + ".*" + re.escape(message)):
        results.recorded(tmp_path)


def test_a_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        results.recorded(tmp_path / "nowhere")
