"""What squeeze supports: one table of widths, groups, fractions and names, and the checks user input passes.

Boundary code (recipes, calibration specs, command-line options, the artifact parsers) validates with the
``check_*`` functions here, which raise ConfigError (or, for files, the ``error`` they are given, e.g.
FormatError) with what was expected, what was found and a hint. Code inside (quant/, the kernels,
calibrate/) then trusts what it is given: its own contract checks raise ValueError / TypeError, which the
CLI reports as an internal error (exit 3), not as the user's mistake.

This module imports nothing from squeeze but the error classes (a leaf), so anything may import it.
"""

from __future__ import annotations

from typing import Literal, TypeGuard, get_args

from squeeze.errors import ConfigError, SqueezeError

# ----------------------------------------------------------------------------------------------------------
# The table

#: Weight code widths: the packing, the file format and the LUT kernels handle exactly these (3 bits packs
#: 8 codes into 3 bytes; the others whole codes per byte).
WEIGHT_BITS = (2, 3, 4, 8)

#: Code widths of token-embedding rows only (``weights.embedding_bits``), never of linears: 6-bit RTN rows
#: (4 codes in 3 bytes, 6.06 bits per weight at d = 576) sit between 4-bit LUT rows and int8 rows. The
#: packing and the RTN format take them; the LUT format, the kernels and the bit budgets keep to WEIGHT_BITS.
EMBEDDING_ONLY_BITS = (6,)

#: Every width the packing and the RTN format handle: WEIGHT_BITS and EMBEDDING_ONLY_BITS.
CODE_BITS = tuple(sorted(WEIGHT_BITS + EMBEDDING_ONLY_BITS))

#: How the k-means weighs each weight: by its diagonal Fisher, or uniformly (ablation).
Sensitivity = Literal["fisher", "activation", "uniform"]
SENSITIVITIES: tuple[str, ...] = get_args(Sensitivity)

#: How a LUT row is stored: float16 centroids (SqueezeLLM), or uint8 levels on a per-row fp16 affine grid.
LutDtype = Literal["float16", "int8"]
LUT_DTYPES: tuple[str, ...] = get_args(LutDtype)

#: Largest share of a matrix kept exactly in the sparse part, per kind (sensitive, outlier) and in total.
#: A sparse entry costs 32 bits (fp16 value + int16 column) where a dense code costs 2-8: at 10% the sparse
#: part alone adds ~3.2 bits per weight, doubling a 3-bit matrix, so more is no longer compression.
#: SqueezeLLM uses 0.45% (0.05% sensitive + 0.4% outliers). The tensor code (quant/sparse.py) accepts any
#: fraction in [0, 1]: that is the mathematical domain, this is what squeeze offers.
MAX_SPARSE_FRACTION = 0.10
#: weights.generated_samples at most: 8 sequences of 512 tokens take ~50 s on a 135M model, so 1024 is hours
#: of sampling on a small model; a larger count is a typo, refused before any work.
MAX_GENERATED_SAMPLES = 1024

#: RTN group size (columns per scale / zero point): any positive integer, the last group of a row may be
#: partial; None = one group per output channel. No kernel constrains it (the LUT kernels' tile width is
#: their own, internal parameter).
MIN_GROUP_SIZE = 1

#: KV-cache code widths (int8, or int4 packed two per byte along the head dimension).
KV_BITS = (4, 8)

#: The other KV cache calibrate-kv writes: vLLM's ``kv_cache_dtype="fp8"``, float8_e4m3fn elements with one
#: float32 scale per layer for keys and one for values (squeeze.quant.kv_spec.LayerFP8).
KV_FP8: Literal["fp8"] = "fp8"

#: What ``squeeze calibrate-kv --bits`` takes: an int grid width, or fp8.
KvChoice = int | Literal["fp8"]
KV_CHOICES: tuple[KvChoice, ...] = (8, 4, KV_FP8)

#: Leading tokens of a sequence whose keys and values the quantized KV cache keeps in full precision (the
#: attention sink; 4 as in StreamingLLM). On SmolLM2-135M with int4 KV (scripts/bench/ablate_kv.py, 10 windows)
#: 4 instead of 1 measured +2.41% vs +2.62% perplexity over full precision; they cost 4 tokens of fp16 per
#: sequence, not per token, and cover the BOS / chat-template tokens where generation puts its outliers.
DEFAULT_SINK_TOKENS = 4

#: Calibration windows need at least 2 tokens: one prediction of the next token.
MIN_SEQ_LEN = 2

#: Largest seed (``--seed``, a calibration spec's ``seed``, ``weights.tuning.seed``): 32 bits, what numpy and
#: most tools take; the tuning stage derives per-block seeds from it (seed x 1_000_003 + block) that stay
#: inside torch.Generator's 64-bit range. One rule for every seed, checked where each enters.
MAX_SEED = 2**32 - 1


# ----------------------------------------------------------------------------------------------------------
# Predicates (for code that must not raise)


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool`` (YAML and Python both let True pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_weight_bits(value: object, widths: tuple[int, ...] = WEIGHT_BITS) -> TypeGuard[int]:
    """Whether ``value`` is a supported weight code width (one of ``widths``: a format may take CODE_BITS)."""
    return is_int(value) and value in widths


def is_kv_bits(value: object) -> TypeGuard[int]:
    """Whether ``value`` is a supported KV-cache code width."""
    return is_int(value) and value in KV_BITS


def is_kv_choice(value: object) -> TypeGuard[KvChoice]:
    """Whether ``value`` is one of :data:`KV_CHOICES` (8, 4 or "fp8")."""
    return is_kv_bits(value) or value == KV_FP8


def is_kv_group(group: object, head_dim: int) -> TypeGuard[int]:
    """Whether ``group`` can be the channels per KV grid of a ``head_dim`` head: an even divisor of it (int4
    packs channel pairs)."""
    return is_int(group) and group >= 2 and not group % 2 and not head_dim % group


# ----------------------------------------------------------------------------------------------------------
# Checks (boundary code: recipes, specs, options, artifact parsers)


def check_weight_bits(
    value: object,
    where: str = "bits",
    error: type[SqueezeError] = ConfigError,
    *,
    hint: str | None = "use 3 or 4 for SqueezeLLM, 8 for near-lossless",
    widths: tuple[int, ...] = WEIGHT_BITS,
) -> int:
    """``value`` if it is one of ``widths`` (the linears' WEIGHT_BITS unless told), else ``error``."""
    if not is_weight_bits(value, widths):
        raise error(f"{where} must be one of {list(widths)}, found {value!r}", hint=hint)
    return value


def check_choice(value: object, choices: tuple[str, ...], where: str, error: type[SqueezeError] = ConfigError) -> str:
    """``value`` if it is one of ``choices`` (SENSITIVITIES, LUT_DTYPES, the registry's methods), else ``error``."""
    if not isinstance(value, str) or value not in choices:
        raise error(
            f"{where} must be one of {list(choices)}, found {value!r}", hint=f"pass one of {', '.join(choices)}"
        )
    return value


def check_sparse_fractions(sensitive: float, outlier: float, where: str = "weights") -> None:
    """ConfigError unless both fractions are in [0, MAX_SPARSE_FRACTION] and so is their sum."""
    for name, value in (("sensitive_fraction", sensitive), ("outlier_fraction", outlier)):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not 0.0 <= value <= MAX_SPARSE_FRACTION:  # NaN fails too
            raise ConfigError(
                f"{where}.{name} must be in [0, {MAX_SPARSE_FRACTION}] (0-10%), found {value}",
                hint="SqueezeLLM uses 0.0005 sensitive + 0.004 outliers",
            )
    if sensitive + outlier > MAX_SPARSE_FRACTION:
        raise ConfigError(
            f"{where}.sensitive_fraction + {where}.outlier_fraction must not exceed {MAX_SPARSE_FRACTION}, "
            f"found {sensitive + outlier}",
            hint="SqueezeLLM uses 0.0005 sensitive + 0.004 outliers",
        )


def check_group_size(
    value: object,
    where: str = "group_size",
    error: type[SqueezeError] = ConfigError,
    *,
    hint: str | None = "e.g. 128, or null for one group per output channel",
) -> int | None:
    """``value`` if it is a positive integer or None (one group per row), else ``error``."""
    if value is None:
        return None
    if not (is_int(value) and value >= MIN_GROUP_SIZE):
        raise error(f"{where} must be an integer >= {MIN_GROUP_SIZE} or null, found {value!r}", hint=hint)
    return value


def check_kv_bits(
    value: object,
    where: str = "KV-cache bits",
    error: type[SqueezeError] = ConfigError,
    *,
    hint: str | None = "pass --bits 8 or --bits 4",
) -> int:
    """``value`` if it is a supported KV-cache width, else ``error``."""
    if not is_kv_bits(value):
        raise error(f"{where} must be {' or '.join(map(str, KV_BITS))}, found {value!r}", hint=hint)
    return value


def check_kv_choice(
    value: object,
    where: str = "--bits",
    error: type[SqueezeError] = ConfigError,
    *,
    hint: str | None = "8 or 4: squeeze's calibrated int grids; fp8: per-layer scales for vLLM's fp8 KV cache",
) -> KvChoice:
    """``value`` as a KV-cache choice (8, 4 or "fp8"), else ``error``; "8" / "4" as typed on a command line
    are the widths."""
    if isinstance(value, str) and value.isdecimal():
        value = int(value)
    if not is_kv_choice(value):
        choices = ", ".join(map(str, KV_CHOICES))
        raise error(f"{where} must be one of {choices}, found {value!r}", hint=hint)
    return value


def check_kv_calibration(
    bits: object,
    sink_tokens: int | None = None,
    key_group: int | None = None,
    value_group: int | None = None,
    error: type[SqueezeError] = ConfigError,
) -> tuple[KvChoice, int]:
    """(bits, sink tokens) of a KV calibration, checked; options named as calibrate-kv's flags.

    ``sink_tokens`` None: the kind's default (:data:`DEFAULT_SINK_TOKENS` for int grids; none for fp8). fp8
    takes no grid sizes and no sink: vLLM's fp8 cache stores every token with the layer's one scale.
    Group sizes are checked against the head dimension later, where the model is known.
    """
    bits = check_kv_choice(bits, "--bits", error)
    if sink_tokens is not None:
        check_at_least(sink_tokens, 0, "--sink-tokens", error)
    if bits != KV_FP8:
        return bits, DEFAULT_SINK_TOKENS if sink_tokens is None else sink_tokens
    given = [
        flag for flag, v in (("--key-group-size", key_group), ("--value-group-size", value_group)) if v is not None
    ]
    if sink_tokens:
        given.append("--sink-tokens")
    if given:
        raise error(
            f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to the int8 / int4 grids only, not to "
            "--bits fp8 (one scale per layer for keys and one for values; vLLM's fp8 cache keeps no exact sink)",
            hint=f"drop {' and '.join(given)}, or use --bits 8 or --bits 4",
        )
    return bits, 0


def check_kv_group(group: object, head_dim: int, what: str, error: type[SqueezeError] = ConfigError) -> int:
    """``group`` if it is an even divisor of ``head_dim`` (channels per KV grid), else ``error``."""
    if not is_kv_group(group, head_dim):
        raise error(
            f"{what} grids must span an even divisor of the head dimension {head_dim}, found {group!r}",
            hint=f"e.g. {head_dim // 2} or {head_dim}",
        )
    return group


def check_at_least(
    value: object, minimum: int, where: str, error: type[SqueezeError] = ConfigError, hint: str | None = None
) -> int:
    """``value`` if it is an integer >= ``minimum`` (counts: samples, tokens), else ``error`` (with ``hint``, or
    one saying what to write)."""
    if not (is_int(value) and value >= minimum):
        raise error(
            f"{where} must be >= {minimum}, found {value!r}",
            hint=hint or f"set {where} to a whole number, {minimum} or more",
        )
    return value


def check_seed(value: object, where: str, error: type[SqueezeError] = ConfigError) -> int:
    """``value`` if it is a seed squeeze takes (an integer in [0, :data:`MAX_SEED`]), else ``error``."""
    if not (is_int(value) and 0 <= value <= MAX_SEED):
        raise error(
            f"{where} must be an integer from 0 to {MAX_SEED} (2**32 - 1), found {value!r}",
            hint=f"pass a smaller {where}, e.g. 0 (the default) or 1234",
        )
    return value


__all__ = [
    "MAX_GENERATED_SAMPLES",
    "WEIGHT_BITS",
    "EMBEDDING_ONLY_BITS",
    "CODE_BITS",
    "Sensitivity",
    "SENSITIVITIES",
    "LutDtype",
    "LUT_DTYPES",
    "MAX_SPARSE_FRACTION",
    "MIN_GROUP_SIZE",
    "KV_BITS",
    "KV_FP8",
    "KvChoice",
    "KV_CHOICES",
    "DEFAULT_SINK_TOKENS",
    "MIN_SEQ_LEN",
    "MAX_SEED",
    "is_int",
    "is_weight_bits",
    "is_kv_bits",
    "is_kv_choice",
    "is_kv_group",
    "check_weight_bits",
    "check_choice",
    "check_sparse_fractions",
    "check_group_size",
    "check_kv_bits",
    "check_kv_choice",
    "check_kv_calibration",
    "check_kv_group",
    "check_at_least",
    "check_seed",
]
