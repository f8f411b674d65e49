"""The model card ``squeeze push`` writes: ``README.md`` of the Hub repo, rendered from the artifact.

The card is data about the artifact, not part of it: it is uploaded beside the listed files, never listed in
the manifest (so it is not hashed, ``squeeze pull`` does not fetch it, and a pulled artifact verifies with or
without it; docs/format.md). Everything in it comes from what the artifact states: the manifest (root digest,
source model), config.json's ``quantization_config`` (method, widths, KV cache), recipe.yaml (verbatim), and
bits per weight computed exactly as ``squeeze inspect`` computes it (:func:`squeeze.format.inspect.inspect_artifact`).
Measured quality comes only from ``squeeze eval --json`` reports the user passes (:func:`read_eval_report`):
push runs no evaluation.

The YAML front matter holds the keys the Hub indexes: ``base_model`` with ``base_model_relation: quantized``
(the model page then lists this repo among its quantizations), ``library_name`` and ``tags``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from squeeze.errors import ConfigError
from squeeze.format.inspect import ArtifactInfo, inspect_artifact
from squeeze.format.paths import read_inside, read_user_file, short_path
from squeeze.version import __version__

#: The card's name in the Hub repo (the Hub renders and indexes this file).
CARD_NAME = "README.md"
RECIPE_NAME = "recipe.yaml"
#: recipe.yaml is a few hundred bytes; an eval report a few KB per task.
MAX_RECIPE_BYTES = 1 << 20
MAX_EVAL_BYTES = 16 << 20
#: A Hub repo id: ``org/name`` (letters, digits, ``-``, ``_``, ``.``; no ``..``).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
#: Built-in model aliases (squeeze.models.source.BUILTIN_MODELS) -> the Hub model they are a build of.
BUILTIN_BASE_MODELS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
EVAL_HINT = "pass the output of `squeeze eval ARTIFACT ... --json` saved to a file"


@dataclass(frozen=True)
class EvalRow:
    """One line of the card's evaluation table: ``what`` (a task or "perplexity"), its ``metric``, the value as
    shown (stderr or baseline included)."""

    what: str
    metric: str
    value: str


def is_repo_id(name: str) -> bool:
    """Whether ``name`` is shaped like a Hub repo id (``org/name``)."""
    return bool(_REPO_ID.match(name)) and ".." not in name


def base_model_of(source_model: str | None) -> str | None:
    """The Hub id the artifact was compressed from, when its provenance names one: a built-in alias's model, or
    a source that is a Hub id (compress read it from the local HF cache) and not a local directory."""
    if not source_model:
        return None
    if source_model in BUILTIN_BASE_MODELS:
        return BUILTIN_BASE_MODELS[source_model]
    if is_repo_id(source_model) and not Path(source_model).exists():
        return source_model
    return None


def read_eval_report(path: str | os.PathLike[str]) -> list[EvalRow]:
    """The rows of one ``squeeze eval --json`` report (perplexity, or lm-eval tasks). ConfigError when the file
    cannot be read or is not such a report."""
    try:
        data = read_user_file(path, MAX_EVAL_BYTES, "evaluation report")
        # json.loads, not the artifact's strict reader: squeeze eval --json writes NaN for a word perplexity it
        # could not count; non-finite values are simply left out of the table
        report = json.loads(data)
    except OSError as exc:
        raise ConfigError(
            f"cannot read the evaluation report {short_path(path)}: {exc.strerror}", hint=EVAL_HINT
        ) from None
    except (ValueError, RecursionError) as exc:  # not JSON, or not UTF-8
        problem = f"the evaluation report {short_path(path)} is not JSON: {str(exc)[:200]}"
        raise ConfigError(problem, hint=EVAL_HINT) from None
    rows = eval_rows(report)
    if not rows:
        raise ConfigError(
            f"{short_path(path)} is not a squeeze eval --json report (expected a 'perplexity' number or "
            "lm-eval 'results')",
            hint=EVAL_HINT,
        )
    return rows


def eval_rows(report: object) -> list[EvalRow]:
    """Table rows of a ``squeeze eval --json`` object (empty when it is neither kind of report)."""
    if not isinstance(report, dict):
        return []
    if _is_number(report.get("perplexity")):
        return _perplexity_rows(report)
    results = report.get("results")
    if not isinstance(results, dict):
        return []
    rows = []
    for task, metrics in sorted(results.items()):
        if not isinstance(metrics, dict):
            continue
        for key, value in sorted(metrics.items()):
            name, comma, filter_ = key.partition(",")
            if not comma or name.endswith("_stderr") or not _is_number(value):
                continue  # "alias", "sample_len": not metrics
            stderr = metrics.get(f"{name}_stderr,{filter_}")
            shown = f"{value:.4f}" + (f" ± {stderr:.4f}" if _is_number(stderr) else "")
            label = name if filter_ == "none" else f"{name} ({filter_})"
            rows.append(EvalRow(str(task), label, shown))
    return rows


def _perplexity_rows(report: Mapping[str, Any]) -> list[EvalRow]:
    windows, tokens = report.get("windows"), report.get("tokens")
    what = f"perplexity ({windows} windows, {tokens} tokens)" if _is_number(windows) else "perplexity"
    kv = report.get("kv_cache")
    if isinstance(kv, str) and report.get("kv_bits") != 16:
        what += f", {kv} KV cache"
    rows = []
    for key, metric in (("perplexity", "perplexity"), ("word_perplexity", "word perplexity")):
        value = report.get(key)
        if not _is_number(value):
            continue
        shown = f"{value:.3f}"
        baseline = report.get(f"baseline_{key}")
        if _is_number(baseline):
            shown += f" (baseline {baseline:.3f})"
        rows.append(EvalRow(what, metric, shown))
    return rows


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _cell(text: object) -> str:
    """``text`` safe inside a Markdown table cell (a task name from a report may hold a ``|``)."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_model_card(
    path: str | os.PathLike[str],
    repo_id: str,
    *,
    base_model: str | None = None,
    evals: Sequence[EvalRow] = (),
) -> str:
    """The card (Markdown with YAML front matter) for the artifact at ``path`` pushed to ``repo_id``.

    ``base_model``: the Hub id it was compressed from (default: the manifest's source model when that is a Hub
    id or a built-in alias; otherwise the card names the source without ``base_model``). ``evals``: rows of
    :func:`read_eval_report`. Reads headers, config.json and recipe.yaml only (the caller verifies).
    Raises ConfigError for a ``base_model`` that is not a Hub id.
    """
    if base_model is not None and not is_repo_id(base_model):
        raise ConfigError(f"--base-model {base_model!r} is not a Hub model id", hint="pass org/name, as on the Hub")
    info = inspect_artifact(path)
    source = info.provenance.get("source_model") if info.provenance else None
    base = base_model or base_model_of(source)
    recipe_text = None  # an artifact of calibrate-kv on a plain model has no recipe
    if any(entry["path"] == RECIPE_NAME and entry["listed"] for entry in info.files):
        recipe_text = read_inside(info.directory, RECIPE_NAME, MAX_RECIPE_BYTES).decode("utf-8", "replace")
    recipe = yaml.safe_load(recipe_text) if recipe_text else None
    recipe_name = recipe.get("name") if isinstance(recipe, dict) else None
    parts = [
        _front_matter(info, base),
        f"# {repo_id.split('/')[-1]}\n",
        _summary(info, repo_id, base, source, recipe_name),
        _evaluation(evals),
        _usage(repo_id),
        _recipe(recipe_text),
        _integrity(info),
    ]
    return "\n".join(part for part in parts if part)


def _front_matter(info: ArtifactInfo, base: str | None) -> str:
    method = info.quantization.method if info.quantization is not None else None
    tags = ["squeeze", "quantized", *(f"{bits}-bit" for bits in info.widths)]
    if method and method not in tags:  # the LUT method is named "squeeze" too
        tags.append(method)
    meta: dict[str, Any] = {}
    if base:
        meta |= {"base_model": base, "base_model_relation": "quantized"}
    meta |= {"library_name": "squeeze", "pipeline_tag": "text-generation", "tags": tags}
    return f"---\n{yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)}---\n"


def _summary(info: ArtifactInfo, repo_id: str, base: str | None, source: str | None, recipe: object) -> str:
    if base:
        origin = f"[{base}](https://huggingface.co/{base})"
    elif source:
        origin = f"a local checkpoint (`{Path(source).name}`)"
    else:
        origin = "a model its manifest does not name"
    quant = info.quantization
    widths = ", ".join(f"{n} at {bits} bits" for bits, n in info.widths.items()) or "none"
    rows = [
        ("base model", origin),
        ("recipe", f"`{recipe}`" if isinstance(recipe, str) else "none recorded"),
        ("weight method", f"`{quant.method}`" if quant is not None and quant.method else "none"),
        ("quantized modules", f"{info.quantized_modules} ({widths})"),
        ("bits per weight", f"{info.bits_per_weight}" if info.bits_per_weight is not None else "n/a"),
        ("KV cache", _kv_line(quant.kv_cache if quant is not None else None)),
        ("root digest", f"`{info.root_digest}`"),
        ("written by", f"squeeze {quant.squeeze_version if quant and quant.squeeze_version else __version__}"),
    ]
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    return (
        f"{origin[0].upper() + origin[1:]}, compressed by squeeze and sealed with a manifest: every file is checked "
        f"against its SHA-256 when it is pulled and when it is loaded.\n\n| | |\n|---|---|\n{table}\n\nBits per "
        "weight: every byte of the quantized layers (codes, look-up tables, sparse entries, packing) over their "
        "weights, as `squeeze inspect` reports it.\n"
    )


def _recipe(text: str | None) -> str:
    if text is None:
        return ""
    return f"## Recipe\n\n`{RECIPE_NAME}`, as `squeeze compress` resolved it:\n\n```yaml\n{text.rstrip()}\n```\n"


def _kv_line(kv: Mapping[str, Any] | None) -> str:
    if kv is None:
        return "not calibrated (full precision unless quantized when run)"
    if "bits" in kv:
        return f"{kv['bits']} bits (int{kv['bits']}, calibrated scales)"
    if kv.get("format"):
        return f"8 bits ({kv['format']}, calibrated per-layer scales)"
    return "calibrated"


def _evaluation(rows: Sequence[EvalRow]) -> str:
    if not rows:
        return ""
    lines = "\n".join(f"| {_cell(row.what)} | {_cell(row.metric)} | {_cell(row.value)} |" for row in rows)
    return (
        "## Evaluation\n\nMeasured with `squeeze eval --json` on this artifact (reported by its publisher; squeeze "
        f"push runs no evaluation).\n\n| evaluation | metric | value |\n|---|---|---|\n{lines}\n"
    )


def _usage(repo_id: str) -> str:
    local = repo_id.split("/")[-1]
    return (
        "## Use it\n\n```bash\n"
        f"squeeze pull {repo_id} -o {local}  # every byte checked against the manifest as it streams\n"
        f"squeeze verify {local}  # again, at any time: sizes, SHA-256, root digest\n"
        f'squeeze run "Once upon a time" -m {local}\n'
        f"squeeze serve {local}  # an OpenAI-compatible server\n"
        "```\n"
    )


def _integrity(info: ArtifactInfo) -> str:
    return (
        "## Integrity\n\n`squeeze.manifest.json` lists every file of the artifact with its size and SHA-256; its "
        f"root digest is `{info.root_digest}`. This README is not part of the artifact: the manifest does not "
        "list it, `squeeze pull` does not fetch it, and editing it changes nothing that is verified.\n"
    )


__all__ = [
    "CARD_NAME",
    "EvalRow",
    "base_model_of",
    "eval_rows",
    "is_repo_id",
    "read_eval_report",
    "render_model_card",
]
