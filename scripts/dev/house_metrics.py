"""House-keeping numbers for the ``squeeze`` package (issue 12's "Done when"), read from the source with ``ast``.

    .venv/bin/python scripts/dev/house_metrics.py            # a table
    .venv/bin/python scripts/dev/house_metrics.py --json     # the same numbers and lists as JSON

What is counted, and how:
- modules over 400 lines: physical lines of each ``.py`` file.
- functions over 60 lines: from the ``def`` line to the function's last line (decorators not counted; a nested
  function counts on its own and inside its parent). ``@triton.jit`` kernels are listed separately.
- functions with 8+ parameters: positional, positional-only and keyword-only parameters; ``self``/``cls`` of a
  method and ``*args``/``**kwargs`` are not counted. The issue's target sets Typer commands (a parameter whose
  default is ``typer.Option(...)``/``typer.Argument(...)``: one parameter per CLI flag) and ``@triton.jit``
  kernels (a kernel's arguments are its launch ABI) aside; the full list is printed too, each one marked.
- import cycles: the graph of squeeze/_dev/import_graph.py, the one tests/test_import_layers.py checks: an edge
  for every import statement anywhere in a module, at module level or inside a function (lazy), and to the
  parent packages an import initialises on the way (but those containing the importer); imports under
  ``if TYPE_CHECKING:`` never run and are left out. Each strongly connected group of modules is one cycle;
  one shortest cycle through it is shown.
- method branches: comparisons (``==``, ``!=``, ``in``, ``not in``, ``is``) and ``match`` cases against the
  literals "squeeze" or "rtn" (alone or inside a tuple, list or set), and ``isinstance(..., LutWeight/RtnWeight)``,
  outside ``squeeze/quant/schemes/`` (the weight-format registry, the one place allowed to know the formats).
  A comparison whose other side names ``quant_method`` is left out: that is the Hugging Face quantization
  config's "is this a squeeze artifact" test, where "squeeze" is the tool's name, not a weight method.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MANY_PARAMETERS = 8
METHOD_LITERALS = frozenset({"squeeze", "rtn"})
WEIGHT_CLASSES = frozenset({"LutWeight", "RtnWeight"})
REGISTRY_DIR = ("quant", "schemes")  # relative to the package directory
# The targets, shown next to the numbers.
TARGETS = {
    "modules over 400 lines": 0,
    "functions over 60 lines (Triton kernels aside)": 3,
    "functions with 8+ parameters (Typer commands, Triton kernels aside)": 15,
    "functions with 8+ parameters (all)": None,
    "import cycles (lazy imports included)": 0,
    # The "1 (the registry)": the registry is the one place, so none outside it. Sites are shown for
    # information; the target counts functions.
    "places that branch on a weight method (registry aside)": None,
    "functions that branch on a weight method (registry aside)": 0,
}


@dataclass
class Module:
    """One source file: its dotted name, path relative to the repository (or --root's parent), and parsed tree."""

    name: str
    path: str
    tree: ast.Module
    lines: int
    is_package: bool


@dataclass
class Function:
    where: str  # path:line
    name: str  # qualified: module.Class.function
    value: int  # lines or parameter count
    aside: str = ""  # why the target sets it aside: "Typer command", "Triton kernel", or "" (it counts)


@dataclass
class Cycle:
    modules: list[str]  # the strongly connected group
    example: list[str]  # one shortest cycle through it, one "a -> b (path:line[, lazy])" step per edge


@dataclass
class Branch:
    where: str  # path:line
    scope: str  # the innermost enclosing function (qualified), or the module
    kind: str
    code: str  # the source line, shortened


@dataclass
class Metrics:
    modules_over_limit: list[Function] = field(default_factory=list)
    long_functions: list[Function] = field(default_factory=list)
    long_triton_kernels: list[Function] = field(default_factory=list)
    many_parameters: list[Function] = field(default_factory=list)
    import_cycles: list[Cycle] = field(default_factory=list)
    method_branches: list[Branch] = field(default_factory=list)


def load_modules(package_dir: Path) -> dict[str, Module]:
    """Every ``.py`` file under ``package_dir``, keyed by dotted module name (``pkg/__init__.py`` -> ``pkg``)."""
    base = package_dir.parent
    modules: dict[str, Module] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        text = path.read_text(encoding="utf-8")
        name = ".".join(parts)
        tree = ast.parse(text, filename=str(path))
        rel = str(path.relative_to(base))
        modules[name] = Module(name, rel, tree, len(text.splitlines()), is_package)
    return modules


def _functions(tree: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """(qualified name, node, is_method) for every function in ``tree``, nested ones included."""
    stack: list[tuple[ast.AST, str, bool]] = [(tree, prefix, False)]
    while stack:
        node, scope, in_class = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualified = f"{scope}.{child.name}"
                yield qualified, child, in_class
                stack.append((child, qualified, False))
            elif isinstance(child, ast.ClassDef):
                stack.append((child, f"{scope}.{child.name}", True))
            else:
                stack.append((child, scope, in_class))


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _triton_jit_names(tree: ast.Module) -> set[str]:
    """Decorator spellings that mean ``triton.jit`` in this module (``triton.jit``, or ``jit`` imported from it)."""
    names = {"triton.jit"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "triton":
            names.update(alias.asname or alias.name for alias in node.names if alias.name == "jit")
        elif isinstance(node, ast.Import):
            names.update(f"{alias.asname}.jit" for alias in node.names if alias.name == "triton" and alias.asname)
    return names


def _parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef, is_method: bool) -> int:
    args = node.args
    named = [*args.posonlyargs, *args.args]
    decorators = {_dotted(d) for d in node.decorator_list}
    if is_method and named and "staticmethod" not in decorators:
        named = named[1:]  # self / cls
    return len(named) + len(args.kwonlyargs)


TYPER_PARAMETERS = frozenset({"typer.Option", "typer.Argument"})


def _has_typer_parameter(node: ast.AST | None) -> bool:
    return node is not None and any(
        isinstance(n, ast.Call) and _dotted(n.func) in TYPER_PARAMETERS for n in ast.walk(node)
    )


def _typer_aliases(modules: dict[str, Module]) -> set[str]:
    """Module-level names bound to ``Annotated[..., typer.Option(...)]`` (or ``typer.Argument``) anywhere."""
    aliases: set[str] = set()
    for module in modules.values():
        for stmt in module.tree.body:
            if isinstance(stmt, ast.Assign) and _has_typer_parameter(stmt.value):
                aliases.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if _has_typer_parameter(stmt.value):  # `X: TypeAlias = Annotated[...]`
                    aliases.add(stmt.target.id)
    return aliases


def _is_typer_command(node: ast.FunctionDef | ast.AsyncFunctionDef, aliases: set[str]) -> bool:
    """A Typer command: a parameter is a CLI flag (its default, or its annotation, is a ``typer.Option`` or
    ``typer.Argument``, directly or through an ``Annotated`` alias)."""
    args = node.args
    defaults = [*args.defaults, *(d for d in args.kw_defaults if d is not None)]
    annotations = [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.annotation]
    return any(_has_typer_parameter(d) for d in defaults) or any(
        _has_typer_parameter(a) or (isinstance(a, ast.Name) and a.id in aliases) for a in annotations
    )


def function_metrics(modules: dict[str, Module], metrics: Metrics) -> None:
    aliases = _typer_aliases(modules)
    for module in modules.values():
        if module.lines > MAX_MODULE_LINES:
            metrics.modules_over_limit.append(Function(module.path, module.name, module.lines))
        jit = _triton_jit_names(module.tree)
        for qualified, node, is_method in _functions(module.tree, module.name):
            where = f"{module.path}:{node.lineno}"
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            is_kernel = any(_dotted(d) in jit for d in node.decorator_list)
            if length > MAX_FUNCTION_LINES:
                target = metrics.long_triton_kernels if is_kernel else metrics.long_functions
                target.append(Function(where, qualified, length))
            count = _parameter_count(node, is_method)
            if count >= MANY_PARAMETERS:
                aside = "Triton kernel" if is_kernel else "Typer command" if _is_typer_command(node, aliases) else ""
                metrics.many_parameters.append(Function(where, qualified, count, aside))
    for items in (
        metrics.modules_over_limit,
        metrics.long_functions,
        metrics.long_triton_kernels,
        metrics.many_parameters,
    ):
        items.sort(key=lambda f: (-f.value, f.name))


def _import_graph() -> types.ModuleType:
    """squeeze/_dev/import_graph.py (the graph the layering test checks), loaded by its path: it is stdlib only,
    while ``import squeeze`` would import torch and transformers (seconds) for this pure-``ast`` script."""
    path = REPO / "squeeze" / "_dev" / "import_graph.py"
    spec = importlib.util.spec_from_file_location("_squeeze_import_graph", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def cycle_metrics(modules: dict[str, Module], package_dir: Path, metrics: Metrics) -> None:
    graph_module = _import_graph()
    edges = graph_module.import_edges(graph_module.all_modules(package_dir))
    graph = graph_module.runtime_graph(edges)
    shown = graph_module.first_edges(edges)
    for group in sorted(graph_module.strongly_connected(graph)):
        cycle = graph_module.shortest_cycle(graph, group)
        steps = []
        for a, b in pairwise(cycle):
            edge = shown[(a, b)]
            steps.append(f"{a} -> {b} ({modules[a].path}:{edge.line}{', lazy' if edge.lazy else ''})")
        metrics.import_cycles.append(Cycle(group, steps))


def _method_literal(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and node.value in METHOD_LITERALS:
        return str(node.value)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        found = [_method_literal(e) for e in node.elts]
        return ",".join(f for f in found if f) or None
    return None


def _weight_class(node: ast.AST) -> str | None:
    names = node.elts if isinstance(node, ast.Tuple) else [node]
    found = [_dotted(n).split(".")[-1] for n in names]
    return ",".join(f for f in found if f in WEIGHT_CLASSES) or None


def _branch_kind(node: ast.AST) -> str | None:
    """What makes ``node`` a branch on the weight method, or None."""
    if isinstance(node, ast.Compare):
        ops = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)
        if any(isinstance(op, ops) for op in node.ops):
            sides = (node.left, *node.comparators)
            if any("quant_method" in ast.unparse(side) for side in sides):
                return None  # the HF quantization config naming the tool (see the module docstring)
            literal = ",".join(f for f in map(_method_literal, sides) if f)
            return f"compare with {literal}" if literal else None
    if isinstance(node, ast.match_case):
        literals = [_method_literal(n.value) for n in ast.walk(node.pattern) if isinstance(n, ast.MatchValue)]
        literal = ",".join(f for f in literals if f)
        return f"match case {literal}" if literal else None
    if isinstance(node, ast.Call) and _dotted(node.func) == "isinstance" and len(node.args) == 2:
        cls = _weight_class(node.args[1])
        return f"isinstance {cls}" if cls else None
    return None


def branch_metrics(modules: dict[str, Module], package_dir: Path, metrics: Metrics) -> None:
    registry = ".".join([package_dir.name, *REGISTRY_DIR])
    for module in modules.values():
        if module.name == registry or module.name.startswith(registry + "."):
            continue
        lines = (package_dir.parent / module.path).read_text(encoding="utf-8").splitlines()
        spans = [(n.lineno, n.end_lineno or n.lineno, q) for q, n, _ in _functions(module.tree, module.name)]
        for node in ast.walk(module.tree):
            kind = _branch_kind(node)
            if kind is not None:
                line = node.pattern.lineno if isinstance(node, ast.match_case) else getattr(node, "lineno", 0)
                where = f"{module.path}:{line}"
                enclosing = [(start, q) for start, end, q in spans if start <= line <= end]
                scope = max(enclosing)[1] if enclosing else module.name
                metrics.method_branches.append(Branch(where, scope, kind, lines[line - 1].strip()[:100]))
    metrics.method_branches.sort(key=lambda b: (b.where.rsplit(":", 1)[0], int(b.where.rsplit(":", 1)[1])))


def collect(package_dir: Path) -> Metrics:
    modules = load_modules(package_dir)
    metrics = Metrics()
    function_metrics(modules, metrics)
    cycle_metrics(modules, package_dir, metrics)
    branch_metrics(modules, package_dir, metrics)
    return metrics


def summary(metrics: Metrics) -> dict[str, int]:
    return {
        "modules over 400 lines": len(metrics.modules_over_limit),
        "functions over 60 lines (Triton kernels aside)": len(metrics.long_functions),
        "Triton kernels over 60 lines": len(metrics.long_triton_kernels),
        "functions with 8+ parameters (Typer commands, Triton kernels aside)": sum(
            not f.aside for f in metrics.many_parameters
        ),
        "functions with 8+ parameters (all)": len(metrics.many_parameters),
        "import cycles (lazy imports included)": len(metrics.import_cycles),
        "places that branch on a weight method (registry aside)": len(metrics.method_branches),
        "functions that branch on a weight method (registry aside)": len({b.scope for b in metrics.method_branches}),
    }


def print_table(metrics: Metrics) -> None:
    counts = summary(metrics)
    width = max(map(len, counts))
    print(f"{'metric':<{width}}  {'now':>5}  {'target':>6}")
    for key, value in counts.items():
        target = TARGETS.get(key)
        print(f"{key:<{width}}  {value:>5}  {'' if target is None else target:>6}")
    sections: list[tuple[str, list[Function]]] = [
        ("Modules over 400 lines", metrics.modules_over_limit),
        ("Functions over 60 lines", metrics.long_functions),
        ("Triton kernels over 60 lines (excepted)", metrics.long_triton_kernels),
        ("Functions with 8+ parameters (those in [brackets] are set aside by the target)", metrics.many_parameters),
    ]
    for title, items in sections:
        if items:
            print(f"\n{title}:")
            for item in items:
                aside = f"  [{item.aside}]" if item.aside else ""
                print(f"  {item.value:>4}  {item.name}  ({item.where}){aside}")
    if metrics.import_cycles:
        print("\nImport cycles:")
        for cycle in metrics.import_cycles:
            print(f"  {len(cycle.modules)} modules: {', '.join(cycle.modules)}")
            for step in cycle.example:
                print(f"      {step}")
    if metrics.method_branches:
        print("\nBranches on a weight method (outside squeeze/quant/schemes/):")
        for branch in metrics.method_branches:
            print(f"  {branch.where} in {branch.scope}: {branch.kind}: {branch.code}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the numbers and lists as JSON")
    parser.add_argument("--root", type=Path, default=REPO / "squeeze", help="the package directory to measure")
    args = parser.parse_args(argv)
    metrics = collect(args.root.resolve())
    if args.json:
        print(json.dumps({"summary": summary(metrics), **asdict(metrics)}, indent=2))
    else:
        print_table(metrics)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `| head` closed the pipe: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        sys.exit(0)
