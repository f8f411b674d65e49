"""Property-based fuzzing of the manifest, index and safetensors-header parsers, and of verify.

Random bytes and mutated valid documents must never raise anything but a SqueezeError, and verify must
never open a file outside the artifact (a sentinel file sits next to it, and every open is watched).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from squeeze.errors import SqueezeError
from squeeze.format.manifest import MANIFEST_NAME, parse_manifest, root_digest_v2
from squeeze.format.safetensors_header import parse_safetensors_header
from squeeze.format.shards import INDEX_NAME
from squeeze.format.verify import seal_artifact, verify_artifact

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FUZZ_VERIFY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

NASTY_PATHS = [
    "../secret.txt",
    "/etc/passwd",
    "extra/../../secret.txt",
    "..",
    ".",
    "",
    "a//b",
    "secret.txt\x00",
    "..\\secret.txt",
    "C:/secret.txt",
    "extra/notes.txt/..",
    "extra",
    "config.json",
    MANIFEST_NAME,
    "model-00001-of-00002.safetensors",
    "x" * 300,
    "\udcff",
    "extra/./notes.txt",
]
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(NASTY_PATHS),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def mutate(document: object, data: st.DataObject) -> object:
    """Replace, delete or add one value somewhere in a JSON document (or swap in a nasty path)."""
    if isinstance(document, dict) and document and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(document)))
        action = data.draw(st.sampled_from(["recurse", "replace", "delete", "path"]))
        copy = dict(document)
        if action == "recurse":
            copy[key] = mutate(copy[key], data)
        elif action == "replace":
            copy[key] = data.draw(json_values)
        elif action == "delete":
            del copy[key]
        else:
            copy[key] = data.draw(st.sampled_from(NASTY_PATHS))
        return copy
    if isinstance(document, list) and document and data.draw(st.booleans()):
        index = data.draw(st.integers(0, len(document) - 1))
        copy = list(document)
        copy[index] = mutate(copy[index], data)
        return copy
    if isinstance(document, dict):
        return {**document, data.draw(st.text(max_size=8)): data.draw(json_values)}
    return data.draw(json_values)


def encode(document: object, data: st.DataObject) -> bytes:
    raw = json.dumps(document, ensure_ascii=data.draw(st.booleans())).encode("utf-8", "surrogatepass")
    if raw and data.draw(st.booleans()):  # a few flipped bytes on top
        buf = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 3))):
            buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
        raw = bytes(buf)
    return raw


@contextlib.contextmanager
def watch_opens(root: Path):
    """Record every os.open / open of a path (with or without dir_fd) while the block runs."""
    seen: list[tuple[str, int | None]] = []
    real_os_open, real_open = os.open, builtins.open

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        seen.append((os.fsdecode(path) if not isinstance(path, int) else str(path), dir_fd))
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    def py_open(file, *args, **kwargs):
        if not isinstance(file, int):
            seen.append((os.fsdecode(file), None))
        return real_open(file, *args, **kwargs)

    os.open, builtins.open = os_open, py_open
    try:
        yield seen
    finally:
        os.open, builtins.open = real_os_open, real_open


def assert_stays_inside(seen: list[tuple[str, int | None]], root: Path) -> None:
    inside = os.path.realpath(root)
    for path, dir_fd in seen:
        if dir_fd is None:
            resolved = os.path.realpath(path)
            assert resolved == inside or resolved.startswith(inside + os.sep), f"opened {path} outside the artifact"
        else:  # component-wise opens below the artifact's fd: one plain name each
            assert path not in ("..", ".", "") and "/" not in path and "\x00" not in path, f"opened {path!r} via dir_fd"


def run_verify(artifact: Path) -> None:
    with watch_opens(artifact) as seen:
        try:
            verify_artifact(artifact, workers=1)
        except SqueezeError:
            pass
    assert seen, "the open() watch saw nothing: verify must at least open the artifact directory"
    assert_stays_inside(seen, artifact)


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_never_escape_the_manifest_parser(data):
    try:
        parse_manifest(data)
    except SqueezeError:
        pass


@FUZZ
@given(st.data())
def test_mutated_manifests_only_raise_squeeze_errors(artifact, data):
    valid = json.loads((artifact / MANIFEST_NAME).read_text())
    try:
        parse_manifest(encode(mutate(valid, data), data))
    except SqueezeError:
        pass


@FUZZ
@given(st.binary(max_size=512), st.integers(0, 2**40))
def test_random_safetensors_headers_only_raise_squeeze_errors(prefix, size):
    try:
        parse_safetensors_header(prefix, size, "x.safetensors")
    except SqueezeError:
        pass


@FUZZ_VERIFY
@given(st.data())
def test_verify_of_a_mutated_manifest_stays_inside_the_artifact(artifact, data):
    saved = artifact.parent / "saved.json"  # the artifact fixture lives for all examples of this test
    if not saved.exists():
        (artifact.parent / "secret.txt").write_text("outside the artifact\n")
        saved.write_bytes((artifact / MANIFEST_NAME).read_bytes())
    valid = json.loads(saved.read_text())
    mutated = mutate(valid, data)
    if isinstance(mutated, dict) and isinstance(mutated.get("files"), list) and data.draw(st.booleans()):
        # re-sign the edited entries, so verify gets past the root digest to the files themselves
        with contextlib.suppress(Exception):
            mutated["root_digest"] = root_digest_v2(mutated)
    (artifact / MANIFEST_NAME).write_bytes(encode(mutated, data))
    run_verify(artifact)


@FUZZ_VERIFY
@given(st.data())
def test_verify_of_a_mutated_index_stays_inside_the_artifact(artifact, data):
    saved = artifact.parent / "index.json"
    if not saved.exists():
        (artifact.parent / "secret.txt").write_text("outside the artifact\n")
        saved.write_bytes((artifact / INDEX_NAME).read_bytes())
    valid = json.loads(saved.read_text())
    if data.draw(st.booleans()):
        raw = encode(mutate(valid, data), data)
    else:
        raw = data.draw(st.binary(max_size=1024))
    (artifact / INDEX_NAME).write_bytes(raw)
    seal_artifact(artifact)  # a correctly signed artifact whose index is garbage: verify must still cope
    run_verify(artifact)
