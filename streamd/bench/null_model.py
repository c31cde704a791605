"""The null model executor, for benchmarks only: isolates the serving cost from the model's own.

`null_engine(config)` builds a real `LLMEngine` (real tokenizer and vocabulary, block manager, scheduler,
batch preparation, output processor, detokenizer) and replaces only the forward pass and the sampler:
`NullExecutor` prepares each step's batch tensors as the real runner does and runs no model, and
`NullSampler` draws every token uniformly from the real vocabulary. What is left is what streamd itself
costs per token. Every report made with it says `"model": "null"`; no correctness test may use it.

Two switches serve issue 32's transport benchmarks (`streamd bench live`), and each report that uses one says
so: `prefill_s_per_token` makes a step that computes prompt tokens sleep that long per token of its longest
prompt chunk, on the engine's thread (a step's prompts computed side by side, as on a GPU), so a proxy's idle
timeout can be tested without a model that is really that slow; `progress=False` takes out the engine's
progress reports (queue places, prompt chunks done), the "off" side of their cost.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from streamd.config import Config
from streamd.engine.core.scheduler_output import SchedulerOutput
from streamd.engine.core.sequence import Sequence, SequenceGroup
from streamd.engine.llm_engine import LLMEngine
from streamd.engine.outputs import RequestUpdate
from streamd.engine.sample.grammar import TokenBitmask
from streamd.engine.sample.sampler import PendingSample
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.worker.executor import Executor
from streamd.engine.worker.model_runner import ModelRunner


class NullExecutor:
    """Builds the batch (positions, slot mapping, block tables) and skips the forward; cache orders go to
    the real executor."""

    def __init__(self, executor: Executor, runner: ModelRunner, prefill_s_per_token: float = 0.0) -> None:
        self.executor = executor
        self.runner = runner
        self.cache = executor.cache
        self.window = executor.window
        self.prefill_s_per_token = prefill_s_per_token  # a prefill step's sleep per token of its longest chunk

    @property
    def failed(self) -> bool:
        return self.executor.failed

    def cpu_threads(self) -> int:
        return self.executor.cpu_threads()

    def execute(
        self, out: SchedulerOutput, prev_tokens: torch.Tensor | None = None, prev_rows: dict[int, int] | None = None
    ) -> torch.Tensor:
        batch = self.runner.prepare(out, prev_tokens, prev_rows)
        if out.num_prefill_tokens and self.prefill_s_per_token:
            chunks = out.scheduled[: len(out.scheduled) - out.num_decode_tokens]
            longest = max(item.num_new_tokens for item in chunks)
            time.sleep(self.prefill_s_per_token * longest)  # the engine's thread is held, as by a real prefill
        return torch.empty((len(batch.sample_idx), 0))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.executor.swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.executor.swap_in(pairs)

    def swap_in_ahead(self, pairs: list[tuple[int, int]]) -> None:
        self.executor.swap_in_ahead(pairs)

    def join_swaps(self) -> None:
        self.executor.join_swaps()

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        self.executor.copy(pairs)

    def read_blocks(self, blocks: list[int]) -> list[bytes]:
        return self.executor.read_blocks(blocks)

    def read_host_blocks(self, blocks: list[int]) -> list[bytes]:
        return self.executor.read_host_blocks(blocks)

    def write_blocks(self, pairs: list[tuple[int, bytes]]) -> None:
        self.executor.write_blocks(pairs)

    def shutdown(self) -> None:
        self.executor.shutdown()


class NullSampler:
    """Uniform random tokens of the real vocabulary, one batched draw per step."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def sample_async(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        params: list[SamplingParams],
        bitmask: TokenBitmask | None = None,
        *,
        owns_logits: bool = False,
    ) -> PendingSample:
        tokens = torch.randint(self.vocab_size, (logits.shape[0],), generator=self.generator)
        return PendingSample(tokens, tokens, params, 0)


class NoProgress:
    """Stands in for the engine's `ProgressReports`: no step reports anything before a first token."""

    def step(self, done: SchedulerOutput | None, waiting: deque[SequenceGroup]) -> list[RequestUpdate]:
        return []


def null_engine(config: Config, prefill_s_per_token: float = 0.0, progress: bool = True) -> LLMEngine:
    """An engine over the configured model's tokenizer and vocabulary whose steps run no model (the switches:
    the module docstring)."""
    engine = LLMEngine.from_config(config)
    engine.executor = NullExecutor(engine.executor, engine.runner, prefill_s_per_token)
    engine.sampler = NullSampler(engine.vocab_size, config.model.seed or 0)  # type: ignore[assignment]
    if not progress:
        engine._progress = NoProgress()  # type: ignore[assignment]
    return engine
