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


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"weights.lnq_rounds": -1}, "lnq_rounds must be >= 0"),
        ({"weights.lnq_rounds": 9}, "lnq_rounds must be an integer from 0 to 8"),
        ({"weights.lnq_rounds": 1.5}, "must be of type int"),
        ({"weights.lnq_ridge": 0.5}, "lnq_ridge: used only with weights.lnq_rounds > 0"),
        ({"weights.lnq_rounds": 2, "weights.lnq_ridge": -0.1}, r"lnq_ridge must be a number in \[0, 100\]"),
        ({"weights.lnq_rounds": 2, "weights.lnq_ridge": float("nan")}, "lnq_ridge must be a number"),
        ({"weights.lnq_rounds": 2, "weights.lnq_shrink": 1.5}, r"lnq_shrink must be a number in \[0, 1\]"),
        ({"weights.lnq_rounds": 2, "weights.lnq_held_out": 0}, "lnq_held_out must be >= 1"),
        ({"weights.lnq_rounds": 2, "weights.refit_rounds": 2}, "give one of them"),
        ({"weights.lnq_rounds": 2, "weights.refit_lut": True}, "give one of them"),
    ],
)
def test_lnq_knobs_are_validated_at_load_with_a_hint(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_recipe("w3-ec", **overrides)
    assert info.value.hint


def test_lnq_needs_error_compensation_and_the_lut_format():
    weights = load_recipe("w3-ec", **{"weights.lnq_rounds": 3, "weights.lnq_ridge": 0.5}).weights
    assert (weights.lnq_rounds, weights.lnq_ridge, weights.lnq_shrink, weights.lnq_held_out) == (3, 0.5, 0.1, 4)
    with pytest.raises(ConfigError, match="lnq_rounds: used only with weights.error_compensation"):
        load_recipe("w3", **{"weights.lnq_rounds": 2})
    with pytest.raises(ConfigError, match="applies to method squeeze"):
        load_recipe("rtn-w3", **{"weights.lnq_rounds": 2})


#: spec_hash of built-in recipes before the lnq_* keys existed (issue 51): keys added at their defaults must
#: leave every older recipe, and so the artifacts built from it, byte-identical.
OLD_HASHES = {
    "w3": "cf45edc8876629c4544a310356e35045a079ada380671e533bf7dd64578b47fe",
    "w3-ec": "0914cea6f4f932332d30e4f31097298f0b9f29006c5c58b3af9879033b4c3d74",
    "w3-ec-tuned": "a8e18837b8e121ae0f95ff48a5c953f16bbb8140093e28bafb7902d070c29709",
    "w4": "2bdc03f0628b0b8373f3962ac63b346fab01e47f159a0f71a2c45af440585fe8",
    "w3-s045-ec": "042e51f0284629f1b51efe44143597b3cb52b55fd51681e1f3ed0289104fa1ef",
    "b3.5": "a966b75c431590014f979ea05808d9d1f55a204692eeb646cf1f532e761aba9c",
}


@pytest.mark.parametrize("name", sorted(OLD_HASHES))
def test_old_recipes_keep_their_hashes(name):
    recipe = load_recipe(name)
    assert recipe.spec_hash() == OLD_HASHES[name]
    assert not any(key.startswith("lnq_") for key in recipe.to_dict()["weights"])


def test_a_set_lnq_knob_is_part_of_the_plain_form_and_the_hash():
    recipe = load_recipe("w3-ec", **{"weights.lnq_rounds": 3})
    assert recipe.to_dict()["weights"]["lnq_rounds"] == 3
    assert "lnq_ridge" not in recipe.to_dict()["weights"]  # still at its default
    assert recipe.spec_hash() != OLD_HASHES["w3-ec"]
    assert load_recipe("w3-ec", **{"weights.lnq_rounds": 3, "weights.lnq_shrink": 0.5}).spec_hash() != (
        recipe.spec_hash()
    )


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
