"""Write a small example artifact (random tensors, sharded, sealed) to the directory given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from squeeze.format import Provenance, seal_artifact, write_shards


def main(out: str) -> None:
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=False)
    generator = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.mlp.weight": torch.randn(256, 256, generator=generator) for i in range(8)}
    write_shards(directory, tensors, max_shard_bytes=1_000_000)
    (directory / "config.json").write_text(json.dumps({"model_type": "example"}, indent=2) + "\n")
    manifest = seal_artifact(directory, Provenance(source_model="example"))
    print(f"wrote {directory} ({len(manifest.files)} files, root digest {manifest.root_digest})")


if __name__ == "__main__":
    main(sys.argv[1])
