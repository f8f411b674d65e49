#!/usr/bin/env bash
# The main job on the built-in default: set up, compress SmolLM2-135M-Instruct (w4 recipe, Fisher from
# 32 x 512 tokens of ../shared/corpora/sotu.txt), verify the artifact, and print size and perplexity
# before and after on WikiText-2 (512-token windows, first 40), side by side.
#   RECIPE=w3-s045 bash scripts/main.sh     # another recipe; OUT=dir to choose the output
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SHARED=${SQUEEZE_SHARED:-../shared}
RECIPE=${RECIPE:-w4}
OUT=${OUT:-artifacts/smollm2-135m-$RECIPE}
CALIB="$SHARED/corpora/sotu.txt"
EVAL="$SHARED/corpora/wikitext2_raw_test.txt"
for f in "$CALIB" "$EVAL"; do
    [ -f "$f" ] || { echo "Error: $f not found (the main job uses the corpora in ../shared; set SQUEEZE_SHARED)" >&2; exit 2; }
done
SQ=.venv/bin/squeeze
start=$(date +%s)
$SQ compress smollm2-135m --recipe "$RECIPE" --calibration "$CALIB" --num-samples 32 --seq-len 512 \
    --output "$OUT" --overwrite
$SQ verify "$OUT"
$SQ eval "$OUT" --baseline smollm2-135m --text "$EVAL" --seq-len 512 --max-windows 40
echo "main job: $(( $(date +%s) - start )) s (after set-up)"
