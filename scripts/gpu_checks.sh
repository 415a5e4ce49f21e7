#!/usr/bin/env bash
# Every poslab check that needs a CUDA GPU, as one command for a short device session (issues 7 and 9):
#
#     OUT=gpu-checks bash scripts/gpu_checks.sh
#
# Runs with the machine's own python3 (it must hold a CUDA torch, triton, transformers, numba, scipy,
# pytest, hypothesis): poslab is imported from src/, nothing is installed or fetched. Each step appends its
# output to one of at most eight files in $OUT (a device session brings back eight) and has its own time
# limit, cut to what is left of BUDGET seconds for the whole script (default 540: a device command may run
# 600), so the files always come back; a step with no time left is skipped and counted as failed. A failing
# step does not stop the later ones, and the exit code counts the failures. About 7 minutes on an H200
# (2026-11-30: 566 s with the launch sweep, 140 of them a test step since trimmed); SWEEP=1 adds the launch
# sweep (~2.5 min), TRAIN=1 two 1,000-step paper-scale torchrun runs (~2.5 min): raise BUDGET with them.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=0
BUDGET=${BUDGET:-540}
step() {  # step FILE SECONDS COMMAND...: run it under a time limit, append its output to $OUT/FILE
    local file=$1 limit=$2; shift 2
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 10 ]; then
        echo "== skipped (the ${BUDGET}s budget is spent): $*" | tee -a "$OUT/$file"
        failed=$((failed + 1))
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "== $* (limit ${limit}s)" | tee -a "$OUT/$file"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$file"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || failed=$((failed + 1))
    echo "== exit $rc after $((SECONDS - start))s" | tee -a "$OUT/$file"
}
step tests.txt 20 nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
step tests.txt 20 python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
# The interpreter's checks are the CPU's: slow, and Triton 3.6's interpreter fails on the kernels' loops
step tests.txt 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_pope.py \
    -k "(cuda or triton) and not interpreter"
# After a kernel's launch code changes (SWEEP=1): time and check each launch configuration and both backward
# passes (~2.5 min); the tables below then run the winners instead of the module's table.
CONFIGS=()
if [ "${SWEEP:-0}" = 1 ]; then
    step configs.txt 240 python3 benchmarks/pope_kernel_configs.py --out "$OUT/configs.json"
    [ -s "$OUT/configs.json" ] && CONFIGS=(--configs "$OUT/configs.json")
fi
for backward in split atomic; do
    step kernel.txt 120 python3 benchmarks/pope_kernel.py ${CONFIGS[@]+"${CONFIGS[@]}"} --backward "$backward" --breakdown
done
# The run directory stays outside $OUT: only a few files come back from a device session.
rm -rf /tmp/poslab-smoke  # a report left by an earlier run must not pass for this one's
step smoke.txt 150 python3 -m poslab reproduce all --scale smoke --out /tmp/poslab-smoke --jobs 1
cp /tmp/poslab-smoke/report.md "$OUT/smoke_report.md" 2>/dev/null || failed=$((failed + 1))
step train_step.txt 90 python3 benchmarks/pope_train_step.py ${CONFIGS[@]+"${CONFIGS[@]}"}
step kernel.txt 60 python3 benchmarks/pope_kernel.py ${CONFIGS[@]+"${CONFIGS[@]}"} --bidirectional --n 4096 16384
if [ "${TRAIN:-0}" = 1 ]; then  # ~2.5 min
    # A short stretch of the paper-scale indirect-indexing recipe's own runs, through torchrun (NCCL, DDP):
    # the engine's GPU path end to end, and the step time that sizes a full paper run.
    step train.txt 30 python3 -c "import yaml; from poslab.experiments.indirect_indexing import SCALES, run_config
for s in ('pope', 'rope'): yaml.safe_dump(run_config(SCALES['paper'], s, 0), open(f'/tmp/ii_{s}.yaml', 'w'))"
    for scheme in pope rope; do
        step train.txt 75 torchrun --nproc_per_node 1 -m poslab train "/tmp/ii_$scheme.yaml" --out "/tmp/ii_$scheme" \
            --overwrite --set train.steps=1000 --set train.warmup_steps=100 --set train.log_every=500
    done
fi
echo "$failed step(s) failed"
exit "$failed"
