"""squeeze.limits: one table of what squeeze supports, checked where user input enters, and nowhere a ConfigError
from inside (a bug must not read as the user's mistake)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
import torch
from typer.testing import CliRunner

from squeeze import limits
from squeeze.cli.app import app
from squeeze.compression import calibrate_kv as calibrate_kv_stage
from squeeze.compression import runner as compress_runner
from squeeze.config import WeightsConfig, load_recipe
from squeeze.errors import ConfigError, FormatError
from squeeze.quant import kv_spec as quant_kv
from squeeze.quant import packing, schemes
from squeeze.quant.schemes.lut import quantize_lut
from squeeze.runtime.kernels.layout import GROUPS

PACKAGE = Path(limits.__file__).resolve().parent
runner = CliRunner()


# ----------------------------------------------------------------------------------------------------------
# One table


def test_every_table_is_the_one_in_limits() -> None:
    assert packing.SUPPORTED_BITS is limits.WEIGHT_BITS
    assert sorted(GROUPS) == sorted(limits.WEIGHT_BITS)
    assert quant_kv.KV_BITS is limits.KV_BITS
    hints = get_type_hints(WeightsConfig)
    assert hints["method"] is str  # the method names are the weight-format registry's
    assert schemes.methods() == ("squeeze", "rtn")
    assert get_args(hints["sensitivity"]) == limits.SENSITIVITIES
    assert get_args(hints["lut_dtype"]) == limits.LUT_DTYPES


def test_no_other_module_spells_out_a_list_of_widths() -> None:
    spelled = re.compile(r"\(2, 3, 4, 8\)|\[2, 3, 4, 8\]|\(None, 4, 8\)")
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "limits.py" and spelled.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == []


@pytest.mark.parametrize("folder", ["quant", "runtime/kernels", "calibrate/fisher.py"])
def test_no_config_error_is_raised_inside(folder: str) -> None:
    root = PACKAGE / folder
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    offenders = [str(p.relative_to(PACKAGE)) for p in files if "raise ConfigError" in p.read_text(encoding="utf-8")]
    assert offenders == []


# ----------------------------------------------------------------------------------------------------------
# The checks


@pytest.mark.parametrize("bits", [1, 5, 16, True, "4", None, 4.0])
def test_weight_bits_outside_the_table_are_refused(bits: object) -> None:
    with pytest.raises(ConfigError, match=r"weights.bits must be one of \[2, 3, 4, 8\], found") as info:
        limits.check_weight_bits(bits, "weights.bits")
    assert info.value.hint


@pytest.mark.parametrize("bits", limits.WEIGHT_BITS)
def test_supported_weight_bits_pass(bits: int) -> None:
    assert limits.check_weight_bits(bits) == bits


@pytest.mark.parametrize(
    ("sensitive", "outlier"), [(0.5, 0.0), (0.0, 0.11), (-0.001, 0.0), (0.06, 0.05), (float("nan"), 0.0), ("0.01", 0.0)]
)
def test_sparse_fractions_beyond_the_user_bound_are_refused(sensitive: object, outlier: object) -> None:
    with pytest.raises(ConfigError, match="fraction") as info:
        limits.check_sparse_fractions(sensitive, outlier)  # type: ignore[arg-type]
    assert "0.1" in info.value.message and info.value.hint


def test_the_user_bound_on_fractions_is_inclusive() -> None:
    limits.check_sparse_fractions(0.05, 0.05)
    limits.check_sparse_fractions(0.0, limits.MAX_SPARSE_FRACTION)


@pytest.mark.parametrize("group", [0, -1, True, 1.5, "128"])
def test_bad_group_sizes_are_refused(group: object) -> None:
    with pytest.raises(ConfigError, match="group_size must be an integer >= 1 or null"):
        limits.check_group_size(group, "weights.group_size")
    assert limits.check_group_size(None) is None and limits.check_group_size(1) == 1


@pytest.mark.parametrize("bits", [2, 6, 16, True, None, "8"])
def test_kv_bits_outside_the_table_are_refused(bits: object) -> None:
    with pytest.raises(ConfigError, match="must be 4 or 8"):
        limits.check_kv_bits(bits)


def test_kv_groups_are_even_divisors_of_the_head() -> None:
    assert [g for g in range(70) if limits.is_kv_group(g, 64)] == [2, 4, 8, 16, 32, 64]
    assert limits.check_kv_group(32, 64, "key") == 32
    with pytest.raises(ConfigError, match="even divisor of the head dimension 64, found 24") as info:
        limits.check_kv_group(24, 64, "key")
    assert info.value.hint == "e.g. 32 or 64"


def test_checks_raise_the_error_a_parser_asks_for() -> None:
    with pytest.raises(FormatError, match="m: bits must be one of") as info:
        limits.check_weight_bits(5, "m: bits", FormatError, hint=None)
    assert info.value.hint is None
    with pytest.raises(FormatError, match="kv_cache.bits"):
        quant_kv.KVSpec.from_config({"bits": 6, "sink_tokens": 0, "layers": []}, {})


def test_recipes_use_the_table() -> None:
    for bad, match in (
        ({"bits": 5}, "weights.bits"),
        ({"outlier_fraction": 0.5}, "outlier_fraction"),
        ({"method": "rtn", "group_size": 0}, "group_size"),
        ({"lut_dtype": "int4"}, "lut_dtype"),
        ({"method": "gptq"}, "method"),
        ({"sensitivity": "hessian"}, "sensitivity"),
    ):
        with pytest.raises(ConfigError, match=match):
            WeightsConfig(**bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------
# At the CLI: one clean line, exit 2, before anything is loaded; a bug inside: exit 3


def _clean_usage_error(result, match: str) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("Error: ") and match in lines[0], result.stderr
    assert len(lines) <= 2 and all(line.startswith("Hint: ") for line in lines[1:]), result.stderr
    assert "Traceback" not in result.output


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("bad options must be refused before any work starts")

    monkeypatch.setattr(compress_runner, "run_compress", fail)
    monkeypatch.setattr(calibrate_kv_stage, "run_calibrate_kv", fail)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (["--bits", "5"], "weights.bits must be one of [2, 3, 4, 8], found 5"),
        (["--outlier-fraction", "0.5"], "weights.outlier_fraction must be in [0, 0.1]"),
        (["--sensitive-fraction", "0.08", "--outlier-fraction", "0.08"], "must not exceed 0.1"),
        (["--recipe", "rtn-w4", "--group-size", "0"], "weights.group_size must be an integer >= 1"),
        (["--lut-dtype", "int4"], "weights.lut_dtype must be one of ['float16', 'int8'], found 'int4'"),
        (["--method", "gptq"], "weights.method must be one of ['squeeze', 'rtn']"),
        (["--sensitivity", "hessian"], "weights.sensitivity must be one of ['fisher', 'activation', 'uniform']"),
    ],
)
def test_bad_compress_options_are_one_clean_usage_error(
    tmp_path: Path, nothing_runs: None, options: list[str], match: str
) -> None:
    result = runner.invoke(app, ["compress", str(tmp_path / "no-model"), "-o", str(tmp_path / "out"), *options])
    _clean_usage_error(result, match)
    assert not (tmp_path / "out").exists()


def test_a_bad_recipe_file_is_one_clean_usage_error(tmp_path: Path, nothing_runs: None) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("version: 1\nweights:\n  bits: 5\n")
    result = runner.invoke(
        app, ["compress", str(tmp_path / "no-model"), "-o", str(tmp_path / "out"), "--recipe", str(recipe)]
    )
    _clean_usage_error(result, "weights.bits must be one of")
    recipe.write_text("version: 1\nweights:\n  method: squeeze\n  group_size: 64\n")
    with pytest.raises(ConfigError, match="weights.group_size applies to method rtn only"):
        load_recipe(recipe)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (["--bits", "6"], "--bits must be one of 8, 4, fp8, found 6"),
        (["--bits", "fp16"], "--bits must be one of 8, 4, fp8, found 'fp16'"),
        (["--bits", "fp8", "--sink-tokens", "4"], "--sink-tokens applies to the int8 / int4 grids only"),
        (["--sink-tokens", "-1"], "--sink-tokens must be >= 0, found -1"),
    ],
)
def test_bad_calibrate_kv_options_are_one_clean_usage_error(
    tmp_path: Path, nothing_runs: None, options: list[str], match: str
) -> None:
    result = runner.invoke(app, ["calibrate-kv", str(tmp_path / "no-artifact"), *options])
    _clean_usage_error(result, match)


def test_a_bug_inside_is_an_internal_error_not_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def misuse(*args: object, **kwargs: object) -> None:
        quantize_lut(torch.zeros(2, 3, 4), None, 4)  # a 3-D tensor: squeeze's own code got it wrong

    with pytest.raises(ValueError, match="2-D"):
        misuse()
    monkeypatch.setattr(compress_runner, "run_compress", misuse)
    result = runner.invoke(app, ["compress", str(tmp_path / "model"), "-o", str(tmp_path / "out"), "--recipe", "w4"])
    assert result.exit_code == 3, result.output
    assert result.stderr.startswith("Error: internal error: ValueError: weight must be a 2-D")
