"""The squeeze CLI as torchrun starts it in tests/compression/test_distributed.py, with two test hooks.

- ``{rank}`` in an argument becomes this rank's number (a world whose ranks disagree on the job);
- ``SQUEEZE_TEST_DIE_RANK=r`` and ``SQUEEZE_TEST_DIE_AFTER=k``: rank r dies (``os._exit(9)``, no clean-up, as a
  killed process) when it starts quantizing its (k+1)-th layer group;
- ``SQUEEZE_TEST_FAIL_LOAD_RANK=r``: rank r's load stage raises a ModelError (an error, not a death).

Run as ``python -m torch.distributed.run --standalone --nproc-per-node 2 torchrun_compress.py compress ...``.
"""

from __future__ import annotations

import os
import sys

import squeeze.compression.pipelines.plain as plain
import squeeze.compression.quantize as quantize
from squeeze.cli.app import main
from squeeze.errors import ModelError

rank = os.environ.get("RANK", "0")
if os.environ.get("SQUEEZE_TEST_DIE_RANK") == rank:
    after = int(os.environ.get("SQUEEZE_TEST_DIE_AFTER", "0"))
    original = quantize.quantize_group
    started = []

    def dying(job, names):  # type: ignore[no-untyped-def]
        if len(started) >= after:
            os._exit(9)
        started.append(names)
        return original(job, names)

    quantize.quantize_group = dying  # type: ignore[assignment]

if os.environ.get("SQUEEZE_TEST_FAIL_LOAD_RANK") == rank:

    def failing(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise ModelError(f"test: rank {rank} cannot load the model")

    plain.load_model = failing  # type: ignore[assignment]

sys.argv = [sys.argv[0], *(arg.replace("{rank}", rank) for arg in sys.argv[1:])]
main()
