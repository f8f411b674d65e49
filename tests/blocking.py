"""A test helper: run a call that must not block (FIFOs, huge files) with a time limit."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest


def within(seconds: float, call, unblock: Path | None = None):
    """``call()``'s result or exception, failing the test if it takes longer than ``seconds``.

    ``unblock``: a FIFO to open for writing afterwards, which releases a reader a regression left blocked.
    """
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if unblock is not None:  # release the blocked reader, so the thread ends with the test
            os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(5)
        pytest.fail(f"still running after {seconds} s (it blocked)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
