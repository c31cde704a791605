"""RequestAccount: the one server-side tally of a request, whatever route it came by.

Every route (`/v1/stream`, the OpenAI routes, any later one) opens an account when it submits a request,
feeds it every delta it delivers, and closes it once. The account owns:

- usage: prompt, completion (all choices) and cached tokens;
- the finish reason, through the one map `FINISH_NAMES` from the finish reasons to each face's names
  (streamd.v1, OpenAI's chat/completions, the Responses API). The
  engine ends a cancelled request with "abort" whoever cancelled it; the account knows why (`cancel(cause)`:
  "abort" for the client, "drain" for the server's drain), so the faces can tell a client what happened;
- timings: time to first token and inter-token latency as the client is handed the tokens, end-to-end
  latency and queue time, recorded into the metrics;
- `streamd_requests_total{finish_reason}` (counted once, when closed) and the `request_done` log line;
- the request's place among the requests in flight, so a drain can find and cancel it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamd.engine import RequestDelta
from streamd.logs import get_logger
from streamd.server.lifecycle import Lifecycle
from streamd.server.metrics import Metrics
from streamd.server.tenants import DEFAULT_TENANT

logger = get_logger(__name__)


@dataclass(slots=True, frozen=True)
class FinishNames:
    wire: str  # streamd.v1 `done` frames and the `finish_reason` label of streamd_requests_total
    openai: str  # OpenAI's `finish_reason` (one of OpenAI's values)
    status: str  # the Responses API's `status` of the response ("completed", "incomplete", ...)
    flag: str | None = None  # an extra field set to true on the OpenAI choice, saying what OpenAI cannot
    incomplete: str | None = None  # the Responses API's `incomplete_details.reason`, when it has one

    @property
    def terminal_event(self) -> str:
        """The Responses API's last event: `response.completed`, `.failed` or `.incomplete`."""
        return f"response.{self.status if self.status in ('completed', 'failed') else 'incomplete'}"


# The engine's finish reasons, the causes of a cancellation ("drain") and "error" (the request failed) ->
# what each face calls them. OpenAI has no "cancelled": a cut request ends "length" (its output is
# incomplete, as at a token limit) with a flag naming why ("abort": a client's own cancel, which over HTTP
# nobody reads, the client being gone). A deadline (`timeout_s` / server.max_request_time_s) leaves a
# response incomplete for the reason "timeout".
FINISH_NAMES: dict[str, FinishNames] = {
    "stop": FinishNames("stop", "stop", "completed"),
    "length": FinishNames("length", "length", "incomplete", incomplete="max_output_tokens"),
    "abort": FinishNames("cancelled", "length", "cancelled", "streamd_cancelled"),
    "drain": FinishNames("cancelled", "length", "cancelled", "streamd_drained"),
    "error": FinishNames("error", "error", "failed"),
    "timeout": FinishNames("timeout", "length", "incomplete", "streamd_timeout", incomplete="timeout"),
}


class RequestAccount:
    def __init__(
        self,
        request_id: str,
        route: str,
        num_prompt_tokens: int,
        metrics: Metrics,
        lifecycle: Lifecycle,
        cancel: Callable[[], None],
        num_choices: int = 1,
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        self.request_id = request_id
        self.route = route
        self.num_prompt_tokens = num_prompt_tokens
        self.num_choices = num_choices
        self.tenant = tenant  # its metrics label (server/tenants.py: a configured name, never a key)
        self.num_cached_tokens = 0
        self.predicted = False  # the request gave a `prediction`: usage reports its accepted / rejected tokens
        self.prediction_tokens = 0  # draft tokens taken from the prediction
        self.accepted_prediction_tokens = 0
        self.completion_tokens: dict[int, int] = {}  # per choice
        self.finish_reasons: dict[int, str] = {}  # per choice, engine names
        self.error: str | None = None
        self.arrival = time.monotonic()
        self._metrics = metrics
        self._lifecycle = lifecycle
        self._cancel = cancel
        self._first_token: float | None = None
        self._last_token: float | None = None
        self._queue_time: float | None = None
        self._closed = False
        self._cause: str | None = None  # why it was cancelled, once it was (a key of FINISH_NAMES)
        lifecycle.add(self)

    # ---- feeding -----------------------------------------------------------------------------------
    def absorb(self, delta: RequestDelta) -> None:
        """Takes a delta as it is handed to the client."""
        count = 0
        for choice in delta.outputs:
            count += len(choice.token_ids)
            self.completion_tokens[choice.index] = choice.num_tokens
            if choice.finish_reason is not None:
                self.finish_reasons[choice.index] = choice.finish_reason
        self.error = self.error or delta.error
        self.num_cached_tokens = delta.num_cached_tokens or self.num_cached_tokens
        self.prediction_tokens += delta.prediction_tokens
        self.accepted_prediction_tokens += delta.accepted_prediction_tokens
        if delta.queue_time is not None:
            self._queue_time = delta.queue_time
        if count:
            self._observe_tokens(count)

    def _observe_tokens(self, count: int) -> None:
        now = time.monotonic()
        if self._first_token is None:
            self._first_token = now
            self._metrics.ttft.observe(now - self.arrival)
            count -= 1
        elif self._last_token is not None:
            self._metrics.observe_inter_token((now - self._last_token) / count, count)
        self._last_token = now

    def cancel(self, cause: str = "abort") -> None:
        """Aborts the request in the engine; its final delta still arrives and closes the account. `cause`
        (the first one given counts) names the finish of every choice the abort ends."""
        self._cause = self._cause or cause
        self._cancel()

    # ---- reading -----------------------------------------------------------------------------------
    @property
    def finish_reason(self) -> str:
        """The request's finish reason in engine names ("error" when it failed; the first choice's)."""
        if self.error is not None:
            return "error"
        return self.finish_reasons.get(0) or next(iter(self.finish_reasons.values()), "abort")

    @property
    def drained(self) -> bool:
        """The server's drain cancelled it (a WebSocket `done` says so)."""
        return self.finish is FINISH_NAMES["drain"]

    @property
    def overloaded(self) -> bool:
        """It timed out before it was ever scheduled (`server.max_queue_time_s`): the server was too busy."""
        return self.finish_reason == "timeout" and self._queue_time is None

    @property
    def finish(self) -> FinishNames:
        return self._names(self.finish_reason)

    def choice_finish(self, index: int) -> FinishNames:
        """One choice's finish reason (every choice's is "error" when the request failed)."""
        if self.error is not None:
            return FINISH_NAMES["error"]
        return self._names(self.finish_reasons.get(index, "abort"))

    def _names(self, reason: str) -> FinishNames:
        """An aborted choice finishes as its cancellation's cause says."""
        if reason == "abort" and self._cause is not None:
            reason = self._cause
        return FINISH_NAMES[reason]

    def choice_finishes(self) -> list[FinishNames]:
        return [self.choice_finish(index) for index in range(self.num_choices)]

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.completion_tokens.values())

    def usage(self) -> dict[str, Any]:
        completion = self.num_completion_tokens
        body: dict[str, Any] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt_tokens + completion,
        }
        if self.num_cached_tokens:
            body["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        if self.predicted:  # (as OpenAI: rejected ones are draft tokens of the prediction the model refused)
            body["completion_tokens_details"] = {
                "accepted_prediction_tokens": self.accepted_prediction_tokens,
                "rejected_prediction_tokens": self.prediction_tokens - self.accepted_prediction_tokens,
            }
        return body

    # ---- closing -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Counts the request once (metrics, log line) and lets go of it; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        self._lifecycle.discard(self)
        name = self.finish.wire
        metrics = self._metrics
        metrics.requests.labels(name).inc()
        if self.error is None:
            metrics.e2e.observe(time.monotonic() - self.arrival)
            queue_s = self._queue_time
            if queue_s is None and self._first_token is not None:
                queue_s = self._first_token - self.arrival  # bounded by the wait for the first token
            if queue_s is not None:
                metrics.queue.observe(queue_s)
                metrics.tenant_queue.labels(self.tenant).observe(queue_s)
        logger.info(
            "request_done",
            request_id=self.request_id,
            route=self.route,
            finish_reason=name,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_completion_tokens,
        )

    def discard(self) -> None:
        """Lets go of a request the engine refused: it never ran, so it is not counted."""
        self._closed = True
        self._lifecycle.discard(self)
