"""vLLM's tokenizer routes: `POST /tokenize` and `POST /detokenize`, with vLLM's fields.

`/tokenize` takes a prompt (`prompt`, `add_special_tokens` default true) or a conversation (`messages`,
`add_generation_prompt` default true, `continue_final_message` default false, `add_special_tokens` default
false, `tools`), and `return_token_strs` (default false); it answers `{"count", "max_model_len", "tokens",
"token_strs"}` (`token_strs`: the tokenizer's own token strings when asked, else null). Prompts and
conversations go through the same code as a generation request's (`Generation.prompt_ids` /
`messages_ids`), so with the defaults `count` is the `prompt_tokens` that request would be charged.
`/detokenize` takes `tokens` (ids in the vocabulary) and answers `{"prompt": text}`. Both check `model`
like every OpenAI route and ignore fields they do not know, as vLLM does. Long inputs and outputs are
(de)tokenized on the tokenizer worker (`tokenizing.py`), within `server.max_prompt_chars`.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamd.engine import is_int
from streamd.server.body_fields import body_flag, check_model, template_options
from streamd.server.errors import ServiceError
from streamd.server.http.common import RouteSpec, json_body
from streamd.server.services import Services
from streamd.server.structured_api import plan_tools


async def tokenize(request: Request) -> Response:
    s: Services = request.app.state.services
    body = await json_body(request)
    check_model(s, body)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise ServiceError("invalid_request", "give exactly one of prompt or messages", "prompt")
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise ServiceError("invalid_request", "prompt must be a string", "prompt")
        ids = await s.generation.prompt_ids(body["prompt"], body_flag(body, "add_special_tokens", True))
    else:
        ids = await s.generation.messages_ids(body["messages"], _tools(body), template_options(body))
    answer: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": s.engine.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }
    if body_flag(body, "return_token_strs", False):
        answer["token_strs"] = await s.generation.tokenizing.run(lambda t: t.convert_ids_to_tokens(ids), len(ids))
    return JSONResponse(answer)


async def detokenize(request: Request) -> Response:
    s: Services = request.app.state.services
    body = await json_body(request)
    check_model(s, body)
    tokens, vocab = body.get("tokens"), len(s.engine.tokenizer)
    if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < vocab for t in tokens):
        raise ServiceError("invalid_request", f"tokens must be a list of token ids in [0, {vocab})", "tokens")
    s.generation.check_chars(len(tokens), "tokens")
    return JSONResponse({"prompt": await s.generation.tokenizing.run(lambda t: t.decode(tokens), len(tokens))})


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    plan = plan_tools(body.get("tools"), None)
    return plan.tools if plan is not None else None


def make_routes() -> list[RouteSpec]:
    return [("/tokenize", tokenize, ["POST"]), ("/detokenize", detokenize, ["POST"])]
