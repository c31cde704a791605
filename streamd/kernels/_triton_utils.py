"""Shared plumbing for the Triton kernels: picking compiled vs interpreted launch, small shape helpers.

Every kernel is wrapped twice, once for the Triton compiler (CUDA tensors) and once for Triton's
interpreter (CPU tensors). The choice is made per call from the tensors' device, not from the
``TRITON_INTERPRET`` variable at import time, so a process that imported ``streamd.kernels`` before
anyone set that variable (a test suite that imported torch and the engine first) still runs the
kernels on CPU tensors, and a GPU process that inherited ``TRITON_INTERPRET=1`` still compiles them.
Triton's interpreter, however, expects ``TRITON_INTERPRET=1`` from the moment ``triton.language`` is
imported: its standard helpers (``tl.zeros``, ``tl.sum``, ``tl.max``, ...) are themselves ``@jit``
functions, and a compiled ``JITFunction`` refuses to be called from interpreted code. When triton was
imported without the variable, ``_interpreter_scope`` makes such calls go through the interpreter for
the duration of a CPU launch (and sets the variable, which triton's knobs read lazily). The same
redirection serves the kernels' own helpers, declared with ``@jit_helper``.

Kernel parameters are annotated ``tl.tensor`` (a pointer or a scalar, as the kernel body sees it) or
``tl.constexpr``. Triton reads only ``constexpr`` and dtype names (``"i32"``, ``"*fp16"``) out of an
annotation, so ``tl.tensor`` changes nothing in how a kernel is specialised or compiled.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


class DualKernel:
    """A Triton kernel usable on CUDA tensors (compiled) and on CPU tensors (interpreted)."""

    def __init__(self, fn: Callable[..., Any], do_not_specialize: tuple[str, ...] = ()) -> None:
        self.fn = fn
        # JITFunction directly (not triton.jit) so an inherited TRITON_INTERPRET=1 cannot turn the
        # CUDA path into the interpreter. Arguments that change from step to step (sequence counts, table
        # widths) are not specialized on, or each new divisibility-by-16 pattern would compile a variant
        # while a user waits.
        self.compiled = JITFunction(fn, do_not_specialize=list(do_not_specialize) or None)
        self.interpreted = InterpretedFunction(fn)

    def select(self, device: torch.device) -> Any:
        """The launchable kernel for tensors on ``device``."""
        return self.compiled if device.type == "cuda" else self.interpreted

    def launch(self, device: torch.device, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if device.type == "cuda":
            self.compiled[grid](*args, **kwargs)
            return
        with _interpreter_scope():
            self.interpreted[grid](*args, **kwargs)


_scope_lock = threading.RLock()
_interpreted_helpers: dict[int, InterpretedFunction] = {}


def _call_jit_via_interpreter(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    helper = _interpreted_helpers.get(id(self))
    if helper is None:
        helper = _interpreted_helpers[id(self)] = InterpretedFunction(self.fn)
    return helper(*args, **kwargs)


@contextlib.contextmanager
def _interpreter_scope() -> Iterator[None]:
    """Let an interpreted launch call triton's compiled ``@jit`` stdlib helpers (see module doc)."""
    with _scope_lock:
        saved_env = os.environ.get("TRITON_INTERPRET")
        saved_call = JITFunction.__call__
        os.environ["TRITON_INTERPRET"] = "1"
        JITFunction.__call__ = _call_jit_via_interpreter
        try:
            yield
        finally:
            JITFunction.__call__ = saved_call
            if saved_env is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = saved_env


def dual_kernel(fn: Callable[..., Any] | None = None, *, do_not_specialize: tuple[str, ...] = ()) -> Any:
    """Decorator: ``@dual_kernel`` (or ``@dual_kernel(do_not_specialize=(...))``) in place of ``@triton.jit``."""
    if fn is None:
        return lambda f: DualKernel(f, do_not_specialize)
    return DualKernel(fn, do_not_specialize)


def jit_helper(fn: Callable[..., Any]) -> JITFunction:
    """Decorator for a device function that the kernels here call: a ``JITFunction`` (not ``triton.jit``,
    for the reason in ``DualKernel``), inlined by a compiled kernel and run through the interpreter by an
    interpreted launch (``_interpreter_scope``)."""
    return JITFunction(fn)


def dot_upcast(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a kernel must feed ``tl.dot`` float32 instead of ``dtype``.

    Triton's interpreter stores bfloat16 as raw uint16 and its ``tl.dot`` multiplies those bit
    patterns (seen in triton 3.9), so interpreted bf16 kernels upcast their dot operands. Compiled
    kernels never do.
    """
    return device.type != "cuda" and dtype == torch.bfloat16


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors on ``device`` (a nominal 16 off CUDA, where only the split logic is exercised)."""
    if device.type != "cuda":
        return 16
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
