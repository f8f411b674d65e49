#!/usr/bin/env bash
# Set up (idempotent), check lint, formatting and types, then run the whole test suite. This is the README's test
# command and what CI runs. SQUEEZE_CHECKS=0 skips the three checks (a quick local run of a few tests); CI never
# sets it.
# The hardening tests (tests/hardening: the CLI in child processes, minutes) are deselected unless named or
# SQUEEZE_HARDENING=1 is set.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${SQUEEZE_CHECKS:-1}" != 0 ]; then
    # All three run before giving up, so one CI run shows every kind of failure.
    failed=()
    .venv/bin/ruff check . || failed+=("ruff check")
    .venv/bin/ruff format --check . || failed+=("ruff format --check")
    .venv/bin/mypy || failed+=("mypy")  # the files and the strict modules are configured in pyproject.toml
    if [ ${#failed[@]} -gt 0 ]; then
        printf 'test.sh: %s failed; the tests did not run\n' "$(printf '%s, ' "${failed[@]}" | sed 's/, $//')" >&2
        exit 1
    fi
fi
exec .venv/bin/python -m pytest -q "$@"
