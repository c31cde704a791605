"""ModelRunner: turns a SchedulerOutput into one forward pass of the flattened batch.

It builds `input_ids`, `positions`, `slot_mapping`, `block_tables`, `seq_lens` and `query_start_loc`,
sets the attention metadata, runs the transformers model with streamd's paged attention and returns
logits only for the positions that sample (one per sequence whose chunk reaches its last token), and for
the prompt positions of requests that asked for `prompt_logprobs` (turned into logprobs at once and kept for
`take_prompt_logprobs`).
It also measures what the KV pool may use (`profile_num_blocks`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from transformers import PreTrainedModel

from streamd.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from streamd.engine.core.sequence import PLACEHOLDER
from streamd.engine.core.step_cost import chunk_pairs
from streamd.engine.worker.attention import (
    ATTN_IMPLEMENTATION,
    AttentionMetadata,
    query_token_lens,
    query_token_tables,
    register_paged_attention,
    set_attention_metadata,
)
from streamd.engine.worker.cache_engine import KVLayout, KVPool, allocate_pool, kv_dtype
from streamd.engine.worker.cuda_graphs import DecodeGraphs, PrefillGraphs
from streamd.engine.worker.fusion import NativeLogits, fuse_layers, native_logits
from streamd.engine.worker.host_to_device import to_device, to_device_many
from streamd.engine.worker.kv_groups import WindowPool
from streamd.logs import get_logger

log = get_logger(__name__)

# A step with prompt chunks replays a decode graph, each query token a decode row (`decode_rows`), when its rows'
# attention work stays under this: the attention pairs of its prompt chunks (`prompt_pairs`: the positions its
# prompt rows attend over) times the model's query width (heads x head dim). Rows of one sequence re-read its K/V
# (from L2 mostly) with the decode kernel, which wastes the tensor cores a prefill kernel uses; an eager step pays
# its launches on the host, which a small model's GPU work does not hide. On an H200 the replay was 2-12x faster
# below ~1e9 and lost past ~1.2e9 (8B shape, even there) to ~2.2e9 (1B) (benchmarks/NOTES.md, "Issue 34: prompt
# chunks in the decode graphs"). A tuning choice, and a conservative one for sliding-window layers (the pairs count
# the whole context) and tensor parallelism (each rank attends with its share of the heads).
MAX_PROMPT_ROW_ATTENTION = 3 * 2**29


def kernel_ops(device: torch.device) -> ModuleType:
    """Triton kernels on CUDA, their plain-torch references elsewhere."""
    if device.type == "cuda":
        from streamd import kernels

        return kernels
    from streamd.kernels import reference

    return reference


def kv_layout_of(
    model: PreTrainedModel, block_size: int, dtype: torch.dtype, tp_size: int = 1, kv_cache_dtype: str = "auto"
) -> KVLayout:
    """The KV pool's layout for a model in `dtype`, its blocks as `cache.kv_cache_dtype` says (`kv_dtype`: auto is
    `dtype`); with tensor parallelism each rank holds `num_kv_heads / tp_size` heads."""
    config = model.config.get_text_config()
    heads, head_dim = _query_heads(model)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    pool_dtype = kv_dtype(kv_cache_dtype, dtype)
    return KVLayout(config.num_hidden_layers, kv_heads // tp_size, head_dim, block_size, pool_dtype)


@dataclass(slots=True)
class ModelInput:
    """One step's batch on the device: the flattened tokens and the paged-attention metadata."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    sample_idx: torch.Tensor  # int64 [num_sampling_seqs]: the rows whose logits are computed
    decode_only: bool
    # Prompt logprobs: the rows (positions q of a prompt chunk, q + 1 still in the prompt) whose logits give
    # the logprob of prompt token q + 1 (`prompt_targets`), and per request (request_id, first prompt
    # position, number of rows, top k), in row order. None: no request of the step asked for them.
    prompt_idx: torch.Tensor | None = None  # int64 [num_prompt_rows]
    prompt_targets: torch.Tensor | None = None  # int64 [num_prompt_rows]
    prompt_spans: list[tuple[str, int, int, int]] | None = None
    # The hybrid layout's window pool (`kv_groups.py`): its slots and block tables (holes read as block 0,
    # never read by the kernels: they lie before every window). None: one pool.
    window_slot_mapping: torch.Tensor | None = None  # int64 [num_tokens]
    window_block_tables: torch.Tensor | None = None  # int32 [num_seqs, max_blocks]
    # The attention pairs of its prompt chunks (`step_cost.chunk_pairs`): the context positions their query tokens
    # attend over, summed, what running them as decode rows (`decode_rows`) reads; 0 for decodes and verifies.
    prompt_pairs: float = 0.0


@dataclass(slots=True)
class PromptLogprobs:
    """One step's prompt logprobs on the host: per span (request_id, first prompt position, number of
    positions, top k), each position's {token_id: logprob}: the top k first, then the prompt token's."""

    spans: list[tuple[str, int, int, int]]
    entries: list[dict[int, float]]


class ModelRunner:
    def __init__(self, model: PreTrainedModel, device: torch.device, block_size: int) -> None:
        register_paged_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.device = device
        self.block_size = block_size
        self.ops = kernel_ops(device)
        self.pool: KVPool | None = None
        self.window: WindowPool | None = None
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        heads, head_dim = _query_heads(model)
        self.query_width = heads * head_dim  # a decode row's attention work per context position and layer
        self.native: NativeLogits | None = None  # decode steps run natively, transformers' wrappers skipped (`fuse`)
        self._prompt_logprobs: PromptLogprobs | None = None  # the last `run`'s, until taken

    def fuse(self, mode: str) -> str:
        """Fuses the model's layers as `model.fuse_layers` says (`fusion.fuse_layers`); returns the mode applied."""
        applied = fuse_layers(self.model, mode, self.device)
        self.native = native_logits(self.model)
        return applied

    def bind_kv_cache(self, pool: KVPool, window: WindowPool | None = None) -> None:
        """`pool`: every layer's blocks, or (`window` given: the hybrid layout) the full-attention layers'."""
        self.pool = pool
        self.window = window

    def max_table_width(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)

    def capture_cuda_graphs(
        self,
        max_batch: int,
        max_blocks: int,
        layers_only: bool = False,
        agree: Callable[[bool], bool] | None = None,
    ) -> bool:
        """Steps of up to `max_batch` decode rows (tables up to `max_blocks` wide) then replay graphs
        instead of running eagerly; `layers_only` and `agree`: a tensor-parallel rank's (`DecodeGraphs`).
        False: not captured (the ranks did not all succeed), decode stays eager."""
        assert self.pool is not None and self.device.type == "cuda"
        graphs = DecodeGraphs(self.model, self.pool, self.ops, max_batch, max_blocks, layers_only, self.window)
        captured = graphs.capture(agree)
        self.graphs = graphs if captured else None
        return captured

    def capture_prefill_graphs(self, max_tokens: int, max_seqs: int, max_blocks: int) -> bool:
        """Steps with prompt chunks of up to `max_tokens` tokens and `max_seqs` sequences then replay graphs
        (`PrefillGraphs`) unless a decode graph takes them; False: not captured, such steps stay eager."""
        assert self.pool is not None and self.device.type == "cuda"
        graphs = PrefillGraphs(self.model, self.pool, self.ops, max_tokens, max_seqs, max_blocks, self.window)
        captured = graphs.capture()
        self.prefill_graphs = graphs if captured else None
        return captured

    def release_graphs(self) -> None:
        """Destroys the CUDA graphs (steps run eagerly after this); before a tensor-parallel rank
        shuts down its process groups (`GraphSet.release`)."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.prefill_graphs = None

    def graph_size(self, batch: ModelInput) -> int:
        """The captured decode graph that runs `batch` (0: none, run eagerly): decodes, speculative verifies and
        short prompt chunks, each query token a decode row (`decode_rows`), up to the graphs' rows and, for prompt
        chunks, `MAX_PROMPT_ROW_ATTENTION`. Steps that want prompt logprobs run eagerly."""
        graphs = self.graphs
        n = len(batch.input_ids)
        if graphs is None or batch.prompt_idx is not None or not graphs.can_run(n, _table_width(batch)):
            return 0
        if batch.prompt_pairs * self.query_width > MAX_PROMPT_ROW_ATTENTION:
            return 0
        return graphs.size_for(n)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, prev_tokens: torch.Tensor | None = None, prev_rows: dict[int, int] | None = None
    ) -> torch.Tensor:
        """Runs the scheduled tokens; returns float32 logits [num_sampling_seqs, vocab] in schedule order."""
        return self.run(self.prepare(out, prev_tokens, prev_rows))

    def prepare(
        self, out: SchedulerOutput, prev_tokens: torch.Tensor | None = None, prev_rows: dict[int, int] | None = None
    ) -> ModelInput:
        """The step's batch tensors on the device.

        A token id PLACEHOLDER stands for a token sampled by the previous step that the host does not have
        yet: it is taken on the device from `prev_tokens[prev_rows[seq_id]]`, so this step can start
        before the previous one's results reach the host."""
        batch, pending = self._prepare(out)
        if pending:
            assert prev_tokens is not None and prev_rows is not None
            dst, seq_ids = zip(*pending)
            src = [prev_rows[seq_id] for seq_id in seq_ids]
            dev = self.device
            batch.input_ids[to_device(list(dst), torch.int64, dev)] = prev_tokens[to_device(src, torch.int64, dev)]
        return batch

    @torch.inference_mode()
    def run(self, batch: ModelInput, graph_size: int | None = None) -> torch.Tensor:
        """The forward of a prepared batch: float32 logits of its `sample_idx` rows (in the decode graph of
        `graph_size`, by default `self.graph_size(batch)`, else in a prefill graph where one holds it; 0: eagerly)."""
        if graph_size is None:
            graph_size = self.graph_size(batch)
            if not graph_size and self.prefill_graph_fits(batch):
                assert self.prefill_graphs is not None
                return self.prefill_graphs.run(batch).float()
        if graph_size:
            return self._replayed_logits(batch)
        metadata = self._metadata(batch)
        if self.native is not None and batch.prompt_idx is None:
            logits = self.native(metadata, batch.input_ids, batch.positions, batch.sample_idx)
            if logits is not None:
                return logits
        set_attention_metadata(metadata)
        keep = batch.sample_idx if batch.prompt_idx is None else torch.cat([batch.sample_idx, batch.prompt_idx])
        try:
            logits = self.model(
                input_ids=batch.input_ids[None],
                position_ids=batch.positions[None],
                logits_to_keep=keep,
                use_cache=False,
            ).logits[0]
        finally:
            set_attention_metadata(None)
        if batch.prompt_idx is not None:
            num_sampling = len(batch.sample_idx)
            self._prompt_logprobs = _prompt_logprobs(batch, logits[num_sampling:])
            logits = logits[:num_sampling]
        return logits.float()

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs the last forward computed (None: it computed none), once."""
        taken, self._prompt_logprobs = self._prompt_logprobs, None
        return taken

    @torch.inference_mode()
    def run_layers(self, batch: ModelInput, graph_size: int = 0) -> None:
        """The decoder layers only (no head, no logits): what a tensor-parallel worker rank runs, writing
        its shard of the KV cache and taking part in the layers' all-reduces; in its layers-only decode graph
        when rank 0 replays the graph of `graph_size` (the same size: the all-reduces pair up)."""
        if graph_size:
            self._replay(batch)
            return
        set_attention_metadata(self._metadata(batch))
        try:
            self.model.base_model(input_ids=batch.input_ids[None], position_ids=batch.positions[None], use_cache=False)
        finally:
            set_attention_metadata(None)

    def _replayed_logits(self, batch: ModelInput) -> torch.Tensor:
        logits = self._replay(batch)
        if len(batch.sample_idx) != len(logits):  # a prompt chunk's rows: only a chunk's last token may sample
            logits = logits.index_select(0, batch.sample_idx)
        return logits.float()

    def prefill_graph_fits(self, batch: ModelInput) -> bool:
        """Whether a prefill graph runs `batch` (no step that wants prompt logprobs)."""
        graphs = self.prefill_graphs
        if graphs is None or batch.prompt_idx is not None:
            return False
        return graphs.can_run(len(batch.input_ids), len(batch.seq_lens), len(batch.sample_idx), _table_width(batch))

    def _replay(self, batch: ModelInput) -> torch.Tensor:
        assert self.graphs is not None, "a graph replay without captured graphs"
        return self.graphs.run(decode_rows(batch))

    def _metadata(self, batch: ModelInput) -> AttentionMetadata:
        assert self.pool is not None, "bind_kv_cache first"
        metadata = self._pool_metadata(batch, self.pool, batch.slot_mapping, batch.block_tables)
        window = self.window
        if window is not None:
            assert batch.window_slot_mapping is not None and batch.window_block_tables is not None
            metadata.layer_slots = window.groups.layer_slots
            metadata.window = self._pool_metadata(
                batch, window.pool, batch.window_slot_mapping, batch.window_block_tables
            )
        return metadata

    def _pool_metadata(
        self, batch: ModelInput, pool: KVPool, slot_mapping: torch.Tensor, block_tables: torch.Tensor
    ) -> AttentionMetadata:
        return AttentionMetadata(
            kv_cache=pool.kv_cache,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=batch.seq_lens,
            query_start_loc=batch.query_start_loc,
            decode_only=batch.decode_only,
            ops=self.ops,
            kv_scales=pool.kv_scales,
        )

    def _prepare(self, out: SchedulerOutput) -> tuple[ModelInput, list[tuple[int, int]]]:
        """Host-built batch tensors, plus (input position, seq_id) of every PLACEHOLDER input."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        tables: list[list[int]] = []
        sample_idx: list[int] = []
        pending: list[tuple[int, int]] = []
        pairs = 0.0
        for item in out.scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            end = start + n
            table = seq.block_table
            if item.draft is not None:  # a decode and its draft tokens: every position samples (verification)
                end = _add_drafted(item, tokens, positions, slots, sample_idx, bs)
                seq_lens.append(end)
                query_lens.append(end - start)
                tables.append(table)
                continue
            if n == 1:  # a decode: the common case at large batch, without slices and ranges
                tokens.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                tokens.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend([table[p // bs] * bs + p % bs for p in range(start, end)])
                pairs += chunk_pairs(n, start)
            seq_lens.append(end)
            query_lens.append(n)
            tables.append(table)
            if end == seq.num_tokens:
                sample_idx.append(len(tokens) - 1)
                # Only a sequence's last token can be pending, and only a chunk that reaches it feeds it.
                if tokens[-1] == PLACEHOLDER:
                    pending.append((len(tokens) - 1, seq.seq_id))
        query_start = [0, *itertools.accumulate(query_lens)]
        dev = self.device
        longs = [np.asarray(x, dtype=np.int64) for x in (tokens, positions, slots, sample_idx)]
        ints = [np.asarray(x, dtype=np.int32) for x in (seq_lens, query_start)]
        ids, pos, slot_mapping, samples, table_rows, lens, starts = to_device_many(
            [*longs, _table_rows(tables), *ints], dev
        )
        batch = ModelInput(
            input_ids=ids,
            positions=pos,
            slot_mapping=slot_mapping,
            block_tables=table_rows,
            seq_lens=lens,
            query_start_loc=starts,
            sample_idx=samples,
            decode_only=len(tokens) == len(seq_lens),
            prompt_pairs=pairs,
        )
        _add_prompt_rows(batch, out.scheduled[: len(out.scheduled) - out.num_decode_tokens], dev)
        if self.window is not None:
            self._add_window_rows(batch, out, positions, query_lens)
        return batch, pending

    def _add_window_rows(
        self, batch: ModelInput, out: SchedulerOutput, positions: list[int], query_lens: list[int]
    ) -> None:
        """The window pool's tables (each sequence's `window_table`, holes read as block 0: they lie before
        every window) and its slots, gathered from them at the batch's positions in one numpy pass."""
        rows = _table_rows([item.seq.window_table for item in out.scheduled])
        np.maximum(rows, 0, out=rows)
        bs, pos = self.block_size, np.asarray(positions, dtype=np.int64)
        row_of = np.repeat(np.arange(len(query_lens)), query_lens)
        slots = rows[row_of, pos // bs].astype(np.int64) * bs + pos % bs
        batch.window_slot_mapping = to_device(slots, torch.int64, self.device)
        batch.window_block_tables = to_device(rows, torch.int32, self.device)


def decode_rows(batch: ModelInput) -> ModelInput:
    """`batch` with each query token a decode row of its own: its sequence's block table (and window table) and
    the context up to and including itself (position + 1). The layers store every row's K/V before any row
    attends, so a speculative verify's or a prompt chunk's rows stay causal and read what its prefill-path forward
    reads; that is what lets a decode graph replay such a step. A decode-only batch is returned as it is; no host
    sync."""
    if batch.decode_only:
        return batch
    n = len(batch.input_ids)
    window = batch.window_block_tables
    return dataclasses.replace(
        batch,
        block_tables=query_token_tables(batch.block_tables, batch.query_start_loc, n),
        seq_lens=query_token_lens(batch.seq_lens, batch.query_start_loc, n),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=batch.input_ids.device),
        decode_only=True,
        window_block_tables=None if window is None else query_token_tables(window, batch.query_start_loc, n),
    )


def _table_width(batch: ModelInput) -> int:
    """The widest block table a graph would copy in (the window pool's too, in the hybrid layout)."""
    window = batch.window_block_tables
    width = batch.block_tables.shape[1]
    return width if window is None else max(width, window.shape[1])


def _query_heads(model: PreTrainedModel) -> tuple[int, int]:
    """The model's query heads and head dim."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    return heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def _table_rows(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one padded int32 array (numpy row assignment is ~5x faster than torch.tensor on padded
    nested lists: hot at large batch)."""
    rows = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
    for i, table in enumerate(tables):
        rows[i, : len(table)] = table
    return rows


def _add_drafted(
    item: ScheduledSeq, tokens: list[int], positions: list[int], slots: list[int], sample_idx: list[int], bs: int
) -> int:
    """A decode's token and its drafts (speculative decoding) into the batch lists, each position a
    sampling row (position i's logits verify draft i + 1); returns the sequence's length with them."""
    assert item.draft is not None
    seq, start = item.seq, item.seq.num_computed_tokens
    run = [seq.token_ids[start], *item.draft.token_ids]
    end = start + len(run)
    table = seq.block_table
    sample_idx.extend(range(len(tokens), len(tokens) + len(run)))
    tokens.extend(run)
    positions.extend(range(start, end))
    slots.extend([table[p // bs] * bs + p % bs for p in range(start, end)])
    return end


def _add_prompt_rows(batch: ModelInput, prefills: list[ScheduledSeq], dev: torch.device) -> None:
    """The rows of `batch` whose logits give prompt logprobs (`ModelInput.prompt_idx`), if any prompt chunk
    asks. Only the prefill items are looked at: they come first (their rows start at 0), and a decode
    computes no prompt position, so a step without prompt chunks pays nothing here."""
    idx: list[int] = []
    targets: list[int] = []
    spans: list[tuple[str, int, int, int]] = []
    row = 0
    for item in prefills:
        seq, start = item.seq, item.seq.num_computed_tokens
        top = item.group.sampling_params.prompt_logprobs
        if top is not None and start < seq.num_prompt_tokens - 1:
            # The logits at position q score prompt token q + 1: this chunk's positions up to the
            # prompt's second to last (the last one's logits sample the first output token).
            stop = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            idx.extend(range(row, row + stop - start))
            targets.extend(seq.token_ids[start + 1 : stop + 1])
            spans.append((item.group.request_id, start + 1, stop - start, top))
        row += item.num_new_tokens
    if spans:
        batch.prompt_idx = to_device(idx, torch.int64, dev)
        batch.prompt_targets = to_device(targets, torch.int64, dev)
        batch.prompt_spans = spans


def _prompt_logprobs(batch: ModelInput, logits: torch.Tensor) -> PromptLogprobs:
    """The prompt rows' logprobs (float32 log-softmax of their logits): each row's target token's and its
    top k (the span's), read back to the host now (a step with prompt logprobs is a prefill step, eager)."""
    assert batch.prompt_targets is not None and batch.prompt_spans is not None
    spans = batch.prompt_spans
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = batch.prompt_targets
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    top_n = min(max(span[3] for span in spans), logprobs.shape[-1])
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    if top_n:
        top = logprobs.topk(top_n, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    target_ids, target_values = targets.tolist(), chosen.tolist()
    entries: list[dict[int, float]] = []
    row = 0
    for _request_id, _first, count, k in spans:
        for r in range(row, row + count):
            entry = dict(zip(top_ids[r][:k], top_values[r][:k])) if k else {}
            entry.setdefault(target_ids[r], target_values[r])  # the prompt token's, in the top k or not
            entries.append(entry)
        row += count
    return PromptLogprobs(spans, entries)


@torch.inference_mode()
def profile_num_blocks(
    runner: ModelRunner,
    layout: KVLayout,
    max_num_batched_tokens: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    reserve_bytes: int = 0,
    activation_copies: int = 1,
) -> int:
    """On CUDA: run one forward at the largest batch the config allows and give the memory left under
    `gpu_memory_utilization` (after weights, `activation_copies` times the peak activations, and `reserve_bytes`
    for what is allocated after the pool, such as CUDA graphs) to KV blocks. Two copies: the prefill graphs'
    private memory pool holds the largest step's activations beside the allocator's own for eager steps."""
    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    num_tokens = max_num_batched_tokens
    seq_len = min(max_model_len, num_tokens)
    num_seqs = -(-num_tokens // seq_len)
    blocks_per_seq = -(-seq_len // layout.block_size)
    scratch = allocate_pool(layout, num_seqs * blocks_per_seq, device)
    scratch.blocks.zero_()
    tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=device).view(num_seqs, -1)
    lens = [min(seq_len, num_tokens - i * seq_len) for i in range(num_seqs)]
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    slots = torch.cat(
        [
            tables[i].repeat_interleave(layout.block_size)[:n].long() * layout.block_size
            + torch.arange(n, device=device) % layout.block_size
            for i, n in enumerate(lens)
        ]
    )
    metadata = AttentionMetadata(
        kv_cache=scratch.kv_cache,
        kv_scales=scratch.kv_scales,
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device),
        decode_only=False,
        ops=runner.ops,
    )
    set_attention_metadata(metadata)
    try:
        ids = torch.zeros((1, num_tokens), dtype=torch.int64, device=device)
        runner.model(input_ids=ids, position_ids=positions[None], logits_to_keep=1, use_cache=False)
    finally:
        set_attention_metadata(None)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch.blocks.numel()
    del scratch
    total = torch.cuda.get_device_properties(device).total_memory
    activations = max(0, peak - weights)
    available = int(total * gpu_memory_utilization) - peak - (activation_copies - 1) * activations - reserve_bytes
    num_blocks = available // layout.bytes_per_block
    log.info(
        "kv_cache.profiled",
        total_gib=round(total / 2**30, 2),
        peak_gib=round(peak / 2**30, 2),
        activation_copies=activation_copies,
        reserved_gib=round(reserve_bytes / 2**30, 2),
        kv_gib=round(available / 2**30, 2),
        num_blocks=num_blocks,
    )
    if num_blocks <= 0:
        raise ValueError(
            "no GPU memory left for the KV cache: raise cache.gpu_memory_utilization or lower "
            "scheduler.max_num_batched_tokens"
        )
    return int(num_blocks)
