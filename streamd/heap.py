"""Garbage-collector settings for a process that holds a loaded model: `settle()` once it is loaded.

The model, tokenizer and everything built while loading (hundreds of thousands of long-lived objects) are
frozen out of every later collection. The youngest generation's threshold is raised from 700 to 10,000
net allocations: an engine step allocates and frees a few thousand short-lived objects (deltas, lists,
tensors' wrappers), so at 700 a collection ran every step or two and promoted live step data into older
generations; at 10,000 a steady stream of steps triggers none (benchmarks/NOTES.md), while memory held
by reference cycles still stays bounded.

It also hands the C heap's free memory back to the OS (`malloc_trim`, glibc only): loading a low-bit model
frees several times the model's size in transient buffers, which glibc otherwise keeps as resident memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable
from typing import cast

YOUNG_THRESHOLD = 10_000


def settle() -> None:
    """Freezes what exists now out of future collections and raises the young generation's threshold."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    trim_c_heap()


def trim_c_heap() -> None:
    """Returns the C heap's free pages to the OS where the C library is glibc (a no-op elsewhere)."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, looked up once (`find_library` runs a subprocess); None for another C library."""
    try:
        return cast(Callable[[int], int], ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim)
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl): nothing to trim
        return None
