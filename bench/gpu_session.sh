#!/bin/sh
# One GPU session (issues 23, 36): bench/gpu_session.sh --out DIR [--report-dir DIR] [--step STEP]
# (see bench/gpu_session.py). Runs from a plain checkout with the machine's python3, no install:
# the sources are first copied into the layout an install gives them (yggdrasil.bench is bench/,
# ...; .ci/installed_layout.py), that copy goes first on PYTHONPATH, and the session runs inside
# it, so that the checkout's own yggdrasil/ folder (no bench/ inside) is not what `-m` finds on
# the working directory's sys.path entry; its children (compile, pytest) inherit both.
# YGGDRASIL_CHECKOUT names the checkout (its tests; relative --out paths).
cd "$(dirname "$0")/.." || exit 1
PY="${PYTHON:-python3}"
LAYOUT="$(mktemp -d "${TMPDIR:-/tmp}/yggdrasil-session-layout.XXXXXX")" || exit 1  # a new folder: nothing removed
"$PY" .ci/installed_layout.py "$LAYOUT" > /dev/null || exit 1
export YGGDRASIL_CHECKOUT="$(pwd)"
export PYTHONPATH="$LAYOUT${PYTHONPATH:+:$PYTHONPATH}"
cd "$LAYOUT" || exit 1
exec "$PY" -m yggdrasil.bench.gpu_session "$@"
