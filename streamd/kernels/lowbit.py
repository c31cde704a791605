"""Low-bit weights and their matmuls on the CPU: torch's packed int4 and int8 kernels and its int8 x int8 matmul,
with plain-torch references.

A decode step on the CPU reads every weight once per token, so its speed is the bytes it reads: a 4-bit weight
is an eighth of float32's. torch's CPU build carries weight-only kernels that read the packed codes and
dequantize inside the GEMM (`_weight_int4pack_mm_for_cpu`: group-wise scales and zero points, AVX-512 VNNI
where the CPU has it; `_weight_int8pack_mm`: one scale per output channel); torchao's CPU path wraps these same
kernels. Measured against float32 and bfloat16 GEMMs on this repository's CPU: benchmarks/NOTES.md.

Two layouts, each a record with its dequantization spelled out (what the references compute):

- `Int4Weight`: codes q in 0..15 in groups of `group_size` (32, 64, 128 or 256) along the input dimension,
  w = (q - 8) * scale + zero per (row, group). GGUF's Q4_0 (zero 0) and Q4_1 (w = d*q + m, so zero = m + 8d)
  map onto it exactly, as does any asymmetric 4-bit quantization. torch's packing wants a row count divisible
  by 16: other rows are padded with zeros and sliced off; an input width not divisible by the group is padded
  with zero activations (which add nothing whatever the padded codes are).
- `Int8Weight`: codes q in -128..127 and one scale per row, w = q * scale (symmetric per-channel int8).

GGUF's Q8_0 (w = d * q, one d per 32 inputs) has no kernel of its own here: it runs as two int4 weights
(q = 16*hi + lo, `gguf_weights.Q8Codes.int4_halves`), exact, and faster than looping torch's int8 kernel over
the 32-wide blocks (benchmarks/NOTES.md).

Where the CPU has AVX-512 BF16, few rows of an int4 weight run in C instead (`NativeInt4`, `native/int4_matmul.c`:
the same packed bytes and scales; a code becomes the bfloat16 128 + q by one bit operation, multiplied by
`vdpbf16ps`), 1.2-1.5x torch's kernel, and a Q8_0 weight's two halves are summed before one rounding.

Both of torch's kernels cost the same per row at any row count (they dequantize the weight again for every 4 rows), so a
step with many rows (a prompt chunk, a k+1-token verify, many streams) runs faster as one dequantization and a
dense GEMM: `dequantize_t` unpacks torch's packed layout back to the weight (float32, as the kernels compute
it; nothing else is held), `dense_linear` multiplies by it in the activations' dtype. Where the crossover is:
benchmarks/NOTES.md ("Issue 25, many rows").

W8A8 (`W8A8Weight`, `w8a8_linear`): llama.cpp's way of going wide, int8 activations times int8 weights summed in
int32 (`torch._int_mm`, VNNI on this CPU), whose cost grows far more slowly with the rows than the weight-only
kernels' (576 -> 1536 at 32 rows: 0.41 against 0.71 ms, at 128: 1.4 against 2.1 ms dense; benchmarks/NOTES.md,
"Issue 25, W8A8"). The weight: codes q in -128..127, one float32 scale per output channel, w = q * scale
(`per_row_int8`: round to nearest, so within half a step). The activations: each row as two int8 halves
(`quantize_rows`: x = scale * (hi + lo / 254), scale = max|x| / 127), one `_int_mm` over both halves stacked.
One half alone (plain per-row int8) cost the default model 7% perplexity: a row's outliers (10-20x its RMS)
set a step that rounds its other values coarsely; the low half takes the error to about 15 bits of the row's
largest value, at twice the int8 work. `w8a8_reference` spells the two out in float64.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamd.kernels import native_cpu

INT4_GROUP_SIZES = (32, 64, 128, 256)
_INT4_ROW_MULTIPLE = 16  # torch's CPU int4 packing wants the output rows in a multiple of 16
_PACK_ROWS = 1024  # rows packed at a time (torch's layout is row-block-local: packing 1024-row chunks is the same)
_INT8_COL_MULTIPLE = 32
_TINY = torch.finfo(torch.float32).tiny  # a zero row's scale: its codes stay 0
_LOW = 254.0  # an activation's low int8 half counts 1/254 of its high half's unit


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A packed 4-bit weight [out_features, in_features] (see the module docstring for the layout)."""

    packed: torch.Tensor  # uint8, torch's CPU int4 layout of the (row-padded) codes
    scales_and_zeros: torch.Tensor  # [groups, padded rows, 2] in the activations' dtype: (scale, zero)
    group_size: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype


@dataclass(frozen=True, slots=True)
class Int8Weight:
    codes: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out] in the activations' dtype

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales.dtype


@dataclass(frozen=True, slots=True)
class W8A8Weight:
    """Symmetric per-output-channel int8 for int8 activations (`w8a8_linear`): w = codes * scales."""

    codes: torch.Tensor  # int8 [out, in]; the kernel reads its transposed view (measured faster than a held [in, out])
    scales: torch.Tensor  # float32 [out]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


@dataclass(frozen=True, slots=True)
class Int8Rows:
    """Activation rows as two int8 halves for `w8a8_linear`: x = scales * (codes[:rows] + codes[rows:] / 254)."""

    codes: torch.Tensor  # int8 [2 * rows, in]: the high halves, then the low ones
    scales: torch.Tensor  # float32 [rows, 1]


def pack_int4(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, dtype: torch.dtype
) -> Int4Weight:
    """Packs codes [out, in] (0..15) with per-group scales and zeros [out, in / group_size]."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    out_features, in_features = codes.shape
    groups = -(-in_features // group_size)
    if scales.shape != (out_features, groups) or zeros.shape != scales.shape:
        raise ValueError(f"int4 scales/zeros must be [{out_features}, {groups}], got {tuple(scales.shape)}")
    pad_rows = -out_features % _INT4_ROW_MULTIPLE
    chunks = [_pack_rows(chunk, groups * group_size - in_features) for chunk in _row_chunks(codes, pad_rows)]
    packed = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    pairs = torch.stack([F.pad(scales, (0, 0, 0, pad_rows)), F.pad(zeros, (0, 0, 0, pad_rows))], dim=-1)
    return Int4Weight(packed, pairs.transpose(0, 1).contiguous().to(dtype), group_size, out_features, in_features)


def _row_chunks(codes: torch.Tensor, pad_rows: int) -> list[torch.Tensor]:
    """Codes in chunks of `_PACK_ROWS` rows (the last one padded to a multiple of 16 with code 8): packing a
    chunk at a time keeps the int32 copy that torch's packing wants to a chunk, not the whole weight."""
    chunks = list(codes.split(_PACK_ROWS))
    if pad_rows:
        chunks[-1] = F.pad(chunks[-1], (0, 0, 0, pad_rows), value=8)
    return chunks


def _pack_rows(codes: torch.Tensor, pad_cols: int) -> torch.Tensor:
    wide = codes.to(torch.int32)
    if pad_cols:
        wide = F.pad(wide, (0, pad_cols), value=8)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(wide.contiguous(), 1)


_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


def int4_linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [..., in] @ w.T through torch's CPU int4 kernel (x in float32 or bfloat16). A 2-D contiguous x of a
    weight that needs no padding can take `int4_mm`, the kernel's call alone (a decode step makes ~120)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    padded_in = weight.scales_and_zeros.shape[0] * weight.group_size
    if padded_in != weight.in_features:
        rows = F.pad(rows, (0, padded_in - weight.in_features))
    out = int4_mm(rows.contiguous(), weight)
    if out.shape[1] != weight.out_features:
        out = out[:, : weight.out_features]
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.out_features)


def int4_mm(rows: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """rows [n, in] (contiguous) @ w.T for a weight that `needs_no_padding`: torch's kernel, nothing around it."""
    return _INT4_MM(rows, weight.packed, weight.group_size, weight.scales_and_zeros)


@dataclass(frozen=True, slots=True)
class NativeInt4:
    """The C int4 matmul (`native/int4_matmul.c`) bound to one weight, the sum of its int4 parts (a 4-bit weight,
    or a Q8_0 weight's two halves, summed in float32 and rounded once to bfloat16): bfloat16 rows in, bfloat16 out.
    It reads torch's packed bytes and scales as they are; on a decode step's matmuls it runs 1.2-1.5x torch's
    kernel (benchmarks/NOTES.md, "Issue 25, the int4 matmul in C"). Made by `native_int4`."""

    parts: tuple[Int4Weight, ...]  # held: the pointers below point into them
    packed: ctypes.Array[ctypes.c_void_p]
    scales: ctypes.Array[ctypes.c_void_p]
    kernel: Callable[..., int]  # `native_cpu.int4_matmul()`

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return self.parts[0].out_features

    def __call__(self, rows: torch.Tensor) -> torch.Tensor | None:
        """rows [n, in] bfloat16 (contiguous) @ w.T [n, out] bfloat16; None for other rows (or no memory)."""
        if rows.dtype != torch.bfloat16 or rows.dim() != 2 or rows.shape[1] != self.in_features:
            return None
        if not rows.is_contiguous():
            return None
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.bfloat16)
        group, threads = self.parts[0].group_size, torch.get_num_threads()
        widths = (self.in_features, self.out_features)
        status = self.kernel(self.packed, self.scales, len(self.parts), group, *widths, rows.data_ptr(), rows.shape[0],
                             out.data_ptr(), threads)  # fmt: skip
        return out if status == 0 else None


def native_int4(parts: Sequence[Int4Weight | Int8Weight]) -> NativeInt4 | None:
    """The C matmul for the sum of `parts`, where it runs: this CPU has AVX-512 BF16 and the library built, every
    part is int4 of its own widths (`needs_no_padding`) with bfloat16 scales, the same group size and widths, in
    whole 64-row blocks of torch's packing. None elsewhere (torch's kernels run)."""
    kernel = native_cpu.int4_matmul()
    int4 = [p for p in parts if isinstance(p, Int4Weight)]
    if kernel is None or not int4 or len(int4) != len(parts) or packed_row_block() != 64:
        return None
    first = int4[0]
    shape = (first.group_size, first.in_features, first.out_features)
    if any((p.group_size, p.in_features, p.out_features) != shape for p in int4):
        return None
    if first.out_features % 64 or not all(needs_no_padding(p) for p in int4):
        return None
    if any(p.scales_and_zeros.dtype != torch.bfloat16 for p in int4):
        return None
    pointers = ctypes.c_void_p * len(int4)
    packed = pointers(*(p.packed.data_ptr() for p in int4))
    scales = pointers(*(p.scales_and_zeros.data_ptr() for p in int4))
    return NativeInt4(tuple(int4), packed, scales, kernel)


def needs_no_padding(weight: Int4Weight) -> bool:
    """Whether the packed weight's widths are its own (no input padded to a group, no rows padded for packing)."""
    groups, rows, _ = weight.scales_and_zeros.shape
    return groups * weight.group_size == weight.in_features and rows == weight.out_features


def int4_codes(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `pack_int4` took, back from the packed weight: codes uint8 [out, in] and the per-group scales and
    zeros [out, groups] (as stored). Exact: the packing is a permutation of nibbles."""
    block = packed_row_block()
    if block is None:
        raise RuntimeError("torch's int4 packing has a layout this module does not unpack")
    groups, rows, _ = weight.scales_and_zeros.shape
    codes = _codes_t(weight.packed.reshape(-1), groups * weight.group_size, rows, block).t()
    pairs = weight.scales_and_zeros[:, : weight.out_features].transpose(0, 1)
    codes = codes[: weight.out_features, : weight.in_features].to(torch.uint8)
    return codes, pairs[..., 0], pairs[..., 1]


def int4_rows(weight: Int4Weight, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of the packed weight's codes, uint8 [len(index), in_features]: the packing undone for those
    rows alone (`_codes_t`'s layout), so a table looked up a few rows at a time need not be held unpacked. In C
    where the CPU glue is built (`native_cpu`: one call, ~2 us a row, where the torch reference below costs ~150
    us for one row, a decode step's embedding lookup), else `int4_rows_reference`."""
    ids = index.to(torch.long).reshape(-1).contiguous()
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= weight.out_features):
        raise IndexError(f"row ids must be in [0, {weight.out_features})")
    lib, block = native_cpu.load(), packed_row_block()
    if lib is None or block is None:
        return int4_rows_reference(weight, ids)
    out = torch.empty(len(ids), weight.in_features, dtype=torch.uint8)
    width, rows = weight.scales_and_zeros.shape[0] * weight.group_size, weight.scales_and_zeros.shape[1]
    packed = weight.packed.contiguous()
    lib.int4_rows(packed.data_ptr(), width, rows, block, ids.data_ptr(), len(ids), weight.in_features, out.data_ptr())
    return out


def table_rows(
    parts: Sequence[Int4Weight], index: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int
) -> torch.Tensor | None:
    """Rows `index` of a table whose codes are packed int4 `parts` (one 4-bit weight with float32 `zeros`, or a Q8_0
    weight's high and low halves, zeros None), dequantized to float32 in one C call (`cpu_decode.c`'s
    `table_rows`: a decode step's embedding lookup, ~15 torch operators otherwise); None where the library or the
    packing is not at hand (then `int4_rows` and the formats' own dequantization give the same floats)."""
    lib, block = native_cpu.load(), packed_row_block()
    floats = [scales] if zeros is None else [scales, zeros]
    if lib is None or block is None or len(parts) != (2 if zeros is None else 1):
        return None
    if not all(t.is_contiguous() for t in [*floats, *(p.packed for p in parts)]):
        return None
    if any(t.dtype != torch.float32 for t in floats):
        return None
    ids = index.to(torch.long).reshape(-1).contiguous()
    first = parts[0]
    out = torch.empty(len(ids), first.in_features, dtype=torch.float32)
    packed = (ctypes.c_void_p * len(parts))(*(p.packed.data_ptr() for p in parts))
    width, rows = first.scales_and_zeros.shape[0] * first.group_size, first.scales_and_zeros.shape[1]
    zero_ptr = None if zeros is None else zeros.data_ptr()
    status = lib.table_rows(packed, len(parts), width, rows, block, ids.data_ptr(), len(ids), first.out_features,
                            first.in_features, scales.data_ptr(), zero_ptr, group, out.data_ptr())  # fmt: skip
    if status != 0:
        raise IndexError(f"row ids must be in [0, {first.out_features})")
    return out


def int4_rows_reference(weight: Int4Weight, index: torch.Tensor) -> torch.Tensor:
    """`int4_rows` in torch operators."""
    block = packed_row_block()
    if block is None:
        raise RuntimeError("torch's int4 packing has a layout this module does not unpack")
    groups, rows, _ = weight.scales_and_zeros.shape
    width, full, half = groups * weight.group_size, rows // block * block, block // 2
    flat, ids = weight.packed.reshape(-1), index.to(torch.long).reshape(-1)
    out = torch.empty(len(ids), width, dtype=torch.uint8)
    in_blocks = ids < full
    if bool(in_blocks.any()):
        r = ids[in_blocks]
        data = flat[: full * width // 2].view(full // block, width, half)[r // block, :, r % half]
        out[in_blocks] = (data >> ((r % block >= half).to(torch.uint8) * 4)[:, None]) & 15
    if not bool(in_blocks.all()):
        r = ids[~in_blocks] - full
        data = flat[full * width // 2 :].view(width, (rows - full) // 2)[:, r // 2].t()
        out[~in_blocks] = (data >> ((r % 2).to(torch.uint8) * 4)[:, None]) & 15
    return out[:, : weight.in_features]


def concat_rows(weights: Sequence[Int4Weight | Int8Weight]) -> Int4Weight | Int8Weight:
    """One weight whose output rows are the weights' rows in turn (q, k and v as one matmul; a large table packed a
    slice at a time): the same codes and scales, so every output row is computed as it was by its own weight
    (tested bit for bit). The weights share a layout, an input width and, for int4, a group size. torch's int4
    packing is local to blocks of rows: weights of whole blocks (all but the last) concatenate as packed; others
    are unpacked and packed again."""
    first = weights[0]
    if any(type(w) is not type(first) or w.compute_dtype != first.compute_dtype for w in weights):
        raise ValueError("weights of different layouts or dtypes do not concatenate")
    if isinstance(first, Int8Weight):
        int8 = [w for w in weights if isinstance(w, Int8Weight)]
        return Int8Weight(torch.cat([w.codes for w in int8]), torch.cat([w.scales for w in int8]))
    int4 = [w for w in weights if isinstance(w, Int4Weight)]
    if any((w.in_features, w.group_size) != (first.in_features, first.group_size) for w in int4):
        raise ValueError("int4 weights of different widths or group sizes do not concatenate")
    if all(_whole_blocks(w) for w in int4[:-1]):
        packed, pairs = torch.cat([w.packed for w in int4]), torch.cat([w.scales_and_zeros for w in int4], dim=1)
        return Int4Weight(packed, pairs, first.group_size, sum(w.out_features for w in int4), first.in_features)
    codes, scales, zeros = zip(*(int4_codes(w) for w in int4))
    return pack_int4(torch.cat(codes), torch.cat(scales), torch.cat(zeros), first.group_size, first.compute_dtype)


def _whole_blocks(weight: Int4Weight) -> bool:
    """Whether the weight's packed rows are whole blocks of torch's packing, none of them padding."""
    block = packed_row_block()
    rows = weight.scales_and_zeros.shape[1]
    return block is not None and rows == weight.out_features and rows % block == 0


def dequantize_t(weight: Int4Weight | Int8Weight) -> torch.Tensor:
    """The weight transposed, [padded in, padded out] float32, from its packed form: w = (q - 8) * scale + zero
    as q * scale + (zero - 8 * scale) (the scales as stored, in the activations' dtype), or q * scale (int8)."""
    if isinstance(weight, Int8Weight):
        return (weight.codes.float() * weight.scales.float()[:, None]).t()
    block = packed_row_block()
    if block is None:
        raise RuntimeError("torch's int4 packing has a layout this module does not unpack")
    groups, rows, _ = weight.scales_and_zeros.shape
    width = groups * weight.group_size
    codes = _codes_t(weight.packed.reshape(-1), width, rows, block)
    scales, zeros = weight.scales_and_zeros.float().unsqueeze(1).unbind(-1)  # [groups, 1, rows] each
    grouped = codes.view(groups, weight.group_size, rows)
    torch.addcmul(zeros - 8 * scales, grouped, scales.contiguous(), out=grouped)  # contiguous: the vector path
    return codes


def dense_linear(x: torch.Tensor, parts: Sequence[Int4Weight | Int8Weight], shape: tuple[int, int]) -> torch.Tensor:
    """x [..., in] @ (sum of the parts' weights [out, in] = `shape`).T through one dequantization (summed in
    float32, rounded once to x's dtype) and one dense matmul in x's dtype."""
    weight = dequantize_t(parts[0])
    for part in parts[1:]:
        weight += dequantize_t(part)
    out_features, in_features = shape
    return x @ weight[:in_features, :out_features].to(x.dtype)


def _codes_t(packed: torch.Tensor, width: int, rows: int, block: int) -> torch.Tensor:
    """torch's CPU int4 packing undone, transposed: float32 codes [width, rows]. Rows come in blocks of `block`
    (64 on AVX-512 builds, 32 on AVX2), each stored as [width, block / 2] bytes: low nibble row j, high nibble row
    j + block / 2; a last block of fewer rows stores rows 2j (low) and 2j + 1 (high)."""
    out = torch.empty(width, rows)
    full, half = rows // block * block, block // 2
    if full:
        blocks = packed[: full * width // 2].view(full // block, width, half)
        into = out[:, :full].unflatten(1, (full // block, 2, half))
        into[:, :, 0].copy_((blocks & 15).transpose(0, 1))  # the nibbles first, on contiguous bytes: faster
        into[:, :, 1].copy_((blocks >> 4).transpose(0, 1))
    if rows > full:
        tail = packed[full * width // 2 :].view(width, (rows - full) // 2)
        pairs = out[:, full:].unflatten(1, (-1, 2))
        pairs[..., 0].copy_(tail & 15)
        pairs[..., 1].copy_(tail >> 4)
    return out


@functools.cache
def packed_row_block() -> int | None:
    """The row block of torch's int4 packing on this build (64: AVX-512, 32: AVX2), found by packing a probe
    (a full block and a 16-row tail) and unpacking it; None for a layout `_codes_t` does not know."""
    codes = torch.randint(0, 16, (80, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = _pack_rows(codes, 0).reshape(-1)
    for block in (64, 32):
        if torch.equal(_codes_t(packed, 64, 80, block).t(), codes.float()):
            return block
    return None


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """Symmetric per-row int8 of a float weight [out, in] (`per_row_int8`). The input width is padded with zero
    codes to a multiple of 32 (torch's bfloat16 kernel crashes on others)."""
    codes, scales = per_row_int8(weight)
    return Int8Weight(pad_int8_columns(codes), scales.to(dtype))


def pad_int8_columns(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in] with zero columns up to a multiple of 32 (the codes themselves where none is needed)."""
    pad = -codes.shape[1] % _INT8_COL_MULTIPLE
    return F.pad(codes, (0, pad)) if pad else codes


def per_row_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [out, in] and float32 scales [out] with w ~ codes * scale: scale = max|w| / 127 per row (a zero
    row keeps scale 1), round to nearest, so |w - codes * scale| <= scale / 2."""
    absmax = weight.float().abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    codes = torch.round(weight.float() / scales[:, None]).clamp_(-128, 127).to(torch.int8)
    return codes, scales


def quantize_rows(x: torch.Tensor) -> Int8Rows:
    """Activation rows [rows, in] as two int8 halves: scale = max|x| / 127 per row, hi = round(x / scale), lo =
    round((x / scale - hi) * 254) (in -127..127, as |x / scale - hi| <= 1/2), so x is within scale / 508 of
    scale * (hi + lo / 254): about 15 bits of the row's largest value. One half alone lets an outlier's scale
    swamp the row's other values (the default model's perplexity +7%: benchmarks/NOTES.md, "Issue 25, W8A8")."""
    rows = x if x.dtype == torch.float32 else x.float()
    count = rows.shape[0]
    scales = rows.abs().amax(dim=1, keepdim=True).div_(127.0).clamp_min_(_TINY)
    scaled = torch.div(rows, scales)
    high = scaled.round()
    codes = torch.empty(2 * count, rows.shape[1], dtype=torch.int8)
    codes[:count].copy_(high)
    codes[count:].copy_(scaled.sub_(high).mul_(_LOW).round_())
    return Int8Rows(codes, scales)


def w8a8_linear(rows: Int8Rows, weight: W8A8Weight, dtype: torch.dtype) -> torch.Tensor:
    """rows @ w.T: both halves' int8 x int8 products summed in int32 by one `torch._int_mm` (VNNI where the CPU
    has it), joined and scaled by the row's and the channel's scales in float32; returned in `dtype`."""
    count = rows.scales.shape[0]
    sums = torch._int_mm(rows.codes, weight.codes.t())
    out = sums[count:].mul(1 / _LOW).add_(sums[:count]).mul_(rows.scales).mul_(weight.scales)
    return out if dtype == torch.float32 else out.to(dtype)


def int8_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[1] != weight.codes.shape[1]:
        rows = F.pad(rows, (0, weight.codes.shape[1] - rows.shape[1]))
    out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), weight.codes, weight.scales)
    return out.reshape(*lead, weight.codes.shape[0])


# ---- plain-torch references (float32 arithmetic on the dequantized weight) ----------------------------------
def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """w = (q - 8) * scale + zero, per (row, group), in float32 [out, in]."""
    expand = torch.arange(codes.shape[1], device=codes.device) // group_size
    return (codes.float() - 8) * scales.float()[:, expand] + zeros.float()[:, expand]


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight.float())


def w8a8_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`quantize_rows` then `w8a8_linear` spelled out: each row of x [rows, in] rounded to scale * (hi + lo / 254)
    with scale = max|x| / 127 (the rounding decided in float32, as `quantize_rows` decides it), then multiplied
    in float64 (exact sums) by the weight codes [out, in] * scales [out]."""
    rows = x.float()
    step = rows.abs().amax(dim=1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    high = torch.round(rows / step)
    low = torch.round((rows / step - high) * 254)
    rounded = (high.double() + low.double() / 254) * step.double()
    return F.linear(rounded, codes.double() * scales.double()[:, None])
