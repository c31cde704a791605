"""The server's wings keep apart: an HTTP route module imports no other route module (what the routes share
is in `server/http/common.py`), and no WebSocket module imports an HTTP route module (what both wings share,
such as the Responses API's core, lives outside `server/http/`). Every import statement counts, at module
level, inside functions and under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "streamd" / "server"
HTTP = "streamd.server.http"
NOT_ROUTES = frozenset({HTTP, f"{HTTP}.common"})  # the package and what the routes share


def _module_name(path: Path) -> str:
    parts = path.relative_to(SERVER.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The modules (or packages) `path` imports; `from pkg import mod` counts as `pkg.mod`."""
    name = _module_name(path)
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
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _route_modules() -> set[str]:
    return {_module_name(p) for p in (SERVER / "http").glob("*.py")} - NOT_ROUTES


def _route_imports(folder: str) -> dict[str, set[str]]:
    """Module of `server/<folder>/` -> the HTTP route modules it imports (itself left out)."""
    routes = _route_modules()
    return {
        _module_name(path): (_imports(path) & routes) - {_module_name(path)}
        for path in sorted((SERVER / folder).glob("*.py"))
    }


def test_the_rule_sees_the_route_modules() -> None:
    routes = _route_modules()
    assert {f"{HTTP}.openai_routes", f"{HTTP}.responses_api", f"{HTTP}.tokenize_api"} <= routes
    assert _imports(SERVER / "app.py") & routes, "the app lists the routes: the import reader missed them"


def test_http_route_modules_import_no_other_route_module() -> None:
    offenders = {name: found for name, found in _route_imports("http").items() if found}
    assert offenders == {}, "share through streamd/server/http/common.py instead"


def test_websocket_modules_import_no_http_route_module() -> None:
    offenders = {name: found for name, found in _route_imports("ws").items() if found}
    assert offenders == {}, "move what both wings share out of streamd/server/http/"
