"""Packaging: the wheel carries the built-in recipes and calibration specs, and works outside the checkout."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from squeeze.config import CALIBRATION_DIR, RECIPES_DIR, builtin_names
from squeeze.version import __version__

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    source = tmp_path_factory.mktemp("source")  # a copy: setuptools builds in place (build/, *.egg-info)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "squeeze", source / "squeeze", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)],
        capture_output=True,
        text=True,
        cwd=dist,
    )
    if build.returncode != 0 and "No module named" in build.stderr:
        pytest.skip(f"cannot build a wheel here: {build.stderr.strip().splitlines()[-1]}")
    assert build.returncode == 0, build.stderr
    (found,) = dist.glob("squeeze-*.whl")
    return found


def test_wheel_ships_every_builtin(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for directory, kind in ((RECIPES_DIR, "recipes"), (CALIBRATION_DIR, "calibration")):
        for name in builtin_names(directory):
            assert f"squeeze/{kind}/{name}.yaml" in names
    assert "squeeze/py.typed" in names
    kernels = REPO / "squeeze" / "runtime" / "kernels"
    for source in sorted([*kernels.glob("*.cpp"), *kernels.glob("*.h")]):  # the native kernels build from these
        assert f"squeeze/runtime/kernels/{source.name}" in names
    assert wheel.name.startswith(f"squeeze-{__version__}-")  # the version is read from squeeze/version.py


def test_installed_wheel_compresses_from_outside_the_checkout(wheel: Path, tmp_path: Path, stories_dir: Path) -> None:
    """A fresh venv with only the wheel installed (its dependencies borrowed from this environment's
    site-packages through a .pth file, which does not run the editable install's finder)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "borrowed-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", purelib, str(wheel)],
        check=True,
        capture_output=True,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [str(python), "-c", "import squeeze, squeeze.config as c; print(squeeze.__file__); print(c.RECIPES_DIR)"],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        check=True,
    )
    module_file, recipes_dir = where.stdout.split()
    assert module_file.startswith(purelib) and recipes_dir.startswith(purelib)
    cli = [str(python), "-c", "from squeeze.cli.app import main; main()"]
    helped = subprocess.run([*cli, "compress", "--help"], capture_output=True, text=True, cwd=work, env=env)
    assert "w4-s045" in " ".join(helped.stdout.split())
    result = subprocess.run(
        [*cli, "compress", str(stories_dir), "-o", "out", "--recipe", "rtn-w4", "--json"],
        capture_output=True,
        text=True,
        cwd=work,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["recipe"] == "rtn-w4" and (work / "out" / "squeeze.manifest.json").is_file()
