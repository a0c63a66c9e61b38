#!/bin/sh
# One GPU session (issues 23, 36): bench/gpu_session.sh --out DIR [--report-dir DIR] [--step STEP]
# (see bench/gpu_session.py). Runs from a plain checkout with the machine's python3: no install.
cd "$(dirname "$0")/.." || exit 1
exec "${PYTHON:-python3}" -m yggdrasil.bench.gpu_session "$@"
