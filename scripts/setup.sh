#!/usr/bin/env bash
# Creates .venv and installs poslab into it. CPU machines get torch's CPU wheel (torch==2.13.0);
# set POSLAB_TORCH to another requirement (e.g. "torch" for a CUDA build) on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "${POSLAB_TORCH:-torch==2.13.0}"
python -m pip install --quiet -e ".[${POSLAB_EXTRAS:-dev}]"
