"""kvlab.bench: medians, sweeps, result files and the command line (smoke runs, no timing
thresholds); GPUs matched to their data sheets by full name and memory; kvlab vs transformers with
transformers' eager rows really eager and its compiled row labelled, tokens checked by first divergence
and teacher forcing; tools/gpu_check.sh planned and run on the CPU.
(The roofline arithmetic is kvlab.roofline's: tests/test_roofline.py.)"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from needs import require

from kvlab import PRESETS, bench, memory
from kvlab.bench import cli, report, sweeps
from kvlab.env import cpp_compiler
from kvlab.model import Transformer

TINY = PRESETS["tiny-gqa"]
ROOT = Path(__file__).resolve().parents[1]


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


GiB = memory.GiB


@pytest.mark.parametrize("name,gib,expected,bandwidth", [
    ("Tesla T4", 14.56, "T4 16GB", 320e9),
    ("NVIDIA A100-SXM4-40GB", 39.4, "A100 40GB", 1555e9),
    ("NVIDIA A100-PCIE-40GB", 39.4, "A100 40GB", 1555e9),
    ("NVIDIA A100-SXM4-80GB", 79.15, "A100 80GB SXM", 2039e9),
    ("NVIDIA A100 80GB PCIe", 79.15, "A100 80GB PCIe", 1935e9),
    ("NVIDIA H100 80GB HBM3", 79.1, "H100 80GB SXM", 3.35e12),
    ("NVIDIA H100 PCIe", 79.1, "H100 80GB PCIe", 2.0e12),
    ("NVIDIA H100 NVL", 93.6, "H100 NVL 94GB", 3.9e12),
    ("NVIDIA H200", 139.8, "H200 141GB SXM", 4.8e12),
])
def test_gpus_are_matched_on_the_whole_name_and_the_memory(name, gib, expected, bandwidth):
    known = memory.match_gpu(name, round(gib * GiB))
    assert known is not None and known.name == expected and known.bandwidth_bytes_per_s == bandwidth


def test_a_gpu_name_alone_is_enough_when_it_tells_the_size():
    assert memory.match_gpu("Tesla T4").name == "T4 16GB"
    assert memory.match_gpu("NVIDIA H200").name == "H200 141GB SXM"
    assert memory.match_gpu("NVIDIA A100-SXM4-80GB").name == "A100 80GB SXM"
    assert memory.match_gpu("NVIDIA H100 PCIe") is None  # 80 or 94 GB H100: the memory decides


@pytest.mark.parametrize("name,gib", [
    ("NVIDIA GH200 480GB", 94.5),             # not an H200: its own memory and bandwidth
    ("NVIDIA H200 NVL", 139.8),               # no figure in the table
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 9.75),  # a slice of a GPU
    ("NVIDIA A100-SXM4-80GB", 39.4),          # the memory contradicts the name
    ("NVIDIA A100", None),                    # 40 or 80 GB, PCIe or SXM: cannot tell
    ("NVIDIA H100", 79.1),                    # SXM or PCIe: cannot tell
    ("NVIDIA GeForce RTX 3060", 12.0),
])
def test_gpus_the_table_cannot_identify_are_unknown(name, gib):
    assert memory.match_gpu(name, None if gib is None else round(gib * GiB)) is None


def test_a_copy_for_the_bandwidth_is_at_least_four_times_the_l2():
    assert bench.copy_bytes_beyond_l2(100 * memory.MiB) == 400 * memory.MiB
    assert bench.copy_bytes_beyond_l2(60 * memory.MiB) >= 240 * memory.MiB       # an H200's L2
    assert bench.copy_bytes_beyond_l2(None) == bench.copy_bytes_beyond_l2(0) >= 4 * 128 * memory.MiB


def test_an_unknown_gpu_says_so_and_is_measured_beyond_its_l2(monkeypatch):
    import importlib
    from types import SimpleNamespace

    machine_mod = importlib.import_module("kvlab.bench.machine")  # kvlab.bench.machine is also a function
    copies = []
    monkeypatch.setattr(machine_mod, "copy_bandwidth",
                        lambda device, nbytes=None, repeats=5: copies.append(nbytes) or 3.0e12)

    def fake_gpu(name, gib, l2_mib):
        props = SimpleNamespace(name=name, total_memory=round(gib * GiB), L2_cache_size=l2_mib * memory.MiB)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)

    fake_gpu("NVIDIA GH200 480GB", 94.5, 100)
    rate, source = bench.device_bandwidth("cuda")
    assert rate == 3.0e12 and copies == [400 * memory.MiB]
    assert source.startswith("unknown GPU 'NVIDIA GH200 480GB': measured copy of 400 MiB")
    fake_gpu("NVIDIA H100 PCIe", 79.1, 50)
    rate, source = bench.device_bandwidth("cuda")
    assert rate == 2.0e12 and "data sheet (H100 80GB PCIe" in source and len(copies) == 1


def test_machine_description_has_the_facts():
    m = bench.machine("cpu")
    assert m["device"] == "cpu" and m["torch"] == torch.__version__
    assert m["threads"] == torch.get_num_threads() and m["date"].endswith("UTC") and m["cpu"]


def test_sweeps_and_files(tmp_path):
    torch.manual_seed(0)
    model = Transformer(TINY).eval()
    rows = bench.sweep_lengths(model, [4], repeats=2)
    assert [r["method"] for r in rows] == [sweeps.NAIVE, sweeps.CACHED, sweeps.FAST]
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


def test_compare_hf_checks_tokens():
    pytest.importorskip("transformers")
    rows = bench.compare_hf(TINY, new_tokens=6, prompt_len=4, repeats=2, device="cpu")
    by = {r["method"]: r for r in rows}
    assert list(by) == ["kvlab generate (static cache)", "transformers generate (dynamic cache)",
                        "transformers generate (static cache, eager)", "kvlab fast eager"]
    assert all(r["tokens_identical"] and r["first_divergence"] is None for r in rows)  # fp32: exact
    assert all(r["teacher_forced_agreement"] == 1.0 for name, r in by.items() if name.startswith("kvlab"))
    assert all(r["teacher_forced_agreement"] is None for name, r in by.items() if name.startswith("trans"))
    assert {r["dtype"] for r in rows} == {"fp32"} and {r["execution"] for r in rows} == {"eager"}
    assert all(r["min_s"] <= r["median_s"] <= r["max_s"] and r["repeats"] == 2 for r in rows)
    assert by["transformers generate (static cache, eager)"]["speedup_vs_hf_static"] == pytest.approx(1.0)
    assert all("speedup_vs_hf_compiled" not in r for r in rows)  # no compiled row on the CPU unless asked
    with pytest.raises(ValueError, match="mode='graph' needs a CUDA device"):
        bench.compare_hf(TINY, new_tokens=2, prompt_len=2, repeats=1, device="cpu", fast_modes=["graph"])


def test_the_eager_rows_disable_transformers_auto_compile():
    pytest.importorskip("transformers")
    hf_model, _ = bench.hf_twin(TINY)
    rows = bench.hf_generate_kwargs("cuda", compiled=True)
    eager = {k: v for k, v in rows.items() if "eager" in k or "dynamic" in k}
    assert len(eager) == 2 and all(kw["disable_compile"] is True for kw in eager.values())
    # transformers' own decision, taken as if on a GPU: without the flag it would compile the
    # static cache (the trap), with it it does not; the compiled row is compiled.
    assert bench.hf_compiles(hf_model, {"cache_implementation": "static"}, assume_device="cuda")
    assert not any(bench.hf_compiles(hf_model, kw, assume_device="cuda") for kw in eager.values())
    assert bench.hf_compiles(hf_model, rows["transformers generate (static cache, compiled)"], "cuda")
    # On the CPU transformers compiles only when the compile config says so for every device.
    assert not bench.hf_compiles(hf_model, {"cache_implementation": "static"})
    cpu = bench.hf_generate_kwargs("cpu", compiled=True)["transformers generate (static cache, compiled)"]
    assert cpu["compile_config"]._compile_all_devices is True


def test_a_row_transformers_did_not_run_as_labelled_is_refused(monkeypatch):
    pytest.importorskip("transformers")
    from kvlab.bench import compare

    original = compare.hf_generate_kwargs

    def no_compile_config(device, compiled):  # a "compiled" row that transformers runs eagerly
        rows = original(device, compiled)
        rows[compare.HF_COMPILED] = {"cache_implementation": "static"}
        return rows

    monkeypatch.setattr(compare, "hf_generate_kwargs", no_compile_config)
    with pytest.raises(RuntimeError, match="static cache, compiled.*would be mislabelled"):
        bench.compare_hf(TINY, new_tokens=2, prompt_len=2, repeats=1, device="cpu", hf_compiled=True)


def test_transformers_compiled_row_on_the_cpu():
    pytest.importorskip("transformers")
    require(None if cpp_compiler() else "no C++ compiler (g++ or clang++) for torch.compile on the CPU",
            "the compiled transformers row")
    rows = bench.compare_hf(TINY, new_tokens=4, prompt_len=4, repeats=1, device="cpu", hf_compiled=True)
    compiled = [r for r in rows if r["method"] == "transformers generate (static cache, compiled)"]
    assert len(compiled) == 1 and compiled[0]["execution"].startswith("torch.compile")
    assert compiled[0]["tokens_identical"] and all("speedup_vs_hf_compiled" in r for r in rows)


def test_first_divergence_is_the_first_differing_new_token():
    ref = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert bench.first_divergence(ref.clone(), ref, 2) is None
    assert bench.first_divergence(torch.tensor([[1, 2, 3, 9, 5, 0]]), ref, 2) == 1
    assert bench.first_divergence(torch.tensor([[7, 2, 3, 4, 5, 6]]), ref, 2) is None  # in the prompt
    batch = torch.stack([ref[0], ref[0]])
    other = batch.clone()
    other[1, 5] = 0
    assert bench.first_divergence(other, batch, 2) == 3  # any row
    with pytest.raises(ValueError, match=r"tokens \(1, 5\) and reference \(1, 6\) differ in shape"):
        bench.first_divergence(ref[:, :5], ref, 2)


def test_teacher_forcing_feeds_the_reference_not_the_model_own_choices():
    from kvlab.fast import FastDecoder
    from kvlab.generate import generate

    a, b = (Transformer(TINY).eval() for _ in range(2))  # two different random models
    prompt_len, new = 5, 12
    ids = torch.randint(0, TINY.vocab_size, (2, prompt_len))
    tokens = generate(a, ids, new).tokens
    assert bench.teacher_forced_agreement(FastDecoder(a, 2, prompt_len + new), tokens, prompt_len) == 1.0
    # Model b fed a's text: at each position its argmax against a's next token, as one forward pass
    # of b over a's text computes it.
    with torch.inference_mode():
        expected = (b(tokens)[:, prompt_len - 1:-1].argmax(-1) == tokens[:, prompt_len:]).float().mean()
    got = bench.teacher_forced_agreement(FastDecoder(b, 2, prompt_len + new), tokens, prompt_len)
    assert got == pytest.approx(expected.item()) and got < 1.0
    with pytest.raises(ValueError, match="need a decoder of batch 2 and at least 16 positions"):
        bench.teacher_forced_agreement(FastDecoder(b, 1, 32), tokens, prompt_len)


@pytest.mark.parametrize("cache", ["static", "dynamic", "paged"])
def test_teacher_forcing_through_the_model_forward_agrees_with_one_pass(cache):
    from kvlab.bench.compare import model_teacher_forced_agreement
    from kvlab.generate import generate

    a, b = (Transformer(TINY).eval() for _ in range(2))
    prompt_len, new = 5, 12
    tokens = generate(a, torch.randint(0, TINY.vocab_size, (2, prompt_len)), new).tokens
    assert model_teacher_forced_agreement(a, tokens, prompt_len, cache) == 1.0
    with torch.inference_mode():
        expected = (b(tokens)[:, prompt_len - 1:-1].argmax(-1) == tokens[:, prompt_len:]).float().mean()
    got = model_teacher_forced_agreement(b, tokens, prompt_len, cache)
    assert got == pytest.approx(expected.item()) and got < 1.0
    with pytest.raises(ValueError, match="prompt_len=17 must be between 1 and 16"):
        model_teacher_forced_agreement(b, tokens, 17, cache)


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from kvlab import hf

    return hf.save_random_checkpoint(tmp_path_factory.mktemp("real") / "random-llama", seed=1)


def test_command_line_compares_on_the_real_model(real_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_REAL_MODEL", str(real_checkpoint))
    result = cli.main(["--real-model", "--sweeps", "none", "--repeats", "2", "--hf-new-tokens", "6",
                       "--prompt-tokens", "12", "--device", "cpu", "--out", str(tmp_path), "--stem", "real",
                       "--no-progress"])
    rows = [r for r in result["rows"] if r["sweep"] == "compare_real"]
    assert len(rows) == 4 and {r["config"] for r in rows} == {str(real_checkpoint)}
    assert all(r["prompt_len"] == 12 and r["new_tokens"] == 6 and r["clock"] == "cpu" for r in rows)
    assert all(r["tokens_identical"] and r["dtype"] == "fp32" for r in rows)
    assert all(r["teacher_forced_agreement"] == 1.0 for r in rows if r["method"].startswith("kvlab"))
    assert all(0 < r["fraction_of_bandwidth"] for r in rows)
    md = (tmp_path / "real.md").read_text()
    assert "on the real model" in md and "identical tokens from kvlab and transformers (required): met" in md
    assert "real model generate (static cache)" in (tmp_path / "README.md").read_text()
    for r in (r for r in rows if r["method"].startswith("kvlab")):   # the goal line: fastest and eager
        fastest = min(r["speedup_vs_hf_dynamic"], r["speedup_vs_hf_static"])   # no compiled row here
        assert (f"- CPU, real model, {r['method']}: at least 1.3× the fastest `transformers` row and 50 % "
                f"of the matrix-vector bandwidth: {fastest:.2f}× ({fastest:.2f}× its faster eager cache), "
                f"{r['fraction_of_bandwidth']:.0%} — ") in md


def test_different_tokens_in_fp32_fail_the_run_after_writing_it(tmp_path, monkeypatch):
    def diverging(*args, **kwargs):
        return [{"sweep": "compare_hf", "method": "kvlab fast eager", "dtype": "fp32", "config": "x",
                 "tokens_identical": False, "first_divergence": 3, "teacher_forced_agreement": 0.9,
                 "speedup_vs_hf_dynamic": 1.0, "speedup_vs_hf_static": 1.0}]

    monkeypatch.setattr(cli, "compare_hf", diverging)
    with pytest.raises(SystemExit, match="x, kvlab fast eager: first divergence at new token 3"):
        cli.main(["--quick", "--compare-hf", "--sweeps", "none", "--repeats", "1", "--out", str(tmp_path),
                  "--stem", "bad", "--no-progress"])
    assert "NOT met" in (tmp_path / "bad.md").read_text()


def test_fast_modes_follow_the_device():
    assert cli.fast_modes(torch.device("cpu")) == ["eager"]
    assert cli.fast_modes(torch.device("cpu"), with_compile=True) == ["eager", "compile"]
    assert cli.fast_modes(torch.device("cuda")) == ["eager", "graph"]


def test_gpu_targets_are_judged_from_the_rows():
    def row(method, static, **extra):
        return {"sweep": "compare_hf", "method": method, "speedup_vs_hf_dynamic": static,
                "speedup_vs_hf_static": static, "dtype": "bf16", "tokens_identical": False, **extra}
    roof = {"sweep": "roofline", "method": "graph", "batch": 1, "fraction_of_bandwidth": 0.55,
            "fraction_of_measured_bandwidth": 0.62}
    result = {"machine": {"device": "cuda", "gpu": "NVIDIA H200"},
              "rows": [row("kvlab fast eager", 0.7), row("kvlab fast graph", 1.3), roof]}
    lines = report.summary_markdown(result)
    assert "with its static cache: best kvlab fast graph at 1.30× — met" in lines
    assert "graph reached 55% (62% of the measured copy bandwidth) — NOT met" in lines
    assert "identical tokens" not in lines  # bf16: a near-tie may round the other way
    # With transformers' compiled row, that is the one to beat.
    result["rows"][:2] = [row("kvlab fast eager", 0.7, speedup_vs_hf_compiled=0.2),
                          row("kvlab fast graph", 1.3, speedup_vs_hf_compiled=0.9)]
    assert "with its compiled static cache: best kvlab fast graph at 0.90× — NOT met" in \
        report.summary_markdown(result)


def test_command_line_quick_run(tmp_path):
    result = cli.main(["--quick", "--repeats", "1", "--sweeps", "memory", "--out", str(tmp_path),
                         "--stem", "smoke", "--no-progress"])
    assert (tmp_path / "smoke.json").exists() and (tmp_path / "README.md").exists()
    assert result["rows"][0]["sweep"] == "memory"
    with pytest.raises(ValueError, match="unknown sweeps"):
        cli.run(cli.parse_args(["--sweeps", "speed"]))


def test_the_profile_sweep_splits_each_path_s_step_by_operator(tmp_path):
    from kvlab.bench.profile import FAST, GENERATE

    result = cli.main(["--quick", "--sweeps", "profile", "--out", str(tmp_path), "--stem", "p",
                       "--no-progress"])
    for method in (GENERATE, FAST):
        rows = [r for r in result["rows"] if r["sweep"] == "profile" and r["method"] == method]
        *ops, total = rows
        assert total["operator"] == "all operators" and 0 < total["matmul_share"] < 1
        assert sum(r["self_ms_per_step"] for r in ops) <= total["self_ms_per_step"] + 1e-9
        times = [r["self_ms_per_step"] for r in ops]
        assert times == sorted(times, reverse=True)
        assert any(r["operator"] in ("aten::mm", "aten::addmm") for r in ops)  # the matrix products show
    assert "Where a decode step's time goes" in (tmp_path / "p.md").read_text()


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


GPU_CHECK = ["bash", str(ROOT / "tools" / "gpu_check.sh")]


def test_gpu_check_plan_lists_every_step_and_its_limits():
    out = subprocess.run(GPU_CHECK + ["--dry-run"], capture_output=True, text=True, check=True,
                         env={**os.environ, "GPU_CHECK_CHAPTERS": "05 06 07 09 11"}).stdout
    steps = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert steps[:4] == ["machine", "tests", "bench-7b", "bench-1b"]
    assert {"real-model", "chapter-05", "chapter-06", "chapter-07", "chapter-09", "chapter-11"} <= set(steps)
    assert "--model llama-2-7b --compare-hf" in out and "--batch-sizes 1\\,8\\,32" in out
    assert "--real-model" in out and "budget 480 s" in out


def test_gpu_check_runs_on_the_cpu_past_a_missing_pytest_and_a_failed_step(tmp_path):
    no_pytest = tmp_path / "site" / "pytest"
    no_pytest.mkdir(parents=True)
    (no_pytest / "__init__.py").write_text("raise ImportError('no pytest on this machine (simulated)')\n")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path / "site"),
           "GPU_CHECK_CHAPTERS": "00", "KVLAB_REAL_MODEL": str(tmp_path / "no-such-model")}
    out = tmp_path / "check"
    proc = subprocess.run(GPU_CHECK + ["--cpu", "--only", "machine,tests,bench-1b,real-model,chapter-00",
                                       str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # not everything ran
    status = {line.split("|")[1].strip(): line.split("|")[2].strip()
              for line in (out / "summary.md").read_text().splitlines() if line.startswith("| ")}
    assert status["machine"] == status["bench-1b"] == status["chapter-00"] == "ok", status
    assert status["tests"].startswith("NOT RUN: pytest is not installed")
    assert status["real-model"].startswith("FAILED (exit 1)")
    assert "ModelUnavailableError" in status["real-model"]
    assert "bench-7b" not in status  # not asked for
    assert json.loads((out / "machine.json").read_text())["device"] == "cpu"
    rows = json.loads(next((out / "bench").glob("*tinyllama-1.1b.json")).read_text())["rows"]
    assert {r["sweep"] for r in rows} == {"modes", "batch", "memory", "roofline", "compare_hf"}
    assert "8 code cells, 0 skipped for a missing interactive package, 0 failed" in (
        out / "logs" / "chapter-00.log").read_text()
    assert "## Machine (machine.json)\n\n- device: cpu" in (out / "summary.md").read_text()


def test_speculative_prompts_hold_held_out_text_or_repeat_their_start():
    from kvlab.bench.speculation import speculative_prompts
    from kvlab.generate import encode_bytes

    held = speculative_prompts("held-out", encode_bytes, 3, 40)
    assert len(held) == 3 and all(len(p) == 40 for p in held) and len({tuple(p) for p in held}) == 3
    for passage, p in zip(held, speculative_prompts("repeating", encode_bytes, 3, 40), strict=True):
        assert p == passage + encode_bytes("\n\n") + passage[:8]  # the passage, then its start again
    with pytest.raises(ValueError, match="text='code' is not allowed"):
        speculative_prompts("code", encode_bytes, 1, 10)


def test_pass_costs_time_a_copy_of_each_drafter_and_leave_the_callers_as_it_was():
    from kvlab.drafters import ModelDrafter

    torch.manual_seed(0)
    target = Transformer(TINY).eval()
    drafter = ModelDrafter(Transformer(TINY.with_(n_layers=1)).eval())
    drafter.reset(64)
    context = list(range(1, 17))
    drafter.propose(context[:5], 2)
    fed_before = list(drafter.fed)
    costs = bench.pass_costs(target, {"draft": drafter}, [2, 3], context, repeats=2, calls=2)
    assert drafter.fed == fed_before  # a speculative run timed between the calls finds its drafter intact
    assert set(costs["verify"]) == set(costs["draft"]["draft"]) == {2, 3}
    assert costs["step_s"] > 0 and all(v > 0 for v in costs["verify"].values())


def test_command_line_speculative_sweep(tmp_path):
    result = cli.main(["--quick", "--repeats", "1", "--sweeps", "speculative", "--out", str(tmp_path),
                       "--stem", "spec", "--no-progress"])
    rows = [r for r in result["rows"] if r["sweep"] == "speculative"]
    assert {(r["text"], r["method"]) for r in rows} == {
        (t, m) for t in ("held-out", "repeating")
        for m in ("plain greedy", "speculative, prompt lookup", "speculative, kvlab-tiny-draft")}
    for r in rows:
        assert r["model"] == "kvlab-tiny" and r["clock"] == "cpu" and r["speedup_vs_plain"] > 0
        if r["method"] != "plain greedy":
            assert r["tokens_identical"] and r["first_divergence"] is None and r["k"] == 2
            assert 0 <= r["accepted_fraction"] <= r["per_token_acceptance"] <= 1
            assert r["verify_cost"] > 0 and r["draft_cost"] >= 0
            a, k, c = r["per_token_acceptance"], r["k"], r["draft_cost"]
            assert r["expected_speedup"] == pytest.approx((1 - a ** (k + 1)) / (1 - a) / (k * c + 1)) \
                if a < 1 else r["expected_speedup"] == pytest.approx((k + 1) / (k * c + 1))
    md = (tmp_path / "spec.md").read_text()
    assert "Speculative vs plain greedy decoding" in md
    assert "speculative decoding gives plain greedy decoding's tokens (required): met." in md


def test_speculative_sweep_on_the_real_model_path(real_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_REAL_MODEL", str(real_checkpoint))
    monkeypatch.setattr(cli, "compare_real_model", lambda *a, **k: [])  # tested above
    result = cli.main(["--quick", "--real-model", "--repeats", "1", "--sweeps", "speculative", "--out",
                       str(tmp_path), "--stem", "spec-real", "--no-progress"])
    real = [r for r in result["rows"] if r["sweep"] == "speculative" and r["model"] != "kvlab-tiny"]
    n = 2  # the random checkpoint's layers: early exit after 1/2 and 5/6 of them
    assert {r["method"] for r in real} == {"plain greedy", "speculative, prompt lookup",
                                           f"speculative, first {n // 2} of {n} layers",
                                           f"speculative, first {n * 5 // 6} of {n} layers"}
    assert all(r["tokens_identical"] for r in real if r["method"] != "plain greedy")


def test_speculative_tokens_that_differ_fail_the_run(tmp_path, monkeypatch):
    row = {"sweep": "speculative", "model": "m", "text": "held-out", "method": "speculative, x", "k": 2,
           "tokens_identical": False, "first_divergence": 5}
    monkeypatch.setattr(cli, "speculative_kvlab_tiny", lambda *a, **k: [row])
    with pytest.raises(SystemExit, match="m, held-out, speculative, x k=2: first divergence from plain "
                                         "greedy decoding at new token 5"):
        cli.main(["--quick", "--sweeps", "speculative", "--repeats", "1", "--out", str(tmp_path),
                  "--stem", "bad-spec", "--no-progress"])
    assert "NOT met" in (tmp_path / "bad-spec.md").read_text()


def test_roofline_rows_count_the_kv_slots_each_path_reads():
    torch.manual_seed(0)
    model = Transformer(TINY).eval()
    filled = {"method": "m", "batch": 1, "new_tokens": 64, "tokens_per_s": 100.0}
    whole = dict(filled, slots_read=8 + 64)   # kvlab.fast: every slot of its buffer
    a, b = bench.roofline_rows(model, 1e10, "test", [filled, whole])
    kv_row = memory.kv_cache_bytes(TINY, 1, 1, "fp32")
    assert b["bytes_per_step"] - a["bytes_per_step"] == (72 - (8 + 32)) * kv_row
    assert b["fraction_of_bandwidth"] > a["fraction_of_bandwidth"]


def test_the_fast_rows_of_a_sweep_say_they_read_the_whole_buffer():
    torch.manual_seed(0)
    model = Transformer(TINY).eval()
    row = bench.sweep_modes(model, 4, ["eager"], prompt_len=3, repeats=1)[0]
    assert row["slots_read"] == 3 + 4


def test_machine_records_how_openmp_threads_wait(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert bench.machine("cpu")["omp_wait_policy"] == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert bench.machine("cpu")["omp_wait_policy"].startswith("unset")


def test_scheduler_sweep_quick_run(tmp_path):
    result = cli.main(["--quick", "--repeats", "1", "--sweeps", "scheduler", "--out", str(tmp_path),
                       "--stem", "sched", "--no-progress"])
    rows = [r for r in result["rows"] if r["sweep"] == "scheduler"]
    assert {r["method"] for r in rows} >= {"one at a time", "static, batches of 8", "continuous, budget 64"}
    assert all(r["tokens_identical"] for r in rows) and rows[0]["speedup_vs_one_at_a_time"] == 1.0
    assert "Serving a stream of requests" in (tmp_path / "sched.md").read_text()
    # the index names both speed-ups and that the continuous run may run everyone at once
    assert "scheduler, kvlab-tiny: continuous (up to all" in (tmp_path / "README.md").read_text()
