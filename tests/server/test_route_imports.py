"""The server's wings keep apart: an HTTP route module imports no other route module (what the routes share
is in `server/http/common.py` and, for background responses, `background_routes.py`), and no WebSocket module
imports an HTTP route module (what both wings share, such as the Responses API's core, lives outside
`server/http/`). Every import statement counts, at module level, inside functions and under
`if TYPE_CHECKING:`."""

from __future__ import annotations

from tests.import_scan import graph, modules

HTTP = "streamd.server.http"
NOT_ROUTES = frozenset({HTTP, f"{HTTP}.common", f"{HTTP}.background_routes"})  # the package, what routes share
IMPORTS = graph(modules())


def _route_modules() -> set[str]:
    return {name for name in IMPORTS if name.startswith(f"{HTTP}.")} - NOT_ROUTES


def _route_imports(folder: str) -> dict[str, set[str]]:
    """Module of `server/<folder>/` -> the HTTP route modules it imports."""
    routes, wing = _route_modules(), f"streamd.server.{folder}."
    return {name: targets & routes for name, targets in sorted(IMPORTS.items()) if name.startswith(wing)}


def test_the_rule_sees_the_route_modules() -> None:
    routes = _route_modules()
    assert {f"{HTTP}.openai_routes", f"{HTTP}.responses_api", f"{HTTP}.tokenize_api"} <= routes
    assert IMPORTS["streamd.server.app"] & routes, "the app lists the routes: the import reader missed them"


def test_http_route_modules_import_no_other_route_module() -> None:
    offenders = {name: found for name, found in _route_imports("http").items() if found}
    assert offenders == {}, "share through streamd/server/http/common.py instead"


def test_websocket_modules_import_no_http_route_module() -> None:
    offenders = {name: found for name, found in _route_imports("ws").items() if found}
    assert offenders == {}, "move what both wings share out of streamd/server/http/"
