"""servelm's own import graph, read from the source (every `import` of a servelm module, at module level, in
a function, or under TYPE_CHECKING): no cycles, and the layering the code relies on (layers/ never reaches
into managers/; the serve backends take their argv helpers from the plugin API, not from `servelm serve`'s
own command module)."""

from __future__ import annotations

import ast
from pathlib import Path

import servelm

ROOT = Path(servelm.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                    node.module.split(".")[0] == "servelm":
                for alias in node.names:
                    dep = owner(f"{node.module}.{alias.name}") or owner(node.module)
                    if dep:
                        deps.add(dep)
            elif isinstance(node, ast.Import):
                deps.update(d for alias in node.names if alias.name.split(".")[0] == "servelm"
                            and (d := owner(alias.name)))
        deps.discard(name)
        # a package's __init__ is imported with any of its modules: not a dependency of its own modules
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert "servelm.entrypoints.http_server" in graph["servelm.entrypoints.launch"]
    assert "servelm.managers.scheduler" in graph["servelm.managers.engine_core"]  # a function-level import too
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_layering() -> None:
    graph = _graph()
    bad = [(m, d) for m, deps in graph.items() for d in deps
           if (m.startswith("servelm.layers") and d.startswith("servelm.managers"))
           or (m.startswith(("servelm.backends", "servelm.diffusion")) and d == "servelm.cli.serve")]
    assert bad == []
