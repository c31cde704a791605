"""transformers' per-layer attention extras in the Triton attention kernels: a sliding window (Mistral,
Gemma 2/3, gpt-oss), logit soft-capping (Gemma 2) and attention sinks (gpt-oss).

Owns what the decode and prefill kernels share about them: the launch arguments (`LogitExtras`, checked
here once) and the device helpers. Each extra is a compile-time flag of the kernels (``WINDOW``,
``SOFTCAP``, ``SINKS``): off, a kernel compiles to what it was without it, so a Llama layer pays nothing.
The semantics are the references' (``streamd.kernels.reference``): a window W shows a query at position
p the keys p - W < k <= p; a cap c turns every logit s into c * tanh(s / c) before masking; a sink is a
per-query-head logit that joins the softmax's denominator only. The kernels keep scores in the exp2
domain (log2(e) folded into the query scale): with a cap they scale by ``scale / c``, take the tanh and
multiply by ``c * log2(e)``; a sink enters as ``sink * log2(e)``, once, where the softmax is normalised
(the decode kernel's final combine when it splits the context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from streamd.kernels._triton_utils import jit_helper

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)  # the same, for kernels (a compiled kernel reads only constexpr globals)


@dataclass(frozen=True, slots=True)
class LogitExtras:
    """The kernels' arguments for the extras; the unused ones are placeholders the flags keep unread."""

    qk_scale: float  # multiplies q.k: scale * log2(e), or scale / cap with a cap
    cap_log2: float  # cap * log2(e) (unused without a cap)
    window: int  # W (unused without a window)
    sinks: torch.Tensor  # [num_heads] logits (without sinks: any tensor, never read)
    has_window: bool
    has_cap: bool
    has_sinks: bool

    def flags(self) -> dict[str, bool]:
        """The kernels' compile-time flags."""
        return {"WINDOW": self.has_window, "SOFTCAP": self.has_cap, "SINKS": self.has_sinks}


def logit_extras(
    query: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> LogitExtras:
    """Checked launch arguments for query [tokens, num_heads, head_dim]; host metadata only (no sync)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if sinks is not None and (sinks.shape != (query.shape[1],) or sinks.device != query.device):
        raise ValueError(f"sinks must be [{query.shape[1]}] on {query.device}, got {tuple(sinks.shape)}")
    return LogitExtras(
        qk_scale=scale / softcap if softcap is not None else scale * LOG2E,
        cap_log2=softcap * LOG2E if softcap is not None else 1.0,
        window=sliding_window or 0,
        sinks=sinks.contiguous() if sinks is not None else query,
        has_window=sliding_window is not None,
        has_cap=softcap is not None,
        has_sinks=sinks is not None,
    )


@jit_helper
def capped(x: tl.tensor, cap_log2: tl.tensor) -> tl.tensor:
    """cap * log2(e) * tanh(x), with tanh(x) = 1 - 2 / (e^2x + 1): Triton's language has no tanh that its
    interpreter also runs, and this form saturates cleanly at +-1 (e^2x overflowing to inf, or 0)."""
    return cap_log2 * (1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0))  # 2 * log2(e)


@jit_helper
def fold_sink(m: tl.tensor, l: tl.tensor, acc: tl.tensor, sink: tl.tensor) -> tuple[tl.tensor, tl.tensor]:
    """Running max ``m``, sum ``l`` and accumulator ``acc`` [rows, D] with the sink logit (exp2 domain)
    added to the denominator: (sum, accumulator), both relative to max(m, sink)."""
    m_fin = tl.maximum(m, sink)
    alpha = tl.exp2(m - m_fin)
    return l * alpha + tl.exp2(sink - m_fin), acc * alpha[:, None]
