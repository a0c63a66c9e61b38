#!/usr/bin/env bash
# generate greedy text for each prompt from BUNDLE with the code at PYTHONPATH ($1: old|new)
set -euo pipefail
which=$1; bundle=$2; out=$3
# old: a checkout of a532e8a (before the re-layering; its symlinks make it importable) at $OLD
if [ "$which" = old ]; then export PYTHONPATH="${OLD:?set OLD to a checkout of a532e8a}"; fi
: > "$out"
while IFS= read -r prompt; do
  for mode in spec nospec; do
    extra=""; [ "$mode" = nospec ] && extra="--no-spec"
    text=$(python -m yggdrasil generate --bundle "$bundle" --prompt "$prompt" --max-new-tokens 64 --no-stats $extra)
    python -c 'import json,sys; print(json.dumps({"prompt": sys.argv[1], "mode": sys.argv[2], "text": sys.argv[3]}))' "$prompt" "$mode" "$text" >> "$out"
  done
done < "$(dirname "$0")/prompts.txt"
