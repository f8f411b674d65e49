"""The import graph of squeeze: no cycles (lazy imports included), and quant/ imports nothing above it.

The graph is :mod:`squeeze._dev.import_graph`'s (read from the source with ``ast``, nothing imported; its
docstring says what counts as an edge). Imports under ``if TYPE_CHECKING:`` never run, so they are left out
of the cycle check; the layer rule (quant/ imports nothing above it) counts them, since they are
dependencies all the same.
"""

from __future__ import annotations

from pathlib import Path

import squeeze
from squeeze._dev.import_graph import (
    Edge,
    all_modules,
    first_edges,
    import_edges,
    runtime_graph,
    shortest_cycle,
    strongly_connected,
)

ROOT = Path(squeeze.__file__).resolve().parent

#: Import edges (importer -> imported) known to close a cycle, in modules whose owner has not yet broken it.
#: Each entry is checked: it must still exist and still lie on a cycle, so fixing a cycle fails this test
#: until its entry is removed. The goal is an empty set.
KNOWN_CYCLE_EDGES: frozenset[tuple[str, str]] = frozenset()

#: What squeeze/quant may import from squeeze: the bottom layer (errors, limits) and itself.
QUANT_ALLOWED = ("squeeze.errors", "squeeze.limits", "squeeze.quant")


def describe_cycles(graph: dict[str, set[str]], edges: list[Edge]) -> list[str]:
    shown = first_edges(edges)
    out = []
    for component in strongly_connected(graph):
        path = shortest_cycle(graph, component)
        hops = [f"{a} (line {shown[(a, b)].line})" for a, b in zip(path, path[1:], strict=False)]
        out.append(" -> ".join([*hops, path[-1]]) + f"   [{len(component)} modules in this knot]")
    return out


def cycle_problems(edges: list[Edge], known: frozenset[tuple[str, str]] = KNOWN_CYCLE_EDGES) -> list[str]:
    """Every import cycle left once the ``known`` edges are set aside, and every ``known`` edge that no longer
    closes one (stale: it must leave the allowlist)."""
    full = runtime_graph(edges)
    knot_of = {m: i for i, component in enumerate(strongly_connected(full)) for m in component}
    stale = sorted(
        pair
        for pair in known
        if pair[1] not in full.get(pair[0], set()) or knot_of.get(pair[0], -1) != knot_of.get(pair[1], -2)
    )
    problems = [f"KNOWN_CYCLE_EDGES entry {a} -> {b} no longer closes a cycle: remove it" for a, b in stale]
    cycles = describe_cycles(runtime_graph(edges, known), edges)
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
    pairs = {(e.importer, e.imported, e.type_only, e.lazy) for e in edges}
    assert ("squeeze.sub.a", "squeeze.sub.b", False, False) in pairs  # relative, submodule
    assert ("squeeze.sub.b", "squeeze.c", False, True) in pairs  # lazy, submodule of the package
    assert ("squeeze.c", "squeeze.sub", False, False) in pairs  # squeeze.sub's __init__ runs first
    assert ("squeeze.c", "squeeze.d", True, False) in pairs  # type-only
    assert ("squeeze.d", "squeeze.sub", False, False) in pairs  # a name re-exported by the package
    assert not any(p[:2] == ("squeeze.sub.a", "squeeze.sub") for p in pairs)  # its own package is running
    knot = ["squeeze.c", "squeeze.sub", "squeeze.sub.a", "squeeze.sub.b"]
    graph = runtime_graph(edges)
    assert strongly_connected(graph) == [knot]
    assert shortest_cycle(graph, knot) == ["squeeze.c", "squeeze.sub.a", "squeeze.sub.b", "squeeze.c"]  # a shortest one
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
    problems = cycle_problems(import_edges(all_modules(ROOT)))
    assert not problems, "\n".join(problems)


def test_quant_imports_nothing_above_it() -> None:
    bad = layer_violations(import_edges(all_modules(ROOT)))
    assert not bad, "squeeze/quant is pure tensor code over squeeze.errors and squeeze.limits:\n" + "\n".join(bad)
