"""Garbage-collector settings for a process that holds a loaded model: `settle()` once it is loaded.

The model, tokenizer and everything built while loading (hundreds of thousands of long-lived objects) are
frozen out of every later collection. The youngest generation's threshold is raised from 700 to 10,000
net allocations: an engine step allocates and frees a few thousand short-lived objects (deltas, lists,
tensors' wrappers), so at 700 a collection ran every step or two and promoted live step data into older
generations; at 10,000 a steady stream of steps triggers none (benchmarks/NOTES.md), while memory held
by reference cycles still stays bounded.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000


def settle() -> None:
    """Freezes what exists now out of future collections and raises the young generation's threshold."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
