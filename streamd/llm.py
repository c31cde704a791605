"""LLM: the offline Python API, shaped like vLLM's (`LLM(...).generate(...)`, `.chat(...)`)."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from transformers import PretrainedConfig

from streamd import heap
from streamd.config import Config, load_config
from streamd.engine.llm_engine import LLMEngine
from streamd.engine.outputs import RequestOutput, RequestOutputBuilder
from streamd.engine.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class LLM:
    """`model`: None (the default model), a local directory, a .gguf file, a cached Hub id, or a
    transformers config for random weights. `overrides`: any config key (`dtype`, `device`, `block_size`,
    `num_kv_blocks`, `max_num_seqs`, ...), as on the command line."""

    def __init__(
        self,
        model: str | PretrainedConfig | None = None,
        *,
        config_path: str | os.PathLike[str] | None = None,
        **overrides: Any,
    ) -> None:
        if isinstance(model, str):
            overrides["model.name"] = model
        self.config: Config = load_config(config_path, overrides)
        self.engine = LLMEngine.from_config(self.config, model if isinstance(model, PretrainedConfig) else None)
        heap.settle()  # the model's objects are permanent: keep them out of every future collection
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching; outputs in prompt order."""
        return self._run(_batch(prompts, single=lambda first: isinstance(first, int)), sampling_params, chat=False)

    def chat(
        self, messages: Messages | Seq[Messages], sampling_params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        return self._run(_batch(messages, single=lambda first: isinstance(first, dict)), sampling_params, chat=True)

    def _run(
        self, items: list[Any], sampling_params: SamplingParams | Seq[SamplingParams] | None, chat: bool
    ) -> list[RequestOutput]:
        params = _per_item(sampling_params, len(items))
        builders: list[RequestOutputBuilder] = []
        try:
            for item, p in zip(items, params):
                request_id = f"llm-{next(self._ids)}"
                if chat:
                    ids = self.engine.add_request(
                        request_id, None, p, prompt_token_ids=self.engine.apply_chat_template(item)
                    )
                    prompt = None
                else:
                    ids = self.engine.add_request(request_id, item, p)
                    prompt = item if isinstance(item, str) else None
                builders.append(RequestOutputBuilder(request_id, prompt, ids, p.n))
            return run_to_completion(self.engine, builders)
        except BaseException:
            with contextlib.suppress(Exception):  # clean up, but the caller sees the first error
                for builder in builders:
                    self.engine.abort(builder.request_id)
                while self.engine.has_unfinished_requests():
                    self.engine.step()
            raise


def run_to_completion(engine: LLMEngine, builders: list[RequestOutputBuilder]) -> list[RequestOutput]:
    """Steps `engine` until every request of `builders` has finished, folding its deltas; outputs in the
    builders' order. A request that failed raises."""
    by_id = {b.request_id: b for b in builders}
    remaining = len(by_id)
    while remaining:
        for delta in engine.step():
            builder = by_id.get(delta.request_id)
            if builder is None:
                continue
            builder.add(delta)
            if delta.finished:
                if delta.error:
                    raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
                remaining -= 1
    return [b.build() for b in builders]


def _per_item(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
    return params


def _batch(items: Any, single: Callable[[Any], bool]) -> list[Any]:
    """One item (a prompt: text or token ids; a conversation) as a batch of one; a batch as a list. `single`
    tells from a list's first element whether the list is itself one item."""
    if isinstance(items, str) or (isinstance(items, list) and items and single(items[0])):
        return [items]
    return list(items)
