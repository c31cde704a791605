"""Resumable WebSocket requests: resume tokens, retained output, and the grace after a dropped socket.

Every request admitted on `/v1/stream` while `server.resume_grace_s` > 0 is resumable. Its `start` frame
carries a `resume_token`: a random handle and an HMAC-SHA256 of it under a secret made at start-up (so a
token is unguessable, only this server process accepts it, and no internal request id appears in it).
The request is also bound to the API key that created it (a hash of it is kept) and to its client id.

Every frame built for it after `start` (deltas with their `seq`, error, done) is retained, counted in
tokens. While its socket is up, only the newest frames are kept: at most half of
`server.resume_max_tokens_per_request`, and fewer when all requests' retained output would pass
`server.resume_max_tokens_total` (those frames were written to a live socket long before; what a cut can
lose is what was in flight). A resume asking for a dropped frame is refused (`resume_expired`), never
answered with a gap. When its socket drops the request is *detached*: it keeps generating for the grace
period and nothing more is dropped; a request whose retained output would then pass either bound is
aborted with an error saying so (never truncated silently). A `resume` frame on a new socket replays the
frames after the client's `after_seq` and the live stream continues there. When the grace ends first,
the request is aborted (its blocks freed) and its id is remembered as expired. A finished request stays
resumable for the grace period after its `done` was written (a write to a socket that then dies before
the bytes arrive looks delivered: its tail would be lost), unless the client acknowledges the `done`
with an `ack` frame (same token): then its retained output is released at once.

The store holds `Resumable` objects (the socket's request records, ws.py) and knows nothing of sockets.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamd.server.errors import ServiceError
from streamd.server.metrics import Metrics

Frame = dict[str, Any]
_TOMBSTONES = 4096  # ended resumable ids remembered, so a late resume hears why


class Resumable(Protocol):
    """A resumable request as the store sees it."""

    client_id: str
    finished: bool  # its done frame is built

    def expire(self, reason: str, cause: str) -> None: ...


@dataclass(slots=True)
class Retention:
    """One resumable request's retained frames and its binding."""

    handle: str  # the token's random part (not the engine's request id, which never leaves the server)
    client_id: str
    key_hash: str
    owner: Resumable
    store: ResumeStore
    frames: deque[tuple[Frame, int]] = field(default_factory=deque)  # (frame, its tokens)
    tokens: int = 0
    dropped_seq: int = -1  # the newest delta seq dropped from the front (-1: none)
    detached: bool = False
    timer: asyncio.TimerHandle | None = None  # the grace timer while detached, or after its done was written

    def replay_after(self, after_seq: int) -> list[Frame]:
        """The frames a client that has every delta up to `after_seq` is missing (-1: all of them)."""
        frames = [frame for frame, _ in self.frames]
        start = 0
        for i, frame in enumerate(frames):
            if frame.get("type") == "delta" and frame["seq"] <= after_seq:
                start = i + 1
        return frames[start:]

    @property
    def last_seq(self) -> int:
        return next((f["seq"] for f, _ in reversed(self.frames) if f.get("type") == "delta"), self.dropped_seq)

    def drop_oldest(self) -> int:
        """Drops the oldest frame; returns its tokens."""
        frame, tokens = self.frames.popleft()
        if frame.get("type") == "delta":
            self.dropped_seq = frame["seq"]
        self.tokens -= tokens
        return tokens


class ResumeStore:
    """The server's resumable requests (by token handle), their retained output and the tombstones of
    those that ended undelivered. Lives on the event loop."""

    def __init__(self, grace_s: float, max_tokens_per_request: int, max_tokens_total: int, metrics: Metrics):
        self.grace_s = grace_s
        self.max_tokens_per_request = max_tokens_per_request
        self.max_tokens_total = max_tokens_total
        self.total_tokens = 0
        self._metrics = metrics
        self._secret = secrets.token_bytes(32)
        self.closing = False  # the server drains: requests whose socket drops are cancelled at once
        self._live: dict[str, Retention] = {}  # handle ->
        self._ended: OrderedDict[str, str] = OrderedDict()  # handle -> why it is gone

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0

    def __len__(self) -> int:
        return len(self._live)

    # ---- while it runs ------------------------------------------------------------------------
    def open(self, client_id: str, api_key: str | None, owner: Resumable) -> tuple[Retention, str]:
        """Starts retaining a request; returns its retention and its resume token."""
        handle = secrets.token_urlsafe(12)
        retention = Retention(handle, client_id, _key_hash(api_key), owner, self)
        self._live[handle] = retention
        return retention, f"{handle}.{self._mac(handle)}"

    def retain(self, retention: Retention, frame: Frame, tokens: int) -> str | None:
        """Keeps a frame; returns why the request must be aborted when, detached, it would pass a bound
        (attached, it drops its oldest frames instead)."""
        retention.frames.append((frame, tokens))
        retention.tokens += tokens
        self.total_tokens += tokens
        if not retention.detached:
            while retention.frames and (
                retention.tokens * 2 > self.max_tokens_per_request or self.total_tokens > self.max_tokens_total
            ):
                self.total_tokens -= retention.drop_oldest()
            return None
        if retention.tokens > self.max_tokens_per_request:
            return (
                f"its output retained for a resume passed server.resume_max_tokens_per_request "
                f"({self.max_tokens_per_request} tokens)"
            )
        if self.total_tokens > self.max_tokens_total:
            return (
                f"the server's output retained for resumes passed server.resume_max_tokens_total "
                f"({self.max_tokens_total} tokens)"
            )
        return None

    def release(self, retention: Retention, reason: str | None = None) -> None:
        """Lets go of a request's retained output (delivered, or `reason`: why a resume is now refused)."""
        if self._live.pop(retention.handle, None) is None:
            return
        self.total_tokens -= retention.tokens
        retention.frames, retention.tokens = deque(), 0
        self._stop_timer(retention)
        if reason is not None:
            self._ended[retention.handle] = reason
            while len(self._ended) > _TOMBSTONES:
                self._ended.popitem(last=False)

    def delivered(self, retention: Retention) -> None:
        """Its `done` was written to a live socket: it stays resumable for the grace period (the bytes may
        not arrive), or until the client's `ack`."""
        if retention.handle not in self._live:
            return  # acknowledged already
        self._stop_timer(retention)
        retention.timer = asyncio.get_running_loop().call_later(self.grace_s, self.release, retention)

    def acknowledge(self, client_id: str, token: Any, api_key: str | None) -> None:
        """The client has a finished request's `done`: its retained output goes. Raises ServiceError for a
        token that is not this request's, or a request not finished; an ack of one already released is
        a no-op."""
        retention = self._find(client_id, token, api_key, missing_ok=True)
        if retention is None:
            return
        if not retention.owner.finished:
            raise ServiceError("invalid_request", f"request {client_id!r} has not finished: ack its done", client_id)
        self.release(retention)

    # ---- socket gone, socket back -------------------------------------------------------------
    def detach(self, retention: Retention) -> None:
        """Its socket dropped: the grace period starts (while the server drains, it ends at once)."""
        if self.closing:
            self._shut_down(retention)
            return
        retention.detached = True
        if retention.handle in self._live:
            self._stop_timer(retention)  # (a finished request's linger restarts as a detached grace)
            retention.timer = asyncio.get_running_loop().call_later(self.grace_s, self._expire, retention)

    def _stop_timer(self, retention: Retention) -> None:
        if retention.timer is not None:
            retention.timer.cancel()
            retention.timer = None

    def _expire(self, retention: Retention) -> None:
        retention.timer = None
        reason = f"its resume grace period ({self.grace_s:g} s) ended"
        self._metrics.resumes.labels("expired").inc()
        retention.owner.expire(reason, "abort")
        self.release(retention, reason)

    def end_detached(self) -> None:
        """The server drains: no new socket can resume, so detached requests are cancelled at once."""
        self.closing = True
        for retention in [r for r in self._live.values() if r.detached]:
            self._shut_down(retention)

    def _shut_down(self, retention: Retention) -> None:
        retention.owner.expire("the server shut down", "drain")
        self.release(retention, "the server shut down before it was resumed")

    def claim(self, client_id: str, token: Any, after_seq: Any, api_key: str | None) -> tuple[Retention, list[Frame]]:
        """Checks a resume; returns the retention (its timer stopped) and the frames to replay. Raises
        ServiceError naming what is wrong."""
        try:
            retention = self._check(client_id, token, after_seq, api_key)
        except ServiceError as exc:
            self._metrics.resumes.labels(exc.code).inc()
            raise
        self._stop_timer(retention)
        retention.detached = False
        self._metrics.resumes.labels("resumed").inc()
        return retention, retention.replay_after(after_seq)

    def _check(self, client_id: str, token: Any, after_seq: Any, api_key: str | None) -> Retention:
        retention = self._find(client_id, token, api_key)
        assert retention is not None
        if not isinstance(after_seq, int) or isinstance(after_seq, bool) or not -1 <= after_seq <= retention.last_seq:
            raise ServiceError(
                "invalid_request",
                f"after_seq must be an integer from -1 (nothing received) to "
                f"{retention.last_seq} (the last seq sent), got {after_seq!r}",
                client_id,
            )
        if after_seq < retention.dropped_seq:
            raise ServiceError(
                "resume_expired",
                f"request {client_id!r}: the deltas up to seq "
                f"{retention.dropped_seq} are no longer retained (server.resume_max_tokens_per_request"
                " / resume_max_tokens_total)",
                client_id,
            )
        return retention

    def _find(self, client_id: str, token: Any, api_key: str | None, missing_ok: bool = False) -> Retention | None:
        """The live retention `token` names, checked against the caller's key and `client_id`; None if
        released and `missing_ok`. Raises ServiceError naming what is wrong."""
        handle, _, mac = token.rpartition(".") if isinstance(token, str) else ("", "", "")
        if not handle or not hmac.compare_digest(mac.encode(), self._mac(handle).encode()):
            raise ServiceError(
                "invalid_resume_token",
                "this resume_token was not issued by this server (it may have restarted)",
                client_id,
            )
        retention = self._live.get(handle)
        if retention is None and missing_ok:
            return None
        if retention is None:
            why = self._ended.get(handle)
            if why is not None:
                raise ServiceError(
                    "resume_expired", f"request {client_id!r} can no longer be resumed: {why}", client_id
                )
            raise ServiceError(
                "unknown_id",
                f"request {client_id!r} is not resumable (it finished and its done was acknowledged,"
                " or written over server.resume_grace_s ago)",
                client_id,
            )
        if not hmac.compare_digest(retention.key_hash, _key_hash(api_key)):
            raise ServiceError("resume_forbidden", "this request was created with another API key", client_id)
        if retention.client_id != client_id:
            raise ServiceError(
                "invalid_resume_token",
                f"this resume_token belongs to id {retention.client_id!r}, not {client_id!r}",
                client_id,
            )
        return retention

    def _mac(self, handle: str) -> str:
        digest = hmac.new(self._secret, handle.encode(), hashlib.sha256).digest()[:24]
        return base64.urlsafe_b64encode(digest).decode()


def _key_hash(api_key: str | None) -> str:
    return hashlib.sha256((api_key or "").encode()).hexdigest()
