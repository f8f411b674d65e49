"""The loader builds nothing from unverified bytes and nothing a config cannot back with tensors (issue 11).

Probes that failed before the fix: a tampered config.json was built into a skeleton while hashing ran
(20000 layers: 21 s and 1.2 GB before the integrity error; 1e6 layers hung); a resealed config that
disagrees with the tensors hung or ended in an internal error; a FIFO or link in place of config.json hung
or was followed; a symlinked artifact path failed with NotADirectoryError; ``verify=False`` followed links.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import squeeze.runtime.config_shapes as config_shapes
import squeeze.runtime.loader as loader
from blocking import within
from squeeze import api
from squeeze.cli.app import app
from squeeze.errors import FormatError, IntegrityError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.verify import seal_artifact

runner = CliRunner()
SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, compress_tiny) -> Path:
    out = tmp_path_factory.mktemp("hardening") / "a"  # the tiny Llama: 2 layers, vocab 320, hidden 64, mlp 144
    return compress_tiny(out, "w4-s045", overrides={"weights.sensitivity": "uniform"})


@pytest.fixture
def art(built: Path, tmp_path: Path) -> Path:
    target = tmp_path / "a"
    shutil.copytree(built, target)
    return target


def edit_config(artifact: Path, reseal: bool, **changes) -> None:
    config = json.loads((artifact / "config.json").read_text())
    config.update(changes)
    (artifact / "config.json").write_text(json.dumps(config))
    if reseal:  # a config changed and signed again: verification passes, the tensors disagree
        (artifact / MANIFEST_NAME).unlink()
        seal_artifact(artifact)


@pytest.fixture
def no_skeleton(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        pytest.fail("a model skeleton was built from a config that cannot be loaded")

    monkeypatch.setattr(loader, "build_skeleton", refuse)


# ------------------------------------------------------------------------------------------------------
# Nothing is built before verification succeeded


def test_a_tampered_config_is_never_built(art: Path, no_skeleton: None) -> None:
    edit_config(art, reseal=False, num_hidden_layers=20000)  # before: built (21 s, 1.2 GB), then refused
    with pytest.raises(IntegrityError, match="config.json"):
        api.load(art)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_hidden_layers": 1_000_000}, "num_hidden_layers is 1000000, but the tensors hold 2"),  # before: hung
        ({"num_hidden_layers": 7}, "num_hidden_layers is 7, but the tensors hold 2"),
        ({"vocab_size": 10**12}, "vocab_size is 1000000000000, but model.embed_tokens.weight has 320 rows"),
        ({"vocab_size": 1e12}, "vocab_size must be a non-negative integer"),
        ({"hidden_size": 128}, "hidden_size is 128, but model.embed_tokens.weight has 64 columns"),
        (
            {"intermediate_size": 4096},
            "intermediate_size is 4096, but model.layers.0.mlp.down_proj has in_features 144",
        ),
    ],
)
def test_a_resealed_config_that_disagrees_with_the_tensors_is_a_format_error(
    art: Path, no_skeleton: None, changes: dict, message: str
) -> None:
    edit_config(art, reseal=True, **changes)
    with pytest.raises(FormatError, match=message):
        within(60, lambda: api.load(art))


def test_the_cli_reports_a_resealed_config_in_one_line(art: Path) -> None:
    edit_config(art, reseal=True, vocab_size=10**12)  # before: internal error (RuntimeError, size mismatch)
    result = runner.invoke(app, ["run", "Once", "-m", str(art), "--max-new-tokens", "2"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("Error: config.json: vocab_size is 1000000000000")
    assert "internal error" not in result.stderr


def test_config_shapes_are_checked_against_tensors_and_quantized_modules() -> None:
    shapes = {
        "model.embed_tokens.weight": (512, 64),
        "model.layers.0.norm.weight": (64,),
        "model.layers.1.norm.weight": (64,),
    }
    modules = {"model.layers.1.mlp.down_proj": {"in_features": 172, "out_features": 64}}
    good = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 172}
    config_shapes.check_config_shapes(good, shapes, modules)
    for bad, message in (
        ({"num_hidden_layers": 3}, "hold 2 of those layers"),
        ({"num_hidden_layers": True}, "non-negative integer"),
        ({"intermediate_size": 100}, "in_features 172"),
    ):
        with pytest.raises(FormatError, match=message):
            config_shapes.check_config_shapes({**good, **bad}, shapes, modules)
    # names without a layer index (another architecture): the layer count is still bounded by the tensors
    with pytest.raises(FormatError, match="more than the artifact's 1 tensors could fill"):
        config_shapes.check_config_shapes({"num_hidden_layers": 10**6}, {"w": (4,)}, {})


# ------------------------------------------------------------------------------------------------------
# Small files before verification: no FIFO blocks, no link is followed


def test_a_fifo_config_does_not_hang_the_load(art: Path) -> None:
    fifo = art / "config.json"
    fifo.unlink()
    os.mkfifo(fifo)  # before: the memory estimate's plain read blocked run / eval / calibrate-kv forever
    with pytest.raises(IntegrityError, match="config.json: not a regular file"):
        within(60, lambda: api.load(art), unblock=fifo)


def test_a_config_linked_outside_is_never_opened(art: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside-fifo"
    os.mkfifo(outside)  # opening it would block: the test sees any attempt to follow the link
    (art / "config.json").unlink()
    os.symlink(outside, art / "config.json")
    with pytest.raises(IntegrityError, match="config.json: symbolic link"):
        within(60, lambda: api.load(art), unblock=outside)


def test_unverified_load_follows_no_link_and_blocks_on_no_fifo(art: Path, tmp_path: Path) -> None:
    moved = tmp_path / SHARD
    (art / SHARD).rename(moved)
    os.symlink(moved, art / SHARD)  # before: verify=False read the link's target
    with pytest.raises(FormatError, match="symbolic link"):
        api.load(art, verify=False)
    (art / SHARD).unlink()
    os.mkfifo(art / SHARD)
    with pytest.raises(FormatError, match="not a regular file"):
        within(60, lambda: api.load(art, verify=False), unblock=art / SHARD)


def test_unverified_load_still_loads_an_intact_artifact(art: Path) -> None:
    loaded = api.load(art, verify=False)
    assert loaded.report is None
    verified = api.load(art).model.state_dict()
    assert all(loaded.model.state_dict()[k].equal(v) for k, v in verified.items())


def test_a_deeply_nested_manifest_is_a_format_error_not_a_recursion_error(art: Path) -> None:
    text = (art / MANIFEST_NAME).read_text().rstrip().rstrip("}")
    (art / MANIFEST_NAME).write_text(text + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(FormatError, match="100001 levels deep"):
        api.load(art)  # before: internal error, RecursionError in the memory estimate


# ------------------------------------------------------------------------------------------------------
# A symlinked artifact path (current -> v3)


def test_a_symlinked_artifact_path_loads(art: Path) -> None:
    current = art.parent / "current"
    os.symlink(art.name, current)
    loaded = api.load(current)  # before: NotADirectoryError
    assert loaded.report.ok and loaded.report.artifact_dir == str(art.resolve())
    assert loaded.tokenizer("Once")["input_ids"]
    assert loader.is_artifact(current)
    result = runner.invoke(app, ["run", "Once", "-m", str(current), "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output


def test_from_pretrained_checks_the_config_before_building_the_model(art: Path) -> None:
    from transformers import AutoModelForCausalLM

    edit_config(art, reseal=True, num_hidden_layers=7)  # before: the extra layers were added, random, silently
    with pytest.raises(FormatError, match="num_hidden_layers is 7, but the tensors hold 2"):
        AutoModelForCausalLM.from_pretrained(str(art))


def test_from_pretrained_does_not_follow_a_shard_link_to_another_directory(art: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    other = tmp_path / "other"
    shutil.copytree(art, other)
    (art / SHARD).unlink()
    os.symlink(other / SHARD, art / SHARD)  # before: the link's directory (other/) was verified instead
    with pytest.raises(IntegrityError, match=f"{SHARD}: symbolic link"):
        AutoModelForCausalLM.from_pretrained(str(art))


def test_per_layer_size_lists_are_left_to_the_shapes() -> None:
    # a few architectures give sizes per layer: a list is not a malformed dimension
    shapes = {"model.layers.0.mlp.down_proj.weight": (64, 172), "model.layers.0.norm.weight": (64,)}
    config_shapes.check_config_shapes({"num_hidden_layers": 1, "intermediate_size": [172]}, shapes, {})


def test_eval_of_a_path_longer_than_the_os_allows_is_one_short_error_line(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    for _ in range(30):  # a 6 KB path, shallow enough for pytest's recursive cleanup
        os.mkdir("d" * 200, dir_fd=fd)
        inner = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time " * 50)
    path = str(tmp_path) + ("/" + "d" * 200) * 30
    result = runner.invoke(app, ["eval", path, "-t", str(text), "--seq-len", "8", "--max-windows", "1"])
    assert result.exit_code == 2, result.output  # before: internal error naming the whole 6 KB path
    assert "longer than the operating system allows" in result.stderr
    assert max(len(line) for line in result.stderr.splitlines()) < 400
