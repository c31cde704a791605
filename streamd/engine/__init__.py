"""The engine's public face: what the server, the CLI and users may import (`from streamd.engine import X`).

The vocabulary (sampling parameters, outputs, stats, errors) is plain Python and loads with the package; the
rest loads on first use, so importing a plain-Python room (`streamd.engine.core`) never pulls in torch. The
rooms below are the engine's inside: `core/` (plain-Python state: sequences, block manager, scheduler),
`worker/` (torch execution), `sample/` (token choice), `output/` (text), `client/` (the asyncio faces).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from streamd.engine.errors import ContextLengthError, KVCacheCapacityError, RequestError
from streamd.engine.outputs import (
    CompletionDelta,
    CompletionOutput,
    FinishReason,
    Progress,
    RequestDelta,
    RequestOutput,
    RequestOutputBuilder,
)
from streamd.engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs, is_int
from streamd.engine.stats import DEFAULT_TENANT, EngineStats, KVCacheStats, TenantStats, add_tallies

if TYPE_CHECKING:
    from streamd.engine.client.async_engine import AsyncEngine
    from streamd.engine.client.engine_process import ProcessEngine
    from streamd.engine.client.protocol import DuplicateRequestError, EngineClient, EngineDeadError
    from streamd.engine.client.request_stream import Backpressure, DeltaSink, PendingDelta, RequestStream
    from streamd.engine.core.admission import Admission
    from streamd.engine.llm_engine import LLMEngine
    from streamd.engine.output.chat_template import DEFAULT_OPTIONS, TemplateOptions, chat_template_ids
    from streamd.engine.output.detokenizer import byte_table
    from streamd.engine.sample.grammar_budget import GrammarBudget, GrammarError, grammar_size
    from streamd.engine.worker.model_loader import resolve_device

# name -> module, for the names loaded on first use
_LAZY = {
    "Admission": "core.admission",
    "AsyncEngine": "client.async_engine",
    "DuplicateRequestError": "client.protocol",
    "EngineClient": "client.protocol",
    "EngineDeadError": "client.protocol",
    "ProcessEngine": "client.engine_process",
    "Backpressure": "client.request_stream",
    "DeltaSink": "client.request_stream",
    "PendingDelta": "client.request_stream",
    "RequestStream": "client.request_stream",
    "LLMEngine": "llm_engine",
    "DEFAULT_OPTIONS": "output.chat_template",
    "TemplateOptions": "output.chat_template",
    "chat_template_ids": "output.chat_template",
    "byte_table": "output.detokenizer",
    "resolve_device": "worker.model_loader",
    "GrammarBudget": "sample.grammar_budget",
    "GrammarError": "sample.grammar_budget",
    "grammar_size": "sample.grammar_budget",
}

__all__ = [
    "DEFAULT_OPTIONS",
    "DEFAULT_TENANT",
    "MAX_LOGPROBS",
    "Admission",
    "AsyncEngine",
    "Backpressure",
    "CompletionDelta",
    "CompletionOutput",
    "ContextLengthError",
    "DeltaSink",
    "DuplicateRequestError",
    "EngineClient",
    "EngineDeadError",
    "EngineStats",
    "FinishReason",
    "GrammarBudget",
    "GrammarError",
    "KVCacheCapacityError",
    "KVCacheStats",
    "LLMEngine",
    "PendingDelta",
    "ProcessEngine",
    "Progress",
    "RequestDelta",
    "RequestError",
    "RequestOutput",
    "RequestOutputBuilder",
    "RequestStream",
    "SamplingParams",
    "StructuredOutputs",
    "TemplateOptions",
    "TenantStats",
    "add_tallies",
    "byte_table",
    "chat_template_ids",
    "grammar_size",
    "is_int",
    "resolve_device",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
