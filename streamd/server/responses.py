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
from streamd.server.body_fields import body_flag, check_model
from streamd.server.errors import ServiceError
from streamd.server.generation import SCHEDULING_FIELDS, Prepared, normalize_messages, wire_user
from streamd.server.logprobs import TokenTexts, chat_entries
from streamd.server.reasoning import ReplyParser
from streamd.server.responses_store import StoredResponse
from streamd.server.services import Services
from streamd.server.structured_api import plan_tools, structured_from_text_format

# Fields that ask for features this server does not have; refused unless empty / the harmless value.
_REFUSED: dict[str, Any] = {
    "conversation": None,
    "prompt": None,
    "reasoning": None,
    "include": None,
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
    background: bool = False  # runs detached (HTTP only: server/background.py)
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the request gave them (echoed)
    tool_choice: Any = "auto"  # as the request gave it (echoed)
    tool_format: str | None = None  # the format the reply's calls are parsed in (None: no tools, or text)
    think_inside: bool | None = None  # a reasoning model's: whether the reply starts inside `<think>`


async def plan_response(
    s: Services, body: dict[str, Any], find: Lookup, *, stream_id: str | None = None
) -> ResponsePlan:
    """Checks a Responses request and tokenizes it (off the event loop when long); raises ServiceError
    naming the field that is wrong."""
    check_model(s, body)
    _refuse_features(body)
    structured = _text_format(body.get("text"))
    tools = plan_tools(_chat_tools(body.get("tools")), _chat_tool_choice(body.get("tool_choice")), s.tool_format)
    if tools is not None and tools.structured is not None:
        if structured is not None:
            raise ServiceError(
                "invalid_request", "a required or named tool_choice cannot be combined with text.format", "tool_choice"
            )
        structured = tools.structured
    template_tools = tools.tools if tools is not None else None
    stream, store = body_flag(body, "stream", False), body_flag(body, "store", True)
    background = _background(body, store, stream_id)
    new = _input_messages(body.get("input"), body.get("instructions"), s.generation.developer_role)
    previous_id = body.get("previous_response_id")
    if previous_id is None:
        messages, ids = new, await s.generation.messages_ids(new, template_tools, param="input")
    else:
        previous = find(previous_id) if isinstance(previous_id, str) else None
        if previous is None:
            raise ServiceError(
                "previous_response_not_found",
                f"previous response {previous_id!r} is not found (unknown, expired, not stored, or another key's)",
                "previous_response_id",
            )
        messages = previous.messages + new
        ids = await continuation_ids(s, previous, new, template_tools)
    prepared = s.generation.prepare(
        ids,
        {**_sampling(body), "structured_outputs": structured},
        default_max_tokens=None,
        prompt_param="input",
        user=wire_user(body),
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
        "background": background,
        "text": body.get("text") or {"format": {"type": "text"}},
        "service_tier": prepared.service_tier,
    }
    think = s.generation.think
    return ResponsePlan(
        "resp_" + uuid.uuid4().hex,
        prepared,
        messages,
        echo,
        store,
        stream,
        stream_id,
        tools=body.get("tools") or [],
        tool_choice=body.get("tool_choice") or ("auto" if tools is not None else "none"),
        tool_format=tools.parser if tools is not None else None,
        think_inside=think.starts_inside(ids) if think is not None else None,
        background=background,
    )


def _background(body: dict[str, Any], store: bool, stream_id: str | None) -> bool:
    """`background: true`: over HTTP, and stored (its id is how it is reached again)."""
    background = body_flag(body, "background", False)
    if background and stream_id is not None:
        raise ServiceError("unsupported", "background is for HTTP (POST /v1/responses) only", "background")
    if background and not store:
        raise ServiceError("invalid_request", "background needs store: true (it is retrieved by its id)", "background")
    return background


async def continuation_ids(
    s: Services, previous: StoredResponse, new: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
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
        return await s.generation.messages_ids(conversation, tools, param="input")
    return previous.token_ids + turn


def _new_turn_ids(tokenizer: Any, previous: StoredResponse, new: list[dict[str, str]]) -> list[int] | None:
    """The new turn's ids after `previous` (see continuation_ids); None when the template does not extend."""
    history = previous.messages
    if history[-1].get("tool_calls"):  # the template renders the calls its own way: render it all afresh
        return None
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


def _input_messages(raw: Any, instructions: Any, developer: str) -> list[dict[str, Any]]:
    if instructions is not None and not isinstance(instructions, str):
        raise ServiceError("invalid_request", "instructions must be a string", "instructions")
    head = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(raw, str) and raw:
        return head + [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise ServiceError(
            "invalid_request", "input must be a non-empty string or a non-empty list of message items", "input"
        )
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        _add_item(messages, i, item)
    return head + normalize_messages(messages, developer)


def _add_item(messages: list[dict[str, Any]], i: int, item: Any) -> None:
    """An input item as chat messages: a message; a `function_call` (the model's earlier call) joins the
    assistant message before it, or starts one; a `function_call_output` is a tool message; a `reasoning`
    item is not shown to the template (as chat templates drop earlier reasoning)."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "reasoning":
        return
    if kind == "function_call":
        call = _function_call(i, item)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return
    if kind == "function_call_output":
        output, call_id = item.get("output"), item.get("call_id")
        if not isinstance(output, str) or not isinstance(call_id, str):
            raise ServiceError(
                "invalid_request", f"input[{i}]: a function_call_output needs string call_id and output", "input"
            )
        messages.append({"role": "tool", "content": output, "tool_call_id": call_id})
        return
    messages.append(_message(i, item))


def _message(i: int, item: Any) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        raise ServiceError(
            "unsupported",
            f"input[{i}]: only message, function_call, function_call_output and reasoning items are supported",
            "input",
        )
    content = item.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in _INPUT_PARTS]
        strings = [t for t in texts if isinstance(t, str)]
        if len(strings) != len(content):  # a part of another type, or one whose text is no string
            raise ServiceError("unsupported", f"input[{i}].content: only input_text parts are supported", "input")
        content = "".join(strings)
    return {"role": item.get("role"), "content": content}


def _function_call(i: int, item: dict[str, Any]) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
        raise ServiceError(
            "invalid_request", f"input[{i}]: a function_call needs string call_id, name and arguments", "input"
        )
    return _chat_call(call_id, name, arguments)


def _chat_tools(tools: Any) -> Any:
    """Responses function tools (`{"type": "function", "name", "parameters", ...}`) in chat's shape (the
    function under `function`) for `plan_tools`, which checks them; anything else is passed on for it to
    refuse."""
    if not isinstance(tools, list):
        return tools
    return [_chat_tool(tool) for tool in tools]


def _chat_tool(tool: Any) -> Any:
    if not isinstance(tool, dict) or tool.get("type") != "function" or "function" in tool:
        return tool
    fields = {k: v for k, v in tool.items() if k in ("name", "description", "parameters") and v is not None}
    return {"type": "function", "function": fields}


def _chat_tool_choice(choice: Any) -> Any:
    """A Responses named choice (`{"type": "function", "name"}`) in chat's shape; the strings as they are."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


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
    return {
        "max_tokens": limit,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "logprobs": top,
        **{name: body.get(name) for name in SCHEDULING_FIELDS},
    }


# ---- events ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Item:
    """One output item as it streams: the assistant's message, its reasoning, or a function call."""

    kind: str  # "message", "reasoning" or "function_call"
    id: str
    index: int  # its output_index
    text: list[str] = field(default_factory=list)  # the message's or reasoning's text, a call's arguments
    call_id: str = ""
    name: str = ""
    done: bool = False


@dataclass(slots=True)
class ResponseBuilder:
    """One response's events, in order, numbered from 0; also its final `response` object. A plain text
    response opens its message at once (as before any tools or reasoning); with tools or a reasoning model,
    each item (reasoning, message, function calls) opens when its first text arrives and the previous one is
    done then. Reply text goes through the `ReplyParser` the chat route uses (reasoning, then tool calls)."""

    plan: ResponsePlan
    model: str
    token_texts: TokenTexts  # for logprobs
    created_at: int = field(default_factory=lambda: int(time.time()))
    seq: int = 0
    items: list[_Item] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    reply: ReplyParser = field(init=False)
    calls: dict[int, _Item] = field(default_factory=dict)  # the parser's call index -> its item
    queued: bool = False  # `response.queued` is out (the engine reported it waiting)
    started: bool = False  # `response.in_progress` is out (the engine scheduled it, or it ended)

    def __post_init__(self) -> None:
        self.reply = ReplyParser(self.plan.think_inside, self.plan.tool_format)

    @property
    def eager(self) -> bool:
        """Whether the message item opens at once (a plain text response)."""
        return self.plan.think_inside is None and self.plan.tool_format is None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        if self.plan.stream_id is not None:
            event["stream_id"] = self.plan.stream_id
        return event

    def opening(self) -> list[dict[str, Any]]:
        """`response.created` at once; `response.queued` / `response.in_progress` follow the engine (`_status`)."""
        return [self.event("response.created", response=self.response(None))]

    def _status(self, delta: RequestDelta | None) -> list[dict[str, Any]]:
        """As OpenAI: `response.queued` while the engine reports it waiting, then `response.in_progress` (and a
        plain response's message opens) once it is scheduled (`delta` None: it ended, never scheduled)."""
        if self.started:
            return []
        waiting = delta is not None and delta.progress is not None and delta.progress.queue_position is not None
        if waiting and delta is not None and not delta.finished:
            if self.queued:
                return []
            self.queued = True
            return [self.event("response.queued", response=self.response(None, "queued"))]
        self.started = True
        events = [self.event("response.in_progress", response=self.response(None))]
        return events + (self._open("message") if self.eager else [])

    def feed(self, delta: RequestDelta, account: RequestAccount) -> list[dict[str, Any]]:
        account.absorb(delta)
        events = self._status(delta)
        for choice in delta.outputs:
            self.output_ids.extend(choice.token_ids)
            logprobs = self._logprobs(choice.token_ids, choice.logprobs)
            if choice.text:
                events += self._text(choice.text, logprobs, final=False)
        return events

    def closing(self, account: RequestAccount) -> list[dict[str, Any]]:
        events = self._status(None)
        events += [] if self.eager else self._text("", [], final=True)
        if not self.items:
            events += self._open("message")
        for item in self.items:
            events += self._close(item)
        return events + [self.event(account.finish.terminal_event, response=self.response(account))]

    # ---- reply text -> items ------------------------------------------------------------------------
    def _text(self, text: str, logprobs: list[dict[str, Any]], final: bool) -> list[dict[str, Any]]:
        out = self.reply.feed(text, final)
        events = []
        if out.reasoning:
            events += self._append("reasoning", out.reasoning, "response.reasoning_text.delta")
        events += self._content(out.content, logprobs)
        for delta in out.tool_calls:
            events += self._call_delta(delta)
        return events

    def _content(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not text:
            return []
        return self._append("message", text, "response.output_text.delta", logprobs=logprobs)

    def _append(self, kind: str, text: str, event: str, **extra: Any) -> list[dict[str, Any]]:
        """`text` added to the open item of `kind` (opened first, closing the one before, when it is not)."""
        open_item = self.items[-1] if self.items and not self.items[-1].done else None
        events = [] if open_item is not None and open_item.kind == kind else self._open(kind)
        item = self.items[-1]
        item.text.append(text)
        at = {"output_index": item.index, "item_id": item.id}
        return events + [self.event(event, **at, content_index=0, delta=text, **extra)]

    def _call_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call delta of the parser's: a new call opens a function_call item, arguments stream in it."""
        events = []
        if "id" in delta:
            events += self._open("function_call", call_id=delta["id"], name=delta["function"]["name"])
            self.calls[delta["index"]] = self.items[-1]
        item, piece = self.calls[delta["index"]], delta["function"].get("arguments", "")
        if piece:
            item.text.append(piece)
            at = {"output_index": item.index, "item_id": item.id}
            events.append(self.event("response.function_call_arguments.delta", **at, delta=piece))
        return events

    def _open(self, kind: str, call_id: str = "", name: str = "") -> list[dict[str, Any]]:
        events = [e for item in self.items for e in self._close(item)]
        prefix = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_"}[kind]
        number = "" if not self.items else f"_{len(self.items)}"
        item_id = prefix + self.plan.id.removeprefix("resp_") + number
        item = _Item(kind, item_id, len(self.items), call_id=call_id, name=name)
        self.items.append(item)
        events.append(self.event("response.output_item.added", output_index=item.index, item=self.item(item)))
        if kind == "message":
            at = {"output_index": item.index, "item_id": item.id}
            events.append(self.event("response.content_part.added", **at, content_index=0, part=self.part("")))
        return events

    def _close(self, item: _Item) -> list[dict[str, Any]]:
        if item.done:
            return []
        item.done = True
        text, at = "".join(item.text), {"output_index": item.index, "item_id": item.id}
        if item.kind == "function_call":
            events = [self.event("response.function_call_arguments.done", **at, arguments=text)]
        elif item.kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **at, content_index=0, text=text)]
        else:
            events = [
                self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=self.logprobs),
                self.event("response.content_part.done", **at, content_index=0, part=self.part(text)),
            ]
        done = self.event("response.output_item.done", output_index=item.index, item=self.item(item, "completed"))
        return [*events, done]

    # ---- objects ------------------------------------------------------------------------------------
    def response(self, account: RequestAccount | None, status: str = "in_progress") -> dict[str, Any]:
        """The `response` object: `status` (no account) or as the account ended it."""
        body: dict[str, Any] = {
            "id": self.plan.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "output": [],
            "parallel_tool_calls": bool(self.plan.tools),
            "tool_choice": self.plan.tool_choice,
            "tools": self.plan.tools,
            "error": None,
            "incomplete_details": None,
            "usage": None,
            **self.plan.echo,
        }
        if account is None:
            return body
        finish = account.finish  # (FINISH_NAMES: the Responses API's status and incomplete reason)
        status = "completed" if finish.status == "completed" else "incomplete"
        body.update(
            status=finish.status, output=[self.item(item, status) for item in self.items], usage=_usage(account)
        )
        if finish.incomplete is not None:
            body["incomplete_details"] = {"reason": finish.incomplete}
        if account.error is not None:
            body["error"] = {"code": "server_error", "message": account.error}
        return body

    def item(self, item: _Item, status: str = "in_progress") -> dict[str, Any]:
        """An output item as the SDK models it (`status` once it is done)."""
        text = "".join(item.text)
        base = {"id": item.id, "type": item.kind, "status": status}
        if item.kind == "function_call":
            return {**base, "call_id": item.call_id, "name": item.name, "arguments": text}
        if item.kind == "reasoning":
            return {**base, "summary": [], "content": [{"type": "reasoning_text", "text": text}] if item.done else []}
        return {**base, "role": "assistant", "content": [self.part(text)] if item.done else []}

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": self.logprobs if text else []}

    def stored(self) -> StoredResponse:
        """The conversation so far, the reply as the assistant's message (its tool calls with it)."""
        text = "".join(t for item in self.items if item.kind == "message" for t in item.text)
        answer: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [item for item in self.items if item.kind == "function_call"]
        if calls:
            answer["tool_calls"] = [_chat_call(item.call_id, item.name, "".join(item.text)) for item in calls]
            try:  # (the template wants the arguments as objects)
                answer = normalize_messages([answer])[0]
            except ServiceError:  # a call cut short (its arguments no JSON): the answer is its text
                del answer["tool_calls"]
        messages = self.plan.messages + [answer]
        return StoredResponse(self.plan.id, messages, self.plan.prepared.prompt_token_ids + self.output_ids)

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None) -> list[dict[str, Any]]:
        if logprobs is None:
            return []
        top = self.plan.prepared.params.logprobs or 0
        out = chat_entries(self.token_texts, token_ids, logprobs, top)
        self.logprobs.extend(out)
        return out


def _chat_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A function call as chat messages carry it (`tool_calls[]`, arguments as JSON text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


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

    @property
    def id(self) -> str:
        return self.builder.plan.id

    def cancel(self) -> None:
        self.account.cancel()

    def snapshot(self, done: bool) -> dict[str, Any]:
        """The `response` object as of now: as it ended (`done`), else queued or in progress."""
        builder = self.builder
        if done:
            return builder.response(self.account)
        return builder.response(None, "queued" if builder.queued and not builder.started else "in_progress")

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


def builder_for(s: Services, plan: ResponsePlan) -> ResponseBuilder:
    return ResponseBuilder(plan, s.model_name, s.token_texts)


def keep(s: Services, key: str, run: ResponseRun) -> None:
    """Stores a finished response for `previous_response_id` unless it failed or `store` is false."""
    if run.builder.plan.store and run.account.error is None:
        s.responses.put(key, run.builder.stored())
