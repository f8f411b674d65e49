"""Built-in recipes inherit ``weights.targets`` from the model families (squeeze.models.families): dropping the
12-name list from their YAML changed no recipe's hash nor the recipe.yaml an artifact stores.

The golden values were computed on main before the list was dropped: (``Recipe.spec_hash()``, SHA-256 of
``Recipe.to_yaml()``) per built-in recipe.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from squeeze.config import RECIPES_DIR, builtin_names, load_recipe
from squeeze.models.families import DEFAULT_TARGETS, default_targets

GOLDEN: dict[str, tuple[str, str]] = {
    "b2.5": (
        "3c827f72cd775a4210ae08b42a1bd0b9f79f8ab2b568b520c8cb0a5eae9fb1b4",
        "8ef7508a0ff86335219c9217e09f50e8ae77f1edc999084f9ac25ee4a6d94afd",
    ),
    "b3.5": (
        "a966b75c431590014f979ea05808d9d1f55a204692eeb646cf1f532e761aba9c",
        "c3536ef76ba902301306112bb06de64170028a1c694aa1155c60f77985716b31",
    ),
    "b3.5-e": (
        "5dc339dcc3d340b7347216b78a74591c0a34560962362aa8dab0dc20c7b90b01",
        "ebefd5b9bad9bfc0dad9365eda41d7090666b1095b082829e46086f2287a4350",
    ),
    "b4-e": (
        "a2f459262be6915a35b109e453eed7ea479d282bd5684d29e28a5bf775f331bd",
        "29fe2fa5e60910028e786956a99fe2b4307cfd3184e236febec1a78ec73c22af",
    ),
    "rtn-w3": (
        "5e6d7cd0228c082370fb87f8dedf964860ab73cf9928975b3b1d2f6996126089",
        "512ea3b6afdd7f20fe204b4eb654c41c6c4682ec8652e56a9549095829213a6d",
    ),
    "rtn-w4": (
        "ceb107b74e568ae084efaf289bdaa17d9faab32f56d5f36324fa0a13ab565cd4",
        "14a65a90b8bcda8f486a82f0716b90a6521d30af48003264fccfef2257b6c7e0",
    ),
    "w3": (
        "cf45edc8876629c4544a310356e35045a079ada380671e533bf7dd64578b47fe",
        "7aa606a2ef7f1c8ef3dafffa73d24dfdb1591cb815de11a80a074e58e6cb74c1",
    ),
    "w3-ec": (
        "0914cea6f4f932332d30e4f31097298f0b9f29006c5c58b3af9879033b4c3d74",
        "14b3dbc6dddafaa871795e944caf911ef74ac4eb33921d476ced06752c471c9f",
    ),
    "w3-ec-distill": (  # added after the list was dropped (issue 51 item 3): its values when it was added
        "603377c91f42f3f90bb76e322a02459ef040c45dee97b9342f60076c6b7777c6",
        "d3083b027cca7aff23faccf2621695d040b9032de6cfc3995ea7f2eef3f4d483",
    ),
    "w3-ec-tuned": (
        "a8e18837b8e121ae0f95ff48a5c953f16bbb8140093e28bafb7902d070c29709",
        "7d8e0e32de5056a7e443bfb7fa339ecd7c8871247eec819911d19440c32f403b",
    ),
    "w3-lut8": (
        "0b9411ae7d1f15b2aa9e4e3678be19a5a876cc758f52bc5876c451998f83ff6f",
        "90a547eebd753e0fe594e3acdd5ef9a5ce685d4b4d094a7fe5cb8e47d1fe34e1",
    ),
    "w3-s045": (
        "a3f56a73ec70b2daa45c45da07073b756d334103bd0ae94715857406c7e8e815",
        "d6c2925759920ba2aedbb295094bc8b2e3f0afe7120e71eb4f933fdbf09d6060",
    ),
    "w3-s045-e4": (
        "c1fed300e9e88c94014b3a34fdd1033c65469ed3adadbe8a22aa7f228d1bc8bd",
        "2af82ed8be02bfff767ee94bde820908f1a6e6cd044afb587715c93b38ba1546",
    ),
    "w3-s045-e6": (
        "6def1193e661db46ae8222fc506177cb8207147800736972798fee54e21376c4",
        "29e8440379f8d04f992bb0c2c852b2bb525d40bd255a495d1c6353332acf5cd8",
    ),
    "w3-s045-ec": (
        "042e51f0284629f1b51efe44143597b3cb52b55fd51681e1f3ed0289104fa1ef",
        "a0238494bca1d9f56e603ff0309d52bf8f4ca3cae43d5cb257b11122c9f93737",
    ),
    "w3-s045-lut8": (
        "08a8841409a58239059f17d8297ad93e1cec6f589a22177e5a0e630c7f02c5a0",
        "ac134e24e476b9589dc332e26e80c01311d76d3ad964d98db6e91085df5aa882",
    ),
    "w3-tuned": (
        "9b38bee75da38e15fa67c6a61add5fd0d1c4b7f32b17fee0c7fa0de2a988dfc3",
        "0e813b868e6b3ef18882118d8e2464d893efb7fb43afb104f49565e84623ebcb",
    ),
    "w4": (
        "2bdc03f0628b0b8373f3962ac63b346fab01e47f159a0f71a2c45af440585fe8",
        "97d684c91fa72f7beca14a99e1c6fd277022189d6d6908b8ae891a9d38dec513",
    ),
    "w4-e4": (
        "f0b21724ff85f85ccd577d7d08a4138d420f5e70a737cfefebd555fe6f1675dd",
        "4fedab3d2fea9d74c131f9bd5923d53b9fedc9789068192c225d2ac4d6ef8bae",
    ),
    "w4-e6": (
        "a0a1b9a5cba1c1fe5e95a4c2e8dcef1f6474a71011a1dc41f3658f56642fd9e6",
        "8cd8f27ef58d7a339c704aaf89ee00a1d78f062b99bf8d9ffd6628ac6b4aa56a",
    ),
    "w4-ec": (
        "c5410f8572d4a82a15bbb15557295a0aea798d8c9224e34271909a1a3548a2e4",
        "9d16e25dab642201364aabc2dc2d5e78e2e75de5975ea3a9dc3cc1d06dca2e05",
    ),
    "w4-lut8": (
        "85151a4418d95e674e121fd7e3c0e33428429b4ad4a5b19993628a722d7d125f",
        "392d556d9fdba451bd97f9dd4a9395ebc6ca6a452c260260df5d869f9b385033",
    ),
    "w4-lut8-e8": (
        "3f1b8bbbebc9ebe9b30830b190e33e953d9a6ed873bde0d2443b82880fe4ea44",
        "737abd466db74cf99f485962948b4e382fbd19499bbef12e106e155506d5fe41",
    ),
    "w4-s045": (
        "1acfb3067564071ed9a138167f8ed11c1a190eab153fdebd2b691d3a37289aa3",
        "75499e2939b2bfb7b72683c8df915c5b706f30a6be3cb94d6be840e2d8cd6496",
    ),
    "w4-s045-lut8": (
        "4b95a483cd3a77292efc05c5b7594cc7665fce4e612dea11b2655bd24c9dbfd3",
        "16f256d3bde7932f5e27427dac477c370341da2cd9f407f5ef94b2cf8a7a8c7f",
    ),
}


def test_every_builtin_recipe_has_a_golden_value() -> None:
    assert sorted(GOLDEN) == builtin_names(RECIPES_DIR)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_builtin_recipe_hash_and_yaml_are_unchanged(name: str) -> None:
    recipe = load_recipe(name)
    assert recipe.weights.targets == DEFAULT_TARGETS
    assert (recipe.spec_hash(), hashlib.sha256(recipe.to_yaml().encode()).hexdigest()) == GOLDEN[name]


def test_builtin_recipes_do_not_repeat_the_default_targets() -> None:
    for path in RECIPES_DIR.glob("*.yaml"):
        assert "targets" not in path.read_text(encoding="utf-8"), path.name


def test_explicit_default_targets_hash_as_the_inherited_ones(tmp_path: Path) -> None:
    inherited = load_recipe("w3")
    text = (RECIPES_DIR / "w3.yaml").read_text(encoding="utf-8")
    explicit = tmp_path / "w3-explicit.yaml"
    explicit.write_text(text.replace("  ignore:", f"  targets: [{', '.join(default_targets())}]\n  ignore:"))
    assert load_recipe(explicit).weights.targets == DEFAULT_TARGETS
    assert load_recipe(explicit).spec_hash() == inherited.spec_hash()
    assert load_recipe(explicit).to_yaml() == inherited.to_yaml()


def test_a_recipe_that_names_targets_changes_them(tmp_path: Path) -> None:
    path = tmp_path / "attention-only.yaml"
    path.write_text("version: 1\nweights:\n  targets: [q_proj, v_proj]\n", encoding="utf-8")
    recipe = load_recipe(path)
    assert recipe.weights.targets == ("q_proj", "v_proj")
    assert recipe.spec_hash() != load_recipe("w4").spec_hash()
