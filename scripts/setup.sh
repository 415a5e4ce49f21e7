#!/usr/bin/env bash
# Creates .venv and installs poslab into it: torch==2.13.0 from pip's index (POSLAB_TORCH: another
# requirement, e.g. "torch" on a GPU machine; POSLAB_TORCH_INDEX: the index to take it from, e.g.
# https://download.pytorch.org/whl/cpu for the CPU wheel where pip's index serves a CUDA build), then
# poslab with the extras in POSLAB_EXTRAS (default: dev, what the tests need).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet ${POSLAB_TORCH_INDEX:+--index-url "$POSLAB_TORCH_INDEX"} "${POSLAB_TORCH:-torch==2.13.0}"
python -m pip install --quiet -e ".[${POSLAB_EXTRAS:-dev}]"
