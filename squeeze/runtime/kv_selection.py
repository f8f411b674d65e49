"""Which KV cache a run uses: the ``--kv-bits`` / ``--kv-dynamic`` options checked, and the artifact's
calibrated spec, the uncalibrated per-token baseline or full precision chosen from them (the cache itself:
squeeze.runtime.quantized_cache)."""

from __future__ import annotations

from torch import nn

from squeeze.errors import ConfigError
from squeeze.limits import DEFAULT_SINK_TOKENS, KV_BITS
from squeeze.quant.kv_spec import KVSpec

#: ``kv_bits`` value meaning "do not quantize the cache".
FULL_PRECISION_BITS = 16


def check_kv_options(kv_bits: int | None, dynamic: bool) -> None:
    """ConfigError for KV options that are wrong whatever the model (checked before anything loads)."""
    if kv_bits is not None and (isinstance(kv_bits, bool) or kv_bits not in (*KV_BITS, FULL_PRECISION_BITS)):
        raise ConfigError(
            f"--kv-bits must be 4, 8 or 16 (no KV quantization), found {kv_bits!r}",
            hint="e.g. --kv-bits 8, or leave it out to take the artifact's calibrated KV cache",
        )
    if dynamic and kv_bits not in KV_BITS:
        raise ConfigError("--kv-dynamic needs --kv-bits 8 or 4", hint="e.g. --kv-bits 4 --kv-dynamic")


def kv_spec_for(
    model: nn.Module, calibrated: KVSpec | None, kv_bits: int | None, *, dynamic: bool = False, checked: bool = False
) -> KVSpec | None:
    """:func:`select_kv_spec` for ``model``: its attention modules are looked up only for a dynamic spec
    without calibration, so a plain full-precision run never depends on recognising the architecture.
    ``checked``: the options come from a KVOptions (checked when it was built)."""
    from squeeze.models.targets import attention_modules

    if calibrated is not None:
        names = calibrated.names
    elif dynamic:
        names = attention_modules(model)
    else:
        names = ()
    return select_kv_spec(calibrated, names, kv_bits, dynamic=dynamic, checked=checked)


def select_kv_spec(
    calibrated: KVSpec | None,
    names: tuple[str, ...],
    kv_bits: int | None,
    *,
    dynamic: bool = False,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    checked: bool = False,
) -> KVSpec | None:
    """Which KV cache to run with; None means an ordinary full-precision cache.

    ``kv_bits`` None: the artifact's calibrated spec if it has one, int or fp8 (else full precision). 4 or 8:
    the calibrated int spec of that width, or with ``dynamic`` the uncalibrated per-token baseline. 16: full
    precision.
    """
    if not checked:  # a KVOptions was checked when built
        check_kv_options(kv_bits, dynamic)
    if kv_bits is None:
        return calibrated
    if kv_bits == FULL_PRECISION_BITS:
        return None
    if dynamic:
        return KVSpec.dynamic(kv_bits, names, sink_tokens)
    if calibrated is None:
        raise ConfigError(
            f"--kv-bits {kv_bits} needs calibrated KV scales, and this model has none",
            hint=f"run `squeeze calibrate-kv ARTIFACT --bits {kv_bits}` first, or add --kv-dynamic for "
            "uncalibrated per-token scales",
        )
    if calibrated.label != f"int{kv_bits}":
        use = f"use --kv-bits {calibrated.bits}" if calibrated.label.startswith("int") else "leave out --kv-bits"
        raise ConfigError(
            f"--kv-bits {kv_bits} asked, but the artifact's KV scales were calibrated for {calibrated.label}",
            hint=f"{use}, re-run `squeeze calibrate-kv ARTIFACT --bits {kv_bits}`, or add --kv-dynamic",
        )
    return calibrated


__all__ = ["FULL_PRECISION_BITS", "check_kv_options", "kv_spec_for", "select_kv_spec"]
