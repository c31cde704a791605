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

`W8A8Linear` (`model.low_bit_matmul = "w8a8"`, asked for: see `model_loader.resolve_matmul`) holds the weight also
as int8 per output channel and, from `INT_MM_ROWS` rows on, multiplies int8 activations by it (`lowbit.w8a8_linear`,
torch's `_int_mm`): its cost grows far more slowly with the rows than the packed kernels', so many streams and
prompt chunks gain (1.4x a decode step at 32 streams), with no dense fallback. Below, where a call is bound by
reading the weight, it keeps the weight-only layer that reads the fewest bytes (4-bit codes packed; a Q8_0 weight's
int8 codes through torch's weight-only int8 kernel). The memory is the price: both forms held (benchmarks/NOTES.md,
"Issue 25, W8A8"). q/k/v and gate/up read one input each: `share_inputs` has it quantized once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
# The same crossover against the C int4 matmul (`lowbit.NativeInt4`, AVX-512 BF16), which costs ~0.75x torch's
# kernel per row: at 128 rows it beat the dense path on all three shapes (3072 x 576: 1.96 against 2.74 ms), at 192
# lost on two of three (benchmarks/NOTES.md, "Issue 25, eighteenth session").
NATIVE_DENSE_ROWS = 160

# How low-bit layers multiply (`model.low_bit_matmul`, resolved by `model_loader.low_bit_plan`): weight-only
# (the packed kernels, bfloat16 activations) or int8 weights x int8 activations (`W8A8Linear`).
WEIGHT_ONLY, W8A8 = "weight_only", "w8a8"
REQUANTIZE_ROWS = 1024  # rows of GGUF codes requantized to int8 at a time
# Rows from which `W8A8Linear` takes the int8 x int8 path (benchmarks/NOTES.md, "Issue 25, W8A8": decode steps of
# the default model, one thread, every layer on one path or the other: even at 8 rows, 9% faster at 12, 20% at 16;
# slower below, where reading twice the weight bytes of 4-bit codes costs more than the packed kernels' work).
INT_MM_ROWS = 10


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
        # the C matmul over every part at once where it runs (AVX-512 BF16): faster, and a Q8_0 weight's halves
        # are summed in float32 and rounded once
        self.native = lowbit.native_int4(self.parts)
        # one packed int4 weight of its own widths: few contiguous rows take torch's kernel and nothing around it
        # (the CPU decode step's ~120 matmuls: `native_decode` calls `matmul` directly)
        single = self.parts[0] if len(self.parts) == 1 else None
        self.int4 = single if isinstance(single, lowbit.Int4Weight) and lowbit.needs_no_padding(single) else None
        small = in_features * out_features <= DENSE_MAX_WEIGHTS
        crossover = DENSE_ROWS if self.native is None else NATIVE_DENSE_ROWS  # against the few-row kernel taken
        self.dense_rows = crossover if small and lowbit.packed_row_block() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.to(self.parts[0].compute_dtype)).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., in] in the compute dtype @ the weight.T, in the compute dtype, without the bias: the kernel
        for the row count (many rows: one dequantization and a dense matmul)."""
        if self.dense_rows is not None and rows.numel() >= self.dense_rows * self.in_features:
            return lowbit.dense_linear(rows, self.parts, (self.out_features, self.in_features))
        if self.native is not None and rows.is_contiguous():
            out = self.native(rows.view(-1, self.in_features))
            if out is not None:
                return out.view(*rows.shape[:-1], self.out_features)
        if self.int4 is not None and rows.dim() == 2 and rows.is_contiguous():
            return lowbit.int4_mm(rows, self.int4)
        return _packed(rows, self.parts)

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


def merge_reason(linears: Sequence[nn.Module]) -> str | None:
    """Why `merge_quantized` cannot merge these low-bit layers (None: it can)."""
    if not all(isinstance(m, QuantizedLinear) for m in linears):
        kinds = sorted({type(m).__name__ for m in linears})
        return f"its low-bit layers {'/'.join(kinds)} do not merge (only weight-only QuantizedLinear layers do)"
    layers = [m for m in linears if isinstance(m, QuantizedLinear)]
    if len({tuple((type(p), p.compute_dtype) for p in m.parts) for m in layers}) != 1:
        return "sibling projections are stored in different low-bit formats"
    if len({m.in_features for m in layers}) != 1:
        return "sibling projections read inputs of different widths"
    return None


def merge_quantized(linears: Sequence[QuantizedLinear]) -> QuantizedLinear:
    """One layer whose output is the `linears`' outputs side by side (q/k/v, gate/up as one matmul): each part's
    rows concatenated (`lowbit.concat_rows`), so every output row is computed as its own layer computed it."""
    reason = merge_reason(linears)
    if reason is not None:
        raise ValueError(reason)
    parts = [lowbit.concat_rows([m.parts[i] for m in linears]) for i in range(len(linears[0].parts))]
    bias = None
    if any(m.bias is not None for m in linears):
        first = next(m.bias for m in linears if m.bias is not None)
        bias = torch.cat([m.bias if m.bias is not None else first.new_zeros(m.out_features) for m in linears])
    return QuantizedLinear(parts, bias, linears[0].in_features, sum(m.out_features for m in linears))


@dataclass(frozen=True, slots=True)
class PackedTable:
    """A tied embedding's table whose codes are read from the head's packed weight, so the codes are held once:
    the file's exact float32 scales (and zeros) beside it, and a looked-up row's codes unpacked
    (`lowbit.int4_rows`; a Q8_0 code from its halves, q = 16 * (hi - 8) + lo), so a row dequantizes to what the
    file's table gives, bit for bit."""

    parts: tuple[lowbit.Int4Weight, ...]  # the head's: a 4-bit weight, or a Q8_0 weight's (high, low) halves
    scales: torch.Tensor
    zeros: torch.Tensor | None  # a 4-bit table's (None: Q8_0)

    def rows(self, index: torch.Tensor) -> Int4Codes | Q8Codes:
        if self.zeros is not None:
            return Int4Codes(lowbit.int4_rows(self.parts[0], index), self.scales[index], self.zeros[index])
        high, low = (lowbit.int4_rows(part, index).to(torch.int16) for part in self.parts)
        return Q8Codes(((high - 8) * 16 + low).to(torch.int8), self.scales[index])

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` dequantized to float32: in one C call where the library is built, else through `rows`."""
        found = lowbit.table_rows(self.parts, index, self.scales, self.zeros, GROUP)
        return found if found is not None else self.rows(index).dequantize()

    @property
    def shape(self) -> tuple[int, int]:
        return self.parts[0].out_features, self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        """What the table holds beside the head (its codes are the head's)."""
        return self.scales.nbytes + (0 if self.zeros is None else self.zeros.nbytes)

    @classmethod
    def of(cls, head: QuantizedLinear, scales: torch.Tensor, zeros: torch.Tensor | None) -> PackedTable:
        """The table of `head` (its weight-only packed form) and the file's `scales` (and a 4-bit table's
        `zeros`; None: Q8_0, two halves)."""
        parts = tuple(p for p in head.parts if isinstance(p, lowbit.Int4Weight))
        if len(parts) != len(head.parts) or len(parts) != (1 if zeros is not None else 2):
            raise ValueError("a packed table is read from one int4 weight (4-bit) or two int4 halves (Q8_0)")
        return cls(parts, scales, zeros)


class QuantizedEmbedding(nn.Module):
    """Rows of a 4-bit or Q8_0 table, dequantized as they are looked up (in `dtype`)."""

    def __init__(self, table: Int4Codes | Q8Codes | PackedTable, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.shape

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        rows = self.table.lookup(flat).to(self.dtype)
        return rows.reshape(*input_ids.shape, self.embedding_dim)


class SharedInput:
    """The int8 rows of one input that `readers` sibling layers read in turn (q/k/v, gate/up: transformers'
    Llama-style attention and MLP pass them the one tensor, unchanged): quantized by the first reader, reused by
    the others, then dropped. The input is recognised by identity (held meanwhile, so its id is not reused); a
    caller that changed it in place between siblings would get the old rows, which those models never do."""

    def __init__(self, readers: int) -> None:
        self.readers = readers
        self._input: torch.Tensor | None = None
        self._rows: lowbit.Int8Rows | None = None
        self._left = 0

    def rows(self, x: torch.Tensor) -> lowbit.Int8Rows:
        if self._rows is None or x is not self._input:
            self._rows, self._input, self._left = lowbit.quantize_rows(x.reshape(-1, x.shape[-1])), x, self.readers
        rows = self._rows
        self._left -= 1
        if self._left == 0:
            self._rows = self._input = None
        return rows


class W8A8Linear(nn.Module):
    """y = x @ w.T + bias, w held int8 per output channel. From `INT_MM_ROWS` rows on, x as two int8 halves per
    row and int8 x int8 sums (`lowbit.w8a8_linear`), whose cost grows far more slowly with the rows than the
    packed kernels'; below, `few_rows` (the weight-only layer of the same weight: the packed kernels read half
    the bytes of int8 where a call is bound by reading the weight). The output is in the input's dtype."""

    def __init__(self, weight: lowbit.W8A8Weight, bias: torch.Tensor | None, few_rows: QuantizedLinear | None) -> None:
        super().__init__()
        self.weight8 = weight
        self.out_features, self.in_features = weight.codes.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.inputs = SharedInput(1)  # `share_inputs` gives siblings one
        self.few_rows = few_rows  # without its own bias, never called with many rows
        if few_rows is not None:
            few_rows.dense_rows = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows is not None and x.numel() < INT_MM_ROWS * self.in_features:
            out = self.few_rows(x)
        else:
            out = lowbit.w8a8_linear(self.inputs.rows(x), self.weight8, x.dtype)
            out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out.add_(self.bias)

    @property
    def nbytes(self) -> int:
        """The int8 weight, less the codes `few_rows` shares (a Q8_0 weight's, unpadded), which it counts."""
        parts = self.few_rows.parts if self.few_rows is not None else ()
        shared = any(isinstance(p, lowbit.Int8Weight) and p.codes is self.weight8.codes for p in parts)
        return self.weight8.nbytes - (self.weight8.codes.nbytes if shared else 0)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"


LowBitLinear = QuantizedLinear | W8A8Linear
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # layers fed one input (Llama-style)


def share_inputs(model: nn.Module) -> int:
    """Gives each group of `SIBLINGS` that are all `W8A8Linear` one `SharedInput`; returns how many groups."""
    groups = 0
    for module in model.modules():
        for names in SIBLINGS:
            layers = [layer for name in names if isinstance(layer := getattr(module, name, None), W8A8Linear)]
            if len(layers) == len(names):
                shared = SharedInput(len(layers))
                for layer in layers:
                    layer.inputs = shared
                groups += 1
    return groups


def w8a8_from_codes(codes: Int4Codes | Q8Codes) -> lowbit.W8A8Weight:
    """GGUF codes requantized to int8 per output channel (`lowbit.per_row_int8` of their dequantized values),
    `REQUANTIZE_ROWS` rows at a time: a chunk's float32 is all the float ever held (the head: 2.4 of 113 MB)."""
    out_features, in_features = codes.codes.shape
    int8, scales = torch.empty(out_features, in_features, dtype=torch.int8), torch.empty(out_features)
    for start in range(0, out_features, REQUANTIZE_ROWS):
        chunk = slice(start, start + REQUANTIZE_ROWS)
        int8[chunk], scales[chunk] = lowbit.per_row_int8(codes.rows(chunk).dequantize())
    return lowbit.W8A8Weight(int8, scales)


def linear_from_codes(
    codes: Int4Codes | Q8Codes, bias: torch.Tensor | None, compute: torch.dtype, matmul: str = WEIGHT_ONLY
) -> LowBitLinear:
    """A Linear of GGUF codes. `WEIGHT_ONLY`: exactly, an Int4Codes packed as it is, a Q8Codes as its two int4
    halves, the kernels in `compute` (the input is cast to it, the output back; the bias added in the input's
    dtype). `W8A8`: requantized to int8 per output channel (`w8a8_from_codes`), int8 activations; for calls of
    few rows the weight-only layer that reads the fewest bytes: an Int4Codes packed, a Q8Codes' int8 codes."""
    if matmul != W8A8:
        return packed_from_codes(codes, bias, compute)
    weight = w8a8_from_codes(codes)
    if isinstance(codes, Q8Codes):  # two int4 halves read as many bytes as int8: the int8 codes serve both
        return W8A8Linear(weight, bias, _int8_few_rows(weight.codes, weight.scales, compute))
    return W8A8Linear(weight, bias, packed_from_codes(codes, None, compute))


def packed_from_codes(codes: Int4Codes | Q8Codes, bias: torch.Tensor | None, compute: torch.dtype) -> QuantizedLinear:
    out_features, in_features = codes.codes.shape
    if isinstance(codes, Q8Codes):
        parts = _packed_halves(codes, compute)
    else:
        parts = [lowbit.pack_int4(codes.codes, codes.scales, codes.zeros, GROUP, compute)]
    return QuantizedLinear(parts, bias, in_features, out_features)


def _packed_halves(codes: Q8Codes, compute: torch.dtype) -> list[Part]:
    """A Q8_0 weight's two int4 halves, packed `REQUANTIZE_ROWS` rows at a time and concatenated as packed
    (`lowbit.concat_rows`): a vocabulary-sized table never has an unpacked half beside it (the load's peak:
    benchmarks/NOTES.md)."""
    high: list[Part] = []
    low: list[Part] = []
    for start in range(0, codes.codes.shape[0], REQUANTIZE_ROWS):
        for into, half in zip((high, low), codes.rows(slice(start, start + REQUANTIZE_ROWS)).int4_halves()):
            into.append(lowbit.pack_int4(half.codes, half.scales, half.zeros, GROUP, compute))
    return [lowbit.concat_rows(high), lowbit.concat_rows(low)]


def quantize_linears(model: nn.Module, mode: str, compute: torch.dtype, matmul: str = WEIGHT_ONLY) -> int:
    """Replaces every nn.Linear of a float model by its int8 (per row) or int4 (per 32 inputs) quantization;
    returns how many. Round to nearest; int4 is asymmetric (min..max of each group over the 16 codes). int8
    runs with int8 activations under `W8A8`, with activations in `compute` otherwise; int4 always the latter."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in linears:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, _quantized(linear, mode, compute, matmul))
    share_inputs(model)
    return len(linears)


def _quantized(linear: nn.Linear, mode: str, compute: torch.dtype, matmul: str) -> LowBitLinear:
    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    if mode == "int4":
        return linear_from_codes(quantize_int4(weight), bias, compute)
    if matmul != W8A8:
        return QuantizedLinear([lowbit.quantize_int8(weight, compute)], bias, linear.in_features, linear.out_features)
    codes, scales = lowbit.per_row_int8(weight)
    return W8A8Linear(lowbit.W8A8Weight(codes, scales), bias, _int8_few_rows(codes, scales, compute))


def _int8_few_rows(codes: torch.Tensor, scales: torch.Tensor, compute: torch.dtype) -> QuantizedLinear | None:
    """torch's weight-only int8 kernel on the same codes (shared where the width needs no padding), for calls of
    few rows; None where it would crawl (float32 activations: a scalar loop)."""
    if compute != torch.bfloat16:
        return None
    out_features, in_features = codes.shape
    part = lowbit.Int8Weight(lowbit.pad_int8_columns(codes), scales.to(compute))
    return QuantizedLinear([part], None, in_features, out_features)


def quantize_int4(weight: torch.Tensor) -> Int4Codes:
    """Asymmetric 4-bit per 32 inputs: scale = (max - min) / 15, codes round((w - min) / scale), so w is
    (q - 8) * scale + (min + 8 * scale). The input width is padded with zeros to a multiple of 32."""
    out_features, in_features = weight.shape
    padded = nn.functional.pad(weight.float(), (0, -in_features % GROUP)).reshape(out_features, -1, GROUP)
    low, high = padded.amin(dim=-1), padded.amax(dim=-1)
    scales = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
    codes = torch.round((padded - low[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
    return Int4Codes(codes.reshape(out_features, -1)[:, :in_features], scales, low + 8 * scales)
