import json

import pytest

from squeeze.errors import FormatError
from squeeze.format.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Provenance,
    build_manifest,
    parse_manifest,
    root_digest,
)

SHA = "a" * 64


def valid_manifest(**overrides):
    manifest = build_manifest([FileEntry("b.txt", 3, SHA), FileEntry("a/c.bin", 5, "b" * 64)], Provenance("m"))
    data = manifest.to_dict()
    data.update(overrides)
    return data


def test_round_trip_and_sorted_entries():
    manifest = build_manifest([FileEntry("z", 1, SHA), FileEntry("a", 2, SHA)])
    again = parse_manifest(manifest.to_json())
    assert again == manifest
    assert [e.path for e in again.files] == ["a", "z"]
    assert again.created.endswith("Z")


def test_root_digest_golden():
    # sha256(b"a\x002\x00" + "a"*64 + b"\n")
    entries = [FileEntry("a", 2, SHA)]
    import hashlib

    assert root_digest(entries) == hashlib.sha256(b"a\x002\x00" + SHA.encode() + b"\n").hexdigest()
    assert root_digest(entries + [FileEntry("b", 0, SHA)]) == root_digest([FileEntry("b", 0, SHA)] + entries)


@pytest.mark.parametrize(
    "path, message",
    [
        ("../evil", "'..'"),
        ("a/../../evil", "'..'"),
        ("/etc/passwd", "absolute"),
        ("a\x00b", "NUL"),
        ("a\\b", "backslash"),
        ("a//b", "empty"),
        ("./a", "'.'"),
        ("", "non-empty"),
    ],
)
def test_unsafe_paths_are_rejected(path, message):
    data = valid_manifest()
    data["files"][0]["path"] = path
    with pytest.raises(FormatError, match=message):
        parse_manifest(json.dumps(data))


def test_name_listed_twice_is_rejected():
    data = valid_manifest()
    data["files"][1]["path"] = data["files"][0]["path"]
    with pytest.raises(FormatError, match="listed twice"):
        parse_manifest(json.dumps(data))


def test_duplicate_json_keys_are_rejected():
    text = json.dumps(valid_manifest())
    text = text.replace('"format_version": 2', '"format_version": 2, "format_version": 2', 1)
    with pytest.raises(FormatError, match="duplicate JSON key 'format_version'"):
        parse_manifest(text)


@pytest.mark.parametrize("blob", [b"not json", b"\xff\xfe", b"[1, 2]", b"", b'{"format": NaN}'])
def test_not_json_is_rejected(blob):
    with pytest.raises(FormatError):
        parse_manifest(blob)


def test_unknown_version_is_rejected():
    with pytest.raises(FormatError, match="unknown format_version 3") as info:
        parse_manifest(json.dumps(valid_manifest(format_version=3)))
    assert "reads versions 1, 2" in info.value.message and info.value.hint


@pytest.mark.parametrize("field", ["format_version", "files", "root_digest", "tool", "provenance", "created"])
def test_missing_fields_are_rejected(field):
    data = valid_manifest()
    del data[field]
    with pytest.raises(FormatError, match=f"lacks the field '{field}'"):
        parse_manifest(json.dumps(data))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["files"][0].update(size=-1), r"size must be in \[0, 1125899906842624\] \(2\*\*50\), found -1"),
        (lambda d: d["files"][0].update(size="3"), "must be int"),
        (lambda d: d["files"][0].update(size=True), "must be int"),
        (lambda d: d["files"][0].update(sha256="XYZ"), "64 lowercase hex"),
        (lambda d: d["files"][0].update(extra=1), "unknown field"),
        (lambda d: d.update(surprise=1), "unknown field"),
        (lambda d: d.update(root_digest="0" * 63), "root_digest"),
        (lambda d: d.update(format="other"), "field 'format'"),
        (lambda d: d["files"].append("x"), "must be an object"),
        (lambda d: d["files"][0].update(path=MANIFEST_NAME), "cannot list itself"),
    ],
)
def test_mistyped_fields_are_rejected(mutate, message):
    data = valid_manifest()
    mutate(data)
    with pytest.raises(FormatError, match=message):
        parse_manifest(json.dumps(data))


def test_a_size_of_thousands_of_digits_is_not_echoed_whole():
    """Issue 41 item 15: the error line for such a size was 8 KB long."""
    data = valid_manifest()
    data["files"][0]["size"] = int("9" * 3000)
    with pytest.raises(FormatError, match="found a number of about 3000 digits") as info:
        parse_manifest(json.dumps(data))
    assert len(str(info.value)) < 300


def test_oversized_manifest_is_refused_unread():
    from squeeze.format import manifest as module

    with pytest.raises(FormatError, match="larger than"):
        parse_manifest(b" " * (module.MAX_MANIFEST_BYTES + 1))


@pytest.mark.parametrize("where", ["sha256", "root_digest"])
def test_a_digest_with_a_trailing_newline_is_rejected(where):
    # re.match(r"^...$") accepted "<64 hex>\n": "$" also matches before a final newline
    data = valid_manifest()
    if where == "sha256":
        data["files"][0]["sha256"] = SHA + "\n"
    else:
        data["root_digest"] += "\n"
    with pytest.raises(FormatError, match="64 lowercase hex"):
        parse_manifest(json.dumps(data))


@pytest.mark.parametrize("depth", [65, 900, 100_000])
def test_deeply_nested_json_is_refused_before_parsing(depth):
    from squeeze.format.strict_json import MAX_JSON_DEPTH, strict_json_loads

    data = json.dumps(valid_manifest())
    deep = data[:-1] + ', "x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    with pytest.raises(FormatError, match=f"{depth} levels deep, more than the {MAX_JSON_DEPTH} allowed"):
        parse_manifest(deep)
    with pytest.raises(FormatError, match="levels deep"):
        strict_json_loads(b"[" * depth + b"]" * depth, "config.json")


def test_brackets_inside_strings_do_not_count_as_nesting():
    from squeeze.format.strict_json import MAX_JSON_DEPTH, json_depth, strict_json_loads

    inner = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    text = json.dumps({"s": '\\"[{' * 100, "t": "\\" * 3 + "[" * 100, "deep": json.loads(inner)})
    assert json_depth(text.encode()) == MAX_JSON_DEPTH
    assert strict_json_loads(text, "x")["s"] == '\\"[{' * 100
