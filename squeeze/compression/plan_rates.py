"""The time side of ``squeeze compress --plan``: per-unit rates measured on a named machine (plan_rates.json),
and each rank's share of the work with its seconds per stage (squeeze.compression.plan builds the plan)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from squeeze.compression.machine import Machine, this_machine


@dataclass(frozen=True)
class Rates:
    """Per-unit costs of the stages on one machine (seconds), read from plan_rates.json."""

    machine: str
    cpu_model: str  # squeeze.compression.machine: the machine the rates were measured on
    isa: str
    cores: int
    measured: str
    command: str
    startup_s: float  # the process (python, torch, transformers), the tokenizer and the calibration windows
    load_s_per_source_byte: float
    fisher_s_per_param_token: float
    streaming_fisher_factor: float
    kmeans_s_per_weight: float
    write_s_per_artifact_byte: float
    seal_s_per_artifact_byte: float


@dataclass(frozen=True)
class RankPlan:
    """One rank's share: memory at its peak, what it computes, and its seconds per stage (None: no rate).
    ``layer_groups``: the units of quantize work dealt to it (layer groups, or with expert groups a block's own
    targets and each expert group: plan._work_units)."""

    rank: int
    host_peak_bytes: int
    gpu_peak_bytes: int | None
    windows: int
    layer_groups: int
    quantized_weights: int
    seconds: dict[str, float | None]

    @property
    def total_seconds(self) -> float | None:
        values = list(self.seconds.values())
        return None if any(v is None for v in values) else float(sum(v for v in values if v is not None))


@cache
def load_rates(device_type: str) -> Rates | None:
    """The measured rates for ``device_type`` ("cpu", "cuda") from plan_rates.json; None when none were measured."""
    text = resources.files("squeeze.compression").joinpath("plan_rates.json").read_text()
    entry = json.loads(text).get(device_type)
    return None if entry is None else Rates(**{k: v for k, v in entry.items() if not k.startswith("_")})


def rates_machine(rates: Rates) -> Machine:
    """The machine ``rates`` were measured on."""
    return Machine(rates.cpu_model, rates.isa, rates.cores)


def machine_note(rates: Rates | None) -> str | None:
    """A note when ``rates`` were measured on another machine than this one (their times are that machine's)."""
    if rates is not None and (here := this_machine()).differs(rates_machine(rates)):
        return (
            f"the times use rates measured on {rates_machine(rates).describe()}; this machine is {here.describe()}: "
            "they are that machine's times (plan_rates.json's _refresh says how to measure this one's)"
        )
    return None


@dataclass(frozen=True)
class PlanWork:
    """What every rank's share is cut from: the memory peaks, the layer groups' weights, the windows, sizes."""

    host: int
    gpu: int | None
    group_sizes: tuple[int, ...]
    num_samples: int | None
    seq_len: int | None
    active: int
    source_bytes: int
    artifact_bytes: int
    streamed: bool


def rank_plan(rank: int, ranks: int, work: PlanWork, rates: Rates | None) -> RankPlan:
    """Rank ``rank``'s windows (an even contiguous share), layer groups (round robin) and seconds per stage."""
    windows = 0
    if work.num_samples is not None:
        windows = work.num_samples * (rank + 1) // ranks - work.num_samples * rank // ranks
    owned = work.group_sizes[rank::ranks]
    weights = sum(owned)
    seconds: dict[str, float | None]
    if rates is None:
        seconds = dict.fromkeys(("startup", "load", "sensitivity", "quantize", "write", "seal"))
    else:
        fisher = work.active * windows * (work.seq_len or 0) * rates.fisher_s_per_param_token
        if work.streamed:
            fisher *= rates.streaming_fisher_factor
        writes = rank == 0
        seconds = {
            "startup": rates.startup_s,
            "load": work.source_bytes * rates.load_s_per_source_byte,
            "sensitivity": fisher,
            "quantize": weights * rates.kmeans_s_per_weight,
            "write": work.artifact_bytes * rates.write_s_per_artifact_byte if writes else 0.0,
            "seal": work.artifact_bytes * rates.seal_s_per_artifact_byte if writes else 0.0,
        }
    return RankPlan(rank, work.host, work.gpu, windows, len(owned), weights, seconds)


__all__ = ["Rates", "RankPlan", "PlanWork", "load_rates", "rates_machine", "machine_note", "rank_plan"]
