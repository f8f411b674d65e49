"""The artifact format: atomic sharded safetensors, the manifest, and verification.

This layer imports nothing above it (no models, quant or runtime).
"""

from squeeze.format.atomic import atomic_write_bytes, atomic_write_text, atomic_writer
from squeeze.format.manifest import (
    DEFAULT_CHUNK_BYTES,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    FileEntry,
    Manifest,
    Provenance,
    build_manifest,
    parse_manifest,
    root_digest,
    root_digest_v2,
    write_manifest,
)
from squeeze.format.shards import INDEX_NAME, ShardIndex, ShardWriter, shard_name, write_shards
from squeeze.format.verify import FileResult, VerifyReport, read_manifest, seal_artifact, verify_artifact

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "INDEX_NAME",
    "FileEntry",
    "Manifest",
    "Provenance",
    "ShardIndex",
    "ShardWriter",
    "FileResult",
    "VerifyReport",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_writer",
    "build_manifest",
    "parse_manifest",
    "root_digest",
    "root_digest_v2",
    "write_manifest",
    "shard_name",
    "write_shards",
    "read_manifest",
    "seal_artifact",
    "verify_artifact",
]
