#!/bin/sh
# One GPU session (issues 23, 36): bench/gpu_session.sh --out DIR [--report-dir DIR] [--step STEP]
# (see bench/gpu_session.py). Runs from the plain checkout with the machine's python3, no install
# and no copy: bench/checkout_path/ goes first on PYTHONPATH, and its sitecustomize.py makes every
# python started (the session, and its children: compile, pytest) import the checkout's folders
# under their installed names (yggdrasil.bench is bench/, ...; pyproject's package-dir).
# YGGDRASIL_CHECKOUT names the checkout (its tests; relative --out paths).
cd "$(dirname "$0")/.." || exit 1
export YGGDRASIL_CHECKOUT="$(pwd)"
export PYTHONPATH="$YGGDRASIL_CHECKOUT/bench/checkout_path${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m yggdrasil.bench.gpu_session "$@"
