"""The OpenAI Responses API's core, shared by `POST /v1/responses` (http/responses_api.py) and its
WebSocket mode (ws/responses.py).

- `plan_response`: a Responses request body (or a WebSocket `response.create` event) checked and turned
  into a `ResponsePlan` (prompt ids through the model's chat template, SamplingParams through
  `Generation.prepare`, the fields echoed on the `response` object). With `previous_response_id` the
  prompt is the stored response's exact prompt + output ids followed by the new turn (`continuation_ids`).
- `ResponseBuilder`: a response's server events (`response.created` ... `response.completed` /
  `.incomplete` / `.failed`) with their `sequence_number`s, fed the request's deltas; the same events go
  out as SSE over HTTP and as WebSocket messages.
- `ResponseRun`: a submitted response (builder, engine stream, account) and `keep`, which stores a finished
  one for `previous_response_id`. Usage, metrics and the `request_done` log come from the request's
  `RequestAccount` (route "responses"), as for every other route.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from streamd.engine import RequestDelta, RequestStream, is_int
from streamd.server.accounting import RequestAccount
from streamd.server.auth import bearer_token
from streamd.server.body_fields import body_flag, check_model
from streamd.server.errors import ServiceError
from streamd.server.generation import Prepared, normalize_messages
from streamd.server.logprobs import TokenTexts, chat_entries
from streamd.server.responses_store import StoredResponse
from streamd.server.services import Services
from streamd.server.structured_api import structured_from_text_format

# Fields that ask for features this server does not have; refused unless empty / the harmless value.
_REFUSED: dict[str, Any] = {
    "tools": None,
    "background": False,
    "conversation": None,
    "prompt": None,
    "reasoning": None,
    "include": None,
    "tool_choice": None,
}
_INPUT_PARTS = frozenset({"input_text", "output_text", "text"})

Lookup = Callable[[str], StoredResponse | None]


@dataclass(slots=True)
class ResponsePlan:
    """A checked Responses request, ready to submit."""

    id: str
    prepared: Prepared
    messages: list[dict[str, str]]  # the whole conversation, new turn included (stored for continuations)
    echo: dict[str, Any]  # request fields repeated on the `response` object
    store: bool
    stream: bool
    stream_id: str | None = None  # WebSocket mode's lane


async def plan_response(
    s: Services, body: dict[str, Any], find: Lookup, *, stream_id: str | None = None
) -> ResponsePlan:
    """Checks a Responses request and tokenizes it (off the event loop when long); raises ServiceError
    naming the field that is wrong."""
    check_model(s, body)
    _refuse_features(body)
    structured = _text_format(body.get("text"))
    stream, store = body_flag(body, "stream", False), body_flag(body, "store", True)
    new = _input_messages(body.get("input"), body.get("instructions"), s.generation.developer_role)
    previous_id = body.get("previous_response_id")
    if previous_id is None:
        messages, ids = new, await s.generation.messages_ids(new, param="input")
    else:
        previous = find(previous_id) if isinstance(previous_id, str) else None
        if previous is None:
            raise ServiceError(
                "previous_response_not_found",
                f"previous response {previous_id!r} is not found (unknown, expired, not stored, or another key's)",
                "previous_response_id",
            )
        messages = previous.messages + new
        ids = await continuation_ids(s, previous, new)
    prepared = s.generation.prepare(
        ids, {**_sampling(body), "structured_outputs": structured}, default_max_tokens=None, prompt_param="input"
    )
    echo = {
        "instructions": body.get("instructions"),
        "metadata": _metadata(body.get("metadata")),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": previous_id,
        "top_logprobs": body.get("top_logprobs"),
        "store": store,
        "text": body.get("text") or {"format": {"type": "text"}},
    }
    return ResponsePlan("resp_" + uuid.uuid4().hex, prepared, messages, echo, store, stream, stream_id)


async def continuation_ids(s: Services, previous: StoredResponse, new: list[dict[str, str]]) -> list[int]:
    """The previous response's exact prompt + output ids, then the new turn as the chat template renders it
    after that conversation: the text the template puts after the previous answer (its end-of-turn, less
    the end-of-turn token the model already produced) followed by the new messages and the generation
    prompt. The earlier ids are kept verbatim, so the prefix cache covers them whatever re-tokenizing the
    answer would give. A template whose rendering of a longer conversation does not extend the shorter
    one's text gets the whole conversation rendered afresh (the cache then covers the common prefix).
    The whole conversation counts against `server.max_prompt_chars`."""
    conversation = previous.messages + new
    chars = sum(len(m["content"]) for m in conversation)
    s.generation.check_chars(chars, "input")
    turn = await s.generation.tokenizing.run(lambda tokenizer: _new_turn_ids(tokenizer, previous, new), chars)
    if turn is None:
        return await s.generation.messages_ids(conversation, param="input")
    return previous.token_ids + turn


def _new_turn_ids(tokenizer: Any, previous: StoredResponse, new: list[dict[str, str]]) -> list[int] | None:
    """The new turn's ids after `previous` (see continuation_ids); None when the template does not extend."""
    history = previous.messages
    answer_open = _render(tokenizer, history[:-1], True) + history[-1]["content"]
    closed = _render(tokenizer, history, False)
    full = _render(tokenizer, history + new, True)
    if not (closed.startswith(answer_open) and full.startswith(closed)):
        return None
    between = closed[len(answer_open) :]
    last = previous.token_ids[-1]
    if last in tokenizer.all_special_ids:  # the answer ended with the model's own end-of-turn token
        between = between.removeprefix(tokenizer.decode([last]))
    turn = between + full[len(closed) :]
    return list(tokenizer(turn, add_special_tokens=False).input_ids)


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    except Exception as exc:  # a template's own refusal (e.g. roles must alternate): the request's fault
        raise ServiceError("invalid_request", f"input: the model's chat template rejected it: {exc}", "input") from exc


def _input_messages(raw: Any, instructions: Any, developer: str) -> list[dict[str, str]]:
    if instructions is not None and not isinstance(instructions, str):
        raise ServiceError("invalid_request", "instructions must be a string", "instructions")
    head = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(raw, str) and raw:
        return head + [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise ServiceError(
            "invalid_request", "input must be a non-empty string or a non-empty list of message items", "input"
        )
    return head + normalize_messages([_message(i, item) for i, item in enumerate(raw)], developer)


def _message(i: int, item: Any) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        raise ServiceError("unsupported", f"input[{i}]: only message items are supported", "input")
    content = item.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in _INPUT_PARTS]
        strings = [t for t in texts if isinstance(t, str)]
        if len(strings) != len(content):  # a part of another type, or one whose text is no string
            raise ServiceError("unsupported", f"input[{i}].content: only input_text parts are supported", "input")
        content = "".join(strings)
    return {"role": item.get("role"), "content": content}


def _refuse_features(body: dict[str, Any]) -> None:
    for name, harmless in _REFUSED.items():
        value = body.get(name)
        if (
            value is None
            or value == harmless
            or value in ("auto", "none")
            or (isinstance(value, (list, dict)) and not value)
        ):
            continue
        raise ServiceError("unsupported", f"{name} is not supported by this server", name)


def _text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` -> `structured_outputs` (None for plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ServiceError("invalid_request", "text must be an object", "text")
    fmt = text.get("format")
    return None if fmt is None else structured_from_text_format(fmt)


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > 16
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    ):
        raise ServiceError("invalid_request", "metadata must be an object of at most 16 string values", "metadata")
    return value


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    limit = body.get("max_output_tokens")
    if limit is not None and not (is_int(limit) and limit >= 1):
        raise ServiceError(
            "invalid_request", f"max_output_tokens must be a positive integer, got {limit!r}", "max_output_tokens"
        )
    top = body.get("top_logprobs")
    if top is not None and not (is_int(top) and 0 <= top <= 20):
        raise ServiceError(
            "invalid_request", f"top_logprobs must be an integer in [0, 20], got {top!r}", "top_logprobs"
        )
    return {"max_tokens": limit, "temperature": body.get("temperature"), "top_p": body.get("top_p"), "logprobs": top}


# ---- events ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ResponseBuilder:
    """One response's events, in order, numbered from 0; also its final `response` object."""

    plan: ResponsePlan
    model: str
    token_texts: TokenTexts  # for logprobs
    created_at: int = field(default_factory=lambda: int(time.time()))
    seq: int = 0
    text: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def item_id(self) -> str:
        return "msg_" + self.plan.id.removeprefix("resp_")

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        if self.plan.stream_id is not None:
            event["stream_id"] = self.plan.stream_id
        return event

    def opening(self) -> list[dict[str, Any]]:
        at = {"output_index": 0, "item_id": self.item_id}
        return [
            self.event("response.created", response=self.response(None)),
            self.event("response.in_progress", response=self.response(None)),
            self.event("response.output_item.added", output_index=0, item=self.item("in_progress", [])),
            self.event("response.content_part.added", **at, content_index=0, part=self.part("")),
        ]

    def feed(self, delta: RequestDelta, account: RequestAccount) -> list[dict[str, Any]]:
        account.absorb(delta)
        events = []
        for choice in delta.outputs:
            self.output_ids.extend(choice.token_ids)
            logprobs = self._logprobs(choice.token_ids, choice.logprobs)
            if choice.text:
                self.text.append(choice.text)
                events.append(
                    self.event(
                        "response.output_text.delta",
                        output_index=0,
                        item_id=self.item_id,
                        content_index=0,
                        delta=choice.text,
                        logprobs=logprobs,
                    )
                )
        return events

    def closing(self, account: RequestAccount) -> list[dict[str, Any]]:
        finish = account.finish
        text, at = "".join(self.text), {"output_index": 0, "item_id": self.item_id}
        item_status = "completed" if finish.status == "completed" else "incomplete"
        return [
            self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=self.logprobs),
            self.event("response.content_part.done", **at, content_index=0, part=self.part(text)),
            self.event("response.output_item.done", output_index=0, item=self.item(item_status, [self.part(text)])),
            self.event(finish.terminal_event, response=self.response(account)),
        ]

    def response(self, account: RequestAccount | None) -> dict[str, Any]:
        """The `response` object: in progress (no account) or as the account ended it."""
        body: dict[str, Any] = {
            "id": self.plan.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": "in_progress",
            "output": [],
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
            **self.plan.echo,
        }
        if account is None:
            return body
        finish = account.finish  # (FINISH_NAMES: the Responses API's status and incomplete reason)
        text = "".join(self.text)
        body.update(
            status=finish.status,
            output=[self.item("completed" if finish.status == "completed" else "incomplete", [self.part(text)])],
            usage=_usage(account),
        )
        if finish.incomplete is not None:
            body["incomplete_details"] = {"reason": finish.incomplete}
        if account.error is not None:
            body["error"] = {"code": "server_error", "message": account.error}
        return body

    def item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": self.logprobs if text else []}

    def stored(self) -> StoredResponse:
        messages = self.plan.messages + [{"role": "assistant", "content": "".join(self.text)}]
        return StoredResponse(self.plan.id, messages, self.plan.prepared.prompt_token_ids + self.output_ids)

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None) -> list[dict[str, Any]]:
        if logprobs is None:
            return []
        top = self.plan.prepared.params.logprobs or 0
        out = chat_entries(self.token_texts, token_ids, logprobs, top)
        self.logprobs.extend(out)
        return out


def _usage(account: RequestAccount) -> dict[str, Any]:
    prompt, output = account.num_prompt_tokens, account.num_completion_tokens
    return {
        "input_tokens": prompt,
        "output_tokens": output,
        "total_tokens": prompt + output,
        "input_tokens_details": {"cached_tokens": account.num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


# ---- a submitted response ---------------------------------------------------------------------------
@dataclass(slots=True)
class ResponseRun:
    """A submitted response: its events' builder, the engine stream and the account."""

    builder: ResponseBuilder
    stream: RequestStream
    account: RequestAccount

    def finish(self) -> None:
        """Over (finished, or its client left): abort if needed, count it once."""
        if not self.stream.finished:
            self.stream.cancel()
        self.account.close()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        builder = self.builder
        for event in builder.opening():
            yield event
        async for delta in self.stream:
            for event in builder.feed(delta, self.account):
                yield event
        for event in builder.closing(self.account):
            yield event


def api_key(headers: Any) -> str:
    """The store's partition: the caller's API key ("" when the server has no keys)."""
    return bearer_token(headers.get("authorization")) or ""


def builder_for(s: Services, plan: ResponsePlan) -> ResponseBuilder:
    return ResponseBuilder(plan, s.model_name, s.token_texts)


def keep(s: Services, key: str, run: ResponseRun) -> None:
    """Stores a finished response for `previous_response_id` unless it failed or `store` is false."""
    if run.builder.plan.store and run.account.error is None:
        s.responses.put(key, run.builder.stored())
