"""The progress lines squeeze compress writes to a stderr that is not a terminal (squeeze/cli/progress_lines.py),
set apart from the rest: tests of a refusal check the error and hint that follow them."""

from __future__ import annotations

import re

#: ``[h:mm:ss] stage: NAME`` or ``[h:mm:ss] LABEL done/total (p%), ...``
PROGRESS_LINE = re.compile(r"^\[\d+:\d\d:\d\d\] ")


def without_progress(stderr: str) -> str:
    """``stderr`` without its progress lines."""
    return "".join(line for line in stderr.splitlines(keepends=True) if not PROGRESS_LINE.match(line))
