#!/bin/sh
# One GPU session (issues 23, 36): bench/gpu_session.sh --out DIR [--report-dir DIR] [--step STEP]
# (see bench/gpu_session.py). Runs from a plain checkout with the machine's python3, no install:
# the sources are first copied into the layout an install gives them (yggdrasil.bench is bench/,
# ...; .ci/installed_layout.py), and that copy goes first on PYTHONPATH for this run and the
# processes it starts (compile, pytest).
cd "$(dirname "$0")/.." || exit 1
PY="${PYTHON:-python3}"
LAYOUT="${TMPDIR:-/tmp}/yggdrasil-session-layout"
rm -rf "$LAYOUT" && "$PY" .ci/installed_layout.py "$LAYOUT" > /dev/null || exit 1
PYTHONPATH="$LAYOUT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m yggdrasil.bench.gpu_session "$@"
