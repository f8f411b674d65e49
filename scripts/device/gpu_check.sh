#!/usr/bin/env bash
# Device check of the Triton LUT kernels (scripts/device/gpu_check.py): correctness against the torch reference,
# kernel time vs the copy-bandwidth floor and vs bf16, decode tokens/s of a random ~1B Llama.
# For a machine with one CUDA GPU and no network: installs nothing (needs torch, triton, transformers).
# Prints a table last; writes gpu_check.json and gpu_check.md to $OUT when it is set.
#   bash scripts/device/gpu_check.sh                  # the full check (budget --budget-s, default 460 s)
#   bash scripts/device/gpu_check.sh --dry-run        # tiny shapes on CPU tensors under TRITON_INTERPRET=1
#   bash scripts/device/gpu_check.sh --compile-only   # compile every kernel variant for sm_90, no GPU needed
# Exit status: 0 all checks passed, 1 a check failed or a section broke, 2 nothing could run.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
# here (no system torch/triton) fall back to the project's venv; on the device python3 has both
if [ -z "${PYTHON:-}" ] && ! "$PY" -c "import torch, triton" 2>/dev/null && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Triton 3.9 warns once per process when this is unset; 1 keeps its (and 3.6's) default: FMA fusion on
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
exec "$PY" scripts/device/gpu_check.py "$@"
