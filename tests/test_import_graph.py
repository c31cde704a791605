"""No import cycles in `streamd/`: every import statement counts, at module level, inside functions and
under `if TYPE_CHECKING:`. An edge goes to the module imported (`from pkg import mod` to `pkg.mod` when that
is a module), never to the parent packages Python initialises on the way."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "streamd"


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        edges.update(t for t in targets if t in modules and t != name)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 40 and any(graph.values()), "the graph was not read"
    assert _cycles(graph) == []


def test_the_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_statement_is_an_edge(tmp_path: Path) -> None:
    """Relative imports at any depth, `from pkg import module`, imports inside functions and under
    TYPE_CHECKING each give an edge to the module imported, never to its parent packages."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\nfrom . import b\n"
                     "from .sub import c as _c\nif TYPE_CHECKING:\n    from pkg.d import X\n\n"
                     "def f():\n    import pkg.e\n"),
        "pkg/b.py": "", "pkg/d.py": "X = 1\n", "pkg/e.py": "",
        "pkg/sub/__init__.py": "from .c import *\n",
        "pkg/sub/c.py": "from ..d import X\nfrom .. import e, b\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules = _modules(tmp_path / "pkg")
    assert set(modules) == {"pkg", "pkg.a", "pkg.b", "pkg.d", "pkg.e", "pkg.sub", "pkg.sub.c"}
    assert _edges("pkg.a", modules["pkg.a"], modules) == {"pkg.b", "pkg.sub.c", "pkg.d", "pkg.e"}
    assert _edges("pkg.sub", modules["pkg.sub"], modules) == {"pkg.sub.c"}
    assert _edges("pkg.sub.c", modules["pkg.sub.c"], modules) == {"pkg.d", "pkg.e", "pkg.b"}
