"""The dataset of the ``squeeze_tinystories_mc`` lm-eval task: tinystories_mc.jsonl, next to this file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(**kwargs: Any) -> dict[str, Any]:
    """The task's splits (lm-eval's ``custom_dataset``): ``test``, every line of the JSON-lines file."""
    import datasets

    lines = (Path(__file__).parent / "tinystories_mc.jsonl").read_text(encoding="utf-8").splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])}
