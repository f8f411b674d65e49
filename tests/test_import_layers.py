"""The import graph of squeeze: no cycles (lazy imports included), and quant/ imports nothing above it.

The graph is built from the source with ``ast`` (nothing is imported): every ``import`` / ``from ... import``
anywhere in a module, function bodies included, is an edge. Rules:

* ``from pkg import name`` is an edge to the submodule ``pkg.name`` when there is one, else to ``pkg``
  itself (its ``__init__``): the name is read from the package, so the package must have run by then.
* Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__`` first, so it adds edges to those packages,
  except to packages that contain the importer: those have started running before the importer did (a
  module inside ``squeeze.quant`` importing ``squeeze.quant.kmeans`` does not run ``squeeze/quant/__init__``
  again). An explicit ``from squeeze.quant import NAME`` of a re-exported name does count: it needs the
  ``__init__`` to have got that far, and a cycle through it is a real import-time cycle.
* Imports under ``if TYPE_CHECKING:`` never run, so they are left out of the cycle check; the layer rule
  (quant/ imports nothing above it) counts them, since they are dependencies all the same.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import squeeze

ROOT = Path(squeeze.__file__).resolve().parent

#: Import edges (importer -> imported) known to close a cycle, in modules whose owner has not yet broken it.
#: Each entry is checked: it must still exist and still lie on a cycle, so fixing a cycle fails this test
#: until its entry is removed. The goal is an empty set.
KNOWN_CYCLE_EDGES: frozenset[tuple[str, str]] = frozenset()

#: What squeeze/quant may import from squeeze: the bottom layer (errors, limits) and itself.
QUANT_ALLOWED = ("squeeze.errors", "squeeze.limits", "squeeze.quant")


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    type_only: bool


def module_name(path: Path, root: Path = ROOT) -> str:
    """squeeze/quant/kv.py -> squeeze.quant.kv; squeeze/quant/__init__.py -> squeeze.quant."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, type_only: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``tree``, nested ones included, with whether only type checkers run it."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), type_only)
        else:
            yield from _imports(node, type_only)


def _resolve_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a ``from X import ...`` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The squeeze modules an import statement names (packages read from included)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    source = _resolve_from(node, importer, is_package)
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        out.append(sub if sub in modules else source)
    return out


def _with_packages(target: str, importer: str) -> list[str]:
    """``target`` and the packages importing it runs first, less those that contain ``importer``."""
    parts = target.split(".")
    chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [m for m in chain if m == target or not (importer == m or importer.startswith(m + "."))]


def import_edges(modules: dict[str, Path] | None = None) -> list[Edge]:
    """Every squeeze -> squeeze import edge (see the module docstring for what counts)."""
    modules = all_modules() if modules is None else modules
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node, type_only in _imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, name, is_package, modules):
                for module in _with_packages(target, name):
                    if module in modules and module != name:
                        edges.append(Edge(name, module, node.lineno, type_only))
    return edges


def _graph(edges: list[Edge], skip: frozenset[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        if not e.type_only and (e.importer, e.imported) not in skip:
            graph.setdefault(e.importer, set()).add(e.imported)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (every cycle lies inside one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    nodes = sorted(set(graph) | {t for targets in graph.values() for t in targets})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]  # iterative DFS: no recursion limit
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
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
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


def cycle_in(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the first module of ``component``, as a path that ends where it starts."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth-first, so the reported cycle is a shortest one through ``start``
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
    raise AssertionError(f"{component} is not strongly connected")


def describe_cycles(graph: dict[str, set[str]], edges: list[Edge]) -> list[str]:
    lines = {(e.importer, e.imported): e.line for e in edges}
    out = []
    for component in strongly_connected(graph):
        path = cycle_in(graph, component)
        hops = [f"{a} (line {lines[(a, b)]})" for a, b in zip(path, path[1:], strict=False)]
        out.append(" -> ".join([*hops, path[-1]]) + f"   [{len(component)} modules in this knot]")
    return out


def cycle_problems(edges: list[Edge], known: frozenset[tuple[str, str]] = KNOWN_CYCLE_EDGES) -> list[str]:
    """Every import cycle left once the ``known`` edges are set aside, and every ``known`` edge that no longer
    closes one (stale: it must leave the allowlist)."""
    full = _graph(edges)
    knot_of = {m: i for i, component in enumerate(strongly_connected(full)) for m in component}
    stale = sorted(
        pair
        for pair in known
        if pair[1] not in full.get(pair[0], set()) or knot_of.get(pair[0], -1) != knot_of.get(pair[1], -2)
    )
    problems = [f"KNOWN_CYCLE_EDGES entry {a} -> {b} no longer closes a cycle: remove it" for a, b in stale]
    cycles = describe_cycles(_graph(edges, known), edges)
    return problems + [f"import cycle: {c}" for c in cycles]


def layer_violations(edges: list[Edge]) -> list[str]:
    """Imports from squeeze/quant of anything but QUANT_ALLOWED (type-only ones included)."""

    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted(
        f"{e.importer} imports {e.imported} (line {e.line})"
        for e in edges
        if within(e.importer, "squeeze.quant") and not any(within(e.imported, ok) for ok in QUANT_ALLOWED)
    )


def _toy_package(root: Path) -> Path:
    """squeeze.sub/__init__ -> sub.a -> sub.b -(lazy)-> c -> sub.a: a cycle closed only by a function-level
    import; d reads a name re-exported by squeeze.sub; c imports d for type checkers only."""
    pkg = root / "squeeze"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from squeeze.sub.a import A\n")
    (pkg / "sub" / "a.py").write_text("from . import b\nA = 1\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from squeeze import c\n")
    (pkg / "c.py").write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    import squeeze.d\nfrom squeeze.sub import a\n"
    )
    (pkg / "d.py").write_text("from squeeze.sub import A\n")
    return pkg


def test_the_graph_sees_lazy_relative_and_submodule_imports(tmp_path: Path) -> None:
    edges = import_edges(all_modules(_toy_package(tmp_path)))
    pairs = {(e.importer, e.imported, e.type_only) for e in edges}
    assert ("squeeze.sub.a", "squeeze.sub.b", False) in pairs  # relative, submodule
    assert ("squeeze.sub.b", "squeeze.c", False) in pairs  # lazy, submodule of the package
    assert ("squeeze.c", "squeeze.sub", False) in pairs  # squeeze.sub's __init__ runs first
    assert ("squeeze.c", "squeeze.d", True) in pairs  # type-only
    assert ("squeeze.d", "squeeze.sub", False) in pairs  # a name re-exported by the package
    assert ("squeeze.sub.a", "squeeze.sub", False) not in pairs  # its own package is already running
    knot = ["squeeze.c", "squeeze.sub", "squeeze.sub.a", "squeeze.sub.b"]
    graph = _graph(edges)
    assert strongly_connected(graph) == [knot]
    assert cycle_in(graph, knot) == ["squeeze.c", "squeeze.sub.a", "squeeze.sub.b", "squeeze.c"]  # a shortest one
    assert describe_cycles(graph, edges) == [
        "squeeze.c (line 4) -> squeeze.sub.a (line 1) -> squeeze.sub.b (line 2) -> squeeze.c   [4 modules in this knot]"
    ]


def test_the_allowlist_hides_only_live_cycles(tmp_path: Path) -> None:
    edges = import_edges(all_modules(_toy_package(tmp_path)))
    assert len(cycle_problems(edges, frozenset())) == 1
    assert cycle_problems(edges, frozenset({("squeeze.sub.b", "squeeze.c")})) == []  # the lazy import
    # an allowlisted edge that does not exist, or lies on no cycle, is stale
    assert cycle_problems(edges, frozenset({("squeeze.sub.b", "squeeze.c"), ("squeeze.d", "squeeze.sub")})) == [
        "KNOWN_CYCLE_EDGES entry squeeze.d -> squeeze.sub no longer closes a cycle: remove it"
    ]


def test_the_quant_rule_counts_lazy_imports(tmp_path: Path) -> None:
    pkg = _toy_package(tmp_path)
    (pkg / "quant").mkdir()
    (pkg / "quant" / "__init__.py").write_text("from squeeze.quant import x\n")
    (pkg / "quant" / "x.py").write_text("import squeeze.limits\ndef f():\n    from squeeze import sub\n")
    assert layer_violations(import_edges(all_modules(pkg))) == ["squeeze.quant.x imports squeeze.sub (line 3)"]


def test_no_import_cycles() -> None:
    problems = cycle_problems(import_edges())
    assert not problems, "\n".join(problems)


def test_quant_imports_nothing_above_it() -> None:
    bad = layer_violations(import_edges())
    assert not bad, "squeeze/quant is pure tensor code over squeeze.errors and squeeze.limits:\n" + "\n".join(bad)
