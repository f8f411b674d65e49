"""Compress and eval inputs refused up front, each with a hint (issue 50 items 8, 9, 12, 13).

One seed rule for ``--seed``, a calibration spec's ``seed`` and ``weights.tuning.seed`` (a 1e23 seed
overflowed torch's generator after the work had begun; -1 was taken by one and refused by the other);
``--recipe NAME`` where a directory of that name sits in the working directory (the output folder of
``--recipe w3-ec-tuned --output w3-ec-tuned``) is the built-in; a name matching both a file and a built-in
says which was taken; lm-eval's ``--num-fewshot`` and ``--include-path`` are checked before lm-eval runs (a FIFO
named like a task YAML blocked it forever; ``!function ../outside.load`` left the include path).
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest

from squeeze import api
from squeeze.config import RECIPES_DIR, BuiltinShadowedWarning, CalibrationSpec, load_recipe
from squeeze.errors import ConfigError
from squeeze.eval.harness import MAX_NUM_FEWSHOT, check_task_options
from squeeze.limits import MAX_SEED

TASKS = Path(__file__).resolve().parent / "data" / "lm_eval"


@pytest.mark.parametrize("seed", [10**23, -1, MAX_SEED + 1])
def test_one_seed_rule_for_every_seed(tmp_path: Path, tiny_llama_dir: Path, seed: int) -> None:
    output = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"seed \(--seed\) must be an integer from 0 to 4294967295") as caught:
        api.compress(str(tiny_llama_dir), output, recipe="rtn-w4", seed=seed)
    assert caught.value.hint and not output.exists()
    with pytest.raises(ConfigError, match="weights.tuning.seed must be an integer from 0") as caught:
        load_recipe("w3-tuned", **{"weights.tuning.seed": seed})
    assert caught.value.hint
    with pytest.raises(ConfigError, match="calibration seed must be an integer from 0") as caught:
        CalibrationSpec(path="text.txt", seed=seed)
    assert caught.value.hint


def test_the_largest_seed_is_taken_everywhere() -> None:
    assert load_recipe("w3-tuned", **{"weights.tuning.seed": MAX_SEED}).weights.tuning.seed == MAX_SEED
    assert CalibrationSpec(path="text.txt", seed=MAX_SEED).seed == MAX_SEED


def test_a_directory_named_like_a_builtin_recipe_is_not_the_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w3-ec-tuned").mkdir()  # the output folder of `--recipe w3-ec-tuned --output w3-ec-tuned`
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: a directory is not a recipe file
        recipe = load_recipe("w3-ec-tuned")
    assert recipe == load_recipe(RECIPES_DIR / "w3-ec-tuned.yaml")


def test_a_file_and_a_builtin_of_one_name_say_which_was_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = (RECIPES_DIR / "w4.yaml").read_text().replace("bits: 4", "bits: 3")
    assert "bits: 3" in text
    (tmp_path / "w4").write_text(text)
    with pytest.warns(BuiltinShadowedWarning, match="'w4' is both the file .* and a built-in: the file was taken"):
        recipe = load_recipe("w4")
    assert recipe.weights.bits == 3


def test_recipe_refusals_carry_hints(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match="cannot read the recipe .*folder") as caught:
        load_recipe(tmp_path / "folder")
    assert "built-ins: " in str(caught.value.hint) or "w4" in str(caught.value.hint)
    duplicated = tmp_path / "dup.yaml"
    duplicated.write_text("name: x\nweights:\n  bits: 4\n  bits: 3\n")
    with pytest.raises(ConfigError, match="duplicate key") as caught:
        load_recipe(duplicated)
    assert caught.value.hint
    with pytest.raises(ConfigError, match="weights.tuning.steps must be >= 1") as caught:
        load_recipe("w3-tuned", **{"weights.tuning.steps": 0})
    assert caught.value.hint


@pytest.mark.parametrize("fewshot", [10**6, MAX_NUM_FEWSHOT + 1, -1])
def test_num_fewshot_is_bounded_before_the_model_loads(fewshot: int) -> None:
    with pytest.raises(ConfigError, match="--num-fewshot must be an integer from 0 to 1024") as caught:
        api.evaluate_tasks("/nonexistent/model", ["squeeze_tinystories_mc"], include_path=TASKS, num_fewshot=fewshot)
    assert caught.value.hint


def test_the_shipped_task_folder_passes() -> None:
    check_task_options(include_path=TASKS, limit=4, num_fewshot=0)


def _task_folder(root: Path, yaml_text: str) -> Path:
    folder = root / "tasks"
    folder.mkdir()
    (folder / "task.yaml").write_text(yaml_text)
    return folder


def test_a_fifo_named_like_a_task_yaml_is_refused_at_once(tmp_path: Path) -> None:
    folder = _task_folder(tmp_path, (TASKS / "tinystories_mc.yaml").read_text())
    os.mkfifo(folder / "x.yaml")
    started = time.monotonic()
    with pytest.raises(ConfigError, match="x.yaml is not a regular file") as caught:
        check_task_options(include_path=folder, limit=None, num_fewshot=None)
    assert caught.value.hint and time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("../outside.load", "outside the include path"),
        ("/etc/passwd.load", "outside the include path"),
        ("absent.load", "absent.py is not a file"),
        ("load", "expected module.function"),
    ],
)
def test_function_tags_stay_inside_the_include_path(tmp_path: Path, tag: str, message: str) -> None:
    (tmp_path / "outside.py").write_text("def load():\n    raise SystemExit('ran outside code')\n")
    folder = _task_folder(tmp_path, f"task: t\ncustom_dataset: !function {tag}\n")
    with pytest.raises(ConfigError, match=message) as caught:
        check_task_options(include_path=folder, limit=None, num_fewshot=None)
    assert caught.value.hint


def test_include_path_must_be_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a directory") as caught:
        check_task_options(include_path=tmp_path / "none", limit=None, num_fewshot=None)
    assert caught.value.hint


def test_more_examples_than_documents_is_a_clean_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within the bound, a task with fewer documents than --num-fewshot: lm-eval's random.sample ValueError
    (exit 3 before) becomes a ConfigError naming the option."""
    lm_eval = pytest.importorskip("lm_eval")
    from types import SimpleNamespace

    from squeeze.eval.harness import run_tasks

    def too_few(**_: object) -> None:
        raise ValueError("Sample larger than population or is negative")

    monkeypatch.setattr(lm_eval, "simple_evaluate", too_few)
    core = SimpleNamespace(batch_size=1)
    with pytest.raises(ConfigError, match="--num-fewshot 500 asks for more examples than a task has") as caught:
        run_tasks(core, ["squeeze_tinystories_mc"], include_path=TASKS, num_fewshot=500)  # type: ignore[arg-type]
    assert caught.value.hint
