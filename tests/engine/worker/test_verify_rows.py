"""A speculative verify or a step with prompt chunks as decode rows (`model_runner.decode_rows`), what lets a decode
CUDA graph replay it: the logits equal the step's own forward (prefill path), and `graph_size` hands such batches to
the graphs (prompt chunks while their rows' attention is short, never a step that wants prompt logprobs). On the CPU,
with the graphs replaced by a recorder (the replay itself is checked on a GPU: test_cuda_engine.py)."""

from __future__ import annotations

import pytest
import torch

from streamd import SamplingParams
from streamd.engine.core.step_cost import StepCost
from streamd.engine.worker.cache_engine import KVLayout, allocate_pool
from streamd.engine.worker.cuda_graphs import PrefillGraphs, capture_sizes, prefill_capture_sizes
from streamd.engine.worker.model_runner import ModelInput, ModelRunner, decode_rows
from tests.helpers import random_prompt, run_to_completion, step_until_idle, tiny_llm


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


def _compare_rows(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, chosen) -> list[ModelInput]:
    """Runs every `chosen` batch twice, as decode rows and as itself, and checks their logits agree; the batches."""
    checked: list[ModelInput] = []
    run = runner.run

    def both(batch: ModelInput, graph_size: int | None = None) -> torch.Tensor:
        if not chosen(batch):
            return run(batch, graph_size)
        # the rows first: the step's own forward stores the same K/V again, so neither reads the other's
        as_rows = run(decode_rows(batch), 0)
        logits = run(batch, 0)
        assert as_rows.shape == logits.shape == (len(batch.sample_idx), logits.shape[1])
        torch.testing.assert_close(as_rows, logits, rtol=1e-5, atol=1e-5)
        checked.append(batch)
        return logits

    monkeypatch.setattr(runner, "run", both)
    return checked


def _has_prompt_chunk(batch: ModelInput) -> bool:
    return len(batch.sample_idx) < len(batch.input_ids)


def test_a_verify_as_decode_rows_gives_the_verify_s_logits(llm, monkeypatch: pytest.MonkeyPatch) -> None:
    checked = _compare_rows(llm.engine.runner, monkeypatch, _is_verify)
    prompts = [random_prompt(seed, length) for seed, length in ((1, 9), (2, 23), (3, 17))]
    _speculate_with_oracle(llm, prompts, max_tokens=40)
    assert checked and max(len(b.input_ids) for b in checked) > len(prompts), "no verify of several rows a sequence"


def test_prompt_chunks_as_decode_rows_give_the_prompt_path_s_logits(llm, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole prompts, a long one's chunks over its cached start, and chunks beside decodes: each step's sampling rows
    (the last token of a chunk that ends its prompt) get the logits the prompt path gives."""
    checked = _compare_rows(llm.engine.runner, monkeypatch, _has_prompt_chunk)
    engine = llm.engine
    engine.add_request("short", random_prompt(5, 9), _greedy(max_tokens=12))
    engine.step()  # "short" decodes from here while the rest arrive
    engine.add_request("long", random_prompt(6, 150), _greedy(max_tokens=6))
    engine.add_request("mid", random_prompt(7, 30), _greedy(max_tokens=6))
    step_until_idle(engine)
    assert any(b.positions[0] > 0 for b in checked), "no chunk continued a prompt"
    assert any(len(b.sample_idx) > 1 and not b.decode_only for b in checked[1:]), "no chunk ran beside a decode"


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"])
def test_a_verify_as_decode_rows_in_the_hybrid_layout_reads_each_row_s_window(family, tmp_path, monkeypatch) -> None:
    """Sliding-window layers in their own pool (holes before the window read as block 0): each row attends over its
    own window, which starts at or after the sequence's computed tokens, so the rows read no hole; outputs run well
    past the window (12). A graph's padded forward loads the window pool's slots and tables too."""
    from streamd import LLM
    from tests.engine.test_model_families import BLOCK, _saved
    from tests.helpers import register_engine

    llm = LLM(str(_saved(family, tmp_path)), device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=60,
              num_swap_blocks=0, watermark=0.0, seed=5, max_num_batched_tokens=16)
    register_engine(llm.engine)
    assert llm.engine.stats().kv.window_blocks_total > 0  # the hybrid layout is on
    test_a_verify_as_decode_rows_gives_the_verify_s_logits(llm, monkeypatch)
    monkeypatch.undo()
    test_prompt_chunks_as_decode_rows_give_the_prompt_path_s_logits(llm, monkeypatch)
    monkeypatch.undo()
    test_a_graphs_padded_forward_gives_each_steps_own_logits(llm, monkeypatch)  # (the window pool's buffers)


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

    def run(self, step: ModelInput) -> torch.Tensor:
        n = len(step.input_ids)
        self.replayed.append((n, step.seq_lens.tolist()))
        assert step.block_tables.shape[0] == n == len(step.seq_lens) and step.decode_only
        return torch.arange(n, dtype=torch.float32)[:, None].expand(-1, 300)


def test_verifies_and_short_prompt_chunks_go_to_the_decode_graphs(llm, monkeypatch) -> None:
    """Verifies always (up to the graphs' rows); a prompt chunk while its rows' attention stays under the cap (a long
    prompt's first chunk does, its later ones, over more context, do not); never a step that wants prompt logprobs."""
    from streamd.engine.worker import model_runner

    runner: ModelRunner = llm.engine.runner
    recorder = _Recorder(max_batch=64, max_blocks=64)
    cap = runner.query_width * 3000  # a 64-token chunk from position 0 attends 2,080 positions, from 64 6,176
    monkeypatch.setattr(model_runner, "MAX_PROMPT_ROW_ATTENTION", cap)
    sizes: list[tuple[ModelInput, int]] = []
    graph_size = runner.graph_size

    def note(batch: ModelInput) -> int:
        runner.graphs = recorder
        try:
            sizes.append((batch, graph_size(batch)))
        finally:
            runner.graphs = None
        return 0  # the step runs eagerly, as it does without graphs

    monkeypatch.setattr(runner, "graph_size", note)
    _speculate_with_oracle(llm, [random_prompt(4, 12)], max_tokens=30)
    run_to_completion(llm.engine, [random_prompt(8, 150)], _greedy(max_tokens=2))
    run_to_completion(llm.engine, [random_prompt(9, 20)], _greedy(max_tokens=2, prompt_logprobs=1))
    verifies = [(len(b.input_ids), size) for b, size in sizes if _is_verify(b)]
    assert verifies and all(size == recorder.size_for(n) for n, size in verifies)
    chunks = [(b, size) for b, size in sizes if _has_prompt_chunk(b)]
    for b, size in chunks:
        assert b.prompt_pairs == _positions_attended(b)
        short = b.prompt_idx is None and b.prompt_pairs * runner.query_width <= cap
        assert size == (recorder.size_for(len(b.input_ids)) if short else 0)
    assert {bool(size) for _, size in chunks} == {True, False}
    assert any(b.prompt_idx is not None for b, _ in chunks)


def _positions_attended(batch: ModelInput) -> int:
    """What a step's prompt chunks (sequences of several query tokens) attend over as decode rows: position + 1 a row."""
    starts = batch.query_start_loc.tolist()
    return sum(
        sum(p + 1 for p in batch.positions[a:b].tolist()) for a, b in zip(starts, starts[1:]) if b - a > 1
    )


def test_a_replayed_prompt_chunk_returns_its_sampling_rows(llm, monkeypatch) -> None:
    runner: ModelRunner = llm.engine.runner
    recorder = _Recorder(max_batch=32, max_blocks=64)
    batch = ModelInput(
        input_ids=torch.arange(4),
        positions=torch.tensor([4, 5, 6, 9]),
        slot_mapping=torch.arange(4),
        block_tables=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([7, 10], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        sample_idx=torch.tensor([2, 3]),
        decode_only=False,
    )
    monkeypatch.setattr(runner, "graphs", recorder)
    logits = runner.run(batch, 4)
    assert recorder.replayed == [(4, [5, 6, 7, 10])]
    assert logits[:, 0].tolist() == [2.0, 3.0]  # the recorder's row i holds i


def _uncaptured_prefill_graphs(runner: ModelRunner, max_tokens: int, max_seqs: int, max_blocks: int) -> PrefillGraphs:
    """A `PrefillGraphs` over the runner's model and pool, its buffers on the CPU, never captured (its `load` and
    `_forward` are what a capture records)."""
    return PrefillGraphs(runner.model, runner.pool, runner.ops, max_tokens, max_seqs, max_blocks, runner.window)


class _PrefillRecorder:
    """Stands in for `PrefillGraphs`: its rule of what fits (`can_run`, of a real one, as if captured), the steps it
    would replay (their token tensors), answered by the step's eager forward."""

    def __init__(self, runner: ModelRunner, max_tokens: int, max_seqs: int, max_blocks: int) -> None:
        self.runner = runner
        self.graphs = _uncaptured_prefill_graphs(runner, max_tokens, max_seqs, max_blocks)
        self.graphs.graphs = dict.fromkeys(self.graphs.sizes)  # (as if captured)
        self.replayed: list[torch.Tensor] = []

    def can_run(self, n: int, seqs: int, samples: int, width: int) -> bool:
        return self.graphs.can_run(n, seqs, samples, width)

    def run(self, step: ModelInput):
        self.replayed.append(step.input_ids)
        assert step.query_start_loc.tolist()[-1] == len(step.input_ids) == len(step.positions)
        assert len(step.query_start_loc) == len(step.seq_lens) + 1 == len(step.block_tables) + 1
        return self.runner.run(step, 0)


def test_steps_no_decode_graph_takes_replay_a_prefill_graph_where_one_fits(llm, monkeypatch) -> None:
    """Without a decode graph for it, a step replays the prefill graphs when its tokens, sequences and tables fit
    them and it wants no prompt logprobs; the tokens are the eager steps'."""
    runner: ModelRunner = llm.engine.runner
    prompts = [random_prompt(10, 20), random_prompt(11, 90)]
    want = [o.outputs[0].token_ids for o in run_to_completion(llm.engine, prompts, _greedy(max_tokens=6))]
    recorder = _PrefillRecorder(runner, max_tokens=32, max_seqs=8, max_blocks=64)
    monkeypatch.setattr(runner, "prefill_graphs", recorder)
    batches: list[ModelInput] = []
    run = runner.run

    def note(batch: ModelInput, graph_size: int | None = None) -> torch.Tensor:
        batches.append(batch)
        return run(batch, graph_size)

    monkeypatch.setattr(runner, "run", note)
    got = [o.outputs[0].token_ids for o in run_to_completion(llm.engine, prompts, _greedy(max_tokens=6))]
    run_to_completion(llm.engine, [random_prompt(12, 20)], _greedy(max_tokens=2, prompt_logprobs=1))
    assert got == want
    replayed = [any(r is b.input_ids for r in recorder.replayed) for b in batches]
    fits = [len(b.input_ids) <= 32 and b.prompt_idx is None for b in batches]
    assert replayed == fits
    assert {True, False} <= set(replayed) and any(b.prompt_idx is not None for b in batches)
    assert any(r and not b.decode_only for r, b in zip(replayed, batches))  # a prompt chunk among them


@pytest.mark.parametrize("max_tokens", [1, 100, 256, 300, 8192, 10000])
def test_prefill_graph_sizes_pad_a_step_by_at_most_64_tokens_or_a_quarter(max_tokens: int) -> None:
    sizes = prefill_capture_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens
    for n in range(1, max_tokens + 1):
        size = next(s for s in sizes if s >= n)
        assert size - n < 64 or size - n <= n / 4, (n, size)


def test_a_prefill_graph_takes_a_step_whose_tokens_sequences_samples_and_tables_fit() -> None:
    """`PrefillGraphs.can_run` (pure: buffers on the CPU, no capture): a size holds min(size, seats) sequences and
    as many sampling rows (a verify samples every token), tables up to the captured width, and nothing once the
    graphs are gone."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
    graphs = PrefillGraphs(torch.nn.Identity(), allocate_pool(layout, 4, "cpu"), None, 512, 100, 16)
    graphs.graphs = dict.fromkeys(graphs.sizes)  # (as if captured)
    assert graphs.can_run(300, 100, 100, 16) and graphs.can_run(512, 1, 1, 1)
    assert graphs.can_run(60, 60, 60, 16) and not graphs.can_run(60, 1, 65, 16)  # (size 64: 64 rows)
    assert not graphs.can_run(513, 1, 1, 1) and not graphs.can_run(300, 101, 1, 16)
    assert not graphs.can_run(300, 1, 101, 16) and not graphs.can_run(300, 1, 1, 17)
    graphs.graphs = {}
    assert not graphs.can_run(300, 1, 1, 1)


def test_a_graphs_padded_forward_gives_each_steps_own_logits(llm, monkeypatch) -> None:
    """What a graph captures, run without the capture on the CPU: each step loaded into the static buffers (`load`:
    padded to its size; a prefill graph's sequences and sampling rows padded too) and the size's forward give the
    logits of the step's own eager forward: steps with prompt chunks in a `PrefillGraphs`, decode steps in a
    `DecodeGraphs`. The prefill padding is what the Triton kernel's contract asks (test_attention.py; the reference
    here would also accept starts that are not monotone). Checked right after each step's forward (its K/V are in
    the pool and are stored again, unchanged)."""
    from streamd.engine.worker.attention import set_attention_metadata
    from streamd.engine.worker.cuda_graphs import DecodeGraphs

    runner: ModelRunner = llm.engine.runner
    prefill = _uncaptured_prefill_graphs(runner, 64, 8, 64)
    decode = DecodeGraphs(runner.model, runner.pool, runner.ops, 8, 64, window=runner.window)
    run = runner.run
    padded_by: dict[str, list[int]] = {"prefill": [], "decode": []}

    def both(batch: ModelInput, graph_size: int | None = None) -> torch.Tensor:
        logits = run(batch, graph_size)
        if batch.prompt_idx is not None:
            return logits
        graphs = decode if batch.decode_only else prefill
        size, m = graphs.load(batch)
        n, k, seqs = len(batch.input_ids), len(batch.seq_lens), graphs._seqs(size)
        if graphs is prefill:  # (the kernel's tile search needs the starts monotone)
            assert prefill.query_start_loc[: seqs + 1].tolist() == batch.query_start_loc.tolist() + [n] * (seqs - k)
        assert graphs.seq_lens[k:seqs].eq(0).all() and graphs.slot_mapping[n:size].eq(-1).all()
        set_attention_metadata(graphs._metadata(size))
        try:
            padded = graphs._forward(size)[:m].float()
        finally:
            set_attention_metadata(None)
        torch.testing.assert_close(padded, logits, atol=1e-5, rtol=1e-5)
        padded_by[graphs.kind].append(size - n)
        return logits

    monkeypatch.setattr(runner, "run", both)
    run_to_completion(llm.engine, [random_prompt(13, 100), random_prompt(14, 7), random_prompt(15, 30)],
                      _greedy(max_tokens=4))
    run_to_completion(llm.engine, [random_prompt(16, 20)], _greedy(max_tokens=3))  # (fewer sequences than before)
    assert all(any(padded) for padded in padded_by.values())  # (steps of both kinds padded by some tokens)
