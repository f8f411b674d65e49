"""The documentation keeps up with the code: every command and option in docs/cli.md and the README's table,
every relative link and every scripts/ path the docs and CI name present, the README a front door."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main

from squeeze.cli.app import app

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").rglob("*.md"))
README = REPO / "README.md"


def _commands() -> dict[str, list[str]]:
    """Each CLI command and its long options, read from the Typer app itself."""
    group = typer.main.get_command(app)
    assert hasattr(group, "commands")
    return {
        name: [opt for param in command.params for opt in param.opts if opt.startswith("--")]
        for name, command in group.commands.items()
    }


def _cli_sections() -> dict[str, str]:
    """docs/cli.md's text per `## squeeze COMMAND` section, HTML comments left out (a note is not a doc)."""
    text = re.sub(r"<!--.*?-->", "", (REPO / "docs" / "cli.md").read_text(), flags=re.DOTALL)
    parts = re.split(r"^## squeeze (\S+)\n", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.parametrize("command", sorted(_commands()))
def test_cli_md_documents_every_option_of_every_command(command: str) -> None:
    sections = _cli_sections()
    assert command in sections, f"docs/cli.md has no '## squeeze {command}' section"
    text = sections[command]
    missing = [o for o in _commands()[command] if o != "--help" and not re.search(rf"(?<![\w-]){o}(?![\w-])", text)]
    assert not missing, f"docs/cli.md, squeeze {command}: options not described: {missing}"


def test_the_readme_is_a_front_door_listing_every_command() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 100, "the README stays a front door (<= 100 lines); details go to docs/"
    first = text.index("bash scripts/main.sh")
    assert first < text.index("bash scripts/test.sh") < text.index("## Install"), "the two newcomer commands first"
    table = {m.group(1) for m in re.finditer(r"^\| `squeeze ([a-z-]+)", text, flags=re.MULTILINE)}
    assert table == set(_commands()), f"README command table: {sorted(table)} vs the CLI's {sorted(_commands())}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    broken = [t for t in targets if "://" not in t and not (page.parent / t).exists()]
    assert not broken, f"{page.relative_to(REPO)}: links to missing files {broken}"


def test_every_scripts_path_named_in_docs_and_ci_exists() -> None:
    named: dict[str, set[str]] = {}
    sources = [README, *DOCS, REPO / ".ci" / "run", REPO / "pyproject.toml", *(REPO / "scripts").rglob("*.sh")]
    sources += list((REPO / "scripts").rglob("*.py"))
    for source in sources:
        for path in re.findall(r"\bscripts/[\w./-]+\.(?:sh|py)\b", source.read_text()):
            named.setdefault(path, set()).add(str(source.relative_to(REPO)))
    missing = {path: sorted(where) for path, where in named.items() if not (REPO / path).is_file()}
    assert named and not missing, f"paths under scripts/ that do not exist: {missing}"


#: Paths that only exist on the machine a page was written on (its work area, home, temporary directories).
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home|tmp|Users|private/var|var/folders)/")


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_names_an_absolute_path_of_the_machine_it_ran_on(page: Path) -> None:
    found = [line.strip() for line in page.read_text().splitlines() if MACHINE_PATH.search(line)]
    assert not found, f"{page.relative_to(REPO)}: repository-relative commands only, found {found[:3]}"


#: A path in architecture.md's code spans and blocks: `runtime/loader.py`, `serve/engine/scheduler`,
#: `compression/pipelines/`, a bare `lut.py`; a module named with a function after it
#: (`runtime/loader.load_artifact`) counts as its module.
_ARCH_PATH = re.compile(r"(?<![\w./-])((?:[a-z_]\w*/)+(?:[a-z_]\w*(?:\.py|\.json|\.sh)?)?|[a-z_]\w*\.py)")


def architecture_paths(text: str) -> set[str]:
    """Every path-like name in ``text``'s `code spans` and fenced blocks (where architecture.md names modules)."""
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"```\n(.*?)```", text, flags=re.DOTALL)
    return {m.group(1) for span in spans for m in _ARCH_PATH.finditer(span)}


def missing_from_tree(path: str, package: Path = REPO / "squeeze") -> bool:
    """Whether ``path`` (relative to squeeze/ or the repository; a module may leave out ``.py``; a bare file name
    may sit anywhere in the package or tests/) names nothing in the tree. Names whose first folder is no folder of
    the tree (``int8/int4``) are not paths."""
    roots = (package, package.parent)
    if "/" not in path:
        return not any(package.rglob(path)) and not any((package.parent / "tests").rglob(path))
    if not any((root / path.split("/")[0]).is_dir() for root in roots):
        return False
    return not any((root / path).exists() or (root / f"{path}.py").exists() for root in roots)


def test_every_module_architecture_md_names_exists() -> None:
    """Issue 49 item 7: architecture.md names modules that exist (it named a removed api.py, for one)."""
    named = architecture_paths((REPO / "docs" / "architecture.md").read_text())
    assert len(named) >= 40, sorted(named)  # the check reads the page's paths at all
    missing = sorted(path for path in named if missing_from_tree(path))
    assert not missing, f"docs/architecture.md names paths that are not in the tree: {missing}"


def test_the_architecture_check_sees_a_missing_module() -> None:
    text = "`runtime/loader.py`, `serve/engine/scheduler`, `api.py`, `int8/int4`, `runtime/gone.py`:\n"
    text += "```\nserve/nowhere.step\n```"
    assert {
        "runtime/loader.py",
        "serve/engine/scheduler",
        "api.py",
        "runtime/gone.py",
        "serve/nowhere",
    } <= architecture_paths(text)
    assert [p for p in sorted(architecture_paths(text)) if missing_from_tree(p)] == [
        "api.py",
        "runtime/gone.py",
        "serve/nowhere",
    ]
