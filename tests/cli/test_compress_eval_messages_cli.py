"""compress / eval / run messages (issue 50 items 8, 9, 12): options that were silently ignored are refused,
every refusal has a Hint: line, sizes print in units that show them, and what ran is said."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import squeeze
from squeeze import errors
from squeeze.cli.app import app
from squeeze.cli.common import cli_errors
from squeeze.cli.compress import _print_summary
from squeeze.compression.job import CompressResult

runner = CliRunner()


def refused(result, contains: str) -> None:
    """Exit 2, one Error: line holding ``contains``, then a Hint: line; never an internal error."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    errors_ = [i for i, line in enumerate(lines) if line.startswith("Error")]
    assert len(errors_) == 1 and contains in lines[errors_[0]], result.stderr
    assert any(line.startswith("Hint:") for line in lines[errors_[0] + 1 :]), result.stderr
    assert "internal error" not in result.stderr.lower()


def test_ranks_without_plan_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    refused(runner.invoke(app, ["compress", str(tiny_llama_dir), "-o", str(tmp_path / "o"), "--ranks", "2"]), "--plan")
    assert not (tmp_path / "o").exists()


def test_plan_ranks_are_bounded_and_parameters_get_a_unit(tiny_llama_dir: Path) -> None:
    refused(
        runner.invoke(app, ["compress", str(tiny_llama_dir), "--plan", "--ranks", "1000000", "--recipe", "rtn-w4"]),
        "--ranks must be from 1 to 4096",
    )
    result = runner.invoke(app, ["compress", str(tiny_llama_dir), "--plan", "--ranks", "3", "--recipe", "rtn-w4"])
    assert result.exit_code == 0, result.output
    assert " K parameters" in result.stdout and "0.000 B" not in result.stdout, result.stdout
    assert re.findall(r"^rank (\d+):", result.stdout, re.M) == ["0", "1", "2"], result.stdout


@pytest.mark.parametrize(
    ("args", "contains"),
    [
        (["--seed", str(10**23)], "seed (--seed) must be an integer from 0 to 4294967295"),
        (["--seed", "-1"], "seed (--seed) must be an integer from 0 to 4294967295"),
        (["--max-memory", "0"], "a size must be positive"),
        (["--recipe", "."], "cannot read the recipe"),
    ],
)
def test_compress_refusals_have_hints(tiny_llama_dir: Path, tmp_path: Path, args: list[str], contains: str) -> None:
    refused(runner.invoke(app, ["compress", str(tiny_llama_dir), "-o", str(tmp_path / "o"), *args]), contains)
    assert not (tmp_path / "o").exists()


def test_a_tuning_seed_too_large_is_refused_before_any_work(tmp_path: Path, tiny_llama_dir: Path) -> None:
    recipe = tmp_path / "tuned.yaml"
    recipe.write_text(_tuned_recipe_with_seed(10**23))
    refused(
        runner.invoke(app, ["compress", str(tiny_llama_dir), "-o", str(tmp_path / "o"), "--recipe", str(recipe)]),
        "weights.tuning.seed must be an integer from 0",
    )


def _tuned_recipe_with_seed(seed: int) -> str:
    import yaml

    data = yaml.safe_load((Path(squeeze.__file__).parent / "recipes" / "w3-tuned.yaml").read_text())
    data["weights"]["tuning"]["seed"] = seed
    return yaml.safe_dump(data)


def test_the_mismatched_checkpoint_is_one_error_with_a_hint(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = Path(shutil.copytree(tiny_llama_dir, tmp_path / "broken"))
    tensors = load_file(broken / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".layers.1." not in k}, broken / "model.safetensors")
    for extra in ([], ["--plan"]):
        refused(
            runner.invoke(app, ["compress", str(broken), "-o", str(tmp_path / "o"), "--recipe", "rtn-w4", *extra]),
            "does not match its config.json",
        )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("args", "contains"),
    [
        (["--limit", "3"], "--limit applies to lm-evaluation-harness tasks only"),
        (["--include-path", "."], "--include-path applies"),
        (["--num-fewshot", "2", "--limit", "1"], "--limit, --num-fewshot apply"),
    ],
)
def test_task_options_without_tasks_are_refused(tmp_path: Path, args: list[str], contains: str) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world\n")
    refused(runner.invoke(app, ["eval", str(tmp_path / "not-read"), "--text", str(text), *args]), contains)


def test_num_fewshot_is_bounded_before_the_model_loads(tmp_path: Path) -> None:
    result = runner.invoke(app, ["eval", str(tmp_path / "not-read"), "--tasks", "x", "--num-fewshot", "1000000"])
    refused(result, "--num-fewshot must be an integer from 0 to 1024")


def test_eval_help_keeps_the_extra_s_brackets() -> None:
    result = runner.invoke(app, ["eval", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0 and "squeeze[eval]" in result.stdout, result.stdout


def test_a_forced_budget_says_it_was_exceeded(capsys: pytest.CaptureFixture[str]) -> None:
    result = CompressResult(
        output="o", model="m", recipe="w4", bits_per_weight=4.2, seconds=1.0, max_memory=10**8,
        peak_estimate_bytes=610 * 10**6, source_bytes=10**6, artifact_bytes=10**5,
    )  # fmt: skip
    _print_summary(result)
    out = capsys.readouterr().out
    assert "estimated peak 0.61 GB exceeds --max-memory 0.10 GB (forced)" in out and "within" not in out


def every_error_class() -> list[type[errors.SqueezeError]]:
    found, todo = [], [errors.SqueezeError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("cls", every_error_class(), ids=lambda c: c.__name__)
def test_every_error_class_prints_a_hint(cls: type[errors.SqueezeError], capsys: pytest.CaptureFixture[str]) -> None:
    assert cls.default_hint.strip(), f"{cls.__name__} has no default hint"
    import typer

    with pytest.raises(typer.Exit), cli_errors():
        raise cls("something was wrong")  # a raise site without a hint of its own
    err = capsys.readouterr().err
    assert "Error: something was wrong" in err and f"Hint: {cls.default_hint[:40]}" in err, err


def test_a_site_s_own_hint_wins(capsys: pytest.CaptureFixture[str]) -> None:
    import typer

    with pytest.raises(typer.Exit), cli_errors():
        raise errors.ConfigError("bad", hint="do this")
    assert "Hint: do this" in capsys.readouterr().err


def test_int8_activations_on_an_rtn_artifact_say_what_ran(tmp_path: Path, compress_tiny) -> None:
    artifact = compress_tiny(tmp_path / "rtn", recipe="rtn-w4", calibration=None, calibration_overrides=None)
    result = runner.invoke(app, ["run", "Once", "-m", str(artifact), "-n", "2", "--activations", "int8"])
    assert result.exit_code == 0, result.output
    assert "Warning: --activations int8 was asked for, but the linears ran activations float32" in result.stderr
    assert "| activations float32 |" in result.stderr
    dense = runner.invoke(app, ["run", "Once", "-m", str(artifact), "-n", "2", "--activations", "int8", "--dense"])
    assert dense.exit_code == 0 and "--dense caches float weights" in dense.stderr, dense.output


def test_eval_with_int8_activations_on_an_rtn_artifact_says_what_ran(
    tmp_path: Path, compress_tiny, tiny_text_file: Path
) -> None:
    artifact = compress_tiny(tmp_path / "rtn", recipe="rtn-w4", calibration=None, calibration_overrides=None)
    args = ["eval", str(artifact), "--text", str(tiny_text_file), "--seq-len", "32", "--max-windows", "2"]
    result = runner.invoke(app, [*args, "--activations", "int8", "--json"])
    assert result.exit_code == 0, result.output
    assert "Warning: --activations int8 was asked for, but the linears ran activations float32" in result.stderr
    assert '"activations_ran": "float32"' in result.stdout
