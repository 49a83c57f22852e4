"""The package's folders are its layers: a module imports only from its own layer or lower ones,
and no set of modules imports each other in a loop (type-only and function-level imports
included). docs/ARCHITECTURE.md describes the layers; this keeps them true."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import keyexpiry

PACKAGE = Path(keyexpiry.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    # 0: the process's basics and what a key is; no settings, no connections
    (
        "errors", "keys", "limits", "tags", "tracing", "clock", "threads", "log", "printable",
        "context", "arguments",
        "masking", "malloc",
    ),
    ("redis",),  # 1: Redis servers and clients, arming keys (each kind parses its own URL)
    # 2: settings, what may run, what a run observes (flow control, pauses)
    (
        "settings", "registry", "retries", "results", "payloads", "run_metrics", "flow",
        "schedules.recurrence", "schedules.rules", "schedules",
    ),
    ("ledger",),  # 3: the SQL ledger
    ("runtime",),  # 4: settings -> connections, once
    ("client", "creates", "aio", "schedules.operate"),  # 5: business code's side
    ("runner",),  # 6: claim, run, record
    ("ops", "web"),  # 7: what operators watch (a listener only through ops.observed)
    ("listener",),  # 8: hear, route, repair
    ("__init__", "__main__", "cli", "demo", "bench", "django"),  # 9: entry points, the benchmark
)  # fmt: skip
"""Each entry names a top-level module or a sub-package of `keyexpiry`."""

_LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    """`keyexpiry.a.b` for PACKAGE/a/b.py (a package's __init__ is the package)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def level_of(module: str) -> int:
    """The layer of `keyexpiry.<a>.<b>…`: the longest of `a.b…`, …, `a` that a layer names (a
    feature folder's modules may sit on different layers); KeyError when none does."""
    parts = module.split(".")
    if len(parts) == 1:
        return _LEVEL["__init__"]
    for end in range(len(parts), 1, -1):
        name = ".".join(parts[1:end])
        if name in _LEVEL:
            return _LEVEL[name]
    raise KeyError(module)


def imports(path: Path, known: set[str]) -> Iterator[tuple[int, str]]:
    """(line, module) of every keyexpiry module `path` imports, wherever the import stands."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "keyexpiry":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "keyexpiry":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield node.lineno, sub if sub in known else node.module


def graph() -> dict[str, list[tuple[int, str]]]:
    """Every module of the package with the keyexpiry modules it imports."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {name: list(imports(path, known)) for name, path in sorted(paths.items())}


def upward(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Imports from a module into a higher layer, as `module:line -> imported`."""
    return [
        f"{mod}:{line} -> {target}"
        for mod, targets in edges.items()
        for line, target in targets
        if target != "keyexpiry" and level_of(target) > level_of(mod)
    ]


def loops(edges: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for _, w in edges.get(v, []):
            if w == "keyexpiry" or w == v:
                continue  # the package's __init__ re-exports the API; everything may import it
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = []
    for mod in graph():
        try:
            level_of(mod)
        except KeyError:
            unplaced.append(mod)
    assert unplaced == [], "add these to LAYERS (and to docs/ARCHITECTURE.md)"


def test_no_module_imports_a_higher_layer() -> None:
    assert upward(graph()) == []


def test_no_modules_import_each_other_in_a_loop() -> None:
    assert loops(graph()) == []


@pytest.mark.parametrize(
    ("module", "imported"),
    [("keyexpiry.ledger.rows", "keyexpiry.listener.listener"), ("keyexpiry.keys", "keyexpiry.cli")],
)
def test_the_check_fails_on_an_upward_import(module: str, imported: str) -> None:
    edges = graph()
    edges[module] = [*edges[module], (1, imported)]
    assert upward(edges) == [f"{module}:1 -> {imported}"]
    assert loops(edges) != [] or imported == "keyexpiry.cli"
