#!/usr/bin/env bash
# Runs every benchmark in benchmarks/ with the project's virtual environment; each prints its own ratios.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
for script in benchmarks/*.py; do
  echo "== $script"
  .venv/bin/python "$script" || status=1
done
exit $status
