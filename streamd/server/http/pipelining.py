"""uvicorn's httptools protocol, telling every unfinished request of a connection that its client left.

With pipelined requests uvicorn keeps only the newest parsed request (`cycle`); when the connection is
lost it marks that one disconnected, so a request already running (an SSE stream, a request waiting for
its disconnect) never learns that its client is gone: it generates on into a dead socket, or, paused by
`Backpressure`, holds its KV blocks until the server stops (issue 35, D13). `PipelinedHttpProtocol`
remembers the connection's unfinished requests and disconnects them all.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class PipelinedHttpProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.earlier: list[RequestResponseCycle] = []  # requests parsed before `cycle`, not yet answered

    def on_headers_complete(self) -> None:
        previous = self.cycle
        super().on_headers_complete()
        self.earlier = [c for c in self.earlier if not c.response_complete]
        if previous is not None and previous is not self.cycle and not previous.response_complete:
            self.earlier.append(previous)

    def connection_lost(self, exc: Exception | None) -> None:
        for cycle in self.earlier:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        self.earlier = []
        super().connection_lost(exc)
