#!/bin/sh
# One GPU session (issue 23): bench/gpu_session.sh --out DIR [--step STEP] (see bench/gpu_session.py).
# Runs from the repository root, so it works before or after `pip install --no-deps -e .`.
cd "$(dirname "$0")/.." || exit 1
exec python -m yggdrasil.bench.gpu_session "$@"
