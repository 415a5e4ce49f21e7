#!/usr/bin/env bash
# Every poslab check that needs a CUDA GPU, as one command for a short device session (issues 7 and 9):
#
#     OUT=gpu-checks bash scripts/gpu_checks.sh
#
# Runs with the machine's own python3 (it must hold a CUDA torch, triton, transformers, numba, scipy,
# pytest, hypothesis): poslab is imported from src/, nothing is installed or fetched. Each step's output goes
# to $OUT/<step>.txt; a failing step does not stop the later ones, and the exit code counts the failures.
# About 5-8 minutes on an H100/H200 (the kernel benchmark dominates).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=0
step() {  # step NAME COMMAND...: run it, keep its output, count a failure
    local name=$1; shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.txt" || failed=$((failed + 1))
}
step gpu nvidia-smi
step kernel_tests python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_pope.py -k "cuda or triton"
step pope_kernel python3 benchmarks/pope_kernel.py
# The run directory stays outside $OUT: only a few files come back from a device session.
step smoke python3 -m poslab reproduce all --scale smoke --out /tmp/poslab-smoke --jobs 1 --force
cp /tmp/poslab-smoke/report.md "$OUT/smoke_report.md" 2>/dev/null || failed=$((failed + 1))
echo "$failed step(s) failed"
exit "$failed"
