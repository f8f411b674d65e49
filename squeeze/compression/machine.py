"""The machine a compress run (or the measurement behind plan_rates.json) runs on: CPU model, ISA, cores.

``squeeze compress --plan`` times come from per-unit rates measured on one machine (plan_rates.json); each
entry names that machine with these fields, and the plan notes when it is made on another one.
``python -m squeeze.compression.machine`` prints this machine's fields as JSON, to paste beside new rates.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Machine:
    """``cpu_model`` (/proc/cpuinfo's model name, or the platform's processor), ``isa`` (the vector instruction
    set torch's CPU kernels use: AVX512, AVX2, DEFAULT...) and ``cores`` (logical CPUs the process may use)."""

    cpu_model: str
    isa: str
    cores: int

    def differs(self, other: Machine) -> bool:
        return (self.cpu_model, self.isa, self.cores) != (other.cpu_model, other.isa, other.cores)

    def describe(self) -> str:
        return f"{self.cpu_model}, {self.isa}, {self.cores} cores"


def this_machine() -> Machine:
    """The machine this process runs on."""
    return Machine(_cpu_model(), torch.backends.cpu.get_cpu_capability(), _cores())


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


if __name__ == "__main__":  # pragma: no cover - a helper for refreshing plan_rates.json
    print(json.dumps(asdict(this_machine()), indent=2))


__all__ = ["Machine", "this_machine"]
