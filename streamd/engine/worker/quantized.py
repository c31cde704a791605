"""Low-bit modules that stand in for transformers' Linear and Embedding: the rest of the model is unchanged.

`QuantizedLinear` runs `streamd.kernels.lowbit`'s packed kernels (a sum of parts: one int4 weight, or the two
int4 halves of a Q8_0 weight, or one int8 weight); `QuantizedEmbedding` dequantizes only the rows it looks up.
`quantize_linears` quantizes a float model's Linear layers at load (`model.quantization = "int8" | "int4"`).

These run on the CPU, with activations in bfloat16: torch's packed kernels take their fast path (AVX-512 VNNI /
AMX) only there; with float32 activations they fall back to a scalar loop 10-20x slower than a float32 GEMM
(benchmarks/NOTES.md, "Issue 25, part 1"). `cpu_threads.cpu_runs_bf16` says whether this CPU has native
bfloat16.

A call with `DENSE_ROWS` rows or more (a prompt chunk, a speculative verify, many streams) dequantizes the weight
once into a transient float32 buffer, rounds it to the activations' dtype and runs one dense matmul: torch's
packed kernels cost the same per row at any row count. Both paths multiply bfloat16 activations in float32 and
round the output to bfloat16; the dense one also rounds the weight to bfloat16 first (2^-9 relative).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from streamd.engine.worker.gguf_weights import GROUP, Int4Codes, Q8Codes
from streamd.kernels import lowbit

Part = lowbit.Int4Weight | lowbit.Int8Weight

# Rows from which one dequantization and a dense bfloat16 matmul beat torch's packed kernel, for weights up to
# DENSE_MAX_WEIGHTS elements (benchmarks/NOTES.md, "Issue 25, many rows": on the shared 2-core box, one thread,
# the dense path lost at 64 rows by 0-20% and won at 128 by 1.0-1.7x on the default model's layers). A vocabulary
# head (49,152 x 576) costs 0.5 s to dequantize, more than the kernel takes for 128 rows, so it stays packed.
DENSE_ROWS = 96
DENSE_MAX_WEIGHTS = 1 << 22


def dense_from_rows(model: nn.Module) -> int | None:
    """The rows from which `model`'s low-bit layers take the dense path (None: none does): a step with
    fewer rows pays the packed kernel's per-row cost on every row."""
    rows = {m.dense_rows for m in model.modules() if isinstance(m, QuantizedLinear) and m.dense_rows is not None}
    return max(rows) if rows else None


class QuantizedLinear(nn.Module):
    """y = x @ (sum of the parts' weights).T + bias."""

    def __init__(self, parts: Sequence[Part], bias: torch.Tensor | None, in_features: int, out_features: int) -> None:
        super().__init__()
        self.parts = tuple(parts)
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        small = in_features * out_features <= DENSE_MAX_WEIGHTS
        self.dense_rows = DENSE_ROWS if small and lowbit.packed_row_block() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.to(self.parts[0].compute_dtype)
        if self.dense_rows is not None and rows.numel() >= self.dense_rows * self.in_features:
            out = lowbit.dense_linear(rows, self.parts, (self.out_features, self.in_features))
        else:
            out = _packed(rows, self.parts)
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def extra_repr(self) -> str:
        kinds = "+".join(type(p).__name__ for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={kinds}"


def _packed(rows: torch.Tensor, parts: tuple[Part, ...]) -> torch.Tensor:
    out = _apply(rows, parts[0])
    for part in parts[1:]:
        out = out + _apply(rows, part)
    return out


def _apply(x: torch.Tensor, part: Part) -> torch.Tensor:
    if isinstance(part, lowbit.Int4Weight):
        return lowbit.int4_linear(x, part)
    return lowbit.int8_linear(x, part)


class QuantizedEmbedding(nn.Module):
    """Rows of a 4-bit or Q8_0 table, dequantized as they are looked up (in `dtype`)."""

    def __init__(self, table: Int4Codes | Q8Codes, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.codes.shape

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        rows = self.table.rows(flat).dequantize().to(self.dtype)
        return rows.reshape(*input_ids.shape, self.embedding_dim)


def linear_from_codes(codes: Int4Codes | Q8Codes, bias: torch.Tensor | None, compute: torch.dtype) -> QuantizedLinear:
    """A Linear of GGUF codes, exactly: an Int4Codes packs as it is, a Q8Codes as its two int4 halves. The
    kernels run in `compute` (the input is cast to it, the output back); the bias is added in the input's dtype."""
    halves = codes.int4_halves() if isinstance(codes, Q8Codes) else iter((codes,))
    parts = [lowbit.pack_int4(h.codes, h.scales, h.zeros, GROUP, compute) for h in halves]  # one half held at a time
    out_features, in_features = codes.codes.shape
    return QuantizedLinear(parts, bias, in_features, out_features)


def quantize_linears(model: nn.Module, mode: str, compute: torch.dtype) -> int:
    """Replaces every nn.Linear of a float model by its int8 (per row) or int4 (per 32 inputs) quantization;
    returns how many. Round to nearest; int4 is asymmetric (min..max of each group over the 16 codes)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in linears:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, _quantized(linear, mode, compute))
    return len(linears)


def _quantized(linear: nn.Linear, mode: str, compute: torch.dtype) -> QuantizedLinear:
    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    if mode == "int4":
        return linear_from_codes(quantize_int4(weight), bias, compute)
    return QuantizedLinear([lowbit.quantize_int8(weight, compute)], bias, linear.in_features, linear.out_features)


def quantize_int4(weight: torch.Tensor) -> Int4Codes:
    """Asymmetric 4-bit per 32 inputs: scale = (max - min) / 15, codes round((w - min) / scale), so w is
    (q - 8) * scale + (min + 8 * scale). The input width is padded with zeros to a multiple of 32."""
    out_features, in_features = weight.shape
    padded = nn.functional.pad(weight.float(), (0, -in_features % GROUP)).reshape(out_features, -1, GROUP)
    low, high = padded.amin(dim=-1), padded.amax(dim=-1)
    scales = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
    codes = torch.round((padded - low[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
    return Int4Codes(codes.reshape(out_features, -1)[:, :in_features], scales, low + 8 * scales)
