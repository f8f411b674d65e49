"""What a compress run depends on, so that a resumed run provably continues the same job.

A fingerprint holds the digest of the source model's files, the full recipe, the calibration spec (with a
digest of its text file instead of the path, so the same file reached from another directory matches),
the seed, and the squeeze and format versions. Two fingerprints are compared key by key, so a refusal can
say exactly what changed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from squeeze.config import CalibrationSpec, Recipe

_CHUNK = 4 * 2**20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_fingerprint(
    *,
    source_model: str,
    source_digest: str,
    recipe: Recipe,
    calibration: CalibrationSpec | None,
    seed: int,
    squeeze_version: str,
    format_version: int,
) -> dict[str, Any]:
    """A JSON-ready description of everything the artifact's bytes depend on."""
    calib: dict[str, Any] | None = None
    if calibration is not None:
        calib = calibration.to_dict()
        path = calib.pop("path", None)
        if path and Path(path).is_file():
            calib["text_sha256"] = file_sha256(Path(path))
        elif path:
            calib["path"] = path
    return {
        "squeeze_version": squeeze_version,
        "format_version": format_version,
        "source": {"model": source_model, "digest": source_digest},
        "recipe": recipe.to_dict(),
        "calibration": calib,
        "seed": seed,
    }


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping) and value:
        for key in sorted(value):
            yield from _flatten(value[key], f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def fingerprint_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One line per differing key: ``recipe.weights.bits: 4 in the work area, 3 now``; empty when equal."""
    old, new = dict(_flatten(saved)), dict(_flatten(current))
    lines = []
    for key in sorted(set(old) | set(new)):
        if old.get(key, "<absent>") != new.get(key, "<absent>"):
            before, after = _short(old.get(key, "<absent>")), _short(new.get(key, "<absent>"))
            lines.append(f"{key}: {before} in the work area, {after} now")
    return lines


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:16] + "..." + text[-8:]


__all__ = ["build_fingerprint", "fingerprint_differences", "file_sha256"]
