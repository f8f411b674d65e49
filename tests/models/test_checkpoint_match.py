"""A checkpoint that does not match its config.json is refused before any work (issue 50 items 1 and 9).

The tiny Llama (2 layers) is copied and edited: a layer deleted from its safetensors, a third layer added,
``num_hidden_layers`` removed from config.json (transformers' default is 32), hostile sizes. Every way
squeeze opens a source refuses the first three with one ModelError naming the weights: preflight's meta
build (from the headers), the bounded run's LazyModel, and load_model (transformers' loading report); a
tied LM head absent from the checkpoint, a tied head stored twice and an old ``rotary_emb.inv_freq`` buffer
are not mismatches.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from squeeze import api
from squeeze.compression.plan import plan_compress
from squeeze.compression.preflight import meta_model
from squeeze.config import load_recipe
from squeeze.errors import ModelError, SqueezeError
from squeeze.models import load_model, resolve_model
from squeeze.models.lazy import LazyModel

SHARD = "model.safetensors"


def _edit(
    source: Path,
    target: Path,
    tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    config: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """A copy of the model directory ``source`` with its tensors and/or config.json edited."""
    shutil.copytree(source, target)
    if tensors is not None:
        save_file(tensors(load_file(target / SHARD)), target / SHARD, metadata={"format": "pt"})
    if config is not None:
        data = json.loads((target / "config.json").read_text())
        config(data)
        (target / "config.json").write_text(json.dumps(data))
    return target


def _drop_layer_1(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if not k.startswith("model.layers.1.")}


def _add_layer_2(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    extra = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if "layers.1." in k}
    return {**tensors, **extra}


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mismatch")
    return {
        "missing": _edit(tiny_llama_dir, root / "missing", tensors=_drop_layer_1),
        "extra": _edit(tiny_llama_dir, root / "extra", tensors=_add_layer_2),
        "no-layers": _edit(tiny_llama_dir, root / "no-layers", config=lambda c: c.pop("num_hidden_layers")),
    }


OPENERS = {
    "meta_model": lambda d: meta_model(resolve_model(str(d))),
    "LazyModel": lambda d: LazyModel(resolve_model(str(d))),
    "load_model": lambda d: load_model(resolve_model(str(d))),
}


@pytest.mark.parametrize("opener", sorted(OPENERS))
@pytest.mark.parametrize(
    ("variant", "named", "kind"),
    [
        ("missing", "model.layers.1.input_layernorm.weight", "9 weight(s) missing from the checkpoint"),
        ("extra", "model.layers.2.input_layernorm.weight", "9 weight(s) in the checkpoint but not in the architecture"),
        ("no-layers", "model.layers.2.input_layernorm.weight", "270 weight(s) missing from the checkpoint"),
    ],
)
def test_mismatched_checkpoint_is_refused(
    variants: dict[str, Path], opener: str, variant: str, named: str, kind: str
) -> None:
    with pytest.raises(ModelError, match="does not match its config.json") as caught:
        OPENERS[opener](variants[variant])
    assert kind in caught.value.message and named in caught.value.message
    assert "(and 5 more)" in caught.value.message or "(and 266 more)" in caught.value.message
    assert caught.value.hint
    if variant == "no-layers":
        assert "num_hidden_layers (default 32)" in caught.value.hint


def _tied_dir(root: Path, tiny_llama_dir: Path, *, keep_head: bool, inv_freq: bool = False) -> Path:
    """The tiny Llama with tie_word_embeddings (the head's tensor saved or not; an old rotary buffer added)."""

    def tensors(found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        found = dict(found)
        if keep_head:
            found["lm_head.weight"] = found["model.embed_tokens.weight"].clone()
        else:
            found.pop("lm_head.weight")
        if inv_freq:
            found["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        return found

    name = f"tied-{keep_head}-{inv_freq}"
    return _edit(tiny_llama_dir, root / name, tensors=tensors, config=lambda c: c.update(tie_word_embeddings=True))


@pytest.mark.parametrize("opener", sorted(OPENERS))
@pytest.mark.parametrize(("keep_head", "inv_freq"), [(False, False), (True, False), (False, True)])
def test_tied_head_and_buffers_are_not_mismatches(
    tmp_path: Path, tiny_llama_dir: Path, opener: str, keep_head: bool, inv_freq: bool
) -> None:
    OPENERS[opener](_tied_dir(tmp_path, tiny_llama_dir, keep_head=keep_head, inv_freq=inv_freq))


@pytest.mark.parametrize("opener", sorted(OPENERS))
def test_safetensors_beside_the_checkpoint_are_not_its_weights(
    tmp_path: Path, tiny_llama_dir: Path, opener: str
) -> None:
    """Mistral's repos ship consolidated.safetensors (other names) beside the HF checkpoint: transformers reads
    model.safetensors (or the index's files) only, and so does the check."""
    directory = Path(shutil.copytree(tiny_llama_dir, tmp_path / "with-consolidated"))
    original = load_file(directory / SHARD)
    save_file({f"layers.{k}": v for k, v in original.items()}, directory / "consolidated.safetensors")
    OPENERS[opener](directory)


def test_the_matched_model_opens(tiny_llama_dir: Path) -> None:
    for open_model in OPENERS.values():
        open_model(tiny_llama_dir)


@pytest.mark.parametrize("max_memory", [None, 8 * 10**9])
def test_compress_refuses_before_any_work(
    tmp_path: Path, variants: dict[str, Path], tiny_text_file: Path, max_memory: int | None
) -> None:
    output = tmp_path / "out"
    with pytest.raises(ModelError, match="model.layers.1.input_layernorm.weight"):
        api.compress(
            str(variants["missing"]),
            output,
            recipe="w4",
            calibration=str(tiny_text_file),
            calibration_overrides={"num_samples": 2, "seq_len": 16},
            max_memory=max_memory,
        )
    assert not output.exists()  # refused in preflight: no output, no work area


def test_plan_refuses_a_mismatch_and_names_defaulted_keys(tmp_path: Path, variants: dict[str, Path]) -> None:
    recipe = load_recipe("w4")
    with pytest.raises(ModelError, match="9 weight\\(s\\) in the checkpoint but not in the architecture"):
        plan_compress(str(variants["extra"]), recipe, num_samples=None, seq_len=None)
    # a config alone (a plan made away from the weights): planned, with the defaulted sizes named
    alone = tmp_path / "config-only"
    alone.mkdir()
    shutil.copy(variants["no-layers"] / "config.json", alone / "config.json")
    plan = plan_compress(str(alone), recipe, num_samples=None, seq_len=None)
    assert any("num_hidden_layers (default 32)" in note for note in plan.notes), plan.notes


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_hidden_layers": 1e12}, "num_hidden_layers = 1000000000000.0: expected a non-negative integer"),
        ({"num_hidden_layers": 10**5}, "num_hidden_layers = 100,000, more than the number of tensors"),
        ({"num_hidden_layers": 10**4}, "num_hidden_layers = 10,000, more than the number of tensors"),
        ({"num_hidden_layers": -1}, "expected a non-negative integer"),
        ({"hidden_size": 2**40}, "hidden_size = 1,099,511,627,776, more than the largest dimension"),
        ({"max_position_embeddings": 10**12}, "more than the longest context squeeze builds"),
    ],
)
@pytest.mark.parametrize("opener", sorted(OPENERS))
def test_hostile_config_sizes_are_refused_at_once(
    tmp_path: Path, tiny_llama_dir: Path, changes: dict[str, Any], message: str, opener: str
) -> None:
    directory = _edit(tiny_llama_dir, tmp_path / "hostile", config=lambda c: c.update(changes))
    started = time.monotonic()
    with pytest.raises(ModelError, match=message.replace("(", "\\(").replace(")", "\\)")) as caught:
        OPENERS[opener](directory)
    assert caught.value.hint
    assert time.monotonic() - started < 5.0  # refused from config.json and the headers, nothing built


def test_null_sizes_are_left_to_the_config_class(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """``head_dim: null`` (derived from hidden_size / heads) is no size to bound."""
    directory = _edit(tiny_llama_dir, tmp_path / "null-head-dim", config=lambda c: c.update(head_dim=None))
    meta_model(resolve_model(str(directory)))


def test_config_alone_is_bounded_absolutely(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Without weights (--plan away from the checkpoint) the absolute bounds apply."""
    alone = tmp_path / "config-only"
    alone.mkdir()
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (alone / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**5}))
    with pytest.raises(SqueezeError, match="more than the most layers squeeze builds \\(2,048\\)"):
        plan_compress(str(alone), load_recipe("w4"), num_samples=None, seq_len=None)
    (alone / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 40}))
    plan = plan_compress(str(alone), load_recipe("w4"), num_samples=None, seq_len=None)
    assert plan.parameters > 0 and not plan.notes
