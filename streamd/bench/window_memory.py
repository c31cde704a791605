"""`streamd bench memory --window`: the KV bytes per token a hybrid model's request holds, with the hybrid
layout (`engine/core/hybrid_blocks.py`: sliding layers keep their window) and without it (every layer keeps
the whole context).

Two measurements, CPU only:
- **Real shapes, the real block managers** (no model): for Gemma 3 1B and 27B, Gemma 2 9B and gpt-oss-20b
  (layer counts, KV heads, head dims and windows of their configs; bf16 blocks of 16 tokens), one request's
  prompt of each context length goes through admission and chunked prefill (8,192-token chunks) as the
  scheduler runs it, and decodes a few tokens; the bytes its blocks hold, divided by its tokens. The ideal is
  (full layers + sliding layers x min(1, window / context)) / all layers of the plain layout's bytes.
- **The real engine** on a small random-weight Gemma 3 text model (6 layers, five local of six, window 64):
  `streamd_kv_bytes_used` (the stats behind `/metrics`) while a 1,024-token prompt decodes, with the layout
  and without, and whether the greedy tokens agree.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from streamd.config import SchedulerConfig
from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.hybrid_blocks import BlockSpace, HybridBlockManager
from streamd.engine.core.scheduler import Scheduler
from streamd.engine.core.sequence import Sequence, SequenceGroup
from streamd.engine.sampling_params import SamplingParams

BLOCK = 16
CHUNK = 8192
CONTEXTS = (1024, 8192, 32768, 131072)


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    layers: int
    global_every: int  # every n-th layer attends to everything (Gemma 3: 6, alternating: 2)
    kv_heads: int
    head_dim: int
    window: int

    @property
    def full_layers(self) -> int:
        return self.layers // self.global_every

    @property
    def window_layers(self) -> int:
        return self.layers - self.full_layers

    def block_bytes(self, layers: int) -> int:
        return layers * 2 * self.kv_heads * BLOCK * self.head_dim * 2  # K and V, bf16


SHAPES = (
    Shape("gemma-3-1b", 26, 6, 1, 256, 512),
    Shape("gemma-3-27b", 62, 6, 16, 128, 1024),
    Shape("gemma-2-9b", 42, 2, 8, 256, 4096),
    Shape("gpt-oss-20b", 24, 2, 8, 64, 128),
)


def held_bytes(shape: Shape, context: int, hybrid: bool) -> int:
    """The bytes one request of `context` prompt tokens holds after its prefill and 8 decoded tokens, driven by
    the real Scheduler (chunked prefill of `CHUNK` tokens, then decodes; no model)."""
    blocks = -(-(context + 16) // BLOCK) + 8
    window_pool = max(blocks, -(-(shape.window + CHUNK) // BLOCK) + 4)  # (room for one chunk ahead)
    plain = BlockManager(blocks, BLOCK, watermark=0.0)
    manager: BlockSpace = plain
    if hybrid:
        manager = HybridBlockManager(plain, BlockManager(window_pool, BLOCK, watermark=0.0), shape.window, CHUNK)
    scheduler = Scheduler(SchedulerConfig(1, CHUNK, "recompute"), manager, context + 16)
    seq = Sequence(list(range(context)))
    scheduler.add_seq_group(SequenceGroup("long", [seq], SamplingParams(max_tokens=8, ignore_eos=True)))
    while seq.num_output_tokens < 8:
        out = scheduler.schedule()
        sampling = out.sampling()
        scheduler.on_step_done(out)
        for item in sampling:
            item.seq.append_token(0)  # the sampled token; its value is irrelevant to memory
    full_layers = shape.full_layers if hybrid else shape.layers
    window_blocks = sum(block >= 0 for block in seq.window_table)
    return len(seq.block_table) * shape.block_bytes(full_layers) + window_blocks * shape.block_bytes(
        shape.window_layers
    )


def shape_rows() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for shape in SHAPES:
        for context in CONTEXTS:
            plain, hybrid = held_bytes(shape, context, False), held_bytes(shape, context, True)
            tokens = context + 8
            ideal = (shape.full_layers + shape.window_layers * min(1.0, shape.window / tokens)) / shape.layers
            rows.append(
                {
                    "model": shape.name,
                    "layers": f"{shape.full_layers} full + {shape.window_layers} sliding (window {shape.window})",
                    "context": context,
                    "plain_bytes_per_token": round(plain / tokens),
                    "hybrid_bytes_per_token": round(hybrid / tokens),
                    "ratio": round(hybrid / plain, 4),
                    "ideal_ratio": round(ideal, 4),
                }
            )
    return rows


def engine_row(prompt_tokens: int = 1024, max_tokens: int = 16) -> dict[str, object]:
    """The real engine, CPU: KV bytes held while a long prompt decodes, with the hybrid layout and without."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from streamd import LLM, SamplingParams
    from streamd.engine.outputs import RequestOutputBuilder

    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, sliding_window=64,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    prompt = [(7 * i + 3) % 512 for i in range(prompt_tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    result: dict[str, object] = {"model": "gemma-3 text, random weights, 6 layers (5 sliding, window 64)"}
    tokens = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for name, disabled in (("plain", True), ("hybrid", False)):
            llm = LLM(
                str(Path(tmp)), device="cpu", dtype="float32", num_kv_blocks=160, num_swap_blocks=0,
                max_num_batched_tokens=256, disable_hybrid_kv_cache_manager=disabled,
            )  # fmt: skip
            engine = llm.engine
            engine.add_request("long", prompt, params)
            peak = decoding = 0
            folded = RequestOutputBuilder("long", None, [])
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    folded.add(delta)
                held = engine.stats().kv.bytes_used
                peak, decoding = max(peak, held), held or decoding  # (the last step frees everything)
            tokens[name] = folded.build().outputs[0].token_ids
            result[f"{name}_peak_bytes"], result[f"{name}_decoding_bytes"] = peak, decoding
    for kind in ("peak", "decoding"):
        result[f"{kind}_ratio"] = round(result_bytes(result, "hybrid", kind) / result_bytes(result, "plain", kind), 4)
    result["same_tokens"] = tokens["plain"] == tokens["hybrid"]
    return result


def result_bytes(result: dict[str, object], name: str, kind: str) -> int:
    value = result[f"{name}_{kind}_bytes"]
    assert isinstance(value, int)
    return value


def render(rows: list[dict[str, object]], engine: dict[str, object] | None) -> str:
    lines = [
        "| model | layers | context | plain B/token | hybrid B/token | hybrid / plain | ideal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['context']:,} | {r['plain_bytes_per_token']:,} "
            f"| {r['hybrid_bytes_per_token']:,} | {r['ratio']:.3f} | {r['ideal_ratio']:.3f} |"
        )
    if engine is not None:
        lines += [
            "",
            f"Engine ({engine['model']}, a 1,024-token prompt read in 256-token chunks, 16 tokens decoded): KV bytes "
            f"held while decoding {engine['plain_decoding_bytes']:,} plain, {engine['hybrid_decoding_bytes']:,} "
            f"hybrid ({engine['decoding_ratio']:.3f}x); at the peak (prefill: the window and a chunk ahead) "
            f"{engine['plain_peak_bytes']:,} and {engine['hybrid_peak_bytes']:,} ({engine['peak_ratio']:.3f}x); "
            f"the same greedy tokens: {engine['same_tokens']}.",
        ]
    return "\n".join(lines)
