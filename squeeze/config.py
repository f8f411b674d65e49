"""Recipes and calibration specs: frozen, versioned dataclasses loaded from YAML; unknown keys are rejected.

A *recipe* says how to compress (weights, KV cache, output); a *calibration spec* says which text to
calibrate on. Both are resolved from a built-in name (``squeeze/recipes/NAME.yaml``,
``squeeze/calibration/NAME.yaml``, shipped as package data) or a file path, and both hash canonically
(``spec_hash``) for the manifest's provenance block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from squeeze.errors import ConfigError
from squeeze.format.paths import read_user_file, short_path
from squeeze.limits import (
    DEFAULT_SINK_TOKENS,
    LUT_DTYPES,
    MAX_GENERATED_SAMPLES,
    MIN_SEQ_LEN,
    SENSITIVITIES,
    WEIGHT_BITS,
    LutDtype,
    Sensitivity,
    check_at_least,
    check_choice,
    check_group_size,
    check_sparse_fractions,
    check_weight_bits,
)
from squeeze.quant.schemes import format_for_recipe, formats, methods, recipe_options

CONFIG_VERSION = 1
#: Kept for callers of the old name; the table is squeeze.limits.
SUPPORTED_BITS = WEIGHT_BITS
#: What ``output.keep_dtype`` (``--keep-dtype``) may say.
KeepDtype = Literal["source", "float32", "bfloat16", "float16"]
KEEP_DTYPE_CHOICES: tuple[str, ...] = get_args(KeepDtype)
#: The bits ``weights.embedding_bits`` may ask for.
EMBEDDING_BITS = (4, 6, 8)
#: ``weights.embedding_bits: auto``: a ``target_bpw`` budget chooses the width (or none) per embedding.
EmbeddingAuto = Literal["auto"]
EMBEDDING_AUTO: EmbeddingAuto = "auto"
#: The WeightsConfig options that only error compensation reads (each must keep its default without it).
ERROR_COMPENSATION_OPTIONS = ("damp", "refit_lut", "refit_rounds", "act_order", "generated_samples")
#: The most rounds ``weights.refit_rounds`` may ask for (each is one more compensation pass per linear).
MAX_REFIT_ROUNDS = 8
#: Dense and shared-expert MLP linears, fused gate_up_proj (Phi-3 linears; MoE expert parameters, see
#: squeeze.models.expert_params), and the MLA projections of DeepSeek-V3 / Kimi K2 attention.
DEFAULT_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)

# Package data (shipped in the wheel), not the repository root: an installed squeeze has its built-ins too.
_PACKAGE_DIR = Path(__file__).resolve().parent
RECIPES_DIR = _PACKAGE_DIR / "recipes"
CALIBRATION_DIR = _PACKAGE_DIR / "calibration"

T = TypeVar("T")
#: A dataclass field left out of ``to_plain`` (recipe.yaml, hashes, fingerprints) while it holds its default: a
#: key added later then leaves every older recipe's hash, and the artifacts built from it, byte-identical.
OMIT_DEFAULT = {"omit_default": True}
#: Upper bounds of ``weights.tuning``: beyond them a run costs hours on one block and gains nothing measured.
MAX_TUNING_STEPS = 100_000
MAX_TUNING_LR = 1.0


@dataclass(frozen=True)
class TuningConfig:
    """``weights.tuning``: block-wise tuning of the LUT values and norm gains after quantization
    (squeeze.quant.tuning; the stage is squeeze.compression.tuning_stage). Codes and format never change."""

    #: Adam steps per decoder block, one calibration window each (early stop on a held-out slice may end sooner).
    steps: int = 64
    #: Adam learning rate of the LUT values and the norm gains.
    lr: float = 1e-4
    #: Calibration tokens the tuning uses at most (whole windows of the calibration's seq_len; 1/8 of them, at
    #: least one window, are held out for the early stop).
    tokens: int = 16384
    #: Seeds the order in which each block's windows are visited.
    seed: int = 0

    def __post_init__(self) -> None:
        check_at_least(self.steps, 1, "weights.tuning.steps")
        if self.steps > MAX_TUNING_STEPS:
            raise ConfigError(f"weights.tuning.steps must be at most {MAX_TUNING_STEPS}, found {self.steps}")
        if not (math.isfinite(self.lr) and 0.0 < self.lr <= MAX_TUNING_LR):
            raise ConfigError(
                f"weights.tuning.lr must be a number in (0, {MAX_TUNING_LR}], found {self.lr!r}",
                hint="1e-4 moves a 3-bit LUT level by about 1% of its spacing per step on SmolLM2",
            )
        check_at_least(self.tokens, 1, "weights.tuning.tokens")
        check_at_least(self.seed, 0, "weights.tuning.seed")


@dataclass(frozen=True)
class WeightsConfig:
    """How target linears are quantized."""

    #: A registered weight format's method (squeeze.quant.schemes): ``squeeze`` (LUT) or ``rtn`` built in.
    method: str = "squeeze"
    bits: int = 4
    #: An average bits per weight over the quantized linears: compress then gives each linear (q/k/v and gate/up
    #: of a block together) the width, and the sparse part or none, that meet it with the least Fisher-weighted
    #: error (squeeze.compression.bit_budget); ``bits`` is then unused. None: every linear gets ``bits``.
    target_bpw: float | None = None
    #: Fraction of weights kept exactly in the sparse part, chosen by sensitivity (Fisher). squeeze only.
    sensitive_fraction: float = 0.0
    #: Fraction kept exactly in the sparse part, chosen by magnitude (outliers). squeeze only.
    outlier_fraction: float = 0.0
    #: ``fisher``: weight k-means by the diagonal Fisher; ``activation``: by each input column's mean square
    #: over the calibration tokens, forward passes only (squeeze.calibrate.activation: for models whose
    #: backward is out of reach); ``uniform``: plain k-means (ablation).
    sensitivity: Sensitivity = "fisher"
    #: RTN only: columns per quantization group; ``None`` = one group per output channel.
    group_size: int | None = None
    #: squeeze only: how each row's LUT is stored. ``float16`` (SqueezeLLM) or ``int8`` (8-bit levels on a
    #: per-row fp16 affine grid: half the LUT bits, ~0.1-0.2 fewer bits per weight at 3-4 bits).
    lut_dtype: LutDtype = "float16"
    #: squeeze only: GPTQ-style error compensation (squeeze.quant.ec): codes chosen column by column against
    #: each row's LUT, each column's error pushed onto the later columns through the inverse input Hessian
    #: (accumulated during calibration). Same artifact format; needs calibration text.
    error_compensation: bool = False
    #: squeeze only, with error_compensation: dampening added to the Hessian's diagonal, as a fraction of its mean.
    damp: float = 0.01
    #: squeeze only, with error_compensation: refit each row's LUT once to the compensated codes (least squares).
    refit_lut: bool = False
    #: squeeze only, with error_compensation: rounds of LNQ's alternation after the compensation (squeeze.quant.ec.
    #: refitted_codes): each row's LUT refitted by least squares under H, then the codes re-chosen with
    #: compensation against it; each row keeps its best pair by output error (never worse than 0 rounds).
    refit_rounds: int = field(default=0, metadata=OMIT_DEFAULT)  # left out of the plain form while 0: hashes unchanged
    #: squeeze only, with error_compensation: quantize the columns by descending diag(H), GPTQ's act-order
    #: (measured on SmolLM2 w3: 55.1 vs 57.2 WikiText-2 perplexity in the original column order).
    act_order: bool = False
    #: squeeze only, with error_compensation: sequences (of the calibration's seq_len tokens) the model samples
    #: itself (temperature 1, seeded by the run's seed) whose inputs are added to the Hessians, so the
    #: compensation is not fitted to the calibration text's domain alone (squeeze.calibrate.generated;
    #: SmolLM2-135M w3-ec, WikiText-2: 50.2 with 8 of them, 47.9 with 32, 54.4 with sotu.txt alone). 0: none.
    generated_samples: int = 0
    #: Module-name suffixes of the nn.Linear layers to quantize.
    targets: tuple[str, ...] = DEFAULT_TARGETS
    #: Module-name substrings never quantized, even when they match a target.
    ignore: tuple[str, ...] = ("lm_head",)
    #: Quantize the token embedding and an untied LM head too: 8 / 6 (int8 / int6 per row, RTN) or 4 (a 4-bit
    #: per-row LUT, Fisher-weighted when the recipe is); None keeps them unquantized. A tied pair is quantized
    #: once. ``auto`` (with ``target_bpw`` only): the budget plans each embedding like a linear, kept in the
    #: source dtype or at 8, 6 or 4 bits, and its weights then count in the average ``target_bpw`` asks for.
    embedding_bits: int | EmbeddingAuto | None = None
    #: Block-wise tuning of the LUT values and norm gains against the original blocks' outputs (TuningConfig);
    #: None: the quantized values are written as the quantizer left them.
    tuning: TuningConfig | None = field(default=None, metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        # squeeze.limits is the one table; a recipe read from YAML passes its Literal checks in from_dict too,
        # these catch a WeightsConfig built in Python
        check_choice(self.method, methods(), "weights.method")
        check_choice(self.sensitivity, SENSITIVITIES, "weights.sensitivity")
        check_choice(self.lut_dtype, LUT_DTYPES, "weights.lut_dtype")
        check_weight_bits(self.bits, "weights.bits")
        if self.target_bpw is not None:
            _check_target_bpw(self.target_bpw)
        check_sparse_fractions(self.sensitive_fraction, self.outlier_fraction, "weights")
        if self.group_size is not None:
            check_group_size(self.group_size, "weights.group_size")
        self._check_options_of_format()
        self._check_error_compensation()
        self._check_embedding_bits()
        self._check_tuning()
        if not self.targets:
            raise ConfigError("weights.targets must name at least one module suffix, found an empty list")

    def _check_embedding_bits(self) -> None:
        bits = self.embedding_bits
        if bits is not None and bits != EMBEDDING_AUTO and bits not in EMBEDDING_BITS:
            raise ConfigError(
                f"weights.embedding_bits must be one of {[*EMBEDDING_BITS, EMBEDDING_AUTO]} or null, found {bits!r}",
                hint="8 / 6: int8 / int6 rows (about 8.06 / 6.06 bits/weight), 4: a 4-bit LUT per row; auto: the "
                "target_bpw budget chooses; null keeps the embedding",
            )
        if bits == EMBEDDING_AUTO and self.target_bpw is None:
            raise ConfigError(
                "weights.embedding_bits auto needs weights.target_bpw: the width is chosen by the bits budget",
                hint="pass a budget (--target-bpw 3.5, or a recipe such as b3.5-e), or a fixed width "
                "(--embedding-bits 4, 6 or 8)",
            )

    def _check_tuning(self) -> None:
        """Tuning trains LUT values on calibration windows: a format without tunable levels (RTN) and a run
        without calibration (``sensitivity: uniform``) are refused here, before any work."""
        if self.tuning is None:
            return
        fmt = format_for_recipe(self)
        if fmt is None or not fmt.tunable:
            raise ConfigError(
                f"weights.tuning tunes LUT values, and method {self.method} has none to tune",
                hint="use method: squeeze (e.g. recipe w3-tuned), or remove weights.tuning",
            )
        if self.sensitivity != "fisher":
            raise ConfigError(
                f"weights.tuning needs calibration windows, and sensitivity {self.sensitivity} compresses without "
                "calibration",
                hint="use --sensitivity fisher with a calibration text, or remove weights.tuning",
            )

    def _check_error_compensation(self) -> None:
        if not 0.0 < self.damp <= 1.0:
            raise ConfigError(
                f"weights.damp must be in (0, 1], found {self.damp!r}",
                hint="0.01 (GPTQ's default) adds 1% of the Hessian's mean diagonal",
            )
        defaults = WeightsConfig.__dataclass_fields__
        changed = [name for name in ERROR_COMPENSATION_OPTIONS if getattr(self, name) != defaults[name].default]
        if not self.error_compensation and changed:
            raise ConfigError(
                f"weights.{', weights.'.join(changed)}: used only with weights.error_compensation: true "
                f"(options of it: {', '.join(ERROR_COMPENSATION_OPTIONS)})",
                hint=f"add error_compensation: true, or remove {' / '.join(changed)}",
            )
        check_at_least(self.generated_samples, 0, "weights.generated_samples")
        self._check_refit_rounds()
        if self.generated_samples > MAX_GENERATED_SAMPLES:
            raise ConfigError(
                f"weights.generated_samples (--generated-samples) must be at most {MAX_GENERATED_SAMPLES}, found "
                f"{self.generated_samples}",
                hint="8 to 64 sampled sequences is the useful range (docs/guide.md); each costs a model run of "
                "seq_len tokens",
            )

    def _check_refit_rounds(self) -> None:
        rounds = check_at_least(self.refit_rounds, 0, "weights.refit_rounds")
        if not 0 <= rounds <= MAX_REFIT_ROUNDS:
            raise ConfigError(
                f"weights.refit_rounds must be an integer from 0 to {MAX_REFIT_ROUNDS}, found {rounds!r}",
                hint="2 to 4 rounds take most of the gain; each adds one compensation pass per linear",
            )
        if rounds and self.refit_lut:
            raise ConfigError(
                f"weights.refit_lut and weights.refit_rounds ({rounds}) both refit the LUT: give one of them",
                hint="refit_rounds alternates refit and compensation and keeps the best; remove refit_lut",
            )

    def _check_options_of_format(self) -> None:
        """Every option the chosen format does not use keeps its default (the format registry says which)."""
        fmt = format_for_recipe(self)
        if fmt is None:
            raise ConfigError(
                f"weights.method {self.method} has no format for lut_dtype {self.lut_dtype}", hint="remove lut_dtype"
            )
        defaults = {f.name: f.default for f in fields(self)}
        for key in sorted(recipe_options() - fmt.recipe_options):
            if getattr(self, key) != defaults[key]:
                users = list(dict.fromkeys(c.method for c in formats() if key in c.recipe_options))
                raise ConfigError(
                    f"weights.{key} applies to method {' / '.join(users)} only, found "
                    f"{getattr(self, key)!r} with method {self.method}",
                    hint=f"remove {key}, or use method: {users[0]}",
                )


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


def _check_target_bpw(value: float) -> None:
    # the exact range depends on the model's shapes (LUT bytes per row): preflight checks it; here only what no
    # model can store (every code takes at least 2 bits)
    if not math.isfinite(value) or value < min(WEIGHT_BITS):
        raise ConfigError(
            f"weights.target_bpw must be a number of at least {min(WEIGHT_BITS)} (bits per weight), found {value!r}",
            hint="e.g. 3.5 (between 3- and 4-bit) or 2.5",
        )


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
    if candidate.is_file() and candidate.suffix.lower() not in (".yaml", ".yml"):
        data: dict[str, Any] = {"name": candidate.name, "source": "text", "path": str(candidate.resolve())}
    else:
        data = _read_named_yaml(name_or_path, CALIBRATION_DIR, "calibration spec")
        spec_file = _named_yaml_path(name_or_path, CALIBRATION_DIR)
        if isinstance(data.get("path"), str) and not Path(data["path"]).is_absolute():
            data["path"] = str((spec_file.parent / data["path"]).resolve())
    for key, value in overrides.items():
        if value is not None:
            data[key] = value
    return from_dict(CalibrationSpec, data, "calibration spec")


def builtin_names(directory: Path) -> list[str]:
    """Names of the built-in YAML files in ``directory`` (recipes or calibration specs)."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def _named_yaml_path(name_or_path: str | Path, directory: Path) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix.lower() in (".yaml", ".yml") or candidate.exists():
        return candidate
    return directory / f"{name_or_path}.yaml"


#: A recipe or calibration spec is a few hundred bytes; this only bounds a wrong file's read.
MAX_YAML_BYTES = 4 * 2**20


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader, refusing a mapping that repeats a key (``bits: 3`` then ``bits: 4``): plain yaml
    keeps the last one silently, so a recipe would not do what one of its lines says."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            first = seen.setdefault(key, line)
        except TypeError:  # an unhashable key: construct_mapping reports it
            continue
        if first != line:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} on line {line} (first given on line {first})", key_node.start_mark
            )
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def load_yaml_unique(text: str) -> Any:
    """``yaml.safe_load`` that raises yaml.YAMLError for a duplicate key in any mapping, naming its line."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _read_named_yaml(name_or_path: str | Path, directory: Path, what: str) -> dict[str, Any]:
    path = _named_yaml_path(name_or_path, directory)
    try:
        raw = read_user_file(path, MAX_YAML_BYTES, what)
    except FileNotFoundError:
        raise ConfigError(
            f"unknown {what} {str(name_or_path)!r}: no such file and no built-in of that name",
            hint=f"built-ins: {', '.join(builtin_names(directory)) or '(none)'}; or pass a YAML file path",
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {short_path(path)}: {exc.strerror or exc}") from None
    try:
        data = load_yaml_unique(raw.decode("utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {_yaml_problem(exc)}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a YAML mapping, found {type(data).__name__}")
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """The first line of a yaml error, or its problem (which names the line) for a duplicate key."""
    problem = getattr(exc, "problem", None)
    if isinstance(problem, str) and problem.startswith("duplicate key"):
        return problem
    return str(exc).splitlines()[0]


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


# ----------------------------------------------------------------------------------------------------------
# Generic dict <-> frozen dataclass conversion (strict)


def from_dict(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types, recursively."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, found {type(data).__name__}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{where} has unknown key(s) {', '.join(map(repr, unknown))}",
            hint=f"allowed keys: {', '.join(sorted(known))}",
        )
    kwargs = {key: _coerce(hints[key], value, f"{where}.{key}") for key, value in data.items()}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)  # type: ignore[arg-type]
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where} must be one of {list(allowed)}, found {value!r}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings, found {value!r}")
        return tuple(value)
    if origin in (Union, UnionType):  # Optional[X], or a union (``int | Literal["auto"] | None``)
        args = get_args(tp)
        if type(None) in args and value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], value, where)
        for alternative in inner:  # the first alternative the value is
            try:
                return _coerce(alternative, value, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where} must be {' or '.join(map(_type_name, inner))}, found {value!r}")
    if tp is bool and isinstance(value, bool):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is str and isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where} must be of type {getattr(tp, '__name__', tp)}, found {value!r}")


def _type_name(tp: Any) -> str:
    """``int``, or the values of a Literal (``'auto'``), for an error message."""
    if get_origin(tp) is Literal:
        return " or ".join(map(repr, get_args(tp)))
    return str(getattr(tp, "__name__", tp))


def to_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (for YAML, JSON and hashing)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_plain(getattr(obj, f.name))
            for f in fields(obj)
            if not (f.metadata.get("omit_default") and getattr(obj, f.name) == f.default)
        }
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def canonical_hash(data: Any) -> str:
    """SHA-256 of the canonical JSON form (sorted keys, no whitespace) of ``data``."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hashlib.sha256(blob).hexdigest()


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"2GB"``, ``"500MB"``, ``"1GiB"`` (decimal units as transformers)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ConfigError(f"a size must be positive, found {size}")
        return size
    match = _SIZE_RE.match(str(size))
    unit = (match.group(2) or "").upper() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(f"cannot read size {size!r}", hint="write it like 2GB, 500MB or 1GiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"a size must be positive, found {size!r}")
    return value


__all__ = [
    "CONFIG_VERSION",
    "DEFAULT_SINK_TOKENS",
    "SUPPORTED_BITS",
    "WeightsConfig",
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
