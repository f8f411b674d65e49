"""squeeze never runs a model's own code: auto_map models load with built-in classes or are refused, no prompt.

transformers asks "Do you wish to run the custom code? [y/N]" on stdout when a config's auto_map points at
Python files and ``trust_remote_code`` is not given; answering y imports those files. Every squeeze call
passes ``trust_remote_code=False``, and a model that needs its own code is refused in one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from squeeze.cli.app import app
from squeeze.errors import ModelError
from squeeze.models import ModelSource, load_model, resolve_model

runner = CliRunner()

AUTO_MAP = {
    "AutoConfig": "configuration_x.XConfig",
    "AutoModelForCausalLM": "modeling_x.XForCausalLM",
}


def _model_with_code(tiny_llama_dir: Path, tmp_path: Path, model_type: str) -> tuple[Path, Path]:
    """A copy of the tiny Llama whose config has auto_map and whose .py files leave a marker when imported."""
    model = tmp_path / f"model-{model_type}"
    shutil.copytree(tiny_llama_dir, model)
    for f in model.iterdir():
        f.chmod(0o644)
    marker = tmp_path / "MARKER"
    for name in ("configuration_x.py", "modeling_x.py"):
        (model / name).write_text(
            f"from pathlib import Path\nPath({str(marker)!r}).write_text({name!r})\n"
            f"raise RuntimeError('squeeze imported {name}')\n"
        )
    config = json.loads((model / "config.json").read_text())
    config.update(model_type=model_type, auto_map=AUTO_MAP)
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model, marker


@pytest.fixture
def remote_model(tiny_llama_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """An architecture that exists only in the directory's own code (a model_type transformers lacks)."""
    return _model_with_code(tiny_llama_dir, tmp_path, "x-custom")


@pytest.fixture
def known_model(tiny_llama_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A llama checkpoint whose config also carries an auto_map (common on the Hub)."""
    return _model_with_code(tiny_llama_dir, tmp_path, "llama")


def _assert_refusal(text: str, model: Path) -> None:
    assert f"model {model} needs its own Python code" in text
    assert "trust_remote_code=True" in text and "squeeze never runs a model's own code" in text
    assert "configuration_x.py" in text and "'x-custom'" in text


def test_resolve_refuses_a_model_that_needs_its_own_code(remote_model) -> None:
    model, marker = remote_model
    with pytest.raises(ModelError) as info:
        resolve_model(str(model))
    _assert_refusal(info.value.message, model)
    assert "\n" not in info.value.message and info.value.hint
    assert not marker.exists()


def test_load_of_a_hand_built_source_is_refused_too(remote_model) -> None:
    # a ModelSource built without resolve_model: transformers' own refusal becomes the same one-line error
    model, marker = remote_model
    with pytest.raises(ModelError) as info:
        load_model(ModelSource(kind="hf_dir", path=model, model_id=str(model)))
    assert "needs its own Python code" in info.value.message and "trust_remote_code=True" in info.value.message
    assert "\n" not in info.value.message
    assert not marker.exists()


@pytest.mark.parametrize("answer", ["", "y\n"])
@pytest.mark.parametrize("command", ["compress", "eval"])
def test_cli_refuses_without_a_prompt(remote_model, tmp_path, tiny_text_file, command, answer) -> None:
    model, marker = remote_model
    args = (
        ["compress", str(model), "-o", str(tmp_path / "out"), "--recipe", "rtn-w4", "--json"]
        if command == "compress"
        else ["eval", str(model), "--text", str(tiny_text_file), "--seq-len", "64", "--max-windows", "1", "--json"]
    )
    result = runner.invoke(app, args, input=answer)  # "y" is what would have run the code at a prompt
    assert result.exit_code == 2, result.output
    assert result.stdout == ""  # no [y/N] prompt, nothing that breaks --json
    assert result.stderr.startswith("Error: ") and result.stderr.count("Error:") == 1
    _assert_refusal(result.stderr.replace("\n", " "), model)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_auto_map_with_a_known_model_type_loads_the_builtin_class(known_model, tmp_path, tiny_text_file) -> None:
    model, marker = known_model
    out = tmp_path / "out"
    compressed = runner.invoke(app, ["compress", str(model), "-o", str(out), "--recipe", "rtn-w4", "--json"], input="")
    assert compressed.exit_code == 0, compressed.output
    assert json.loads(compressed.stdout)["quantized_modules"] > 0
    for target in (model, out):  # the source model and the artifact (its config keeps the auto_map)
        evaluated = runner.invoke(
            app,
            ["eval", str(target), "--text", str(tiny_text_file), "--seq-len", "64", "--max-windows", "1", "--json"],
            input="",
        )
        assert evaluated.exit_code == 0, evaluated.output
        assert json.loads(evaluated.stdout)["windows"] == 1
    assert not marker.exists()
