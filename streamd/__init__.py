"""streamd: a PagedAttention LLM-serving engine that streams every token to many users at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamd.engine.outputs import CompletionOutput, RequestOutput
from streamd.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from streamd.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> type[LLM]:  # LLM pulls in torch and transformers; import it only when asked for
    if name == "LLM":
        from streamd.llm import LLM

        return LLM
    raise AttributeError(name)
