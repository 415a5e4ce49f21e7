#!/usr/bin/env bash
# Length extrapolation of the schemes the extrapolation recipe does not train (xPos, KERPLE, FIRE, ALiBi, CoPE): each
# trains the recipe's quick PoPE model with its own scheme (same config, data, seed and steps), then one
# `poslab analyze extrapolation` evaluates them with the quick run's PoPE and RoPE models at 1-10x the length (xPos
# also with its blockwise attention). An exploration, not a recipe: its table is in FINDINGS.md ("Twenty-fifth
# session"; CoPE: "Twenty-sixth session"; xPos blockwise: "Twenty-seventh session").
#
#     bash benchmarks/quick_search/extrapolation_schemes.sh [QUICK_RUN_DIR=runs/quick] [OUT=runs/extrapolation-schemes]
set -euo pipefail
cd "$(dirname "$0")/../.."
quick=${1:-runs/quick}
out=${2:-runs/extrapolation-schemes}
runs=$quick/extrapolation/runs
[ -f "$runs/pope/config.yaml" ] || { echo "no $runs/pope: run 'poslab reproduce extrapolation --scale quick --out $quick' first" >&2; exit 2; }
mkdir -p "$out"

train() {  # one thread each, two at a time: the machine's two cores
  OMP_NUM_THREADS=1 .venv/bin/poslab train "$runs/pope/config.yaml" --out "$out/$1" --overwrite \
    --set model.positional.name="$1" > "$out/$1.log" 2>&1
}
train xpos & train kerple & wait
train fire & train alibi & wait
train cope

.venv/bin/poslab analyze extrapolation --run "$out/xpos" --sequences 32 --batch-size 8 --factors 1 2 4 8 10 \
  --scalings blockwise --compare "$runs/rope" "$runs/pope" "$out/kerple" "$out/fire" "$out/alibi" "$out/cope"
.venv/bin/python - "$out/xpos/analysis/extrapolation.json" <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
print("| run | " + " | ".join(f"{f:g}x" for f in data["factors"]) + " | 10x / 1x |")
print("|---|" + "---|" * (len(data["factors"]) + 1))
for name, run in data["runs"].items():
    for scaling, curve in run["curves"].items():  # xpos also with its blockwise attention
        losses = [rec["loss"] for rec in curve]
        label = name if scaling == "none" else f"{name} + {scaling}"
        print(f"| {label} | " + " | ".join(f"{x:.3f}" for x in losses) + f" | {losses[-1] / losses[0]:.3f} |")
EOF
