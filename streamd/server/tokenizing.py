"""Prompt text and chat messages to token ids without stalling the event loop.

Short inputs are tokenized on the loop (with `EngineClient.tokenizer`, the loop's own copy: a thread hop
costs more than they do). Longer ones go to one dedicated worker thread with its own tokenizer copy (a
Hugging Face fast tokenizer must never be used by two threads at once); the Rust tokenizer releases the
GIL while it encodes, so the loop keeps serving every other stream meanwhile. At most `MAX_QUEUED` inputs
wait for the worker; beyond that a request is refused as overloaded rather than queued without bound.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from streamd.engine import TemplateOptions, chat_template_ids
from streamd.server.errors import ServiceError

INLINE_CHARS = 4096  # inputs up to this many characters are tokenized on the loop
MAX_QUEUED = 32

T = TypeVar("T")


class Tokenizing:
    def __init__(self, loop_tokenizer: Any) -> None:
        self._loop_tokenizer = loop_tokenizer
        self._worker_tokenizer = copy.deepcopy(loop_tokenizer)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="streamd-tokenize")
        self._queued = 0

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, as `LLMEngine` tokenizes one (unless told to leave out special tokens)."""
        if self._loop_tokenizer is None:
            raise ServiceError("invalid_request", "this model has no tokenizer: send prompt token ids", "prompt")
        return await self.run(
            lambda tokenizer: list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids), len(text)
        )

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, options: TemplateOptions, chars: int
    ) -> list[int]:
        """The model's chat template over `messages` (and OpenAI function `tools`), `chars` long in all, as
        `options` say; raises the engine's RequestError if it refuses them."""
        return await self.run(lambda tokenizer: chat_template_ids(tokenizer, messages, tools, options), chars)

    async def run(self, fn: Callable[[Any], T], chars: int) -> T:
        """`fn(tokenizer)` for an input `chars` long: on the loop's tokenizer when short, else on the worker."""
        if chars <= INLINE_CHARS:
            return fn(self._loop_tokenizer)
        worker = self._worker_tokenizer
        return await self._offload(lambda: fn(worker))

    async def _offload(self, fn: Callable[[], T]) -> T:
        if self._queued >= MAX_QUEUED:
            raise ServiceError("overloaded", "too many long prompts are being tokenized; retry later")
        self._queued += 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn)
        future.add_done_callback(self._release)
        return await future

    def _release(self, _: object) -> None:
        self._queued -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
