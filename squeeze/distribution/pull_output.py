"""The output directory of ``squeeze pull``: what may be there before a pull (nothing, an empty directory, or an
earlier pull of the same artifact), a symbolic link resolved, and a damaged earlier pull set aside for repair."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from squeeze.errors import ConfigError, FormatError
from squeeze.format.manifest import MANIFEST_NAME, Manifest
from squeeze.format.paths import short_path

ProgressFn = Callable[[int, int], None]


def resolve_output(output: Path) -> Path:
    """``output`` made absolute, a symbolic link resolved to the directory it names (the staging directory and
    the final rename happen beside that directory, not beside the link); ConfigError for a link to nothing
    or to something other than a directory. Checked before any download."""
    target = output.absolute()
    if not target.is_symlink():
        return target
    resolved = Path(os.path.realpath(target))
    if not resolved.is_dir():
        what = "a directory that does not exist" if not resolved.exists() else "something that is not a directory"
        raise ConfigError(
            f"the output {short_path(target)} is a symbolic link to {what} ({short_path(resolved)})",
            hint="pass a directory, or point the link at an empty directory",
        )
    return resolved


def intact(target: Path, progress: ProgressFn | None) -> bool:
    """Whether every file of the complete-looking earlier pull in ``target`` still hashes as its manifest says
    (a same-size corrupted file must not pass as "already present")."""
    from squeeze.format.verify import verify_artifact

    try:
        return verify_artifact(target, progress=progress).ok
    except FormatError:
        return False


def holds_manifest(target: Path) -> bool:
    return (target / MANIFEST_NAME).is_file()


def set_aside_for_repair(target: Path) -> None:
    """Move a damaged earlier pull of the same artifact into its staging directory, where the downloader
    keeps what re-hashes correctly and downloads the rest; the commit renames it back. ConfigError when an
    older staging directory is in the way."""
    from squeeze.distribution.staging import staging_path

    staging = staging_path(target)
    try:
        os.rename(target, staging)
    except OSError as exc:
        raise ConfigError(
            f"{short_path(target)} holds a damaged copy of this artifact, and it cannot be repaired: "
            f"{short_path(staging)} is in the way ({exc.strerror})",
            hint=f"delete {short_path(staging)} (an interrupted pull's files) and pull again",
        ) from None


def check_output(target: Path, manifest: Manifest | None) -> bool:
    """True when ``target`` already holds a complete pull of ``manifest`` (same root digest, every listed
    file there with its size; the bytes are verified when the artifact loads). False when it is absent or
    an empty directory. ConfigError when it holds anything else. With ``manifest`` None (before it is
    fetched) only what no manifest can make right is refused."""
    try:
        if not target.is_dir():
            if target.exists() or target.is_symlink():
                raise ConfigError(
                    f"the output {short_path(target)} exists and is not a directory", hint="pass a new directory"
                )
            return False
        names = os.listdir(target)
    except OSError as exc:
        raise ConfigError(
            f"cannot read the output {short_path(target)}: {exc.strerror}",
            hint="check its permissions, or pass another --output",
        ) from None
    if not names:
        return False
    if MANIFEST_NAME not in names:
        raise ConfigError(
            f"the output {short_path(target)} exists and is not empty",
            hint="pull into a new or empty directory (or into the directory of an earlier pull of the same artifact)",
        )
    if manifest is None:
        return False
    from squeeze.format.verify import read_manifest

    try:
        local = read_manifest(target)
    except FormatError as exc:
        raise ConfigError(
            f"the output {short_path(target)} holds an unreadable artifact: {exc.message}",
            hint="pull into a new directory, or delete the old one first",
        ) from None
    if local.root_digest != manifest.root_digest:
        raise ConfigError(
            f"the output {short_path(target)} holds another artifact (root digest {local.root_digest[:16]}..., "
            f"the source's is {manifest.root_digest[:16]}...)",
            hint="pull into a new directory, or delete the old one first",
        )
    for entry in manifest.files:
        try:
            found = os.lstat(target / entry.path)
        except OSError:
            found = None
        if found is None or found.st_size != entry.size:
            raise ConfigError(
                f"the output {short_path(target)} holds an incomplete copy of this artifact ({entry.path})",
                hint="delete it and pull again",
            )
    return True


__all__ = ["ProgressFn", "resolve_output", "intact", "holds_manifest", "set_aside_for_repair", "check_output"]
