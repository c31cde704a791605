"""The import statements of a package, read from its source (nothing is imported): the helpers behind
tests/test_import_graph.py (no cycles) and tests/test_layers.py (which layer may import which).

Every import statement counts: at module level, inside functions and under `if TYPE_CHECKING:`. Relative
imports are made absolute. `from pkg import name` names the module `pkg.name` when that is a module of the
package, else `pkg`; `import a.b.c` names `a.b.c`, never the parent packages Python initialises on the way.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "streamd"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> source file, for every module and package under `root` (named from its parent)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every name the import statements of module `name` (source `path`) import, third-party ones included
    (`torch.nn`, `numpy`); `known` (the package's modules) decides whether `from pkg import x` names a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return found


def edges(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that module `name` imports (itself excluded)."""
    return {target for target in imports(name, path, known) if target in known and target != name}


def graph(known: dict[str, Path]) -> dict[str, set[str]]:
    return {name: edges(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
