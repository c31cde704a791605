"""ResumeStore rules without a socket: tokens are bound to this process, the key and the id; attached
requests trim their oldest frames to fit both bounds; a detached request over a bound must be aborted."""

from __future__ import annotations

import pytest

from streamd.server.errors import ServiceError
from streamd.server.metrics import Metrics
from streamd.server.ws import protocol
from streamd.server.ws.resume import ResumeStore


class Owner:
    client_id = "a"

    def __init__(self) -> None:
        self.expired: list[str] = []

    def expire(self, reason: str, cause: str) -> None:
        self.expired.append(reason)


def delta(seq: int) -> protocol.Frame:
    return protocol.delta_frame("a", seq, "x", [7], 0)


async def test_attached_trims_detached_aborts_and_claims_check_everything() -> None:
    store = ResumeStore(30.0, max_tokens_per_request=8, max_tokens_total=6, metrics=Metrics())
    first, token_1 = store.open("a", "key", Owner())
    second, _ = store.open("a", "key", Owner())
    for seq in range(10):  # attached: the newest half of the per-request bound (4), then the total (6)
        assert store.retain(first, delta(seq), 1) is None
    assert first.tokens == 4 and first.dropped_seq == 5
    for seq in range(3):
        assert store.retain(second, delta(seq), 1) is None
    assert store.total_tokens == 6 and first.tokens == 4 and second.tokens == 2  # the one that went over trims
    with pytest.raises(ServiceError, match="no longer retained"):
        store.claim("a", token_1, 3, "key")
    for wrong in [("a", token_1 + "0", 9, "key"), ("b", token_1, 9, "key")]:
        with pytest.raises(ServiceError) as refused:
            store.claim(*wrong)
        assert refused.value.code == "invalid_resume_token"
    with pytest.raises(ServiceError) as refused:
        store.claim("a", token_1, 9, "other")
    assert refused.value.code == "resume_forbidden"
    other_process = ResumeStore(30.0, 8, 6, Metrics())
    with pytest.raises(ServiceError) as refused:
        other_process.claim("a", token_1, 9, "key")
    assert refused.value.code == "invalid_resume_token"
    retention, replay = store.claim("a", token_1, 7, "key")
    assert [f["seq"] for f in replay] == [8, 9]
    store.detach(second)  # detached: no more trimming; over the total it must be aborted
    assert "resume_max_tokens_total" in (store.retain(second, delta(3), 1) or "")
    store.release(second, "aborted")
    store.release(retention)
    assert store.total_tokens == 0 and len(store) == 0


def test_resume_frames_on_the_wire() -> None:
    frame = protocol.parse_frame('{"type":"resume","id":"a","resume_token":"t.m","after_seq":4}')
    assert frame == protocol.Resume("a", "t.m", 4)
    assert protocol.start_frame("a", 3, "t.m") == {"type": "start", "id": "a", "prompt_tokens": 3, "service_tier": "default",
                                                "resume_token": "t.m"}
    assert "resume_token" not in protocol.start_frame("a", 3)
    assert protocol.done_frame("a", "cancelled", {}, ["cancelled"], drained=True)["drained"] is True
    assert "drained" not in protocol.done_frame("a", "stop", {}, ["stop"])
