"""A speculative verify as decode rows (`model_runner.decode_rows`), what lets a decode CUDA graph replay it: the
logits equal the verify's own forward (prefill path), and `graph_size` hands such batches to the graphs. On the
CPU, with the graphs replaced by a recorder (the replay itself is checked on a GPU: test_cuda_engine.py)."""

from __future__ import annotations

import pytest
import torch

from streamd import SamplingParams
from streamd.engine.core.step_cost import StepCost
from streamd.engine.worker.cuda_graphs import capture_sizes
from streamd.engine.worker.model_runner import ModelInput, ModelRunner, decode_rows
from tests.helpers import random_prompt, run_to_completion, tiny_llm


@pytest.fixture(autouse=True)
def unmeasured_row_price(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft row's price comes from measured step times; these tests need verifies of several rows a sequence
    whatever this machine's timing, so the price stays the unmeasured default (a GPU's: drafts of ~6)."""
    monkeypatch.setattr(StepCost, "row_cost", lambda self, tokens: None)


def _is_verify(batch: ModelInput) -> bool:
    return not batch.decode_only and len(batch.sample_idx) == len(batch.input_ids)


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(num_kv_blocks=200, max_num_seqs=8)


def _greedy(**changes) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "ignore_eos": True, "detokenize": False, **changes})


def _speculate_with_oracle(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs with each request's prediction its own off-run output, every 5th token wrong."""
    off = [o.outputs[0].token_ids for o in run_to_completion(llm.engine, prompts, _greedy(max_tokens=max_tokens))]
    drafts = iter([[t if i % 5 != 4 else (t + 1) % 300 for i, t in enumerate(o)] for o in off])
    llm.engine._prediction_ids = lambda text: next(drafts)
    try:
        params = _greedy(max_tokens=max_tokens, prediction="oracle")
        on = [o.outputs[0].token_ids for o in run_to_completion(llm.engine, prompts, params)]
    finally:
        del llm.engine._prediction_ids
    assert on == off
    return on


def test_a_verify_as_decode_rows_gives_the_verify_s_logits(llm, monkeypatch: pytest.MonkeyPatch) -> None:
    runner: ModelRunner = llm.engine.runner
    checked: list[int] = []
    run = runner.run

    def both(batch: ModelInput, graph_size: int | None = None) -> torch.Tensor:
        if not _is_verify(batch):
            return run(batch, graph_size)
        # the rows first: the verify's own forward stores the same K/V again, so neither reads the other's
        as_rows = run(decode_rows(batch), 0)
        logits = run(batch, 0)
        torch.testing.assert_close(as_rows, logits, rtol=1e-5, atol=1e-5)
        checked.append(len(batch.input_ids))
        return logits

    monkeypatch.setattr(runner, "run", both)
    prompts = [random_prompt(seed, length) for seed, length in ((1, 9), (2, 23), (3, 17))]
    _speculate_with_oracle(llm, prompts, max_tokens=40)
    assert checked and max(checked) > len(prompts), "no verify step with several rows a sequence ran"


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"])
def test_a_verify_as_decode_rows_in_the_hybrid_layout_reads_each_row_s_window(family, tmp_path, monkeypatch) -> None:
    """Sliding-window layers in their own pool (holes before the window read as block 0): each row attends over its
    own window, which starts at or after the sequence's computed tokens, so the rows read no hole; outputs run well
    past the window (12)."""
    from streamd import LLM
    from tests.engine.test_model_families import BLOCK, _saved
    from tests.helpers import register_engine

    llm = LLM(str(_saved(family, tmp_path)), device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=60,
              num_swap_blocks=0, watermark=0.0, seed=5, max_num_batched_tokens=16)
    register_engine(llm.engine)
    assert llm.engine.stats().kv.window_blocks_total > 0  # the hybrid layout is on
    test_a_verify_as_decode_rows_gives_the_verify_s_logits(llm, monkeypatch)


def test_decode_rows_gives_each_query_token_its_sequence_s_table_and_causal_context() -> None:
    tables = torch.tensor([[3, 4, 0], [7, 8, 9]], dtype=torch.int32)
    batch = ModelInput(
        input_ids=torch.arange(5),
        positions=torch.tensor([12, 13, 14, 20, 21]),
        slot_mapping=torch.arange(5),
        block_tables=tables,
        seq_lens=torch.tensor([15, 22], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        sample_idx=torch.arange(5),
        decode_only=False,
        window_block_tables=tables + 10,
    )
    rows = decode_rows(batch)
    assert rows.decode_only
    assert rows.block_tables.tolist() == [[3, 4, 0]] * 3 + [[7, 8, 9]] * 2
    assert rows.window_block_tables is not None and rows.window_block_tables.tolist() == (rows.block_tables + 10).tolist()
    assert rows.seq_lens.tolist() == [13, 14, 15, 21, 22]  # each row sees itself and what comes before it
    assert rows.query_start_loc.tolist() == list(range(6))
    assert decode_rows(rows) is rows


class _Recorder:
    """Stands in for `DecodeGraphs`: which sizes it would replay, and the rows it was given."""

    def __init__(self, max_batch: int, max_blocks: int) -> None:
        self.sizes = capture_sizes(max_batch)
        self.max_blocks = max_blocks
        self.replayed: list[tuple[int, list[int]]] = []

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def can_run(self, n: int, width: int) -> bool:
        return n <= self.sizes[-1] and width <= self.max_blocks

    def run(self, input_ids, positions, slot_mapping, block_tables, seq_lens, *window) -> torch.Tensor:
        self.replayed.append((len(input_ids), seq_lens.tolist()))
        assert block_tables.shape[0] == len(input_ids) == len(seq_lens)
        return torch.zeros(len(input_ids), 300)


def test_verify_steps_go_to_the_decode_graphs_and_prompt_chunks_do_not(llm, monkeypatch) -> None:
    runner: ModelRunner = llm.engine.runner
    recorder = _Recorder(max_batch=32, max_blocks=64)
    sizes: list[tuple[bool, int, int]] = []
    graph_size = runner.graph_size

    def note(batch: ModelInput) -> int:
        runner.graphs = recorder
        try:
            sizes.append((_is_verify(batch), len(batch.input_ids), graph_size(batch)))
        finally:
            runner.graphs = None
        return 0  # the step runs eagerly, as it does without graphs

    monkeypatch.setattr(runner, "graph_size", note)
    _speculate_with_oracle(llm, [random_prompt(4, 12)], max_tokens=30)
    verifies = [(n, size) for verify, n, size in sizes if verify]
    assert verifies and all(size == recorder.size_for(n) for n, size in verifies)
    prompt_chunks = [size for verify, n, size in sizes if not verify and n > 1]
    assert prompt_chunks and not any(prompt_chunks)
    batch = ModelInput(
        input_ids=torch.arange(3),
        positions=torch.tensor([4, 5, 6]),
        slot_mapping=torch.arange(3),
        block_tables=torch.tensor([[1, 2]], dtype=torch.int32),
        seq_lens=torch.tensor([7], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        sample_idx=torch.arange(3),
        decode_only=False,
    )
    monkeypatch.setattr(runner, "graphs", recorder)
    runner.run(batch, 4)
    assert recorder.replayed == [(3, [5, 6, 7])]
