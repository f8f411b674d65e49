"""transformers integration: ``AutoModelForCausalLM.from_pretrained(artifact)`` after ``import squeeze``.

The model it gives must compute exactly what ``squeeze.load``'s model computes (same tensors, same
SqueezeLinear path: the native CPU kernels for LUT formats), generate the same greedy text, refuse a tampered
artifact before loading (IntegrityError) and reject malformed quantized tensors (FormatError). Loading a
squeeze artifact *without* ``import squeeze`` cannot be tested in this process (the registration is global).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import squeeze
from squeeze import api
from squeeze.errors import FormatError, IntegrityError
from squeeze.format import seal_artifact
from squeeze.runtime.linear import SqueezeLinear

# squeeze.runtime.hf is imported inside the tests: it imports transformers' quantizer registry, which
# imports triton, and test_kernels.py must set TRITON_INTERPRET before triton is first imported

PROMPT = "Once upon a time"
IDS = torch.tensor([[1, 20, 30, 40, 50, 60, 70]])

# recipe, overrides: the three kinds of quantized tensors (LUT + sparse, 8-bit LUT + sparse, RTN groups)
RECIPES = {
    "w4-s045": ("w4-s045", {}),
    "w3-s045-lut8": ("w3-s045-lut8", {}),
    "rtn-w4-g32": ("rtn-w4", {"weights.group_size": 32}),  # down_proj's 144 columns: the last group is partial
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory, compress_tiny) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for key, (recipe, overrides) in RECIPES.items():
        overrides = {**overrides, "output.max_shard_size": "40KB"}  # several shards and an index
        if not recipe.startswith("rtn"):
            overrides["weights.sensitivity"] = "uniform"  # no calibration needed
        out[key] = compress_tiny(root / key, recipe, overrides=overrides)
    # the fixture really covers what it claims: sparse parts, 8-bit LUT grids, RTN groups, several shards
    for key, role in (
        ("w4-s045", "weight_sparse_vals"),
        ("w3-s045-lut8", "weight_lut_scale"),
        ("rtn-w4-g32", "weight_scales"),
    ):
        index = json.loads((out[key] / "model.safetensors.index.json").read_text())["weight_map"]
        assert any(name.endswith(role) for name in index) and len(set(index.values())) > 1, key
    return out


def from_pretrained(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("kind", sorted(RECIPES))
def test_from_pretrained_computes_what_squeeze_load_computes(artifacts: dict[str, Path], kind: str) -> None:
    from squeeze.runtime.hf import SqueezeHfQuantizer, SqueezeQuantConfig

    path = artifacts[kind]
    model = from_pretrained(path)
    reference = api.load(path).model
    squeezed = {n for n, m in model.named_modules() if isinstance(m, SqueezeLinear)}
    assert squeezed == {n for n, m in reference.named_modules() if isinstance(m, SqueezeLinear)}
    assert len(squeezed) == 2 * 7  # the tiny Llama's 2 layers
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours)
    assert {m.weight_path for m in model.modules() if isinstance(m, SqueezeLinear)} == {
        m.weight_path for m in reference.modules() if isinstance(m, SqueezeLinear)
    }
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)
    config = json.loads((path / "config.json").read_text())
    assert isinstance(model.config.quantization_config, SqueezeQuantConfig)
    assert model.config.quantization_config.to_dict() == config["quantization_config"]
    assert isinstance(model.hf_quantizer, SqueezeHfQuantizer)


def test_generate_equals_squeeze_greedy_output(artifacts: dict[str, Path]) -> None:
    path = artifacts["w4-s045"]
    model = from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    text = tokenizer.decode(out[0], skip_special_tokens=True)  # squeeze's text is read after the prompt
    ours = api.generate(api.load(path), PROMPT, max_new_tokens=16)
    assert ours.new_tokens == [16]  # no early end of sequence: both ran 16 steps
    assert text == PROMPT + ours.text and ours.text.strip()


def test_tampered_artifact_is_refused_before_loading(artifacts: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "tampered"
    shutil.copytree(artifacts["w4-s045"], target)
    shard = sorted(target.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one bit of one weight
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=shard.name):
        from_pretrained(target)


def test_extra_file_and_missing_manifest_are_refused(artifacts: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "extra"
    shutil.copytree(artifacts["w4-s045"], target)
    (target / "notes.txt").write_text("not in the manifest")
    with pytest.raises(IntegrityError, match="notes.txt"):
        from_pretrained(target)
    (target / "notes.txt").unlink()
    (target / "squeeze.manifest.json").unlink()
    with pytest.raises(FormatError, match="no manifest"):
        from_pretrained(target)


def test_malformed_quantized_tensor_in_a_sealed_artifact_is_a_format_error(
    artifacts: dict[str, Path], tmp_path: Path
) -> None:
    target = tmp_path / "malformed"
    shutil.copytree(artifacts["w4-s045"], target)
    name = "model.layers.0.mlp.up_proj.weight_lut"
    index = json.loads((target / "model.safetensors.index.json").read_text())
    shard = target / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name][:, :8].contiguous()  # 8 centroids for 4-bit codes: 16 expected
    save_file(tensors, shard, metadata={"format": "pt"})
    seal_artifact(target)  # a consistent manifest: verification passes, the format check must not
    with pytest.raises(FormatError, match=name):
        from_pretrained(target)


def test_save_pretrained_is_refused(artifacts: dict[str, Path], tmp_path: Path) -> None:
    model = from_pretrained(artifacts["rtn-w4-g32"])
    with pytest.raises(ValueError, match="quantized with squeeze and is not serializable"):
        model.save_pretrained(tmp_path / "copy")  # artifacts are written and sealed by `squeeze compress` only
    assert not list(tmp_path.rglob("*.safetensors"))


def test_import_squeeze_registers_nothing() -> None:
    """Issue 49 item 2: `import squeeze` has no side effect on transformers; squeeze.register() is explicit."""
    code = (
        "import sys; import squeeze\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as Q\n"
        "assert 'squeeze' not in Q, 'import squeeze registered with transformers'\n"
        "squeeze.register(lm_eval=False)  # the registry is imported: registers at once\n"
        "assert 'squeeze' in Q\n"
        "print('ok')\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_register_is_lazy_without_importing_transformers() -> None:
    code = (
        "import sys; import squeeze; squeeze.register(lm_eval=False)\n"
        "assert 'transformers' not in sys.modules, 'squeeze.register() imported transformers'\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as Q, AUTO_QUANTIZATION_CONFIG_MAPPING as C\n"
        "from squeeze.runtime.hf import SqueezeHfQuantizer, SqueezeQuantConfig\n"
        "assert Q['squeeze'] is SqueezeHfQuantizer and C['squeeze'] is SqueezeQuantConfig\n"
        "print('ok')\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_registration_is_idempotent_in_process() -> None:
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    from squeeze.runtime import hf_hook
    from squeeze.runtime.hf import SqueezeHfQuantizer

    hf_hook.install()  # the registry is imported here: registers (again) at once, no hook left behind
    squeeze.runtime.hf.register()
    assert AUTO_QUANTIZER_MAPPING["squeeze"] is SqueezeHfQuantizer
    assert hf_hook._FINDER not in sys.meta_path


def test_unsupported_bits_in_a_sealed_config_is_a_format_error_before_loading(
    artifacts: dict[str, Path], tmp_path: Path
) -> None:
    target = tmp_path / "bits"
    shutil.copytree(artifacts["w4-s045"], target)
    config = json.loads((target / "config.json").read_text())
    name = "model.layers.0.mlp.up_proj"
    config["quantization_config"]["modules"][name]["bits"] = 5
    (target / "config.json").write_text(json.dumps(config))
    seal_artifact(target)
    with pytest.raises(FormatError, match=r"modules\['model.layers.0.mlp.up_proj'\].bits must be one of"):
        from_pretrained(target)
