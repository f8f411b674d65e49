"""Remote code: squeeze never runs a model's own Python files, and says so in one line.

Also the size-capped, non-blocking JSON read every check of a model's small files goes through.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from squeeze.errors import ConfigError, ModelError
from squeeze.format.paths import read_user_file

if TYPE_CHECKING:
    from squeeze.models.source import ModelSource

#: Largest config.json / tokenizer_config.json read while resolving a model.
_MAX_CONFIG_BYTES = 16 * 2**20


def check_no_remote_code(source: ModelSource) -> None:
    """Refuse (ModelError) a model whose architecture exists only as Python files shipped with it.

    Such a model's config.json points ``auto_map`` at those files and has a ``model_type`` transformers does
    not know. squeeze never runs a model's own code: every transformers call passes
    ``trust_remote_code=False``, and such a model is refused here, in one line, instead of transformers
    asking [y/N] on stdout. A config with ``auto_map`` but a known ``model_type`` (e.g. ``llama``) passes:
    transformers builds its built-in class and never imports the directory's .py files.
    """
    if source.kind == "gguf":
        return  # transformers reads a GGUF file's architecture from its metadata; there is no auto_map
    config = read_small_json(source.directory / "config.json")
    if not isinstance(config, dict) or not config.get("auto_map"):
        return
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    raise remote_code_error(
        source,
        f"config.json has auto_map ({_code_files(config['auto_map'])}) and a model_type "
        f"({model_type!r}) that transformers does not know",
    )


def remote_code_error(source: ModelSource, found: str) -> ModelError:
    """The one refusal for a model that needs its own code (``found``: what shows it)."""
    return ModelError(
        f"model {source.path} needs its own Python code to load: {found}; that would take "
        "trust_remote_code=True, and squeeze never runs a model's own code",
        hint="use a checkpoint of an architecture transformers supports natively, or convert the model to one",
    )


def is_remote_code_refusal(exc: BaseException) -> bool:
    # what transformers raises when trust_remote_code=False meets a model or tokenizer defined by its own code
    return isinstance(exc, ValueError) and "trust_remote_code" in str(exc)


def _code_files(auto_map: object) -> str:
    """The Python files an ``auto_map`` points at (``module.Class`` -> ``module.py``), at most three."""
    refs: list[str] = []
    for value in auto_map.values() if isinstance(auto_map, dict) else [auto_map]:
        refs += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, str)]
    files = sorted({ref.rpartition(".")[0].split("--")[-1] + ".py" for ref in refs if "." in ref})
    return ", ".join(files[:3]) + (", ..." if len(files) > 3 else "") if files else "no Python file named"


def read_small_json(path: Path) -> object:
    """``path`` parsed as JSON; None when it is not a small regular file holding valid JSON.

    Read by the one capped reader (:func:`squeeze.format.paths.read_user_file`: non-blocking, regular files
    only, size capped before reading); links are followed (hub-cache snapshots are links to blobs). None
    leaves the file to transformers, which reports what is wrong.
    """
    try:
        return json.loads(read_user_file(path, _MAX_CONFIG_BYTES, "config"))
    except (OSError, ConfigError, ValueError, RecursionError):
        return None


__all__ = ["check_no_remote_code", "remote_code_error", "is_remote_code_refusal", "read_small_json"]
