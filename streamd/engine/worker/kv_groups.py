"""The hybrid KV layout's worker half: which layers keep only their window, and how the memory splits.

A model with both sliding-window and full-attention layers (Gemma 2 and 3, gpt-oss) keeps two pools: the full
layers' blocks for the whole context and the sliding layers' for their window only (the block bookkeeping is
`core/hybrid_blocks.py`). Here: each layer's place (`WindowGroups.layer_slots`: which pool, which layer of
it), the two pools' layouts, and the split of one memory budget between them (`split_blocks`:
`cache.swa_full_tokens_ratio` window-pool tokens per full-pool token).

Not used (every layer keeps the whole context, as before) when `cache.disable_hybrid_kv_cache_manager` is set,
under tensor parallelism (its step message carries one block table), or for a model whose layers all have a
window (Mistral 7B v0.1, Phi-3: the full group would be empty) or none has one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import PreTrainedModel

from streamd.engine.worker.cache_engine import KVLayout, KVPool
from streamd.engine.worker.families import attention_needs


@dataclass(frozen=True, slots=True)
class WindowGroups:
    """The layers of a hybrid model by group: `layer_slots[layer]` is (in the window group, index in its
    group's pool); `sliding_window` is the widest window of the sliding layers."""

    sliding_window: int
    layer_slots: tuple[tuple[bool, int], ...]

    @property
    def num_window_layers(self) -> int:
        return sum(in_window for in_window, _ in self.layer_slots)

    @property
    def num_full_layers(self) -> int:
        return len(self.layer_slots) - self.num_window_layers

    def layouts(self, layout: KVLayout) -> tuple[KVLayout, KVLayout]:
        """The full pool's and the window pool's layouts, from the plain layout of every layer."""
        return (
            dataclasses.replace(layout, num_layers=self.num_full_layers),
            dataclasses.replace(layout, num_layers=self.num_window_layers),
        )


@dataclass(frozen=True, slots=True)
class WindowPool:
    """The hybrid layout's second pool, the sliding layers', and where each layer lives."""

    pool: KVPool
    groups: WindowGroups


def window_groups(model: PreTrainedModel, disabled: bool, tensor_parallel_size: int) -> WindowGroups | None:
    """The hybrid layout of `model`, or None where every layer keeps the whole context (see the module)."""
    windows = attention_needs(model).windows
    sliding = [w for w in windows if w is not None]
    if disabled or tensor_parallel_size > 1 or not sliding or len(sliding) == len(windows):
        return None
    counts = [0, 0]
    slots = []
    for window in windows:
        in_window = window is not None
        slots.append((in_window, counts[in_window]))
        counts[in_window] += 1
    return WindowGroups(max(sliding), tuple(slots))


def split_blocks(budget_bytes: int, full: KVLayout, window: KVLayout, ratio: float) -> tuple[int, int]:
    """(full-pool blocks, window-pool blocks) that fit `budget_bytes` with `ratio` window blocks per full one."""
    num_full = int(budget_bytes // (full.bytes_per_block + ratio * window.bytes_per_block))
    return num_full, int(ratio * num_full)
