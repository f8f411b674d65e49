import pytest

from squeeze.config import (
    RECIPES_DIR,
    CalibrationSpec,
    Recipe,
    WeightsConfig,
    builtin_names,
    load_calibration_spec,
    load_recipe,
    parse_size,
)
from squeeze.errors import ConfigError


def test_builtin_recipes_all_load():
    names = builtin_names(RECIPES_DIR)
    assert {"w4", "w4-s045", "w3", "w3-s045", "rtn-w4", "rtn-w3", "w4-lut8", "w3-s045-lut8"} <= set(names)
    for name in names:
        recipe = load_recipe(name)
        assert recipe.name == name


def test_w3_s045_matches_squeezellm_defaults():
    w = load_recipe("w3-s045").weights
    assert (w.method, w.bits, w.sensitive_fraction, w.outlier_fraction) == ("squeeze", 3, 0.0005, 0.004)


def test_lut8_recipes_differ_from_their_twins_only_in_the_lut():
    for name in ("w4", "w4-s045", "w3", "w3-s045"):
        plain, compact = load_recipe(name).to_dict(), load_recipe(f"{name}-lut8").to_dict()
        assert compact["weights"].pop("lut_dtype") == "int8" and plain["weights"].pop("lut_dtype") == "float16"
        assert compact.pop("name") == f"{name}-lut8" and plain.pop("name") == name
        assert compact == plain


def test_overrides_apply_dotted_keys():
    recipe = load_recipe("w4", **{"weights.bits": 3, "output.max_shard_size": "10MB", "weights.group_size": None})
    assert recipe.weights.bits == 3 and recipe.output.max_shard_bytes == 10_000_000


def test_unknown_keys_are_rejected(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("version: 1\nweights:\n  bits: 4\n  colour: blue\n")
    with pytest.raises(ConfigError, match="unknown key.*'colour'"):
        load_recipe(path)
    path.write_text("version: 1\nextra: 1\n")
    with pytest.raises(ConfigError, match="unknown key.*'extra'"):
        load_recipe(path)


def test_a_duplicate_key_is_refused_naming_its_line(tmp_path):
    """Issue 41 item 10: yaml kept the last of two ``bits`` silently."""
    path = tmp_path / "r.yaml"
    path.write_text("version: 1\nweights:\n  bits: 3\n  bits: 4\n")
    with pytest.raises(ConfigError, match="duplicate key 'bits' on line 4 \\(first given on line 3\\)"):
        load_recipe(path)
    spec = tmp_path / "c.yaml"
    spec.write_text("name: a\nname: b\nsource: text\n")
    with pytest.raises(ConfigError, match="duplicate key 'name' on line 2"):
        load_calibration_spec(spec)


def test_same_keys_in_different_mappings_are_fine(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("version: 1\nweights:\n  bits: 4\n")
    assert load_recipe(path).weights.bits == 4


@pytest.mark.parametrize("kind", ["fifo", "folder", "device"])
def test_a_recipe_path_that_is_not_a_file_is_named_as_what_it_is(tmp_path, kind):
    """Issue 41 item 15: a FIFO, folder or device was reported as "no such file" (and a FIFO must not block)."""
    import os

    if kind == "fifo":
        path = tmp_path / "r.yaml"
        os.mkfifo(path)
        expected = "FIFO"
    elif kind == "folder":
        path = tmp_path / "r.yaml"
        path.mkdir()
        expected = "a directory"
    else:
        path = "/dev/null"
        expected = "a device"
    with pytest.raises(ConfigError, match=expected) as info:
        load_recipe(path)
    assert "no such file" not in str(info.value)


@pytest.mark.parametrize("bits", [1, 5, 16])
def test_unsupported_bits(bits):
    with pytest.raises(ConfigError, match="weights.bits must be one of"):
        WeightsConfig(bits=bits)


@pytest.mark.parametrize("fraction", [-0.01, 0.11, 1.0])
def test_sparsity_outside_range(fraction):
    with pytest.raises(ConfigError, match=r"\[0, 0.1\]"):
        WeightsConfig(outlier_fraction=fraction)


def test_rtn_rejects_sparse_fractions_and_squeeze_rejects_groups():
    with pytest.raises(
        ConfigError, match="outlier_fraction applies to method squeeze only, found 0.01 with method rtn"
    ):
        WeightsConfig(method="rtn", outlier_fraction=0.01)
    with pytest.raises(ConfigError, match="lut_dtype applies to method squeeze only"):
        WeightsConfig(method="rtn", lut_dtype="int8")
    with pytest.raises(ConfigError, match="group_size applies to method rtn only, found 128 with method squeeze"):
        WeightsConfig(method="squeeze", group_size=128)


def test_a_recipe_with_the_old_kv_cache_section_is_refused_with_the_way_forward(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("version: 1\nweights: {bits: 4}\nkv_cache: {bits: null}\n")
    with pytest.raises(ConfigError, match="kv_cache") as info:
        load_recipe(str(path))
    assert "calibrate-kv" in info.value.hint


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"weights.refit_rounds": -1}, "refit_rounds must be >= 0"),
        ({"weights.refit_rounds": 9}, "refit_rounds must be an integer from 0 to 8"),
        ({"weights.refit_rounds": 2.5}, "must be of type int"),
        ({"weights.refit_rounds": True}, "must be of type int"),
        ({"weights.refit_rounds": 2, "weights.refit_lut": True}, "give one of them"),
    ],
)
def test_refit_rounds_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe("w3-ec", **overrides)


def test_refit_rounds_need_error_compensation_and_the_lut_format():
    assert load_recipe("w3-ec", **{"weights.refit_rounds": 8}).weights.refit_rounds == 8
    with pytest.raises(ConfigError, match="refit_rounds: used only with weights.error_compensation"):
        load_recipe("w3", **{"weights.refit_rounds": 2})
    with pytest.raises(ConfigError, match="applies to method squeeze"):
        load_recipe("rtn-w3", **{"weights.refit_rounds": 2})


def test_wrong_types_and_literals():
    with pytest.raises(ConfigError, match="must be one of"):
        load_recipe("w4", **{"weights.method": "gptq"})
    with pytest.raises(ConfigError, match="must be of type int"):
        load_recipe("w4", **{"weights.bits": "four"})


def test_unknown_recipe_lists_builtins():
    with pytest.raises(ConfigError) as info:
        load_recipe("w5")
    assert "w3-s045" in (info.value.hint or "")


def test_recipe_is_frozen_and_hash_is_stable():
    recipe = load_recipe("w4")
    with pytest.raises(AttributeError):
        recipe.name = "x"  # type: ignore[misc]
    assert recipe.spec_hash() == load_recipe("w4").spec_hash()
    assert recipe.spec_hash() != load_recipe("w3").spec_hash()
    assert Recipe().to_dict()["weights"]["targets"][0] == "q_proj"


def test_yaml_round_trip(tmp_path):
    recipe = load_recipe("w3-s045")
    path = tmp_path / "again.yaml"
    path.write_text(recipe.to_yaml())
    assert load_recipe(path) == recipe


def test_plain_text_file_becomes_a_text_spec(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("hello")
    spec = load_calibration_spec(text, num_samples=4)
    assert spec.source == "text" and spec.path == str(text.resolve()) and spec.num_samples == 4


def test_spec_paths_resolve_against_the_spec_file(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "spec.yaml"
    path.write_text("version: 1\nsource: text\npath: ../data.txt\n")
    assert load_calibration_spec(path).path == str((tmp_path / "data.txt").resolve())


def test_builtin_calibration_specs_load():
    for name in ("sotu", "text", "wikitext2-train", "c4"):
        assert load_calibration_spec(name).name == name


def test_calibration_spec_errors():
    with pytest.raises(ConfigError, match="needs a 'path'"):
        CalibrationSpec(source="text")
    with pytest.raises(ConfigError, match="num_samples must be >= 1"):
        CalibrationSpec(path="x", num_samples=0)
    with pytest.raises(ConfigError, match="version must be 1"):
        CalibrationSpec(path="x", version=2)


@pytest.mark.parametrize(
    "text, value", [("2GB", 2 * 10**9), ("500MB", 500 * 10**6), ("1GiB", 2**30), (1234, 1234), ("10 kb", 10_000)]
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "big", "-1GB", "0", "3XB"])
def test_parse_size_errors(text):
    with pytest.raises(ConfigError):
        parse_size(text)
