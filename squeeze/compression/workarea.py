"""The resumable work area of a compress run: ``<output>/.squeeze-work/``.

It holds the lock, the run's fingerprint, the Fisher information once computed (and, for error-compensated
recipes, the layer inputs' Hessians, computed in the same pass), one checkpoint per
quantized layer group, and the staging directory where the final artifact is assembled. Every checkpoint
is a safetensors file committed atomically (temp file, fsync, rename), so a run killed at any moment
leaves only complete checkpoints under final names; leftover temp files are removed on the next run.
Checkpoints are caches of derived data: one that cannot be read is recomputed, never trusted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from squeeze.calibrate.hessian import dedupe_hessians
from squeeze.compression.lock import LOCK_NAME
from squeeze.errors import FormatError, ResumeError
from squeeze.format.atomic import PARTIAL_SUFFIX, atomic_write_text, commit_file, temp_path_for
from squeeze.format.paths import WORK_AREA_NAME
from squeeze.format.strict_json import strict_json_loads

WORK_NAME = WORK_AREA_NAME  # the artifact format passes over it: see squeeze.format.paths
_FINGERPRINT = "fingerprint.json"
_FISHER = "fisher.safetensors"
_HESSIAN = "hessian.safetensors"
#: The held-out calibration windows' Hessians (weights.lnq_rounds: they choose each row's refit iterate).
_HELD_OUT = "hessian-held-out.safetensors"
_GROUPS = "groups"
_TUNED = "tuned"  # weights.tuning: each layer group's tuned LUTs and norm gains, committed as its block is done
_DISTILL = "distill"  # weights.distill: its sampled windows, its resumable state, its committed result
_FISHER_GROUPS = "fisher-groups"  # --max-memory: the Fisher of each layer group, committed as its block is done
_ACTIVATIONS = "activations"  # --max-memory: per-block hidden states spilled during the Fisher pass (scratch)
_STAGING = "artifact"
_PUBLISHING = "publishing.json"
_META_KEY = "squeeze"


class WorkArea:
    """Paths and checkpoint I/O of ``output/.squeeze-work``."""

    def __init__(self, output: Path) -> None:
        self.output = Path(output)
        self.root = self.output / WORK_NAME

    @property
    def staging(self) -> Path:
        return self.root / _STAGING

    # -- life cycle

    def create(self) -> bool:
        """Make the work area (and the output directory); returns True if it did not exist."""
        existed = self.root.is_dir()
        self.root.mkdir(parents=True, exist_ok=True)  # only the lock goes here before the lock is held
        return not existed

    def clean_temps(self) -> None:
        """Remove temp files a killed run left behind (never a committed checkpoint)."""
        for directory in (self.root, self.root / _GROUPS, self.root / _FISHER_GROUPS, self.root / _TUNED):
            if directory.is_dir():
                for path in directory.iterdir():
                    # ours (.NAME.*.partial), and the .tmpXXXXXX safetensors >= 0.8 writes before its rename
                    ours = path.name.startswith(".") and path.name.endswith(PARTIAL_SUFFIX)
                    if (ours or path.name.startswith(".tmp")) and path.is_file():
                        path.unlink(missing_ok=True)

    def reset(self, keep: tuple[str, ...] = (LOCK_NAME,)) -> None:
        """Forget every checkpoint (``--restart``); the lock file stays, it is held."""
        for path in self.root.iterdir():
            if path.name in keep:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

    def remove(self) -> None:
        """Delete the work area; the publishing marker goes last (then the lock), so a run killed half-way
        through still finds the marker and finishes the clean-up instead of leaving checkpoints in the artifact."""
        if not self.root.is_dir():
            return
        last = (_PUBLISHING, LOCK_NAME)
        for path in sorted(self.root.iterdir()):
            if path.name in last:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        for name in last:
            with contextlib.suppress(FileNotFoundError):
                (self.root / name).unlink()
        with contextlib.suppress(OSError):
            self.root.rmdir()

    def is_leftover(self) -> bool:
        """True for a work area with neither a fingerprint nor a publishing record: nothing in it can be
        resumed (what an older squeeze's clean-up left when killed half-way, or a run killed before its
        fingerprint was written)."""
        return (
            self.root.is_dir() and not (self.root / _FINGERPRINT).is_file() and not (self.root / _PUBLISHING).is_file()
        )

    def has_checkpoints(self) -> bool:
        """True once anything worth resuming is committed (Fisher, a layer group, or a publish in progress)."""
        return (
            (self.root / _FISHER).is_file()
            or (self.root / _PUBLISHING).is_file()
            or self.committed_groups() > 0
            or any((self.root / _FISHER_GROUPS).glob("*.safetensors"))
        )

    def disk_bytes(self) -> int:
        """Bytes the work area holds now (subtracted from what a resumed run still needs)."""
        total = 0
        for path in self.root.rglob("*"):
            with contextlib.suppress(OSError):
                if path.is_file() and not path.is_symlink():
                    total += path.stat().st_size
        return total

    # -- fingerprint

    def read_fingerprint(self) -> dict[str, Any] | None:
        path = self.root / _FINGERPRINT
        if not path.is_file():  # a clean-up cut short may have removed it: the publishing record keeps a copy
            record = self.publishing()
            return record["fingerprint"] if record is not None else None
        value = _read_own_json(path, "fingerprint")
        if not isinstance(value, dict):
            raise ResumeError(f"{path} does not hold a JSON object", hint="pass --restart to start over")
        return value

    def write_fingerprint(self, fingerprint: dict[str, Any]) -> None:
        atomic_write_text(self.root / _FINGERPRINT, json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")

    # -- Fisher

    def has_fisher(self) -> bool:
        return (self.root / _FISHER).is_file()

    def save_fisher(self, fisher: dict[str, torch.Tensor]) -> None:
        _save_atomic(self.root / _FISHER, fisher, {})

    def load_fisher(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """The saved Fisher if it exists, reads back, and covers exactly ``names``; else None."""
        path = self.root / _FISHER
        if not path.is_file():
            return None
        try:
            fisher = load_file(str(path))
        except Exception:  # noqa: BLE001 - an unreadable cache is recomputed, whatever safetensors raised
            path.unlink(missing_ok=True)
            return None
        return fisher if sorted(fisher) == sorted(names) else None

    # -- the Fisher by layer group (--max-memory: never all of it in memory at once)

    @property
    def activations(self) -> Path:
        """Scratch for the hidden states a bounded run spills between blocks (removed when the pass ends)."""
        return self.root / _ACTIVATIONS

    def fisher_group_path(self, index: int) -> Path:
        return self.root / _FISHER_GROUPS / f"{index:05d}.safetensors"

    def save_fisher_group(self, index: int, fisher: dict[str, torch.Tensor]) -> None:
        (self.root / _FISHER_GROUPS).mkdir(exist_ok=True)
        _save_atomic(self.fisher_group_path(index), fisher, {})

    def load_fisher_group(self, index: int, names: list[str]) -> dict[str, torch.Tensor] | None:
        """Group ``index``'s Fisher covering exactly ``names``: its own checkpoint, else those entries of a whole
        Fisher checkpoint (an unbounded run's, read by name without loading the rest); else None."""
        path = self.fisher_group_path(index)
        whole = self.root / _FISHER
        try:
            if path.is_file():
                fisher = load_file(str(path))
                return fisher if sorted(fisher) == sorted(names) else None
            if whole.is_file():
                with safe_open(str(whole), framework="pt") as handle:
                    return (
                        {name: handle.get_tensor(name) for name in names} if set(names) <= set(handle.keys()) else None
                    )
        except Exception:  # noqa: BLE001 - an unreadable cache is recomputed, whatever safetensors raised
            path.unlink(missing_ok=True)
        return None

    def has_fisher_group(self, index: int, names: list[str]) -> bool:
        """True if :meth:`load_fisher_group` finds ``names`` (headers only; a bad group checkpoint is removed)."""
        path = self.fisher_group_path(index)
        for candidate in (path, self.root / _FISHER):
            if not candidate.is_file():
                continue
            try:
                with safe_open(str(candidate), framework="pt") as handle:
                    keys = set(handle.keys())
            except Exception:  # noqa: BLE001 - a bad checkpoint is recomputed rather than trusted
                candidate.unlink(missing_ok=True)
                continue
            return keys == set(names) if candidate == path else set(names) <= keys
        return False

    # -- input Hessians (error compensation)

    def has_hessians(self) -> bool:
        return (self.root / _HESSIAN).is_file()

    def save_hessians(self, hessians: dict[str, torch.Tensor], *, held_out: bool = False) -> None:
        """Commit ``hessians`` (name -> float32 (in, in)); a tensor shared by several names is stored once.
        ``held_out``: the held-out windows' set (weights.lnq_rounds), a file of its own."""
        stored, alias = dedupe_hessians(hessians)
        path = self.root / (_HELD_OUT if held_out else _HESSIAN)
        _save_atomic(path, stored, {_META_KEY: json.dumps(alias, sort_keys=True)})

    def load_hessians(self, names: list[str], *, held_out: bool = False) -> dict[str, torch.Tensor] | None:
        """The saved Hessians (``held_out``: the held-out set) if they exist, read back, and cover exactly
        ``names`` (names that shared one tensor share it again); else None (an unreadable file is removed)."""
        path = self.root / (_HELD_OUT if held_out else _HESSIAN)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                alias = json.loads((handle.metadata() or {})[_META_KEY])
                stored = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
            hessians = {name: stored[owner] for name, owner in alias.items()}
        except Exception:  # noqa: BLE001 - an unreadable cache is recomputed, whatever safetensors raised
            path.unlink(missing_ok=True)
            return None
        return hessians if sorted(hessians) == sorted(names) else None

    # -- layer groups

    def group_path(self, index: int) -> Path:
        return self.root / _GROUPS / f"{index:05d}.safetensors"

    def committed_groups(self) -> int:
        directory = self.root / _GROUPS
        if not directory.is_dir():
            return 0
        return sum(1 for p in directory.iterdir() if p.suffix == ".safetensors" and not p.name.startswith("."))

    def save_group(self, index: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Commit one layer group's quantized tensors; ``meta`` (JSON) rides in the safetensors header."""
        (self.root / _GROUPS).mkdir(exist_ok=True)
        _save_atomic(self.group_path(index), tensors, {_META_KEY: json.dumps(meta, sort_keys=True)})

    def has_group(self, index: int, modules: list[str]) -> bool:
        """True if group ``index`` is committed for exactly ``modules`` (header only); a bad one is removed."""
        path = self.group_path(index)
        if not path.is_file():
            return False
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = json.loads((handle.metadata() or {})[_META_KEY])
            if sorted(meta["modules"]) != sorted(modules):
                raise ValueError("the group covers other modules")
        except Exception:  # noqa: BLE001 - a bad checkpoint is recomputed rather than trusted
            path.unlink(missing_ok=True)
            return False
        return True

    def load_group(self, index: int, modules: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """A committed group covering exactly ``modules``, or None (absent, or unreadable: it is removed)."""
        return _load_checkpoint(self.group_path(index), modules)

    # -- tuned layer groups (weights.tuning)

    def tuned_path(self, index: int) -> Path:
        return self.root / _TUNED / f"{index:05d}.safetensors"

    def save_tuned(self, index: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Commit one layer group's tuning: the tensors replacing the quantized ones (none when the tuning was
        refused or gained nothing) and its record (JSON in the header)."""
        (self.root / _TUNED).mkdir(exist_ok=True)
        _save_atomic(self.tuned_path(index), tensors, {_META_KEY: json.dumps(meta, sort_keys=True)})

    def has_tuned(self, index: int, modules: list[str]) -> bool:
        """True if group ``index``'s tuning is committed for exactly ``modules``; a bad one is removed."""
        return self.load_tuned(index, modules) is not None

    def load_tuned(self, index: int, modules: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """A committed tuning of group ``index`` covering exactly ``modules``, or None (absent, or unreadable:
        it is removed)."""
        return _load_checkpoint(self.tuned_path(index), modules)

    # -- end-to-end distillation (weights.distill)

    def distill_path(self, part: str) -> Path:
        """``part``: ``generated`` (the sampled windows), ``state`` (the loop's last checkpoint), ``result``."""
        return self.root / _DISTILL / f"{part}.safetensors"

    def save_distill(self, part: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Commit one part of the distillation: its tensors and its record (JSON in the header; ``modules`` names
        what it covers, checked when it is read back)."""
        (self.root / _DISTILL).mkdir(exist_ok=True)
        _save_atomic(self.distill_path(part), tensors, {_META_KEY: json.dumps(meta, sort_keys=True)})

    def load_distill(self, part: str, modules: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """A committed part covering exactly ``modules``, or None (absent, or unreadable: it is removed)."""
        return _load_checkpoint(self.distill_path(part), modules)

    # -- publishing

    def is_publishing(self) -> bool:
        return (self.root / _PUBLISHING).is_file()

    def publishing(self) -> dict[str, Any] | None:
        """The publish plan once publishing has begun, else None: {"summary", "fingerprint", "old_files"}.

        Written by this squeeze into its own work area (never shipped), so trusted as its own record; a
        marker that does not parse is a ResumeError rather than a guess.
        """
        path = self.root / _PUBLISHING
        if not path.is_file():
            return None
        value = _read_own_json(path, "publishing record")
        if not isinstance(value, dict) or not {"summary", "fingerprint", "old_files"} <= set(value):
            raise ResumeError(
                f"{path} is not a publishing record of this squeeze version",
                hint="pass --restart to discard the work area and start over",
            )
        return value

    def mark_publishing(self, summary: dict[str, Any], fingerprint: dict[str, Any], old_files: list[str]) -> None:
        """Record, before anything in the output changes, the result and which old files the publish removes.

        The fingerprint rides along because :meth:`remove` deletes fingerprint.json before this marker.
        """
        record = {"summary": summary, "fingerprint": fingerprint, "old_files": sorted(old_files)}
        atomic_write_text(self.root / _PUBLISHING, json.dumps(record, sort_keys=True) + "\n")


def _load_checkpoint(path: Path, modules: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """A committed checkpoint (a layer group's quantized or tuned tensors and its JSON record) covering exactly
    ``modules``, or None: absent, or unreadable or for other modules (then it is removed, and recomputed rather
    than trusted)."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = json.loads((handle.metadata() or {})[_META_KEY])
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        if sorted(meta["modules"]) != sorted(modules):
            raise ValueError("the checkpoint covers other modules")
    except Exception:  # noqa: BLE001 - a bad checkpoint is recomputed rather than trusted
        path.unlink(missing_ok=True)
        return None
    return tensors, meta


def _save_atomic(final: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    temp = temp_path_for(final)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(temp), metadata=metadata or None)
        commit_file(temp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _read_own_json(path: Path, what: str) -> object:
    """A JSON file this squeeze wrote into its work area; ResumeError (start over) when it does not parse."""
    try:
        return strict_json_loads(path.read_bytes(), str(path))
    except FormatError as exc:
        raise ResumeError(
            f"the work area's {what} is unreadable: {exc.message}",
            hint="pass --restart to discard the work area and start over",
        ) from None


__all__ = ["WORK_NAME", "WorkArea"]
