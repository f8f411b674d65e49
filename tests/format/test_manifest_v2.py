"""Manifest format version 2 (chunk digests, root digest over the whole manifest) and reading version 1."""

import hashlib
import json

import pytest

import squeeze.format.manifest as manifest_module
from squeeze.errors import FormatError
from squeeze.format.manifest import (
    DEFAULT_CHUNK_BYTES,
    FileEntry,
    Provenance,
    build_manifest,
    parse_manifest,
    root_digest,
    root_digest_v2,
)

CONFIG = b'{"model_type": "llama"}\n'
WEIGHTS = bytes(i % 251 for i in range(10240))  # 3 chunks of 4096 (the last 2048), each different
CHUNKS = [hashlib.sha256(WEIGHTS[i : i + 4096]).hexdigest() for i in range(0, len(WEIGHTS), 4096)]

GOLDEN_V2 = """{
  "format": "squeeze.manifest",
  "format_version": 2,
  "tool": {
    "name": "squeeze",
    "version": "1.2.3"
  },
  "created": "2026-01-02T03:04:05Z",
  "chunk_bytes": 4096,
  "files": [
    {
      "path": "config.json",
      "size": 24,
      "sha256": "4bebf7dba2e37ce6166493cdcfb8f61810db88844139be2b932de7e0275babd0"
    },
    {
      "path": "weights/w.bin",
      "size": 10240,
      "sha256": "957161dce6c65864066e98f463feee573d8242998094e2f6f186dbf9dbaa968c",
      "chunks": [
        "d67c656e01756650d77717b0839985a056ec28ffe174601d690fc407a2ceffca",
        "416317ed11e1666ed2a36373377df576bd327eb944640bf119b242d6f941bb5a",
        "fc21ce1040ad321d19a1af7a8bd82cbe9042f5eebbb324a4a12b21eba14ff3a4"
      ]
    }
  ],
  "root_digest": "7822e144c86d4542123d2b6b2cf15d1549553a821cfd275cafdebf3ef9eb859f",
  "provenance": {
    "source_model": "tiny",
    "source_digest": null,
    "recipe_hash": "rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr",
    "calibration_hash": null,
    "extra": {
      "note": "v2 golden"
    }
  }
}
"""

# The canonical form the root digest hashes, written out by hand (keys sorted, no spaces, no root_digest).
CANONICAL_V2 = (
    '{"chunk_bytes":4096,"created":"2026-01-02T03:04:05Z","files":[{"path":"config.json","sha256":'
    '"4bebf7dba2e37ce6166493cdcfb8f61810db88844139be2b932de7e0275babd0","size":24},{"chunks":['
    '"d67c656e01756650d77717b0839985a056ec28ffe174601d690fc407a2ceffca",'
    '"416317ed11e1666ed2a36373377df576bd327eb944640bf119b242d6f941bb5a",'
    '"fc21ce1040ad321d19a1af7a8bd82cbe9042f5eebbb324a4a12b21eba14ff3a4"],"path":"weights/w.bin","sha256":'
    '"957161dce6c65864066e98f463feee573d8242998094e2f6f186dbf9dbaa968c","size":10240}],'
    '"format":"squeeze.manifest","format_version":2,"provenance":{"calibration_hash":null,"extra":'
    '{"note":"v2 golden"},"recipe_hash":"rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr",'
    '"source_digest":null,"source_model":"tiny"},"tool":{"name":"squeeze","version":"1.2.3"}}'
)

# Written by squeeze's version-1 rules (git 063449f's build_manifest, then created / tool version fixed):
# the root digest covers the entries only.
GOLDEN_V1 = """{
  "format": "squeeze.manifest",
  "format_version": 1,
  "tool": {
    "name": "squeeze",
    "version": "0.9.0"
  },
  "created": "2025-06-01T12:00:00Z",
  "files": [
    {
      "path": "config.json",
      "size": 24,
      "sha256": "4bebf7dba2e37ce6166493cdcfb8f61810db88844139be2b932de7e0275babd0"
    },
    {
      "path": "weights/w.bin",
      "size": 10240,
      "sha256": "e96760a87768717bcebcfd25ddc7d46b4dbc95a4b0014def080c08539f7d90d0"
    }
  ],
  "root_digest": "d9b8dbab2d0c5a5c9c836256b1283fc6462d3f3d1d8439359688cb546c1a7c88",
  "provenance": {
    "source_model": "tiny",
    "source_digest": null,
    "recipe_hash": null,
    "calibration_hash": null,
    "extra": {
      "note": "v1 fixture"
    }
  }
}
"""
V1_WEIGHTS = bytes(range(256)) * 40


def golden_entries() -> list[FileEntry]:
    return [
        FileEntry("weights/w.bin", len(WEIGHTS), hashlib.sha256(WEIGHTS).hexdigest(), tuple(CHUNKS)),
        FileEntry("config.json", len(CONFIG), hashlib.sha256(CONFIG).hexdigest()),
    ]


def golden_manifest(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(manifest_module, "__version__", "1.2.3")
    provenance = Provenance(source_model="tiny", recipe_hash="r" * 64, extra={"note": "v2 golden"})
    return build_manifest(golden_entries(), provenance, chunk_bytes=4096, created="2026-01-02T03:04:05Z")


def test_v2_golden_bytes(monkeypatch):
    manifest = golden_manifest(monkeypatch)
    assert manifest.to_json() == GOLDEN_V2
    assert manifest.root_digest == hashlib.sha256(CANONICAL_V2.encode()).hexdigest()
    assert root_digest_v2(json.loads(GOLDEN_V2)) == manifest.root_digest


def test_v2_round_trip(monkeypatch):
    manifest = golden_manifest(monkeypatch)
    again = parse_manifest(GOLDEN_V2)
    assert again == manifest and again.to_json() == GOLDEN_V2
    assert again.chunk_bytes == 4096 and again.files[1].chunks == tuple(CHUNKS)
    assert again.computed_root_digest() == again.root_digest
    assert again.files[1].chunk_range(2, 4096) == (8192, 10240)


def test_build_manifest_defaults_to_64_mib_chunks():
    manifest = build_manifest([FileEntry("a", 5, "a" * 64)])
    assert manifest.format_version == 2 and manifest.chunk_bytes == DEFAULT_CHUNK_BYTES == 2**26
    assert '"chunk_bytes": 67108864' in manifest.to_json()


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["provenance"].update(source_model="other"),
        lambda d: d["provenance"]["extra"].update(note="edited"),
        lambda d: d.update(created="2027-01-01T00:00:00Z"),
        lambda d: d["tool"].update(version="9.9.9"),
        lambda d: d["files"][1]["chunks"].reverse(),
    ],
)
def test_v2_root_digest_covers_everything_but_itself(edit):
    data = json.loads(GOLDEN_V2)
    edit(data)
    edited = parse_manifest(json.dumps(data))  # still well formed ...
    assert edited.computed_root_digest() != edited.root_digest  # ... but no longer matches its root digest


def test_v1_still_parses_with_its_own_root_digest():
    manifest = parse_manifest(GOLDEN_V1)
    assert manifest.format_version == 1 and manifest.chunk_bytes is None
    assert all(not entry.chunks for entry in manifest.files)
    assert manifest.provenance.extra == {"note": "v1 fixture"}
    assert manifest.computed_root_digest() == manifest.root_digest == root_digest(manifest.files)
    assert manifest.to_json() == GOLDEN_V1  # v1 is read and re-written unchanged, never upgraded silently
    assert hashlib.sha256(V1_WEIGHTS).hexdigest() == manifest.files[1].sha256


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(chunk_bytes=4096), r"unknown field\(s\) 'chunk_bytes'"),
        (lambda d: d["files"][1].update(chunks=["a" * 64] * 3), r"unknown field\(s\) 'chunks'"),
    ],
)
def test_v1_refuses_v2_fields(edit, message):
    data = json.loads(GOLDEN_V1)
    edit(data)
    with pytest.raises(FormatError, match=message):
        parse_manifest(json.dumps(data))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["files"][1]["chunks"].pop(), "need 3 chunk digests, found 2"),
        (lambda d: d["files"][1]["chunks"].append("a" * 64), "need 3 chunk digests, found 4"),
        (lambda d: d["files"][1].pop("chunks"), "need 3 chunk digests, found 0"),
        (lambda d: d["files"][1].update(chunks=[]), "must be left out, not empty"),
        (lambda d: d["files"][1].update(chunks="a" * 64), "'chunks' must be list"),
        (lambda d: d["files"][1]["chunks"].__setitem__(1, "A" * 64), r"chunks\[1\] must be 64 lowercase hex"),
        (lambda d: d["files"][1]["chunks"].__setitem__(0, "a" * 63), r"chunks\[0\] must be 64 lowercase hex"),
        (lambda d: d["files"][1]["chunks"].__setitem__(2, 7), r"chunks\[2\] must be 64 lowercase hex"),
        (lambda d: d["files"][0].update(chunks=["a" * 64]), "fits in one chunk of 4096 bytes and must not list"),
        (lambda d: d.update(chunk_bytes=4095), "multiple of 4096 between 4096 and 1073741824, found 4095"),
        (lambda d: d.update(chunk_bytes=0), "multiple of 4096 between 4096 and 1073741824, found 0"),
        (lambda d: d.update(chunk_bytes=6000), "multiple of 4096"),
        (lambda d: d.update(chunk_bytes=2**30 + 4096), "multiple of 4096"),
        (lambda d: d.update(chunk_bytes=True), "'chunk_bytes' must be int"),
        (lambda d: d.update(chunk_bytes="4096"), "'chunk_bytes' must be int"),
        (lambda d: d.pop("chunk_bytes"), "lacks the field 'chunk_bytes'"),
        (lambda d: d["provenance"].update(surprise=1), r"provenance: unknown field\(s\) 'surprise'"),
        (lambda d: d["provenance"].pop("source_digest"), "not in the form squeeze writes"),
        (lambda d: d["provenance"].update(extra={}), "'extra' must be a non-empty object"),
        (lambda d: d["provenance"].update(extra=[1]), "'extra' must be a non-empty object"),
        (lambda d: d["tool"].update(build="x"), "tool must have exactly the fields"),
        (lambda d: d["tool"].update(name="other"), "tool name must be 'squeeze'"),
    ],
)
def test_malformed_v2_is_a_format_error(edit, message):
    data = json.loads(GOLDEN_V2)
    edit(data)
    with pytest.raises(FormatError, match=message):
        parse_manifest(json.dumps(data))


def test_chunk_count_boundaries():
    # a file of exactly chunk_bytes has no chunks; one byte more has two (the last of one byte)
    build_manifest([FileEntry("a", 4096, "a" * 64)], chunk_bytes=4096)
    build_manifest([FileEntry("a", 4097, "a" * 64, ("b" * 64, "c" * 64))], chunk_bytes=4096)
    with pytest.raises(FormatError, match="must not list chunks"):
        build_manifest([FileEntry("a", 4096, "a" * 64, ("b" * 64,))], chunk_bytes=4096)
    with pytest.raises(FormatError, match="need 2 chunk digests, found 0"):
        build_manifest([FileEntry("a", 4097, "a" * 64)], chunk_bytes=4096)
    with pytest.raises(FormatError, match="multiple of 4096"):
        build_manifest([], chunk_bytes=1000)


def test_v1_artifact_still_verifies_and_its_provenance_is_not_covered(tmp_path):
    from squeeze.format.verify import verify_artifact

    (tmp_path / "weights").mkdir()
    (tmp_path / "config.json").write_bytes(CONFIG)
    (tmp_path / "weights" / "w.bin").write_bytes(V1_WEIGHTS)
    (tmp_path / "squeeze.manifest.json").write_text(GOLDEN_V1)
    report = verify_artifact(tmp_path)
    assert report.ok, report.to_dict()
    assert report.manifest is not None and report.manifest.format_version == 1
    # version 1's root digest covers the entries only (the reason for version 2): a provenance edit passes
    (tmp_path / "squeeze.manifest.json").write_text(GOLDEN_V1.replace('"tiny"', '"other"'))
    assert verify_artifact(tmp_path).ok
    (tmp_path / "weights" / "w.bin").write_bytes(V1_WEIGHTS[:-1] + b"\x00")
    (bad,) = verify_artifact(tmp_path).failures
    assert bad.path == "weights/w.bin" and bad.error is not None and bad.error.startswith("SHA-256 mismatch")


def test_source_date_epoch_makes_created_and_the_root_digest_reproducible(monkeypatch):
    from squeeze.errors import ConfigError

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767323045")
    first = build_manifest(golden_entries(), Provenance("m"), chunk_bytes=4096)
    assert first.created == "2026-01-02T03:04:05Z"
    assert build_manifest(golden_entries(), Provenance("m"), chunk_bytes=4096).root_digest == first.root_digest
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(ConfigError, match="SOURCE_DATE_EPOCH must be a whole number of seconds"):
        build_manifest(golden_entries(), chunk_bytes=4096)
