"""The CLI goes through the public library API: squeeze/cli/*.py import squeeze only as squeeze.api, squeeze.errors,
squeeze.version and the CLI's own modules (lazy imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import squeeze.cli

ALLOWED = ("squeeze.api", "squeeze.errors", "squeeze.version", "squeeze.cli")
CLI_DIR = Path(squeeze.cli.__file__).parent


def _squeeze_imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from squeeze import api` names squeeze.api; `from squeeze.cli import run` names squeeze.cli.run
            modules = (
                [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "squeeze" else [node.module]
            )
            names += modules
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return [name for name in names if name == "squeeze" or name.startswith("squeeze.")]


def test_cli_modules_import_the_library_only_through_api() -> None:
    files = sorted(CLI_DIR.glob("*.py"))
    assert len(files) >= 8
    outside = {
        f"{path.name}: {name}"
        for path in files
        for name in _squeeze_imports(path)
        if not any(name == allowed or name.startswith(allowed + ".") for allowed in ALLOWED)
    }
    assert not outside, sorted(outside)


def test_the_check_sees_a_bypass(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from squeeze.runtime.generate import generate\nfrom squeeze import api\n")
    assert sorted(_squeeze_imports(module)) == ["squeeze.api", "squeeze.runtime.generate"]


def _api_uses(path: Path) -> tuple[set[str], set[str]]:
    """The names a CLI module takes from the face: ``api.NAME`` attributes, and ``from squeeze.api import NAME``."""
    attributes, imported = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "api":
            attributes.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module == "squeeze.api":
            imported |= {alias.name for alias in node.names}
    return attributes, imported


def test_the_cli_takes_verbs_from_api_and_everything_else_from_support() -> None:
    """Issue 49 item 2: ``api.NAME`` in the CLI is a verb (a function of squeeze/api's verb modules); what the CLI
    needs beyond the verbs comes from the one module squeeze.api.support."""
    import inspect

    from squeeze import api

    verb_modules = {f"squeeze.api.{name}" for name in ("artifact", "compress", "run", "serve", "eval")}
    not_verbs = set()
    for path in sorted(CLI_DIR.glob("*.py")):
        attributes, imported = _api_uses(path)
        not_verbs |= {f"{path.name}: from squeeze.api import {name}" for name in imported - {"support"}}
        for name in attributes:
            value = getattr(api, name, None)
            if not (inspect.isfunction(value) and value.__module__ in verb_modules):
                not_verbs.add(f"{path.name}: api.{name}")
    assert not not_verbs, sorted(not_verbs)
