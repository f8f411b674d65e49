"""Safe handling of artifact paths: validation, resolving the root, and reading files without leaving it.

Manifest paths are relative POSIX paths inside the artifact directory. Anything that could name a file
outside it, or name the same file two ways, is rejected before a single byte is read. The artifact's own
path may be a symlink (``current -> v3``): it is resolved once, and from the real root down no symlink is
followed.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from squeeze.errors import ConfigError, FormatError, SqueezeError

_OPEN_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever; fstat then refuses it
_OPEN_FILE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)

#: config.json and the other small JSON files read before (or without) hashing them. A real one is a few
#: KB, plus ~120 bytes per quantized module in ``quantization_config``.
MAX_CONFIG_BYTES = 64 * 2**20
#: Directory levels below an artifact's root that are scanned; deeper ones are reported, not descended
#: (squeeze writes at most one level; this also bounds the file descriptors a walk holds open).
MAX_DEPTH = 32
#: Characters of a path kept in a one-line message (the tail, which names the file).
MESSAGE_PATH_CHARS = 120
#: ``squeeze compress``'s resumable work area, a directory at the top of its output. While a run replaces an
#: artifact (``--overwrite``) or after it was killed, the work area sits inside the old, still complete
#: artifact: it is not part of any artifact (no manifest may list a path in it, :func:`check_relative_path`),
#: and :func:`walk_artifact` does not enter it, so the old artifact verifies, loads and serves until the new
#: one replaces it. Only a real directory of that name is passed over: a symlink or file is walked as usual
#: (and so refused as a link, or as an extra file).
WORK_AREA_NAME = ".squeeze-work"


def short_path(path: str | os.PathLike[str], keep: int = MESSAGE_PATH_CHARS) -> str:
    """``path`` for a one-line message: the last ``keep`` characters after "..." when longer."""
    text = os.fspath(path)
    return text if len(text) <= keep else "..." + text[-keep:]


def short_repr(value: object, keep: int = 80) -> str:
    """``repr(value)`` for a one-line message: cut to ``keep`` characters, ending in "..." when longer."""
    text = repr(value)
    return text if len(text) <= keep else text[: keep - 3] + "..."


def short_number(value: int, keep: int = 24) -> str:
    """An integer for a one-line message: as is up to ``keep`` digits, else only its length (a hostile
    manifest's size may have thousands of digits, and str() refuses past 4300)."""
    if abs(value) < 10**keep:
        return str(value)
    try:
        digits = len(str(abs(value)))
    except ValueError:  # past Python's int-to-str limit
        digits = int(abs(value).bit_length() * 0.30103) + 1
    return f"{'-' if value < 0 else ''}a number of about {digits} digits"


def file_kind(mode: int) -> str:
    """What a non-regular file is, for a message: "a directory", "a FIFO (named pipe)", "a device" ..."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a special file"


def read_capped(
    fd: int, limit: int, subject: str, error: type[SqueezeError] = FormatError, hint: str | None = None
) -> bytes:
    """The whole of the small file open as ``fd`` (closed here): the one capped read of every file squeeze
    reads whole before or without hashing it (config.json, the manifest, a signature, a key, a recipe).

    ``fd`` was opened non-blocking (a FIFO cannot hang the open). Refused, with ``error`` whose message starts
    with ``subject``: anything but a regular file (``hint`` then), and a file larger than ``limit`` bytes, by
    its size before a byte is read and again after reading at most ``limit + 1`` (a file growing meanwhile).
    """
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{subject} is {file_kind(info.st_mode)}, not a regular file", hint=hint)
        if info.st_size > limit:
            raise error(f"{subject} is {info.st_size} bytes, larger than the {limit} byte limit")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise error(f"{subject} grew past the {limit} byte limit while being read")
    return data


def read_user_file(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The whole of a small file the user named (a key, a recipe, a model's config.json), at most ``limit``
    bytes (:func:`read_capped`). The user's own links are followed. Raises OSError (missing, unreadable) and
    ConfigError (not a regular file, too large) naming it as "the ``what`` <path>"."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    hint = f"pass the path of the {what} file itself"
    return read_capped(fd, limit, f"the {what} {short_path(path)}", ConfigError, hint)


def check_relative_path(path: object, where: str) -> str:
    """Return ``path`` if it is a clean relative POSIX path, else raise FormatError naming ``where``."""
    if not isinstance(path, str) or not path:
        raise FormatError(f"{where}: path must be a non-empty string, found {path!r}")
    shown = repr(short_path(path))
    if "\x00" in path:
        raise FormatError(f"{where}: path {shown} contains a NUL byte")
    if "\\" in path:
        raise FormatError(f"{where}: path {shown} contains a backslash; manifest paths use '/'")
    if path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        raise FormatError(f"{where}: path {shown} is absolute; manifest paths are relative to the artifact")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise FormatError(f"{where}: path {shown} has an empty, '.' or '..' component")
    if parts[0] == WORK_AREA_NAME:
        raise FormatError(
            f"{where}: path {shown} lies in {WORK_AREA_NAME}, squeeze compress's work area, never an artifact file"
        )
    return path


def resolve_root(path: str | os.PathLike[str]) -> Path:
    """The artifact directory ``path`` names, with every symlink in ``path`` itself resolved.

    ``current -> v3`` gives ``.../v3``: the user's own links to an artifact are followed once, here; what
    is inside the artifact is then opened with O_NOFOLLOW at every step (``open_root``, ``open_inside``).
    """
    return Path(os.path.realpath(os.fspath(path)))


def open_root(directory: str | os.PathLike[str]) -> int:
    """A directory fd for the (resolved) artifact root; FormatError when it cannot be opened as one."""
    try:
        return os.open(directory, _OPEN_DIR)
    except OSError as exc:
        raise path_error("cannot open the artifact directory", directory, exc) from None


def path_error(action: str, path: str | os.PathLike[str], exc: OSError) -> FormatError:
    """``<action> <path>: <reason>`` as a one-line FormatError (the path shortened, a hint when one helps)."""
    return FormatError(f"{action} {short_path(path)}: {describe_os_error(exc)}", hint=_hint_for(exc))


def describe_os_error(exc: OSError) -> str:
    """A short reason for a failed open/read of an artifact path (no path in it: callers name the file)."""
    if exc.errno == errno.ELOOP:
        return "a path component is a symbolic link; artifacts may not contain links"
    if exc.errno == errno.ENOTDIR:
        return "not a directory (or a path component is a symbolic link)"
    if exc.errno == errno.ENAMETOOLONG:
        return "the path is longer than the operating system allows"
    return exc.strerror or type(exc).__name__


def _hint_for(exc: OSError) -> str | None:
    if exc.errno == errno.ENAMETOOLONG:
        return "cd closer to the artifact and pass a shorter (relative) path"
    return None


def open_inside(root_fd: int, relative: str) -> int:
    """Open ``relative`` under the directory fd ``root_fd`` for reading, refusing symlinks at every step.

    Each component is opened with O_NOFOLLOW relative to its parent's fd, so no symlink (even one swapped
    in after a check) can lead outside the artifact; the file is opened non-blocking (a FIFO cannot hang
    the open). Returns a file descriptor; the caller closes it.
    Raises OSError (ELOOP for a symlink, ENOENT for a missing file) and FormatError for a non-regular file.
    """
    parts = relative.split("/")
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, _OPEN_DIR, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        file_fd = os.open(parts[-1], _OPEN_FILE, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        raise FormatError(f"{short_path(relative)}: not a regular file")
    return file_fd


def read_inside(root: int | str | os.PathLike[str], relative: str, limit: int, *, name: str | None = None) -> bytes:
    """The whole of the small file ``relative`` under ``root`` (a directory fd, or a resolved root path).

    Hardened for files read before they are verified: no symlink at any component (:func:`open_inside`),
    then :func:`read_capped`. Raises FormatError naming the file as ``name`` (default: ``relative``).
    """
    shown = short_path(name or relative)
    root_fd = root if isinstance(root, int) else open_root(root)
    try:
        fd = open_inside(root_fd, relative)
    except OSError as exc:
        raise FormatError(f"cannot open {shown}: {describe_os_error(exc)}") from None
    except FormatError:
        raise FormatError(f"{shown} is not a regular file") from None
    finally:
        if not isinstance(root, int):
            os.close(root_fd)
    return read_capped(fd, limit, shown)


def walk_artifact(root: int | str | os.PathLike[str]) -> Iterator[tuple[str, os.stat_result]]:
    """Yield (relative POSIX path, lstat) of every entry below ``root`` without following symlinks.

    ``root`` is a directory fd or a resolved root path. Directories are descended through fds (no path
    grows past the OS limit) and not yielded, except one nested deeper than MAX_DEPTH levels, which is
    yielded unread; symlinks and special files are yielded so that callers reject them. A top-level directory
    named :data:`WORK_AREA_NAME` (squeeze compress's work area) is neither entered nor yielded.
    """
    top = os.dup(root) if isinstance(root, int) else open_root(root)
    # one (prefix, fd, pending entries) per open directory: at most MAX_DEPTH + 1 fds at a time
    stack = [("", top, _sorted_entries(top))]
    try:
        while stack:
            prefix, fd, pending = stack[-1]
            if not pending:
                os.close(fd)
                stack.pop()
                continue
            name, info = pending.pop()
            relative = f"{prefix}{name}"
            if relative == WORK_AREA_NAME and stat.S_ISDIR(info.st_mode):
                continue  # a compress run's work area (see WORK_AREA_NAME), not the artifact's
            if stat.S_ISDIR(info.st_mode) and len(stack) <= MAX_DEPTH:
                try:
                    child = os.open(name, _OPEN_DIR, dir_fd=fd)
                except OSError:  # replaced (by a link?) since it was listed: yielded, so callers refuse it
                    yield relative, info
                    continue
                stack.append((relative + "/", child, _sorted_entries(child)))
            else:
                yield relative, info
    finally:
        for _, fd, _ in stack:
            os.close(fd)


def _sorted_entries(fd: int) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of a directory's entries, in reverse name order (popped from the end: ascending)."""
    with os.scandir(fd) as entries:
        listed = [(entry.name, entry.stat(follow_symlinks=False)) for entry in entries]
    return sorted(listed, key=lambda item: item[0], reverse=True)
