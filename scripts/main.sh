#!/usr/bin/env bash
# The main job on the built-in default: set up, write an example artifact, verify it, inspect it.
# (Replaced by "compress the default model" once `squeeze compress` lands.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-artifacts/example}
rm -rf "$OUT"
.venv/bin/python scripts/example_artifact.py "$OUT"
.venv/bin/squeeze verify "$OUT"
.venv/bin/squeeze inspect "$OUT"
