"""No import cycles in `streamd/`: every import statement counts, at module level, inside functions and
under `if TYPE_CHECKING:`. An edge goes to the module imported (`from pkg import mod` to `pkg.mod` when that
is a module), never to the parent packages Python initialises on the way."""

from __future__ import annotations

from pathlib import Path

from tests.import_scan import cycles as _cycles
from tests.import_scan import edges as _edges
from tests.import_scan import modules as _modules


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
