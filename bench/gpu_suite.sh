#!/usr/bin/env bash
# The GPU suite: build specops, run every test and every kernel benchmark on CUDA, write one report.
#
#   bash bench/gpu_suite.sh [REPORT_DIR]        (default: ${OUT:-bench/results/gpu})
#
# For a machine with a CUDA build of torch and Triton and no package registry: nothing is downloaded.
# Every step runs even if an earlier one failed; failures are recorded in REPORT_DIR/report.md and the
# script exits non-zero at the end. Per-step logs and the benchmarks' CSVs sit next to the report.
# SUITE_STEP_TIMEOUT (seconds, default 3600; 0 = none) bounds each step, so one hang cannot eat the run.
set -u

cd "$(dirname "$0")/.." || exit 2
report_dir="${1:-${OUT:-bench/results/gpu}}"
mkdir -p "$report_dir" || exit 2
report_dir="$(cd "$report_dir" && pwd)"
report="$report_dir/report.md"
step_timeout="${SUITE_STEP_TIMEOUT:-3600}"
python="${PYTHON:-python}"
failed=()

md() { printf '%s\n' "$@" >>"$report"; }

# run_step NAME LOG CMD...: runs CMD with stdout+stderr in LOG, records its outcome in the report.
run_step() {
    local name="$1" log="$2" rc start elapsed
    shift 2
    start=$(date +%s)
    if [ "$step_timeout" != 0 ] && command -v timeout >/dev/null; then
        timeout "$step_timeout" "$@" >"$log" 2>&1
    else
        "$@" >"$log" 2>&1
    fi
    rc=$?
    elapsed=$(( $(date +%s) - start ))
    if [ "$rc" -eq 0 ]; then
        md "" "### $name: ok (${elapsed} s)"
    else
        [ "$rc" -eq 124 ] && md "" "### $name: FAILED, timed out after ${step_timeout} s" \
                          || md "" "### $name: FAILED, exit $rc (${elapsed} s)"
        failed+=("$name")
    fi
    echo "[gpu_suite] $name: exit $rc in ${elapsed} s (log: $log)"
    return "$rc"
}

# tail_block LOG N: the last N lines of LOG as a code block.
tail_block() {
    md '```'
    tail -n "$2" "$1" >>"$report"
    md '```'
}

{
    echo "# specops GPU suite"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), host: $(hostname)"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (+ local changes)')"
    if command -v nvidia-smi >/dev/null; then
        echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | paste -sd ';')"
    else
        echo "- GPU: nvidia-smi not found"
    fi
    "$python" - <<'EOF' 2>&1
import platform, sys
print(f"- python {platform.python_version()}")
try:
    import torch
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "NOT AVAILABLE"
    print(f"- torch {torch.__version__} (CUDA {torch.version.cuda}), torch.cuda device: {cuda}")
except Exception as error:
    print(f"- torch: import failed: {error!r}")
try:
    import triton
    print(f"- triton {triton.__version__}")
except Exception as error:
    print(f"- triton: import failed: {error!r}")
EOF
} >"$report"

md "" "## Build"
# --no-index: the machine has no registry, and --no-deps/--no-build-isolation need none.
if ! run_step "install" "$report_dir/install.log" \
        "$python" -m pip install --no-index --no-build-isolation --no-deps -e .; then
    tail_block "$report_dir/install.log" 30
fi

md "" "## Tests"
if run_step "pytest python_tests" "$report_dir/tests.log" "$python" -m pytest python_tests -q -rs; then
    tests_ok=1
else
    tests_ok=0
fi
# pytest's last line is its summary ("N passed, M skipped in T s"); failures get their short summary.
md "" "Summary: \`$(tail -n 1 "$report_dir/tests.log")\`"
if grep -q -E '^(FAILED|ERROR) ' "$report_dir/tests.log"; then
    md "" '```'
    grep -E '^(FAILED|ERROR) ' "$report_dir/tests.log" | head -n 50 >>"$report"
    md '```'
elif [ "$tests_ok" -eq 0 ]; then
    tail_block "$report_dir/tests.log" 30
fi

# run_bench FILE: one benchmark on CUDA; its table goes into the report, its CSV next to it.
run_bench() {
    local file="$1" name args=()
    name="$(basename "$file" .py)"
    if "$python" "$file" --help 2>/dev/null | grep -q -- '--device'; then args+=(--device cuda); fi
    if "$python" "$file" --help 2>/dev/null | grep -q -- '--csv'; then args+=(--csv "$report_dir/${name}_cuda.csv"); fi
    md "" "## $name"
    run_step "$name" "$report_dir/$name.log" "$python" "$file" ${args[@]+"${args[@]}"}
    # The log holds stdout and stderr (progress lines); the report keeps everything but progress.
    md '```'
    grep -v -E '^\[[0-9]+/[0-9]+\] ' "$report_dir/$name.log" | tail -n 400 >>"$report"
    md '```'
}

shopt -s nullglob
for file in bench/bench_*.py; do
    [ "$(basename "$file")" = "bench_e2e.py" ] && continue
    run_bench "$file"
done
[ -f bench/bench_e2e.py ] && run_bench bench/bench_e2e.py

md "" "## Result"
if [ "${#failed[@]}" -eq 0 ]; then
    md "" "All steps passed."
    echo "[gpu_suite] all steps passed; report: $report"
    exit 0
fi
md "" "FAILED steps: ${failed[*]}"
echo "[gpu_suite] FAILED: ${failed[*]}; report: $report"
exit 1
