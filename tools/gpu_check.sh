#!/usr/bin/env bash
# Every GPU check of the course in one run, for a machine with a CUDA GPU on which PyTorch and
# transformers are already installed (a lent GPU machine, where nothing can be downloaded, or a
# course machine with a GPU). From the repository root:
#
#     bash tools/gpu_check.sh [OUT_DIR]
#
# 1. the tests that exercise the GPU paths (CUDA graph and torch.compile decoding, bench on CUDA);
# 2. chapter 06's code cells, top to bottom, on the GPU: its GPU-only branches and their asserts
#    (nbval checks the stored CPU outputs; this runs the other branch);
# 3. `python -m kvlab.bench --compare-hf`, whose result files land in OUT_DIR/benchmarks beside
#    copies of the recorded ones (default OUT_DIR: the repository, so straight into benchmarks/).
#
# BENCH_ARGS adds bench options (e.g. "--compile"); CHECK_ON_CPU=1 runs the same steps on a CPU,
# small, to try the script itself. A few minutes on an H100-class GPU.
#
# On a lent device machine (one command, nothing to carry; 8 files come back, the limit):
#     set -o pipefail; bash tools/gpu_check.sh "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
# then copy the new gpu-* files from OUT/benchmarks into benchmarks/ (README.md too), re-execute
# chapter 06 (`make notebook NB=notebooks/06_gpu_decoder.ipynb`) and commit.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg

step() { printf '\n== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

if [ "${CHECK_ON_CPU:-0}" = 1 ]; then
    bench_args="--quick"
else
    "$py" -c "import torch, sys; torch.cuda.is_available() or sys.exit('no CUDA GPU: these checks need one')"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv \
        || true
    bench_args=""
fi

step "1/3 tests of the GPU paths"
"$py" -m pytest -q -p no:cacheprovider tests/test_fast.py tests/test_bench.py tests/test_roofline.py tests/test_env.py \
    tests/course/test_ch06.py

step "2/3 chapter 06's code cells"
"$py" - notebooks/06_gpu_decoder.ipynb <<'PY'
import json, os, sys, time

path = sys.argv[1]
os.chdir(os.path.dirname(path))  # the notebook reads ../benchmarks, as in Jupyter
cells = [c for c in json.load(open(os.path.basename(path)))["cells"] if c["cell_type"] == "code"]
scope = {"__name__": "__main__"}
for i, cell in enumerate(cells):
    t0 = time.perf_counter()
    exec(compile("".join(cell["source"]), f"{path}, code cell {i}", "exec"), scope)
    print(f"-- code cell {i} done in {time.perf_counter() - t0:.1f} s", flush=True)
PY

step "3/3 benchmark"
if [ "$out" != . ]; then
    mkdir -p "$out/benchmarks"
    cp benchmarks/* "$out/benchmarks/"
fi
# shellcheck disable=SC2086  # the options are meant to split into words
"$py" -m kvlab.bench --compare-hf --repeats 5 --no-progress --out "$out/benchmarks" $bench_args ${BENCH_ARGS:-}
step "done"
