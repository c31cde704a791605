"""From a wire request to an engine request: prompt or messages to token ids, params to SamplingParams,
limits (context length, max_tokens, overload, drain), engine errors to ServiceErrors, and the request's
`RequestAccount` opened on submission.

Shared by the WebSocket protocol and the OpenAI routes so both refuse and accept exactly the same things.
Chat templates come only from the model (`tokenizing.py` renders them), never from a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from streamd.config import GrammarConfig, ServerConfig
from streamd.engine import (
    DEFAULT_OPTIONS,
    Admission,
    Backpressure,
    DeltaSink,
    EngineClient,
    EngineDeadError,
    RequestError,
    RequestStream,
    SamplingParams,
    TemplateOptions,
    is_int,
)
from streamd.server.accounting import RequestAccount
from streamd.server.compile_gate import CompileGate
from streamd.server.encoding import loads
from streamd.server.errors import ServiceError
from streamd.server.lifecycle import Lifecycle
from streamd.server.metrics import Metrics
from streamd.server.reasoning import think_tags
from streamd.server.structured_api import GUIDED_ALIASES, structured_from_fields
from streamd.server.tenants import Tenants
from streamd.server.tokenizing import Tokenizing

# SamplingParams fields no request may set: `detokenize` (the server always streams text),
# `queue_timeout_s` (the server sets it from `server.max_queue_time_s`) and `thinking_end_token_ids` (the
# model's `</think>`, set with a `thinking_token_budget`).
# (`prompt_logprobs` is read by the completions route only, the one route that returns it.)
# `tenant` (set from the API key or user: server/tenants.py).
ENGINE_ONLY_PARAMS = frozenset(
    {"detokenize", "queue_timeout_s", "thinking_end_token_ids", "prompt_logprobs", "tenant", "queue_reports"}
)
# The routes that send a waiting request's queue place (`/v1/stream`'s `progress`, the Responses API's
# `response.queued`); on the others the engine does not report it.
QUEUE_REPORT_ROUTES = frozenset({"ws", "responses"})
# Wire names that are no SamplingParams field but become one (OpenAI's `response_format` and vLLM's older
# `guided_*`: structured_outputs).
WIRE_ALIASES = frozenset({"response_format", *GUIDED_ALIASES})
# Wire parameter names (OpenAI / vLLM) accepted on every route: every SamplingParams field but the engine's own.
WIRE_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - ENGINE_ONLY_PARAMS | WIRE_ALIASES
# Who goes first (engine/core/fairness.py) and which prefix cache a request shares: accepted on every route.
SCHEDULING_FIELDS = ("service_tier", "priority", "cache_salt")
# Who the end user is (`wire_user`: the tenant where keys are off), beside them on every route: the OpenAI
# routes' bodies, `/v1/stream`'s `params`.
USER_FIELDS = ("safety_identifier", "user")
MAX_N = 16  # parallel samples or beams per request (each is a sequence of the batch)
_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})


@dataclass(slots=True)
class Prepared:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    user: str | None = None  # the body's `user` / `safety_identifier` (the tenant where keys are off)

    @property
    def service_tier(self) -> str:
        """The tier the response reports (OpenAI's `service_tier`; "auto" is served as "default")."""
        tier = self.params.service_tier
        return "default" if tier == "auto" else tier


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        config: ServerConfig,
        lifecycle: Lifecycle,
        metrics: Metrics,
        compiles: CompileGate | None = None,
        tenants: Tenants | None = None,
    ):
        self.engine = engine
        self.config = config
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.compiles = compiles or CompileGate(GrammarConfig())
        self.tenants = tenants or Tenants(config)  # (the app's, whose labels its metrics use too)
        self.tokenizing = Tokenizing(engine.tokenizer)
        # The engine's admission check, as far as the server knows the engine: its context, and the server's
        # cap on the samples or beams of one request (the engine checks its KV pool on submission).
        self.admission = Admission(engine.max_model_len, max_width=MAX_N)
        self.developer_role = developer_role(getattr(engine.tokenizer, "chat_template", None))
        self.think = think_tags(engine.tokenizer) if engine.tokenizer is not None else None

    # ---- building ----------------------------------------------------------------------------
    async def prompt_ids(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        """A text prompt (tokenized as LLMEngine tokenizes one, unless told to leave out special tokens; off
        the loop when long), or a list of token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ServiceError("invalid_request", "prompt must not be empty", "prompt")
            self.check_chars(len(prompt), "prompt")
            return await self.tokenizing.encode(prompt, add_special_tokens)
        if isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt):
            self.check_chars(len(prompt), "prompt")
            return list(prompt)  # the engine checks them against the vocabulary
        raise ServiceError("invalid_request", "prompt must be a non-empty string or a list of token ids", "prompt")

    async def messages_ids(
        self,
        messages: Any,
        tools: list[dict[str, Any]] | None = None,
        options: TemplateOptions = DEFAULT_OPTIONS,
        *,
        param: str = "messages",
    ) -> list[int]:
        """Chat messages (and OpenAI function `tools`) through the model's chat template as `options` say,
        off the loop when long; errors name `param`, the field they came in."""
        messages = normalize_messages(messages, self.developer_role)
        chars = chat_chars(messages, tools)
        self.check_chars(chars, param)
        try:
            return await self.tokenizing.chat(messages, tools, options, chars)
        except RequestError as exc:
            if exc.param is not None:  # a template option's fault, not the messages'
                raise ServiceError(exc.code, str(exc), exc.param) from exc
            raise ServiceError("invalid_request", f"{param}: {exc}", param) from exc
        except ValueError as exc:
            raise ServiceError("invalid_request", f"{param}: {exc}", param) from exc

    def check_chars(self, size: int, param: str) -> None:
        limit = self.config.max_prompt_chars
        if size > limit:
            raise ServiceError(
                "request_too_large",
                f"{param} is too long: {size} characters (or token ids); "
                f"this server takes at most {limit} (server.max_prompt_chars)",
                param,
            )

    def prepare(
        self,
        prompt_ids: list[int],
        raw: dict[str, Any],
        *,
        default_max_tokens: int | None,
        prompt: str | None = None,
        prompt_param: str = "messages",
        prompt_logprobs: int | None = None,
        user: str | None = None,
    ) -> Prepared:
        """Validates params against the context; `default_max_tokens` None means "the rest of the context".
        `prompt_param` names the field the prompt came in (`prompt` or `messages`) in context errors.
        `prompt_logprobs`: the completions route's (echo with logprobs, or vLLM's `prompt_logprobs`); `user`: the
        body's `wire_user`."""
        unknown = sorted(set(raw) - WIRE_PARAMS)
        if unknown:
            raise ServiceError("invalid_request", f"unknown parameter {unknown[0]!r}", unknown[0])
        fields = {k: v for k, v in raw.items() if v is not None}
        structured_from_fields(fields)
        if "prediction" in fields:
            fields["prediction"] = prediction_text(fields["prediction"])
            self.check_chars(len(fields["prediction"]), "prediction")
        if prompt_logprobs is not None:
            fields["prompt_logprobs"] = prompt_logprobs
        if "thinking_token_budget" in fields:
            fields["thinking_end_token_ids"] = self._thinking_end()
        context, n_prompt = self.engine.max_model_len, len(prompt_ids)
        with _refusal(prompt_param):
            self.admission.check_lengths(n_prompt, None)
        limit = self.config.max_tokens_limit
        if "max_tokens" not in fields:
            room = context - n_prompt
            fields["max_tokens"] = min(default_max_tokens or room, room, limit or room)
        max_tokens = fields["max_tokens"]
        if is_int(max_tokens) and limit is not None and max_tokens > limit:
            raise ServiceError("invalid_request", f"max_tokens must be <= {limit}, got {max_tokens}", "max_tokens")
        if is_int(max_tokens):
            with _refusal(prompt_param):
                self.admission.check_lengths(n_prompt, max_tokens)
        self._deadlines(fields)
        try:
            params = SamplingParams.from_dict(fields)
        except (ValueError, TypeError) as exc:
            raise ServiceError("invalid_request", str(exc), str(exc).split(" ", 1)[0]) from exc
        with _refusal(prompt_param):
            self.admission.check_width(params)
            self.admission.check_prompt_logprobs(params)
        return Prepared(prompt_ids, params, prompt, user)

    def _thinking_end(self) -> list[int]:
        if self.think is None:
            raise ServiceError(
                "unsupported",
                "thinking_token_budget needs a reasoning model (its chat template uses <think>); this one's does not",
                "thinking_token_budget",
            )
        return self.think.end_token_ids

    def _deadlines(self, fields: dict[str, Any]) -> None:
        """`server.max_request_time_s` is the default and the cap of `timeout_s`; `server.max_queue_time_s`
        bounds the wait before first scheduling."""
        cap, timeout = self.config.max_request_time_s, fields.get("timeout_s")
        if cap is not None and (timeout is None or (isinstance(timeout, (int, float)) and timeout > cap)):
            fields["timeout_s"] = cap
        if self.config.max_queue_time_s is not None:
            fields["queue_timeout_s"] = self.config.max_queue_time_s

    # ---- running -----------------------------------------------------------------------------
    async def submit(
        self, prepared: Prepared, route: str, sink: DeltaSink | None = None, *, api_key: str | None = None
    ) -> tuple[RequestAccount, RequestStream | None]:
        """Submits a prepared request; returns its account and, without a `sink` of the caller's, the
        stream its deltas come on. Raises ServiceError when refused (the request is then not counted).
        `api_key`: whose compile slots a heavy grammar takes (compile_gate.py)."""
        if self.lifecycle.draining:
            raise ServiceError("shutting_down", "the server is shutting down")
        if self.engine.num_waiting >= self.config.max_waiting_requests:
            raise ServiceError("overloaded", "too many requests are waiting; retry later")
        compiling = None
        with _grammar_refusal():
            slot = self.compiles.enter(prepared.params, api_key)
        try:
            compiling = self.compiles.start(self.engine.compile_grammar(prepared.params))
            with _grammar_refusal():  # before the request exists: a bad schema never takes a KV block
                await self.compiles.wait(compiling)
            return await self._submit(prepared, route, sink, api_key)
        finally:
            self.compiles.leave(slot, compiling)

    async def _submit(
        self, prepared: Prepared, route: str, sink: DeltaSink | None, api_key: str | None
    ) -> tuple[RequestAccount, RequestStream | None]:
        engine, request_id = self.engine, new_request_id()
        tenant = self.tenants.of(api_key, prepared.user)
        prepared.params.tenant = tenant.name
        prepared.params.queue_reports = route in QUEUE_REPORT_ROUTES
        stream = None
        if sink is None:
            backpressure = Backpressure(request_id, self.config.max_unsent_tokens, engine.set_paused)
            sink = stream = RequestStream(request_id, engine.abort, backpressure)
        account = RequestAccount(
            request_id,
            route,
            len(prepared.prompt_token_ids),
            self.metrics,
            self.lifecycle,
            cancel=lambda: engine.abort(request_id),
            num_choices=prepared.params.n,
            tenant=tenant.label,
        )
        account.predicted = prepared.params.prediction is not None
        try:
            await engine.submit(
                request_id, prepared.prompt, prepared.params, sink, prompt_token_ids=prepared.prompt_token_ids
            )
        except asyncio.CancelledError:
            account.close()  # cancelled while waiting for admission: counted as cancelled
            raise
        except RequestError as exc:
            account.discard()
            raise ServiceError(exc.code, str(exc), exc.param) from exc
        except EngineDeadError as exc:
            account.discard()
            raise ServiceError("engine_unavailable", str(exc)) from exc
        except ValueError as exc:
            account.discard()
            raise ServiceError("invalid_request", str(exc)) from exc
        return account, stream

    def count_cancelled(self, route: str) -> None:
        """Counts a request whose client left before it could even be submitted (as cancelled)."""
        RequestAccount(new_request_id(), route, 0, self.metrics, self.lifecycle, cancel=lambda: None).close()


def wire_user(body: dict[str, Any]) -> str | None:
    """OpenAI's `user` (or its successor `safety_identifier`): who the end user is, the tenant where keys are
    off (server/tenants.py). Refused unless a string of at most 256 characters."""
    for name in USER_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not 0 < len(value) <= 256:
            raise ServiceError("invalid_request", f"{name} must be a string of 1 to 256 characters", name)
        return value
    return None


def split_user(params: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """`params` without USER_FIELDS, and their `wire_user` (for `prepare`, where they are not sampling params)."""
    user = wire_user(params)
    return {k: v for k, v in params.items() if k not in USER_FIELDS}, user


@contextlib.contextmanager
def _refusal(prompt_param: str) -> Iterator[None]:
    """An admission check's refusal becomes a ServiceError naming the wire field (the prompt's: `prompt_param`)."""
    try:
        yield
    except RequestError as exc:
        raise ServiceError(exc.code, str(exc), prompt_param if exc.param == "prompt" else exc.param) from exc


@contextlib.contextmanager
def _grammar_refusal() -> Iterator[None]:
    """A GrammarError (or a model that cannot constrain its output) becomes a ServiceError naming the field."""
    try:
        yield
    except RequestError as exc:
        raise ServiceError(exc.code, str(exc), "structured_outputs") from exc


def prediction_text(value: Any) -> str:
    """OpenAI's `prediction` (Predicted Outputs): `{"type": "content", "content": text or [text parts]}`, or
    the text itself (`/v1/stream`); its text, or a refusal naming the field."""
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) and value.get("type") == "content" else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise ServiceError(
            "invalid_request",
            'prediction must be {"type": "content", "content": a string or text parts} (or a string)',
            "prediction",
        )
    return content


def chat_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """What `server.max_prompt_chars` counts of a chat: every message's content, its tool calls' arguments
    and the tools' definitions (as JSON)."""
    size = sum(len(m["content"]) + len(json.dumps(m.get("tool_calls") or "")) for m in messages)
    return size + (len(json.dumps(tools)) if tools else 0)


def developer_role(chat_template: Any) -> str:
    """The role OpenAI's `developer` messages get: their own where the model's chat template names it, else
    "system" (templates that do not know it would drop or refuse it)."""
    return "developer" if isinstance(chat_template, str) and "developer" in chat_template else "system"


def normalize_messages(messages: Any, developer: str = "system") -> list[dict[str, Any]]:
    """OpenAI chat messages to plain {role, content} dicts (text parts joined), `developer` messages in the
    role `developer` (`developer_role`), keeping an assistant's `tool_calls` (arguments parsed to objects, as
    chat templates expect) and a tool message's `tool_call_id`; anything else is refused."""
    if not isinstance(messages, list) or not messages:
        raise ServiceError("invalid_request", "messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise ServiceError(
                "invalid_request", f"messages[{i}] must be an object with a role in {sorted(_ROLES)}", "messages"
            )
        content = message.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            strings = [p for p in parts if isinstance(p, str)]
            if len(strings) != len(content):  # a part of another type, or one whose text is no string
                raise ServiceError("unsupported", f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(strings)
        if content is None and message["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ServiceError("invalid_request", f"messages[{i}].content must be a string", "messages")
        role = developer if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": content, **_tool_fields(i, message)})
    return out


def _tool_fields(i: int, message: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if message["role"] == "tool" and isinstance(message.get("tool_call_id"), str):
        fields["tool_call_id"] = message["tool_call_id"]
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls:
        try:  # `loads` refuses unencodable text and deep nesting in the arguments as in a body
            fields["tool_calls"] = [
                {
                    "id": c.get("id"),
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": _arguments(c["function"]["arguments"]),
                    },
                }
                for c in calls
            ]
        except (TypeError, KeyError, AttributeError, ServiceError) as exc:
            raise ServiceError(
                "invalid_request",
                f"messages[{i}].tool_calls must be OpenAI tool calls with JSON-string arguments ({exc})",
                "messages",
            ) from exc
    return fields


def _arguments(value: Any) -> Any:
    """A call's arguments as an object: parsed from JSON text, or kept when already parsed (a message
    normalized before, as the Responses API's are)."""
    return value if isinstance(value, dict) else loads(value, "arguments")


def new_request_id() -> str:
    return uuid.uuid4().hex
