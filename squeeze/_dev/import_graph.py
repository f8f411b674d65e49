"""The import graph of a package, read from its source with ``ast`` (nothing is imported).

One graph for the two readers that need it: the layering test (no cycles, quant/ imports nothing above it)
and scripts/dev/house_metrics.py (import cycles counted and shown). Every ``import`` / ``from ... import``
anywhere in a module is an edge, function bodies included (``lazy``). Rules:

* ``from pkg import name`` is an edge to the submodule ``pkg.name`` when there is one, else to ``pkg``
  itself (its ``__init__``): the name is read from the package, so the package must have run by then.
* Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__`` first, so it adds edges to those packages,
  except to packages that contain the importer: those have started running before the importer did (a
  module inside ``squeeze.quant`` importing ``squeeze.quant.kmeans`` does not run ``squeeze/quant/__init__``
  again). An explicit ``from squeeze.quant import NAME`` of a re-exported name does count: it needs the
  ``__init__`` to have got that far, and a cycle through it is a real import-time cycle.
* Imports under ``if TYPE_CHECKING:`` never run (``type_only``): :func:`runtime_graph` leaves them out;
  a layer rule may count them, since they are dependencies all the same.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass(frozen=True)
class Edge:
    """``importer`` imports ``imported`` at ``line``; ``type_only``: under TYPE_CHECKING; ``lazy``: in a function."""

    importer: str
    imported: str
    line: int
    type_only: bool
    lazy: bool


def module_name(path: Path, root: Path) -> str:
    """root/quant/kv.py -> squeeze.quant.kv (``root``: the package directory, here squeeze/); __init__ -> the
    package's name."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, type_only: bool = False, lazy: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement under ``tree``, nested ones included: (node, type_only, lazy)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only, lazy
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True, lazy)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), type_only, lazy)
        else:
            yield from _imports(node, type_only, lazy or isinstance(node, _SCOPES))


def _resolve_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a ``from X import ...`` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The modules an import statement names (packages read from included)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    source = _resolve_from(node, importer, is_package)
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]


def _with_packages(target: str, importer: str) -> list[str]:
    """``target`` and the packages importing it runs first, less those that contain ``importer``."""
    parts = target.split(".")
    chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [m for m in chain if m == target or not (importer == m or importer.startswith(m + "."))]


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    """Every import edge between ``modules`` (:func:`all_modules`), in source order (see the module docstring)."""
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node, type_only, lazy in _imports(tree):
            for target in _targets(node, name, is_package, modules):
                for module in _with_packages(target, name):
                    if module in modules and module != name:
                        edges.append(Edge(name, module, node.lineno, type_only, lazy))
    return edges


def runtime_graph(edges: list[Edge], skip: frozenset[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    """importer -> the modules it imports when it runs (type-only edges and the ``skip`` pairs left out)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if not e.type_only and (e.importer, e.imported) not in skip:
            graph.setdefault(e.importer, set()).add(e.imported)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (every cycle lies inside one), each
    sorted, in the order found (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(set(graph) | {t for targets in graph.values() for t in targets}):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = [stack.pop()]
                    while component[-1] != node:
                        component.append(stack.pop())
                    on_stack.difference_update(component)
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the first module of ``component`` (breadth-first), as a path that ends where
    it starts. ValueError when ``component`` is not strongly connected."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, set()) & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise ValueError(f"{component} is not strongly connected")


def first_edges(edges: list[Edge]) -> dict[tuple[str, str], Edge]:
    """The edge to show for each (importer, imported) pair that runs: the first eager one, else the first lazy
    one (the cycle shown is then the one that bites at import time)."""
    shown: dict[tuple[str, str], Edge] = {}
    for e in edges:
        pair = (e.importer, e.imported)
        if not e.type_only and (pair not in shown or (shown[pair].lazy and not e.lazy)):
            shown[pair] = e
    return shown


__all__ = [
    "Edge",
    "module_name",
    "all_modules",
    "import_edges",
    "runtime_graph",
    "strongly_connected",
    "shortest_cycle",
    "first_edges",
]
