"""`GET /v1/server-info` and the chat page's static files: open without a key; the model's name only to
a caller that may use the API."""

from __future__ import annotations

import httpx

from streamd import __version__
from streamd.engine.client.async_engine import AsyncEngine
from tests.server.util import Server, running_server

PAGE_FILES = ["/static/chat.js", "/static/render.js", "/static/engine_view.js", "/static/chat.css",
              "/static/vendor/marked.umd.js", "/static/vendor/purify.min.js", "/static/vendor/marked.LICENSE",
              "/static/vendor/dompurify.LICENSE"]


async def test_server_info_without_keys(server: Server, async_engine: AsyncEngine) -> None:
    async with httpx.AsyncClient(base_url=server.http) as http:
        info = (await http.get("/v1/server-info")).json()
    assert info == {"object": "server_info", "auth_required": False, "status": "ready", "version": __version__,
                    "model": server.services.model_name, "max_model_len": async_engine.max_model_len}


async def test_server_info_and_page_files_with_keys(async_engine: AsyncEngine) -> None:
    async with running_server(async_engine, api_keys=["k1"]) as srv, httpx.AsyncClient(base_url=srv.http) as http:
        anonymous = (await http.get("/v1/server-info")).json()
        wrong = (await http.get("/v1/server-info", headers={"Authorization": "Bearer nope"})).json()
        keyed = (await http.get("/v1/server-info", headers={"Authorization": "Bearer k1"})).json()
        files = {path: await http.get(path) for path in ["/", "/favicon.ico", *PAGE_FILES]}
        private = (await http.get("/v1/models")).status_code
    assert anonymous["auth_required"] and anonymous["model"] is None and anonymous["max_model_len"] is None
    assert wrong == anonymous
    assert keyed["model"] == srv.services.model_name and keyed["max_model_len"] == async_engine.max_model_len
    assert {path: r.status_code for path, r in files.items()} == {path: 200 for path in files}
    assert files["/favicon.ico"].headers["content-type"] == "image/svg+xml"
    assert files["/favicon.ico"].text.startswith("<svg")
    assert private == 401
