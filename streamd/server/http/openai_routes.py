"""OpenAI-compatible HTTP: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`.

`stream: true` answers with SSE (`data: {chunk}` ... `data: [DONE]`, a usage chunk when
`stream_options.include_usage`; with vLLM's `stream_options.continuous_usage_stats` too, every chunk carries the
request's usage so far). Errors are OpenAI error bodies with their status codes (raised as
ServiceError, rendered by the app's handler). A client that disconnects aborts its request: for SSE,
Starlette cancels the body iterator; otherwise a watcher on `http.disconnect` cancels the collection.
Unknown top-level fields are ignored (as OpenAI clients and frontends send extras), each logged at debug
and counted (`body_fields.note_ignored`); unsupported features that would change the answer (functions,
suffix) are refused. `/v1/completions` takes a batch of prompts (a list of strings or
of token-id lists): one engine request each, choices indexed prompt-major (prompt i's choice j is
`i * n + j`, as OpenAI), usage summed; `echo` puts the prompt before each choice's text (with `logprobs`,
the prompt's tokens come first in the logprobs, the first one's null, as OpenAI's legacy completions: the
engine's `prompt_logprobs`; vLLM's `prompt_logprobs` field gives each choice its `prompt_logprobs`, in the
first chunk when streamed). `logprobs` (chat: with `top_logprobs` 0..20; completions: an integer 0..20) come
in OpenAI's shapes (`logprobs.py`), streamed per chunk or whole. A finish reason is OpenAI's name for the
engine's (`accounting.FINISH_NAMES`); a request the
server cut (the drain) finishes "length" with an extra flag on the choice (`streamd_drained: true`).
`response_format` and `structured_outputs` constrain the reply by a grammar; `tools` with `tool_choice`
"required" or a named function make the reply a grammar-enforced tool call (`structured_api.py`), and with
"auto" the model's own tool-call format is parsed where its chat template defines one (`tool_parsers.py`):
either way the calls are returned as `tool_calls` (streamed as `delta.tool_calls`), finish reason
"tool_calls".

streamd's `streamd_background: true` (with `stream: true`, one prompt) runs the stream detached from its
connection (`server/background.py`): every SSE event carries `id: N` (from 0), and
`GET /v1/chat/completions/{id}` (or `/v1/completions/{id}`) with `starting_after=N` (or the SSE
`Last-Event-ID: N` header) replays the events after N, then the live ones; `POST .../{id}/cancel` and
`DELETE .../{id}` as for background Responses, bound to the API key that created it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamd.engine import MAX_LOGPROBS, RequestDelta, RequestStream, is_int
from streamd.server.accounting import FinishNames, RequestAccount
from streamd.server.auth import api_key
from streamd.server.body_fields import body_flag, check_model, note_ignored, template_options
from streamd.server.encoding import dumps
from streamd.server.errors import ServiceError, queue_timed_out
from streamd.server.generation import WIRE_PARAMS, Prepared, wire_user
from streamd.server.http.background_routes import BackgroundRoutes
from streamd.server.http.common import RouteSpec, SSEResponse, json_body, until_disconnect
from streamd.server.logprobs import LogprobsBuilder, TokenTexts, prompt_entries
from streamd.server.reasoning import ReplyParser
from streamd.server.services import Services
from streamd.server.structured_api import plan_tools, with_enforced_call


@dataclass(slots=True)
class _Call:
    """One OpenAI call in flight: what the chunk builders need and what it has produced so far."""

    kind: str  # "chat" or "completion"
    id: str
    model: str
    created: int
    prepared: Prepared
    stream: RequestStream
    account: RequestAccount
    tool_format: str | None = None  # the format the replies' tool calls are parsed in (None: text)
    logprobs: LogprobsBuilder | None = None  # set when the request asked for logprobs
    first_index: int = 0  # the wire index of its first choice (a batch's prompt i starts at i * n)
    echo: str | None = None  # the prompt's text, put before each choice's text (completions' `echo`)
    prompt_top: int | None = None  # vLLM's `prompt_logprobs` asked (completions): each choice's `prompt_logprobs`
    token_texts: TokenTexts | None = None  # with prompt_top: the tokens' texts
    think_inside: bool | None = None  # a reasoning model's chat: whether replies start inside `<think>`
    replies: dict[int, ReplyParser] = field(default_factory=dict)  # per choice (chat): reasoning, tool calls

    def reply(self, index: int) -> ReplyParser:
        if index not in self.replies:
            self.replies[index] = ReplyParser(self.think_inside, self.tool_format)
        return self.replies[index]

    def finish(self) -> None:
        """The request is over for this call (finished, or its client left): abort if needed, count it."""
        if not self.stream.finished:
            self.stream.cancel()
        self.account.close()


async def list_models(request: Request) -> Response:
    s: Services = request.app.state.services
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": s.started,
                    "owned_by": "streamd",
                    "max_model_len": s.engine.max_model_len,
                }
                for name in s.models.served
            ],
        }
    )


async def chat_completions(request: Request) -> Response:
    s: Services = request.app.state.services
    body = await json_body(request)
    check_model(s, body)
    _refuse(body, functions=None)
    note_ignored(s, "chat", body, _CHAT_FIELDS)
    params = _params(body)
    params["logprobs"] = _chat_logprobs(body)
    if body.get("max_completion_tokens") is not None:
        params["max_tokens"] = body["max_completion_tokens"]
    plan = plan_tools(body.get("tools"), body.get("tool_choice"), s.tool_format)
    if plan is not None and plan.structured is not None:
        params = with_enforced_call(params, plan.structured)
    options = template_options(body)
    ids = await s.generation.messages_ids(body.get("messages"), plan.tools if plan is not None else None, options)
    prepared = s.generation.prepare(ids, params, default_max_tokens=None, user=wire_user(body))
    return await _respond(request, s, body, "chat", [prepared], plan.parser if plan is not None else None)


async def completions(request: Request) -> Response:
    s: Services = request.app.state.services
    body = await json_body(request)
    check_model(s, body)
    _refuse(body, suffix=None)
    note_ignored(s, "completion", body, _COMPLETION_FIELDS)
    best_of = body.get("best_of")
    if body.get("use_beam_search") is True and best_of is not None and body.get("beam_width") is None:
        body["beam_width"] = best_of  # vLLM's legacy beam search: best_of is the beam width
    elif best_of not in (None, 1, body.get("n", 1)):
        raise ServiceError("unsupported", "best_of must equal n (or be the beam width with use_beam_search)", "best_of")
    params = _params(body)
    params["logprobs"] = _completion_logprobs(body)
    echo = body_flag(body, "echo", False)
    # Echo with logprobs puts the prompt's tokens first in the logprobs (OpenAI's legacy completions); vLLM's
    # `prompt_logprobs` adds each choice's `prompt_logprobs`. Either asks the engine for prompt logprobs.
    prompt_top = _completion_logprobs(body, "prompt_logprobs")
    asked = [k for k in (params["logprobs"] if echo else None, prompt_top) if k is not None]
    user = wire_user(body)
    prepared = []
    for prompt in _prompts(body.get("prompt")):
        ids = await s.generation.prompt_ids(prompt)
        text = prompt if isinstance(prompt, str) else None
        prepared.append(
            s.generation.prepare(
                ids,
                params,
                default_max_tokens=16,
                prompt=text,
                prompt_param="prompt",
                prompt_logprobs=max(asked) if asked else None,
                user=user,
            )
        )
    return await _respond(request, s, body, "completion", prepared, echo=echo, prompt_top=prompt_top)


def _prompts(prompt: Any) -> list[Any]:
    """Completions' `prompt`: one (a string or token ids) or a batch (a list of strings or of token-id lists)."""
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, (str, list)) for p in prompt):
        return [prompt]  # one prompt (`prompt_ids` refuses what is none)
    if len(prompt) > MAX_PROMPTS:
        raise ServiceError(
            "invalid_request", f"a batch may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt"
        )
    return prompt


async def _respond(
    request: Request,
    s: Services,
    body: dict[str, Any],
    kind: str,
    prepared: list[Prepared],
    tool_format: str | None = None,
    *,
    echo: bool = False,
    prompt_top: int | None = None,
) -> Response:
    """Submits the call's requests (one per prompt) and answers them as one response, SSE or JSON."""
    stream_flag = body_flag(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ServiceError("invalid_request", f"stream_options must be an object, got {options!r}", "stream_options")
    call_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    key = api_key(request.headers)
    background = _background(s, body, stream_flag, len(prepared))
    calls = await _start_all(s, kind, call_id, prepared, tool_format, echo, key, prompt_top)
    structlog.contextvars.bind_contextvars(request_id=call_id)
    if not stream_flag:
        return await until_disconnect(request, _collect_all(calls))
    firsts: list[RequestDelta | None] = [None] * len(calls)
    if calls[0].prepared.params.queue_timeout_s is not None:  # a queue timeout must still be able to answer 503
        try:
            answer = await until_disconnect(request, asyncio.gather(*(_first_delta(c) for c in calls)))
        except BaseException:  # one request timed out in the queue: the whole call answers 503
            _finish_all(calls)
            raise
        if isinstance(answer, Response):
            _finish_all(calls)
            return answer
        firsts = list(answer)
    include_usage = bool((options or {}).get("include_usage"))
    continuous = include_usage and body_flag(options or {}, "continuous_usage_stats", False)
    if len(calls) == 1:
        sse = _sse(calls[0], include_usage, firsts[0], continuous=continuous)
        if background:
            record = s.background.start(key, kind, _DetachedCall(calls[0], sse))
            return _BACKGROUND[kind].follow(s, record, -1)
        return SSEResponse(sse, calls[0].finish, s.config.sse_keepalive_s)
    parts = [_sse(c, include_usage, f, last=False, continuous=continuous) for c, f in zip(calls, firsts)]
    return SSEResponse(_batch_sse(calls, parts, include_usage), lambda: _finish_all(calls), s.config.sse_keepalive_s)


def _background(s: Services, body: dict[str, Any], stream: bool, num_prompts: int) -> bool:
    """streamd's `streamd_background`: a streamed call of one prompt, run detached (room checked before it
    takes any engine work)."""
    if not body_flag(body, "streamd_background", False):
        return False
    if not stream or num_prompts != 1:
        raise ServiceError(
            "invalid_request", "streamd_background needs stream: true and one prompt", "streamd_background"
        )
    s.background.make_room()
    return True


@dataclass(slots=True)
class _DetachedCall:
    """A background call's stream as `background.DetachedRun`: its SSE events one by one."""

    call: _Call
    body: AsyncIterator[bytes]

    @property
    def id(self) -> str:
        return self.call.id

    async def events(self) -> AsyncIterator[bytes]:
        async for chunk in self.body:
            for event in chunk.split(b"\n\n"):
                if event:
                    yield event + b"\n\n"

    def finish(self) -> None:
        self.call.finish()

    def cancel(self) -> None:
        self.call.account.cancel()

    def snapshot(self, done: bool) -> dict[str, Any]:
        account = self.call.account
        status = ("failed" if account.error else account.finish.status) if done else "in_progress"
        return {"id": self.call.id, "object": "streamd.background", "status": status, "usage": account.usage()}


def _numbered(number: int, event: bytes) -> bytes:
    """A background call's event with its SSE `id` (what `Last-Event-ID` names when a reader reconnects)."""
    return b"id: %d\n" % number + event


_BACKGROUND = {
    kind: BackgroundRoutes(base, kind, "streamd.background", _numbered)
    for kind, base in (("chat", "/v1/chat/completions"), ("completion", "/v1/completions"))
}


async def _start_all(
    s: Services,
    kind: str,
    call_id: str,
    prepared: list[Prepared],
    tool_format: str | None,
    echo: bool,
    api_key: str,
    prompt_top: int | None = None,
) -> list[_Call]:
    """Submits every prompt's request (`api_key`: whose compile slots a grammar takes); a refusal of one lets
    go of those already submitted."""
    calls: list[_Call] = []
    created, think = int(time.time()), s.generation.think if kind == "chat" else None
    try:
        for i, one in enumerate(prepared):
            account, stream = await s.generation.submit(one, kind, api_key=api_key)
            assert stream is not None
            top = one.params.logprobs
            logprobs = None if top is None else LogprobsBuilder(s.token_texts, kind, top, one.params.n)
            text = _echo_text(s, one) if echo else None
            inside = think.starts_inside(one.prompt_token_ids) if think is not None else None
            calls.append(
                _Call(
                    kind,
                    call_id,
                    s.model_name,
                    created,
                    one,
                    stream,
                    account,
                    tool_format,
                    logprobs,
                    first_index=i * one.params.n,
                    echo=text,
                    prompt_top=prompt_top,
                    token_texts=s.token_texts,
                    think_inside=inside,
                )
            )
    except BaseException:
        _finish_all(calls)
        raise
    return calls


def _echo_text(s: Services, prepared: Prepared) -> str:
    if prepared.prompt is not None:
        return prepared.prompt
    return str(s.engine.tokenizer.decode(prepared.prompt_token_ids))


def _finish_all(calls: list[_Call]) -> None:
    for call in calls:
        call.finish()


async def _first_delta(call: _Call) -> RequestDelta:
    """The request's first delta once it has been scheduled, or it timed out waiting: then 503 `overloaded`.
    Progress reports while it waits (queue places) are merged into it: a queue limit must be able to answer
    503, so the head waits for scheduling (at most `server.max_queue_time_s`)."""
    delta = await _merged_until(call.stream, lambda d: d.queue_time is not None)
    if delta is None:
        raise ServiceError("internal_error", "the request's stream ended before it was scheduled")
    call.account.absorb(delta)
    if call.account.overloaded:
        call.finish()
        raise queue_timed_out()
    return delta


async def _merged_until(
    deltas: AsyncIterator[RequestDelta], ready: Callable[[RequestDelta], bool]
) -> RequestDelta | None:
    """The stream's first delta with the next ones merged in until `ready` holds of it or it finished (None:
    the stream ended first). The progress reports before a request's first token (its queue places, its prompt
    chunks done) carry none of what a head needs: its scheduling, its prompt logprobs."""
    head = await anext(deltas, None)
    while head is not None and not ready(head) and not head.finished:
        later = await anext(deltas, None)
        if later is None:
            break
        head.merge(later)
    return head


def _has_output(delta: RequestDelta) -> bool:
    return delta.prompt_logprobs is not None or delta.num_new_tokens > 0


async def _deltas(call: _Call, first: RequestDelta | None) -> AsyncIterator[RequestDelta]:
    """The request's deltas, each absorbed by its account (`first`: already taken and absorbed)."""
    if first is not None:
        yield first
    async for delta in call.stream:
        call.account.absorb(delta)
        yield delta


async def _sse(
    call: _Call,
    include_usage: bool,
    first: RequestDelta | None = None,
    *,
    last: bool = True,
    continuous: bool = False,
) -> AsyncIterator[bytes]:
    """One chunk per choice that has new text (each with its index); each choice's finish chunk at the end.
    The chunks of one delta go out in one write, and so do the closing ones. `last`: this call ends the
    response (its usage chunk and `[DONE]`; a batch's calls leave them to `_batch_sse`). `continuous`: every
    chunk carries this request's usage as of its delta (vLLM's `continuous_usage_stats`)."""
    account = call.account
    extra: dict[str, Any] = {"usage": account.usage() if continuous else None} if include_usage else {}
    if call.kind == "chat":
        yield b"".join(
            _data(_chunk(call, index, {"role": "assistant", "content": ""}, None, extra)).encode()
            for index in range(account.num_choices)
        )
    deltas = _deltas(call, first)
    if call.echo or call.prompt_top is not None:  # (completions) the prompt first, with its logprobs if asked
        head = None
        if (call.echo and call.logprobs is not None) or call.prompt_top is not None:
            head = await _merged_until(deltas, _has_output)  # the first output carries the prompt logprobs
            _add_prompt(call, head.prompt_logprobs if head is not None else None)
        yield b"".join(
            _data(_prompt_chunk(call, i, head.prompt_logprobs if head is not None else None, extra)).encode()
            for i in range(account.num_choices)
        )
        deltas = _after(head, deltas)
    texts = TextEvents(call, extra, continuous=continuous)
    plain = call.logprobs is None and call.think_inside is None and call.tool_format is None  # the fast path
    async for delta in deltas:
        if continuous:
            extra["usage"] = account.usage()
        events = []
        for choice in delta.outputs:
            if call.logprobs is not None:
                call.logprobs.add(choice)
            if plain and choice.text:
                events.append(texts.event(choice.index, choice.text))
            elif choice.text:
                events += _text_events(call, texts, choice.index, choice.text, final=False)
        if events:
            yield b"".join(events)
    tail: list[bytes] = []
    if account.error:
        tail.append(_data(ServiceError("internal_error", account.error).openai_body()).encode())
    else:
        for index, finish in enumerate(account.choice_finishes()):
            if not plain:  # what the parsers held back (part of a tag, text that might have become a call)
                tail += _text_events(call, texts, index, "", final=True)
            tail.append(_data(_chunk(call, index, _piece(call, ""), finish, extra)).encode())
    if last:
        tail.append(_stream_end([call], include_usage))
    yield b"".join(tail)


def _add_prompt(call: _Call, prompt_logprobs: list[dict[int, float] | None] | None) -> None:
    """Echo with logprobs: the prompt's tokens go first in every choice's logprobs."""
    if call.echo is not None and call.logprobs is not None and prompt_logprobs is not None:
        call.logprobs.add_prompt(call.prepared.prompt_token_ids, prompt_logprobs)


def _prompt_chunk(
    call: _Call, index: int, prompt_logprobs: list[dict[int, float] | None] | None, extra: dict[str, Any]
) -> dict[str, Any]:
    """A completion stream's first chunk of a choice: the echoed prompt (with its logprobs) and vLLM's
    `prompt_logprobs` when asked."""
    chunk = _chunk(call, index, call.echo or "", None, extra)
    if call.prompt_top is not None:
        chunk["choices"][0]["prompt_logprobs"] = _prompt_entries(call, prompt_logprobs)
    return chunk


def _prompt_entries(call: _Call, prompt_logprobs: list[dict[int, float] | None] | None) -> list[Any] | None:
    if call.prompt_top is None or prompt_logprobs is None:
        return None
    assert call.token_texts is not None
    return prompt_entries(call.token_texts, call.prepared.prompt_token_ids, prompt_logprobs, call.prompt_top)


async def _after(head: RequestDelta | None, rest: AsyncIterator[RequestDelta]) -> AsyncIterator[RequestDelta]:
    if head is not None:
        yield head
    async for delta in rest:
        yield delta


async def _batch_sse(
    calls: list[_Call], parts: list[AsyncIterator[bytes]], include_usage: bool
) -> AsyncIterator[bytes]:
    """A batch's chunks as its requests produce them (at most one pending write per request), then the
    summed usage and `[DONE]`."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=len(parts))

    async def pump(part: AsyncIterator[bytes]) -> None:
        try:
            async for chunk in part:
                await queue.put(chunk)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(part)) for part in parts]
    try:
        running = len(tasks)
        while running:
            chunk = await queue.get()
            running -= chunk is None
            if chunk is not None:
                yield chunk
        for task in tasks:
            task.result()  # a request's failure surfaces here
    finally:
        for task in tasks:
            task.cancel()
    yield _stream_end(calls, include_usage)


def _stream_end(calls: list[_Call], include_usage: bool) -> bytes:
    """A stream's last write: the calls' summed usage (when asked) and `[DONE]`."""
    usage = [_data({**_envelope(calls[0]), "choices": [], "usage": _usage(calls)}).encode()] if include_usage else []
    return b"".join([*usage, b"data: [DONE]\n\n"])


def _usage(calls: list[_Call]) -> dict[str, Any]:
    """The calls' usage, summed (a batch's)."""
    total: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    details: dict[str, int] = {}  # completion_tokens_details (a `prediction`'s accepted / rejected tokens)
    for call in calls:
        usage = call.account.usage()
        for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
            total[name] += usage[name]
        cached += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        for name, count in usage.get("completion_tokens_details", {}).items():
            details[name] = details.get(name, 0) + count
    if cached:
        total["prompt_tokens_details"] = {"cached_tokens": cached}
    if details:
        total["completion_tokens_details"] = details
    return total


class TextEvents:
    """A call's text chunks (without logprobs) as bytes: per choice, the chunk is encoded once around a
    placeholder text (and, with continuous usage, a placeholder usage) and split there, so each delta costs
    an orjson call on its text (and one on the usage) instead of building and encoding the whole chunk (the
    same bytes: each placeholder's JSON is replaced by the value's JSON)."""

    HOLE = "\x00streamd-text\x00"
    USAGE_HOLE = "\x00streamd-usage\x00"

    def __init__(self, call: _Call, extra: dict[str, Any], continuous: bool = False) -> None:
        """`continuous`: `extra["usage"]` changes from delta to delta (vLLM's continuous usage): it has its own hole."""
        self.call = call
        self.extra = extra
        self.continuous = continuous
        self.parts: dict[int, list[bytes]] = {}

    def event(self, index: int, text: str) -> bytes:
        parts = self.parts.get(index)
        if parts is None:
            parts = self.parts[index] = self._template(index)
        try:
            if self.continuous:
                return parts[0] + orjson.dumps(text) + parts[1] + orjson.dumps(self.extra["usage"]) + parts[2]
            return parts[0] + orjson.dumps(text) + parts[1]
        except TypeError:  # text orjson refuses (a lone surrogate): the generic encoder decides
            return self._whole(index, text)

    def _template(self, index: int) -> list[bytes]:
        """The choice's chunk split at its placeholders: [before the text, after it (up to the usage), ...]."""
        extra = {**self.extra, "usage": self.USAGE_HOLE} if self.continuous else self.extra
        whole = _data(_chunk(self.call, index, _piece(self.call, self.HOLE), None, extra)).encode()
        before, _, after = whole.partition(orjson.dumps(self.HOLE))
        if not self.continuous:
            return [before, after]
        middle, _, end = after.partition(orjson.dumps(self.USAGE_HOLE))
        return [before, middle, end]

    def content(self, index: int, text: str) -> list[bytes]:
        """A choice's new content as its chunk (none for no text); with logprobs, the whole chunk carries
        those of its tokens."""
        if not text:
            return []
        return [self.event(index, text) if self.call.logprobs is None else self._whole(index, text)]

    def _whole(self, index: int, text: str) -> bytes:
        return _data(_chunk(self.call, index, _piece(self.call, text), None, self.extra)).encode()


async def _collect_all(calls: list[_Call]) -> Response:
    """Every request's choices (in wire-index order) and the summed usage, as one JSON answer."""
    try:
        choices = await asyncio.gather(*(_collect(call) for call in calls))
    finally:
        _finish_all(calls)  # a failed request's siblings are aborted, not left to run
    body = {**_envelope(calls[0], final=True), "choices": [c for one in choices for c in one], "usage": _usage(calls)}
    return JSONResponse(body)


async def _collect(call: _Call) -> list[dict[str, Any]]:
    account = call.account
    texts: list[list[str]] = [[] for _ in range(account.num_choices)]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    try:
        async for delta in _deltas(call, None):
            if delta.prompt_logprobs is not None and prompt_logprobs is None:
                prompt_logprobs = delta.prompt_logprobs
                _add_prompt(call, prompt_logprobs)
            for choice in delta.outputs:
                texts[choice.index].append(choice.text)
                if call.logprobs is not None:
                    call.logprobs.add(choice)
    finally:
        call.finish()
    if account.error:
        raise ServiceError("internal_error", account.error)
    if account.overloaded:
        raise queue_timed_out()
    choices = []
    for index, (pieces, finish) in enumerate(zip(texts, account.choice_finishes())):
        text = (call.echo or "") + "".join(pieces)
        message = _message(call, index, text) if call.kind == "chat" else None  # (before `_ending`: it parses)
        logprobs = call.logprobs.take(index) if call.logprobs is not None else None
        ending = _ending(call, index, finish)
        if message is not None:
            choices.append({"index": call.first_index + index, "message": message, "logprobs": logprobs, **ending})
            continue
        entry = {"index": call.first_index + index, "text": text, "logprobs": logprobs, **ending}
        if call.prompt_top is not None:
            entry["prompt_logprobs"] = _prompt_entries(call, prompt_logprobs)
        choices.append(entry)
    return choices


def _message(call: _Call, index: int, text: str) -> dict[str, Any]:
    """A chat choice's whole reply as its message: the content, the tool calls, the reasoning."""
    reply = call.reply(index)
    message: dict[str, Any] = {"role": "assistant", "content": reply.feed(text, final=True).content}
    if reply.tools is not None:
        parsed = reply.tools.result()  # (its content: all the text after the reasoning when it made no call)
        message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
    reasoning = reply.reasoner.reasoning_text if reply.reasoner is not None else None
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _ending(call: _Call, index: int, finish: FinishNames) -> dict[str, Any]:
    """A finished choice's `finish_reason` ("tool_calls" when it stopped with a complete tool call, else
    OpenAI's name for the engine's) and its extra flag, if the finish has one (`streamd_drained`)."""
    reason = finish.openai
    if call.tool_format is not None and reason == "stop" and call.reply(index).called:
        reason = "tool_calls"
    return {"finish_reason": reason, **({finish.flag: True} if finish.flag else {})}


def _text_events(call: _Call, texts: TextEvents, index: int, text: str, final: bool) -> list[bytes]:
    """A choice's new text -> its chunks: a reasoning model's reasoning as `reasoning_content`, the rest as
    content, through the tool-call parser when there is one (`final`: release what the parsers held back)."""
    out = call.reply(index).feed(text, final)
    events = []
    if out.reasoning:
        events.append(_data(_chunk(call, index, {"reasoning_content": out.reasoning}, None, texts.extra)).encode())
    if not out.tool_calls:
        return events + texts.content(index, out.content)
    pieces: list[dict[str, Any]] = [{"content": out.content}] if out.content else []
    pieces.append({"tool_calls": out.tool_calls})
    return events + [_data(_chunk(call, index, piece, None, texts.extra)).encode() for piece in pieces]


def _envelope(call: _Call, final: bool = False) -> dict[str, Any]:
    obj = {"chat": "chat.completion", "completion": "text_completion"}[call.kind]
    if call.kind == "chat" and not final:
        obj = "chat.completion.chunk"
    return {
        "id": call.id,
        "object": obj,
        "created": call.created,
        "model": call.model,
        "service_tier": call.prepared.service_tier,
    }


def _piece(call: _Call, text: str) -> dict[str, Any] | str:
    return {"content": text} if call.kind == "chat" else text


def _chunk(call: _Call, index: int, piece: Any, finish: FinishNames | None, extra: dict[str, Any]) -> dict[str, Any]:
    """A chunk of one choice: its new piece or (`finish` given) its ending, with the logprobs of the choice's
    tokens since its previous chunk (null when none: the role chunk, text held back and released later)."""
    builder = call.logprobs
    logprobs = builder.take(index) if builder is not None and builder.has_pending(index) else None
    ending = {"finish_reason": None} if finish is None else _ending(call, index, finish)
    wire_index = call.first_index + index
    if call.kind == "chat":
        choice = {"index": wire_index, "delta": piece if finish is None else {}, "logprobs": logprobs, **ending}
    else:
        choice = {"index": wire_index, "text": piece, "logprobs": logprobs, **ending}
    return {**_envelope(call), "choices": [choice], **extra}


def _data(obj: dict[str, Any]) -> str:
    return f"data: {dumps(obj)}\n\n"


def _refuse(body: dict[str, Any], **allowed: Any) -> None:
    """Refuses fields whose value would need a feature this server does not have."""
    for name, harmless in allowed.items():
        value = body.get(name)
        if value is None or value == harmless or (isinstance(value, (list, dict)) and not value):
            continue
        raise ServiceError("unsupported", f"{name} is not supported", name)


def _params(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k in WIRE_PARAMS and k != "logprobs"}


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's `logprobs: true` + `top_logprobs` -> how many top logprobs per token (None: none asked)."""
    wanted, top = body_flag(body, "logprobs", False), body.get("top_logprobs")
    if top is not None and not (is_int(top) and 0 <= top <= MAX_LOGPROBS):
        raise ServiceError(
            "invalid_request", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}", "top_logprobs"
        )
    if top is not None and not wanted:
        raise ServiceError("invalid_request", "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _completion_logprobs(body: dict[str, Any], name: str = "logprobs") -> int | None:
    """Completions' `logprobs` (or vLLM's `prompt_logprobs`): how many top logprobs per token (the
    token's own always comes too)."""
    top = body.get(name)
    if top is not None and not (is_int(top) and 0 <= top <= MAX_LOGPROBS):
        raise ServiceError("invalid_request", f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {top!r}", name)
    return top


MAX_PROMPTS = 64  # prompts in one /v1/completions batch (each is an engine request of n sequences)
# The top-level fields each route reads (the rest is ignored: `note_ignored`).
_CHAT_FIELDS = WIRE_PARAMS | {
    "messages",
    "model",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "max_completion_tokens",
    "top_logprobs",
    "logprobs",
    "functions",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "streamd_background",
}
_COMPLETION_FIELDS = WIRE_PARAMS | {
    "prompt",
    "model",
    "stream",
    "stream_options",
    "echo",
    "suffix",
    "best_of",
    "logprobs",
    "prompt_logprobs",
    "streamd_background",
}


def make_routes() -> list[RouteSpec]:
    return [
        ("/v1/models", list_models, ["GET"]),
        ("/v1/completions", completions, ["POST"]),
        ("/v1/chat/completions", chat_completions, ["POST"]),
        *(route for family in _BACKGROUND.values() for route in family.routes()),
    ]
