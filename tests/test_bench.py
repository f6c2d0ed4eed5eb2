"""A smoke run of kvlab.bench: medians, sweeps, result files, the command line. No timing thresholds.
(The roofline arithmetic is kvlab.roofline's: tests/test_roofline.py.)"""

import csv
import json

import pytest
import torch

from kvlab import PRESETS, bench, memory
from kvlab.bench import cli, report
from kvlab.model import Transformer

TINY = PRESETS["tiny-gqa"]


def test_median_is_the_middle_value():
    assert bench.median([3.0, 1.0, 2.0]) == 2.0
    assert bench.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert bench.median([5.0, 100.0, 5.0]) == 5.0  # one slow outlier changes nothing
    with pytest.raises(ValueError, match="median of no values"):
        bench.median([])


def test_time_interleaved_warms_up_and_repeats():
    calls = []
    times = bench.time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                   repeats=3, warmup=1)
    assert sorted(times) == ["a", "b"] and all(len(t) == 3 for t in times.values())
    assert calls.count("a") == calls.count("b") == 4  # 1 warm-up + 3 timed each
    assert calls[:2] == ["a", "b"] and calls[2:4] == ["b", "a"]  # the order rotates
    with pytest.raises(ValueError, match="repeats=0 must be >= 1"):
        bench.time_interleaved({"a": lambda: None}, repeats=0)


def test_gpu_names_match_the_table():
    assert bench.match_gpu("Tesla T4").name == "T4 16GB"
    assert bench.match_gpu("NVIDIA A100-SXM4-80GB", 80 * 10**9).name == "A100 80GB"
    assert bench.match_gpu("NVIDIA A100-SXM4-40GB", 40 * 10**9).name == "A100 40GB"
    assert bench.match_gpu("NVIDIA H100 80GB HBM3").name == "H100 80GB"
    assert bench.match_gpu("NVIDIA GeForce RTX 3060") is None


def test_machine_description_has_the_facts():
    m = bench.machine("cpu")
    assert m["device"] == "cpu" and m["torch"] == torch.__version__
    assert m["threads"] == torch.get_num_threads() and m["date"].endswith("UTC") and m["cpu"]


def test_sweeps_and_files(tmp_path):
    torch.manual_seed(0)
    model = Transformer(TINY).eval()
    rows = bench.sweep_lengths(model, [4], repeats=2)
    assert [r["method"] for r in rows] == ["naive", "cached (static)", "fast eager"]
    assert all(r["repeats"] == 2 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["tokens_per_s"] == pytest.approx(4 / rows[0]["median_s"])
    modes = bench.sweep_modes(model, 4, ["eager"], repeats=1)
    batch = bench.sweep_batch(model, [2], 4, repeats=1)
    assert batch[0]["tokens_per_s"] == pytest.approx(8 / batch[0]["median_s"])
    mem = bench.memory_check(model, 2, 16)
    assert mem["cache_bytes"] == mem["predicted_cache_bytes"] == memory.kv_cache_bytes(TINY, 16, 2, "fp32")
    roof = bench.roofline_rows(model, 1e10, "test", modes)
    assert 0 < roof[0]["fraction_of_bandwidth"] < 1
    result = {"machine": bench.machine("cpu"), "model": "tiny", "rows": rows + modes + batch + [mem] + roof,
              "notes": ["a note"], "args": "--quick"}
    paths = report.write_results(result, tmp_path, "cpu-test")
    data = json.loads(paths["json"].read_text())
    assert data["machine"]["torch"] == torch.__version__ and len(data["rows"]) == len(result["rows"])
    with paths["csv"].open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(result["rows"]) and table[0]["machine_device"] == "cpu"
    md = paths["md"].read_text()
    assert "Naive vs cached" in md and "no GPU in this run" in md and "a note" in md
    index = paths["index"].read_text()
    assert "[cpu-test](cpu-test.md)" in index and "No GPU result has been recorded yet" in index


def test_compare_hf_checks_tokens(tmp_path):
    pytest.importorskip("transformers")
    rows = bench.compare_hf(TINY, new_tokens=6, prompt_len=4, repeats=1, device="cpu")
    assert len(rows) == 4 and all(r["tokens_identical"] and r["tokens_agree"] == 1.0 for r in rows)
    assert {r["dtype"] for r in rows} == {"fp32"}
    hf_static = [r for r in rows if r["method"] == "transformers generate (static cache)"][0]
    assert hf_static["speedup_vs_hf_static"] == pytest.approx(1.0)
    assert {r["method"] for r in rows} >= {"kvlab generate (static cache)", "kvlab fast eager"}
    with pytest.raises(ValueError, match="mode='graph' needs a CUDA device"):
        bench.compare_hf(TINY, new_tokens=2, prompt_len=2, repeats=1, device="cpu", fast_modes=["graph"])


def test_fast_modes_follow_the_device():
    assert cli.fast_modes(torch.device("cpu")) == ["eager"]
    assert cli.fast_modes(torch.device("cpu"), with_compile=True) == ["eager", "compile"]
    assert cli.fast_modes(torch.device("cuda")) == ["eager", "graph"]


def test_gpu_targets_are_judged_from_the_rows():
    def row(method, static):
        return {"sweep": "compare_hf", "method": method, "speedup_vs_hf_dynamic": static,
                "speedup_vs_hf_static": static}
    roof = {"sweep": "roofline", "method": "graph", "batch": 1, "fraction_of_bandwidth": 0.55}
    result = {"machine": {"device": "cuda", "gpu": "NVIDIA H200"},
              "rows": [row("kvlab fast eager", 0.7), row("kvlab fast graph", 1.3), roof]}
    lines = report.summary_markdown(result)
    assert "best kvlab fast graph at 1.30× — met" in lines
    assert "graph reached 55% — NOT met" in lines


def test_command_line_quick_run(tmp_path):
    result = cli.main(["--quick", "--repeats", "1", "--sweeps", "memory", "--out", str(tmp_path),
                         "--stem", "smoke", "--no-progress"])
    assert (tmp_path / "smoke.json").exists() and (tmp_path / "README.md").exists()
    assert result["rows"][0]["sweep"] == "memory"
    with pytest.raises(ValueError, match="unknown sweeps"):
        cli.run(cli.parse_args(["--sweeps", "speed"]))


def test_fit_step_time_recovers_a_line():
    overhead, per_token = bench.fit_step_time([8, 16, 32, 64], [0.002 + 1e-5 * t for t in (8, 16, 32, 64)])
    assert overhead == pytest.approx(0.002) and per_token == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="need two or more"):
        bench.fit_step_time([8], [0.1])


def test_op_counts_counts_dispatched_operations():
    x = torch.ones(3)
    assert bench.op_counts(lambda: x + 1) == {"total": 1, "views": 0, "launching": 1}
    assert bench.op_counts(lambda: (x + 1) * 2 - x)["launching"] == 3


def test_cpu_clock_and_bad_clock():
    assert bench.time_call(lambda: sum(range(1000)), "cpu", clock="cpu") >= 0
    with pytest.raises(ValueError, match="clock='gpu' is not known; allowed: wall, cpu"):
        bench.time_call(lambda: None, "cpu", clock="gpu")


def test_the_bandwidth_bound_config_is_25m_parameters_and_selectable():
    from kvlab.bench.cli import parse_args
    from kvlab.bench.sweeps import CPU_CONFIG_25M, HF_CONFIGS

    assert 25e6 <= memory.param_count(CPU_CONFIG_25M) <= 30e6
    assert (CPU_CONFIG_25M.n_layers, CPU_CONFIG_25M.d_model, CPU_CONFIG_25M.vocab_size) == (8, 512, 4096)
    assert HF_CONFIGS[parse_args(["--compare-hf", "--hf-config", "25m"]).hf_config] is CPU_CONFIG_25M
    assert parse_args([]).hf_config == "small"


def test_matvec_bandwidth_is_a_plausible_rate():
    from kvlab.bench.machine import matvec_bandwidth

    rate = matvec_bandwidth("cpu", nbytes=8 * memory.MiB, repeats=3)
    assert 1e8 < rate < 1e13  # bytes/s: between a slow disk and far beyond any CPU's memory bus
