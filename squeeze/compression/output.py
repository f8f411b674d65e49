"""What squeeze may write and delete in an output directory, checked before any work starts.

The rule that keeps users' files safe: squeeze deletes only paths that the old artifact's manifest lists
(plus its own work area and staging names). An output directory that holds anything else, or holds files
but no manifest, is refused even with ``--overwrite``, and so is an output that is the model's own
directory, lies inside it, or contains it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from squeeze.errors import ConfigError, FormatError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.paths import short_path
from squeeze.format.verify import read_manifest

#: Foreign entries named in an error's hint.
SHOWN = 4


def check_not_model_path(output: Path, protected: Iterable[Path], *, what: str = "the model") -> None:
    """Refuse an ``output`` equal to, inside, or an ancestor of a ``protected`` path (even with --overwrite)."""
    out = output.resolve()
    for path in protected:
        source = path.resolve()
        if out == source or source in out.parents or out in source.parents:
            relation = "is" if out == source else "lies inside" if source in out.parents else "contains"
            raise ConfigError(
                f"output {output} {relation} {what} ({source}); squeeze never writes over its input",
                hint="choose an --output outside the model's directory",
            )


#: Room kept below the OS limits for the names squeeze adds: ``.NAME.kv-XXXXXXXX.partial`` next to an output,
#: ``.squeeze-work/artifact/...`` inside it.
_NAME_ROOM = 40
_PATH_ROOM = 200


def output_path(output: str | os.PathLike[str]) -> Path:
    """``output`` with symlinks resolved (``current -> v3`` means v3), refused when squeeze could not use it.

    Refused (ConfigError): the filesystem root, and a name or path too long for the names squeeze puts
    next to and inside it.
    """
    text = os.fspath(output)
    name_max, path_max = _limits(Path(text).parent if text else Path("."))
    if len(os.fsencode(text)) + _PATH_ROOM > path_max or any(
        len(os.fsencode(part)) > name_max for part in Path(text).parts
    ):
        raise ConfigError(
            f"output path {short_path(text)} is too long for this filesystem "
            f"({len(os.fsencode(text))} bytes; squeeze needs it under {path_max - _PATH_ROOM})",
            hint="choose a shorter --output path",
        )
    resolved = Path(text).resolve()
    if not resolved.name:
        raise ConfigError(
            f"cannot write an artifact at {resolved}: it is the filesystem root", hint="choose another --output"
        )
    if len(os.fsencode(resolved.name)) + _NAME_ROOM > name_max:
        raise ConfigError(
            f"output name {short_path(resolved.name)} is too long: squeeze adds up to {_NAME_ROOM} "
            f"characters to it for its staging names, and names here end at {name_max} bytes",
            hint="choose a shorter --output name",
        )
    return resolved


def _limits(directory: Path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the filesystem holding ``directory`` (its nearest existing ancestor)."""
    probe = directory.absolute()
    while probe != probe.parent:
        with contextlib.suppress(OSError):  # ENOENT, and ENAMETOOLONG for the very paths being judged
            if probe.is_dir():
                break
        probe = probe.parent
    try:
        return os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX")
    except (OSError, ValueError):
        return 255, 4096


def check_writable(output: Path) -> None:
    """Refuse an output squeeze could not create files in (read-only filesystem, no permission), cheaply.

    Probes the directory itself when it exists, else its nearest existing ancestor, by creating a file:
    ``os.access`` alone misses read-only mounts for root and some network filesystems. The probe is an
    unnamed O_TMPFILE where the filesystem has them, so a kill at any moment leaves nothing behind;
    elsewhere a hidden named file removed at once (and ignored, then removed, by the next run).
    """
    probe = output.resolve()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"cannot write into {output}: {probe} is not a directory", hint="choose another --output")
    try:
        _probe(probe)
    except OSError as exc:
        reason = (
            "read-only file system" if exc.errno == errno.EROFS else (os.strerror(exc.errno) if exc.errno else str(exc))
        )
        raise ConfigError(
            f"cannot write into {output}: {reason} ({probe})", hint="choose an --output on a writable filesystem"
        ) from None


#: Name prefix of the fallback write probe; such a leftover (a kill between create and unlink) is squeeze's own.
PROBE_PREFIX = ".squeeze-probe-"


def _probe(directory: Path) -> None:
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            os.close(os.open(directory, tmpfile | os.O_WRONLY, 0o600))
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    for stale in directory.glob(PROBE_PREFIX + "*"):
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(stale).st_mode):
                stale.unlink()
    fd, name = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=directory)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)


def owned_paths(output: Path) -> frozenset[str]:
    """The paths of ``output`` that squeeze wrote: its manifest's files and the manifest; FormatError if none."""
    manifest = read_manifest(output)  # hardened: no symlink, regular file, size capped
    return frozenset({MANIFEST_NAME, *(entry.path for entry in manifest.files)})


def foreign_entries(output: Path, owned: Iterable[str], ignore: Sequence[str] = (), limit: int = SHOWN) -> list[str]:
    """Up to ``limit`` entries under ``output`` that are not ``owned`` (relative paths; dirs end in '/').

    Descends only into directories that lead to an owned path, so a home directory full of files is
    judged by its first few entries, not walked. Symlinks and special files are never owned.
    """
    owned = set(owned)
    prefixes = {path.rsplit("/", 1)[0] + "/" for path in owned if "/" in path}
    prefixes |= {p[: i + 1] for p in list(prefixes) for i, c in enumerate(p) if c == "/"}
    found: list[str] = []
    stack = [""]
    while stack and len(found) < limit:
        prefix = stack.pop()
        with os.scandir(output / prefix if prefix else output) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                relative = prefix + entry.name
                if not prefix and entry.name in ignore:
                    continue
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode) and relative + "/" in prefixes:
                    stack.append(relative + "/")
                elif not (stat.S_ISREG(mode) and relative in owned):
                    found.append(relative + ("/" if stat.S_ISDIR(mode) else ""))
                if len(found) >= limit:
                    break
    return found


def check_output_dir(
    output: Path, overwrite: bool, *, ignore: Sequence[str] = (), protected: Iterable[Path] = ()
) -> frozenset[str]:
    """Check ``output`` before any work; returns the paths squeeze may replace there (empty: nothing to replace).

    Refused: a path that is not a directory; an output that is, lies in, or contains a ``protected`` path;
    a non-empty directory without ``overwrite``; with ``overwrite``, a directory holding anything the old
    artifact's manifest does not list (or no manifest at all). Entries named in ``ignore`` (the resumable
    work area) are squeeze's own and never count.
    """
    check_not_model_path(output, protected)
    if output.is_symlink() or (output.exists() and not output.is_dir()):
        kind = "a symbolic link" if output.is_symlink() else "not a directory"
        raise ConfigError(f"output {output} exists and is {kind}", hint="choose another --output")
    check_writable(output)
    if not output.is_dir() or not any(entry.name not in ignore for entry in os.scandir(output)):
        return frozenset()
    if not overwrite:
        holds = "already holds a squeeze artifact" if (output / MANIFEST_NAME).is_file() else "is not empty"
        raise ConfigError(
            f"output directory {output} exists and {holds}",
            hint="choose another --output, or pass --overwrite to replace the squeeze artifact in it (the old "
            "one stays until the new one is complete)",
        )
    try:
        owned = owned_paths(output)
    except FormatError:
        owned = frozenset()
    foreign = foreign_entries(output, owned, ignore)
    if foreign:
        reason = (
            "files squeeze did not write" if owned else "no squeeze manifest, so it is not an artifact squeeze wrote"
        )
        raise ConfigError(
            f"--overwrite refused: output directory {output} holds {reason}; squeeze replaces only the files an "
            "old artifact's manifest lists",
            hint=f"move these away or choose another --output: {', '.join(foreign)}"
            + (", ..." if len(foreign) >= SHOWN else ""),
        )
    return owned


def remove_owned(output: Path, owned: Iterable[str], keep: Iterable[str] = ()) -> None:
    """Delete the ``owned`` regular files of ``output`` (manifest first), except ``keep``; then empty dirs they left.

    Never removes a directory that still holds anything, nor follows a symlink.
    """
    keep = set(keep)
    ordered = sorted(set(owned) - keep, key=lambda p: (p != MANIFEST_NAME, p))
    for relative in ordered:
        path = output / relative
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(path).st_mode):
                path.unlink()
    parents = {Path(relative).parent for relative in ordered} - {Path(".")}
    for parent in sorted(parents, key=lambda p: -len(p.parts)):
        for directory in [parent, *parent.parents][:-1]:
            with contextlib.suppress(OSError):  # not empty, or gone: leave it
                (output / directory).rmdir()


__all__ = [
    "output_path",
    "check_output_dir",
    "check_not_model_path",
    "check_writable",
    "owned_paths",
    "foreign_entries",
    "remove_owned",
]
