"""Recipes and calibration specs: frozen, versioned dataclasses loaded from YAML; unknown keys are rejected.

A *recipe* says how to compress (weights, KV cache, output); a *calibration spec* says which text to
calibrate on. Both are resolved from a built-in name (``squeeze/recipes/NAME.yaml``,
``squeeze/calibration/NAME.yaml``, shipped as package data) or a file path, and both hash canonically
(``spec_hash``) for the manifest's provenance block.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from squeeze.config_values import (  # noqa: F401 - re-exported: squeeze.config is the public home
    MAX_YAML_BYTES,
    OMIT_DEFAULT,
    _yaml_problem,
    canonical_hash,
    from_dict,
    load_yaml_unique,
    parse_size,
    to_plain,
)
from squeeze.errors import ConfigError
from squeeze.format.paths import read_user_file, short_path
from squeeze.limits import (
    DEFAULT_SINK_TOKENS,
    MIN_SEQ_LEN,
    check_at_least,
    check_choice,
    check_seed,
)
from squeeze.models.families import DEFAULT_TARGETS  # noqa: F401 - re-exported (older callers)
from squeeze.weights_config import (  # noqa: F401 - re-exported: squeeze.config is the public home
    EMBEDDING_AUTO,
    EMBEDDING_BITS,
    ERROR_COMPENSATION_OPTIONS,
    MAX_REFIT_ROUNDS,
    MAX_TUNING_LR,
    MAX_TUNING_STEPS,
    SUPPORTED_BITS,
    DistillConfig,
    EmbeddingAuto,
    TuningConfig,
    WeightsConfig,
)

CONFIG_VERSION = 1
#: What ``output.keep_dtype`` (``--keep-dtype``) may say.
KeepDtype = Literal["source", "float32", "bfloat16", "float16"]
KEEP_DTYPE_CHOICES: tuple[str, ...] = get_args(KeepDtype)

_PACKAGE_DIR = Path(__file__).resolve().parent
RECIPES_DIR = _PACKAGE_DIR / "recipes"
CALIBRATION_DIR = _PACKAGE_DIR / "calibration"


@dataclass(frozen=True)
class OutputConfig:
    """How the artifact is written."""

    #: Largest shard, as bytes or a string like "2GB", "500MB" (decimal, as transformers uses).
    max_shard_size: str = "2GB"
    #: dtype of the tensors left unquantized (norms, biases, an unquantized embedding / LM head): "source"
    #: keeps the checkpoint's own (float16 for GGUF), or float32 / bfloat16 / float16.
    keep_dtype: KeepDtype = "source"

    def __post_init__(self) -> None:
        parse_size(self.max_shard_size)
        check_choice(self.keep_dtype, KEEP_DTYPE_CHOICES, "output.keep_dtype")

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size)


@dataclass(frozen=True)
class Recipe:
    """A complete compression recipe."""

    name: str = "custom"
    version: int = CONFIG_VERSION
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        _check_version(self.version, "recipe")

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def spec_hash(self) -> str:
        return canonical_hash(self.to_dict())


@dataclass(frozen=True)
class CalibrationSpec:
    """Which text to calibrate on, and how to cut it into token windows."""

    name: str = "custom"
    version: int = CONFIG_VERSION
    #: ``text``: a local UTF-8 text file (``path``); ``hf``: a dataset read with ``datasets`` (``dataset``).
    source: Literal["text", "hf"] = "text"
    path: str | None = None
    dataset: str | None = None
    dataset_config: str | None = None
    split: str = "train"
    field: str = "text"
    num_samples: int = 32
    seq_len: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        _check_version(self.version, "calibration spec")
        if self.source == "text" and not self.path:
            raise ConfigError("calibration source 'text' needs a 'path' to a local text file")
        if self.source == "hf" and not self.dataset:
            raise ConfigError("calibration source 'hf' needs a 'dataset' id (e.g. wikitext)")
        check_at_least(self.num_samples, 1, "calibration num_samples")
        check_at_least(self.seq_len, MIN_SEQ_LEN, "calibration seq_len")
        check_seed(self.seed, "calibration seed")

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    def spec_hash(self) -> str:
        return canonical_hash(self.to_dict())


# ----------------------------------------------------------------------------------------------------------
# Loading


def load_recipe(name_or_path: str | Path, **overrides: Any) -> Recipe:
    """Resolve a built-in recipe name (``w4``, ``w3-s045``, ...) or a YAML file into a Recipe.

    ``overrides`` are dotted keys (``weights.bits=3``) applied on top, as CLI flags do.
    """
    data = _read_named_yaml(name_or_path, RECIPES_DIR, "recipe")
    if isinstance(data, dict) and "kv_cache" in data:  # read by nothing in compress; older recipes carried it
        raise ConfigError(
            "recipe key 'kv_cache' is not a compress setting: the KV cache is calibrated on the artifact afterwards",
            hint="remove the kv_cache section and run `squeeze calibrate-kv ARTIFACT --bits 4|8`",
        )
    _resolve_width(data, overrides, name_or_path)
    for dotted, value in overrides.items():
        if value is None:
            continue
        _set_dotted(data, dotted.split("."), value)
    return from_dict(Recipe, data, "recipe")


def _resolve_width(data: dict[str, Any], overrides: dict[str, Any], name: str | Path) -> None:
    """``weights.bits`` and ``weights.target_bpw`` both set by one source (the recipe, or the flags) contradict:
    ConfigError. One set by a flag replaces the other from the recipe (``--bits 4`` makes a budget recipe
    uniform, ``--target-bpw 3.5`` budgets a uniform one)."""
    weights = data.get("weights")
    weights = weights if isinstance(weights, dict) else {}
    if weights.get("bits") is not None and weights.get("target_bpw") is not None:
        raise ConfigError(
            f"recipe {name} sets both weights.bits ({weights['bits']}) and weights.target_bpw "
            f"({weights['target_bpw']}), which contradict",
            hint="keep bits for one width everywhere, or target_bpw for an average the linears are planned to",
        )
    flags = [key for key in ("weights.bits", "weights.target_bpw") if overrides.get(key) is not None]
    if len(flags) == 2:
        raise ConfigError(
            f"--bits {overrides['weights.bits']} and --target-bpw {overrides['weights.target_bpw']} contradict: "
            "one sets every linear's width, the other an average that the widths are planned to",
            hint="pass only one of them",
        )
    if flags:
        weights.pop("target_bpw" if flags[0] == "weights.bits" else "bits", None)


def load_calibration_spec(name_or_path: str | Path, **overrides: Any) -> CalibrationSpec:
    """Resolve a built-in spec name, a spec YAML file, or a plain text file into a CalibrationSpec.

    A path to a non-YAML file is taken as calibration text (``source: text``). Relative ``path`` entries
    inside a spec file resolve against the spec file's directory.
    """
    candidate = Path(name_or_path)
    what = "calibration spec"
    if candidate.is_file() and candidate.suffix.lower() not in (".yaml", ".yml"):
        _named_yaml_path(name_or_path, CALIBRATION_DIR, what)  # warns when a built-in has the same name
        data: dict[str, Any] = {"name": candidate.name, "source": "text", "path": str(candidate.resolve())}
    else:
        spec_file = _named_yaml_path(name_or_path, CALIBRATION_DIR, what)
        data = _read_yaml_at(spec_file, name_or_path, CALIBRATION_DIR, what)
        if isinstance(data.get("path"), str) and not Path(data["path"]).is_absolute():
            data["path"] = str((spec_file.parent / data["path"]).resolve())
    for key, value in overrides.items():
        if value is not None:
            data[key] = value
    return from_dict(CalibrationSpec, data, "calibration spec")


def builtin_names(directory: Path) -> list[str]:
    """Names of the built-in YAML files in ``directory`` (recipes or calibration specs)."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


class BuiltinShadowedWarning(UserWarning):
    """A recipe or calibration spec name matched both a file here and a built-in: the file was taken."""


def _named_yaml_path(name_or_path: str | Path, directory: Path, what: str = "recipe") -> Path:
    """The YAML file ``name_or_path`` names: an existing file; else a built-in of that name in ``directory``
    (a directory named like a built-in, e.g. the output folder of ``--recipe w3-ec-tuned --output
    w3-ec-tuned``, is not a recipe file: the built-in is taken); else the path itself (read, and refused)."""
    candidate = Path(name_or_path)
    text = str(name_or_path)
    plain = "/" not in text and candidate.suffix.lower() not in (".yaml", ".yml") and text not in ("", ".", "..")
    builtin = directory / f"{text}.yaml" if plain else None
    if candidate.is_file():
        if builtin is not None and builtin.is_file():  # both match: say which one was taken
            warnings.warn(
                f"{what} {text!r} is both the file {short_path(candidate.resolve())} and a built-in: the file was "
                f"taken (pass the built-in's contents by path, or rename the file, to choose the other)",
                BuiltinShadowedWarning,
                stacklevel=3,
            )
        return candidate
    if builtin is not None and builtin.is_file():
        return builtin
    if candidate.suffix.lower() in (".yaml", ".yml") or candidate.exists():
        return candidate
    return directory / f"{text}.yaml"


def _read_named_yaml(name_or_path: str | Path, directory: Path, what: str) -> dict[str, Any]:
    return _read_yaml_at(_named_yaml_path(name_or_path, directory, what), name_or_path, directory, what)


def _read_yaml_at(path: Path, name_or_path: str | Path, directory: Path, what: str) -> dict[str, Any]:
    fix = f"pass a {what} YAML file, or one of the built-ins: {', '.join(builtin_names(directory)) or '(none)'}"
    try:
        raw = read_user_file(path, MAX_YAML_BYTES, what)
    except FileNotFoundError:
        raise ConfigError(
            f"unknown {what} {str(name_or_path)!r}: no such file and no built-in of that name",
            hint=f"built-ins: {', '.join(builtin_names(directory)) or '(none)'}; or pass a YAML file path",
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {short_path(path)}: {exc.strerror or exc}", hint=fix) from None
    try:
        data = load_yaml_unique(raw.decode("utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"{what} {path} is not valid YAML: {_yaml_problem(exc)}",
            hint="each key once per mapping, indented by spaces (YAML 1.1, as PyYAML reads it)",
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path} is not valid YAML: {str(exc).splitlines()[0]}", hint="save the file as UTF-8"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"{what} {path} must be a YAML mapping, found {type(data).__name__}",
            hint=f"write the {what} as keys and values (see the built-ins in {short_path(directory)})",
        )
    return data


def _set_dotted(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value


def _check_version(version: int, what: str) -> None:
    if version != CONFIG_VERSION:
        raise ConfigError(
            f"{what} version must be {CONFIG_VERSION}, found {version!r}",
            hint="this squeeze release reads version 1 files",
        )


__all__ = [
    "CONFIG_VERSION",
    "DEFAULT_SINK_TOKENS",
    "SUPPORTED_BITS",
    "WeightsConfig",
    "DistillConfig",
    "TuningConfig",
    "OutputConfig",
    "Recipe",
    "CalibrationSpec",
    "load_recipe",
    "load_calibration_spec",
    "from_dict",
    "to_plain",
    "canonical_hash",
    "parse_size",
    "replace",
]
