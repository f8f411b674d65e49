"""Data-parallel compress under torchrun: the world of ranks, and the few collectives compress needs.

``torchrun --nproc-per-node N -m squeeze compress ...`` starts N copies of the CLI; each reads its rank from
the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and joins one
torch.distributed process group (gloo for CPU tensors, NCCL for CUDA tensors when CUDA is present). Without
torchrun (WORLD_SIZE unset or 1) the run is one process and nothing here communicates.

How the data-parallel pipelines share the work (squeeze.compression.pipelines.torchrun derives them from the
one-process pipelines; with ``--max-memory`` each rank streams block by block):
- every rank runs preflight and computes the job fingerprint; :func:`check_same_job` refuses, on every rank,
  a world whose ranks disagree on it (model digest, recipe, calibration, seed, versions, output, flags);
- rank 0 alone creates and locks the work area and writes the fingerprint; the work area must be on a
  filesystem every rank sees (multi-node: a shared filesystem), which each rank checks (:func:`check_visible`);
- the calibration windows are split into contiguous ranges (:func:`window_range`); each rank sums its
  windows' squared gradients in float64 (squeeze.calibrate.fisher), and :func:`sum_in_rank_order` adds the
  partials in rank order (a bounded run: per layer group, inside its block-by-block pass), so the fp32 Fisher
  has the bits one process gets;
- the layer groups are dealt round robin (:func:`owns_group`), each rank committing its own to the shared
  work area; rank 0 writes, seals and publishes, and sends the result to the others (:func:`share_json`).

Every stage ends with :meth:`World.step`, an all-gather of one status row per rank: a rank that failed
raises its own error, and every other rank raises :class:`WorldError` naming it, so no rank is left waiting
in a collective. A rank that dies outright (killed) is seen by torchrun, which stops the others; every
committed checkpoint stays in the work area, and rerunning the same torchrun command resumes.

Nothing is pickled: statuses and digests travel as uint8 tensors, the result as JSON bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from squeeze.errors import ConfigError, SqueezeError

T = TypeVar("T")

#: Bytes of the payload each rank adds to a step's status row (a sha256 digest fits).
PAYLOAD_BYTES = 32


class WorldError(SqueezeError):
    """Another rank of the torchrun world failed (its own error is printed by that rank)."""

    exit_code = 1


@dataclass(frozen=True)
class World:
    """This process's place in the run: ``rank`` of ``size`` (one process: rank 0 of 1)."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: it owns the work area's lock, the fingerprint, the Fisher checkpoint and the artifact."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """More than one rank (a process group exists)."""
        return self.size > 1

    def step(
        self, what: str, fn: Callable[[], T], payload: Callable[[T], bytes] | None = None
    ) -> tuple[T, list[bytes]]:
        """Run ``fn`` on this rank, then exchange one status row with every rank.

        Returns ``fn``'s value and each rank's payload (``payload(value)``, at most PAYLOAD_BYTES bytes,
        zero-padded; rank order). When ``fn`` raises an Exception here, the status says so and the error
        propagates; when another rank's ``fn`` raised, :class:`WorldError` is raised here. ``fn`` must not
        itself communicate (a rank failing before such a collective would leave the others waiting in it).
        """
        if not self.active:
            value = fn()
            return value, [payload(value) if payload else b""]
        try:
            value = fn()
        except Exception:  # a signal or an exit (BaseException) skips this: a peer may be gone, torchrun ends all
            self._exchange(what, failed=True, data=b"")
            raise
        rows = self._exchange(what, failed=False, data=payload(value) if payload else b"")
        return value, rows

    def _exchange(self, what: str, *, failed: bool, data: bytes) -> list[bytes]:
        if len(data) > PAYLOAD_BYTES:
            raise ValueError(f"a step's payload is at most {PAYLOAD_BYTES} bytes, found {len(data)}")
        row = torch.zeros(1 + PAYLOAD_BYTES, dtype=torch.uint8)
        row[0] = 1 if failed else 0
        row[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else row[1:1]
        rows = [torch.empty_like(row) for _ in range(self.size)]
        dist.all_gather(rows, row)
        failed_ranks = [r for r, got in enumerate(rows) if int(got[0]) != 0]
        if failed_ranks and not failed:
            raise WorldError(
                f"rank {failed_ranks[0]} of the torchrun world failed ({what})"
                + (f" (and {len(failed_ranks) - 1} more)" if len(failed_ranks) > 1 else "")
                + "; its error is printed above",
                hint="fix what that rank reports and rerun the same torchrun command: committed work is kept",
            )
        return [got[1:].numpy().tobytes() for got in rows]


#: One process, no process group.
SINGLE = World()


def world_from_env(env: Mapping[str, str] | None = None) -> World:
    """This rank as torchrun describes it (RANK, WORLD_SIZE), or :data:`SINGLE` without torchrun.

    Raises ConfigError when the variables are malformed or inconsistent.
    """
    env = os.environ if env is None else env
    size_text = env.get("WORLD_SIZE", "").strip()
    if not size_text:
        return SINGLE
    try:
        size = int(size_text)
        rank = int(env.get("RANK", "0").strip() or "0")
    except ValueError:
        raise ConfigError(
            f"WORLD_SIZE and RANK must be integers, found WORLD_SIZE={size_text!r} RANK={env.get('RANK')!r}",
            hint="start data-parallel compress with torchrun, which sets them, or unset them",
        ) from None
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(
            f"RANK must be in [0, WORLD_SIZE) with WORLD_SIZE >= 1, found RANK={rank} WORLD_SIZE={size}",
            hint="start data-parallel compress with torchrun, which sets them, or unset them",
        )
    return World(rank=rank, size=size)


def backend_for(cuda_available: bool) -> str:
    """The process group backend: gloo for CPU tensors, and NCCL for CUDA tensors where CUDA is present."""
    return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"


def join(world: World) -> bool:
    """Join the process group of ``world`` (env:// rendezvous, as torchrun sets it up); returns True if this
    call created it (then :func:`leave` destroys it). One process, or a group already made: nothing to do."""
    if not world.active or (dist.is_available() and dist.is_initialized()):
        return False
    if not dist.is_available():
        raise ConfigError(
            "this torch build has no torch.distributed, so compress cannot run under torchrun",
            hint="run one process (without torchrun), or install a torch build with distributed support",
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:  # WORLD_SIZE set by hand, not by torchrun: init_process_group would fail with a traceback
        raise ConfigError(
            f"WORLD_SIZE={world.size} asks for a torchrun world, but {' and '.join(missing)} is not set",
            hint="start data-parallel compress with torchrun (e.g. torchrun --nproc-per-node 2 -m squeeze compress "
            "...), or unset WORLD_SIZE to run one process",
        )
    cuda = torch.cuda.is_available()
    if cuda:  # NCCL needs each rank on its own device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend_for(cuda), rank=world.rank, world_size=world.size)
    return True


def leave(created: bool) -> None:
    """Destroy the process group :func:`join` created."""
    if created and dist.is_initialized():
        dist.destroy_process_group()


# -- what each rank does


class _HasWorld(Protocol):
    world: World


J = TypeVar("J", bound=_HasWorld)


def every_rank(stage: Callable[[J], None], what: str | None = None) -> Callable[[J], None]:
    """``stage`` run by every rank, then a :meth:`World.step` (``stage`` must not communicate); ``what`` names
    the step in a failing peer's error (default: the stage function's name)."""
    label = what or _name(stage)
    return lambda job: job.world.step(label, lambda: stage(job))[0]


def main_rank(stage: Callable[[J], None], what: str | None = None) -> Callable[[J], None]:
    """``stage`` run by rank 0 alone (writing, sealing, publishing); the others wait for it."""
    label = what or _name(stage)
    return lambda job: job.world.step(label, lambda: stage(job) if job.world.is_main else None)[0]


def main_first(stage: Callable[[J], None], what: str | None = None) -> Callable[[J], None]:
    """``stage`` run by rank 0, then by the others: rank 0 commits its checkpoint, the others read it back."""
    label = what or _name(stage)

    def run(job: J) -> None:
        world = job.world
        world.step(label, lambda: stage(job) if world.is_main else None)
        world.step(label, lambda: None if world.is_main else stage(job))

    return run


def _name(stage: Callable[..., Any]) -> str:
    return getattr(stage, "__name__", "a stage").removesuffix("_stage").replace("_", " ")


def check_world_options(world: World, *, error_compensation: bool, activation: bool = False) -> None:
    """Refuse (ConfigError) what data-parallel compress does not split yet: error compensation (its input
    Hessians are summed in fp32 by a GEMM, whose bits depend on how the windows are split) and the activation
    sensitivity (a forward-only pass in one process: its per-window sums are not combined across ranks)."""
    if world.active and activation:
        raise ConfigError(
            f"weights.sensitivity: activation runs in one process, found a torchrun world of {world.size} ranks",
            hint="run it without torchrun (--max-memory bounds its memory), or use --sensitivity fisher",
        )
    if world.active and error_compensation:
        raise ConfigError(
            f"error compensation recipes run in one process, found a torchrun world of {world.size} ranks",
            hint="run this recipe without torchrun, or choose a recipe without error compensation",
        )


def window_range(n: int, world: World) -> tuple[int, int]:
    """This rank's contiguous share ``[start, stop)`` of ``n`` calibration windows (sizes differ by <= 1)."""
    return n * world.rank // world.size, n * (world.rank + 1) // world.size


def owns_group(index: int, world: World) -> bool:
    """Whether this rank quantizes layer group ``index`` (round robin: blocks of similar cost spread evenly)."""
    return index % world.size == world.rank


# -- agreement and combination


def job_digest(fingerprint: Mapping[str, Any], extra: Mapping[str, Any]) -> bytes:
    """sha256 of the fingerprint (model digest, recipe, calibration, seed, versions) and ``extra`` (output,
    flags): what every rank must agree on."""
    text = json.dumps({"fingerprint": fingerprint, "extra": extra}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def check_same_job(world: World, digests: list[bytes]) -> None:
    """Refuse (ConfigError, on every rank alike) a world whose ranks' job digests differ from rank 0's."""
    others = [r for r, d in enumerate(digests) if d != digests[0]]
    if others:
        raise ConfigError(
            f"the {world.size} torchrun ranks disagree on the job: rank(s) {others} have another model, recipe, "
            "calibration, seed, squeeze version, output or option than rank 0",
            hint="start every rank with the same command, the same files and the same squeeze",
        )


def check_visible(world: World, work_root: Path) -> None:
    """Refuse (ConfigError) a rank that cannot see the work area rank 0 created: not a shared filesystem."""
    if not work_root.is_dir():
        raise ConfigError(
            f"rank {world.rank} cannot see the work area {work_root} that rank 0 created",
            hint="the output directory must be on a filesystem every rank (every node) shares, e.g. NFS",
        )


def sum_in_rank_order(world: World, sums: dict[str, torch.Tensor]) -> None:
    """Make rank 0's ``sums`` the total over the ranks, added in rank order (0 + 1 + 2 ...) in their dtype.

    ``sums`` (same names, shapes and dtype on every rank, float64 from squeeze.calibrate.fisher) is updated in
    place on rank 0; the other ranks send theirs and keep them unchanged. One tensor at a time: rank 0 holds
    one extra tensor, never a rank's whole set.
    """
    if not world.active:
        return
    for name in sorted(sums):
        acc = sums[name]
        if world.is_main:
            buffer = torch.empty_like(acc)
            for source in range(1, world.size):
                dist.recv(buffer, src=source)
                acc.add_(buffer)
        else:
            dist.send(acc.contiguous(), dst=0)


def broadcast_tensors(world: World, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite every rank's ``tensors`` (same names, shapes, dtypes) with rank 0's, in place."""
    if not world.active:
        return
    for name in sorted(tensors):
        dist.broadcast(tensors[name], src=0)


def share_json(world: World, value: Any) -> Any:
    """Rank 0's ``value`` (JSON-ready) on every rank; sent as UTF-8 bytes (nothing is pickled)."""
    if not world.active:
        return value
    data = json.dumps(value, sort_keys=True).encode() if world.is_main else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(length, src=0)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8)
    if world.is_main and data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return value if world.is_main else json.loads(buffer.numpy().tobytes().decode())


__all__ = [
    "SINGLE",
    "World",
    "WorldError",
    "backend_for",
    "broadcast_tensors",
    "check_same_job",
    "check_world_options",
    "every_rank",
    "main_first",
    "main_rank",
    "check_visible",
    "join",
    "job_digest",
    "leave",
    "owns_group",
    "share_json",
    "sum_in_rank_order",
    "window_range",
]
