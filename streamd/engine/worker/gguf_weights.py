"""GGUF tensors decoded as they are stored: 4-bit and 8-bit blocks stay codes and scales, never float32.

llama.cpp's block formats are affine in their codes, so several map exactly onto the low-bit layouts of
`streamd.kernels.lowbit` (w = (q - 8) * scale + zero per 32 inputs):

| GGUF | block | as stored | here |
|---|---|---|---|
| Q4_0 | 32 | w = d * (q - 8) | `Int4Codes`: scale d, zero 0 |
| Q4_1 | 32 | w = d * q + m | `Int4Codes`: scale d, zero m + 8d |
| Q4_K | 256 = 8 x 32 | w = d * sc_j * q - dmin * m_j (6-bit) | `Int4Codes`: scale d*sc_j, zero 8d*sc_j - dmin*m_j |
| Q8_0 | 32 | w = d * q, q int8 | `Q8Codes` (two int4 halves at matmul time: q = 16*hi + lo, exact) |
| F32 / F16 / BF16 | - | floats | a float tensor in its own dtype |
| anything else (Q5_*, Q6_K, Q2_K, Q3_K, IQ*) | | | dequantized by gguf-py at load to the model's dtype |

"Exactly" holds in real arithmetic: the scales are stored as float16 in the file and the kernels read them in
the activations' dtype (bfloat16 on the CPU, whose 8-bit mantissa rounds a float16 scale; tests state the
tolerance). The decoding is numpy on the file's memory map, one tensor at a time, so loading holds the file's
bytes plus one tensor's codes at most.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as GGML

from streamd.kernels import lowbit

GROUP = 32  # every block format here has 32 inputs per scale


@dataclass(frozen=True, slots=True)
class Int4Codes:
    """4-bit codes [out, in] (uint8, 0..15) with float32 scales and zeros [out, in / 32]: w = (q-8)*scale + zero."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def rows(self, index: torch.Tensor | slice) -> Int4Codes:
        return Int4Codes(self.codes[index], self.scales[index], self.zeros[index])

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` dequantized to float32 (an embedding's lookup)."""
        return self.rows(index).dequantize()

    def dequantize(self) -> torch.Tensor:
        return lowbit.dequantize_int4(self.codes, self.scales, self.zeros, GROUP)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.zeros.nbytes


@dataclass(frozen=True, slots=True)
class Q8Codes:
    """int8 codes [out, in] with float32 scales [out, in / 32]: w = scale * q (GGUF's Q8_0)."""

    codes: torch.Tensor
    scales: torch.Tensor

    def rows(self, index: torch.Tensor | slice) -> Q8Codes:
        return Q8Codes(self.codes[index], self.scales[index])

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` dequantized to float32 (an embedding's lookup)."""
        return self.rows(index).dequantize()

    def dequantize(self) -> torch.Tensor:
        rows, width = self.codes.shape
        return (self.codes.float().view(rows, -1, GROUP) * self.scales[:, : width // GROUP, None]).view(rows, width)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def int4_halves(self) -> Iterator[Int4Codes]:
        """q = 16*hi + lo (hi = q >> 4 in -8..7, lo = q & 15): w = (hi+8 - 8) * 16d + (lo - 8) * d + 8d. One
        at a time, in int8 arithmetic (>> is arithmetic on int8): a vocabulary-sized table is copied once."""
        yield Int4Codes((self.codes >> 4).add_(8).view(torch.uint8), self.scales * 16, torch.zeros_like(self.scales))
        yield Int4Codes((self.codes & 15).view(torch.uint8), self.scales, self.scales * 8)


Decoded = Int4Codes | Q8Codes | torch.Tensor
BLOCK_FORMATS = (Int4Codes, Q8Codes)  # what `decode` keeps low-bit


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes are in the file, and how they are laid out."""

    name: str
    kind: GGML
    shape: tuple[int, ...]  # as torch orders it: [out, in] for a 2-D weight (GGUF lists [in, out])
    offset: int  # from the file's start

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.kind]
        return int(np.prod(self.shape)) // block * size

    @property
    def low_bit(self) -> bool:
        """Whether `decode` keeps this tensor as codes (`BLOCK_FORMATS`) rather than floats."""
        return self.kind in _DECODERS


def read(path: Path, info: TensorInfo) -> np.ndarray:
    """One tensor's bytes, read (not memory-mapped: mapped pages of the whole file would stay resident)."""
    return np.fromfile(path, dtype=np.uint8, count=info.nbytes, offset=info.offset)


def decode(raw: np.ndarray, info: TensorInfo) -> Decoded:
    """One tensor as stored (see the module docstring), from its bytes (`read`)."""
    rows = int(np.prod(info.shape[:-1]))
    if info.kind in _DECODERS:
        return _DECODERS[info.kind](raw.reshape(rows, -1))
    if info.kind in _FLOATS:
        return torch.from_numpy(raw.view(_FLOATS[info.kind]).reshape(info.shape).copy())
    if info.kind == GGML.BF16:
        return torch.from_numpy(raw.view(np.int16).reshape(info.shape).copy()).view(torch.bfloat16)
    return torch.from_numpy(quants.dequantize(raw.reshape(rows, -1), info.kind).reshape(info.shape))


_FLOATS = {GGML.F32: np.float32, GGML.F16: np.float16}


# ---- the file's index: header, metadata (skipped, but for the alignment), tensor infos --------------------
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_index(path: Path) -> tuple[dict[str, object], list[TensorInfo]]:
    """The scalar metadata (arrays skipped: the vocabulary is transformers' business) and the tensor infos,
    read straight from the header: gguf-py's reader parses every vocabulary string into numpy views first
    (about 10 s for the default model's 49,152 tokens and merges on a 2-core machine)."""
    with path.open("rb") as fh:
        magic, version, n_tensors, n_fields = struct.unpack("<4sIQQ", fh.read(24))
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF v2+ file")
        fields = dict(_field(fh) for _ in range(n_fields))
        infos = [_tensor_info(fh) for _ in range(n_tensors)]
        alignment = int(fields.get("general.alignment", 32))  # type: ignore[call-overload]
        start = -(-fh.tell() // alignment) * alignment
    return fields, [TensorInfo(i.name, i.kind, i.shape, start + i.offset) for i in infos]


def _field(fh: BinaryIO) -> tuple[str, object]:
    key = _string(fh)
    (kind,) = struct.unpack("<I", fh.read(4))
    return key, _value(fh, kind)


def _value(fh: BinaryIO, kind: int) -> object:
    if kind == _STRING:
        return _string(fh)
    if kind == _ARRAY:  # skipped: strings and nested arrays item by item, scalars in one seek
        item, count = struct.unpack("<IQ", fh.read(12))
        if item in (_STRING, _ARRAY):
            for _ in range(count):
                _value(fh, item)
        else:
            fh.seek(struct.calcsize("<" + _SCALARS[item]) * count, 1)
        return None
    fmt = "<" + _SCALARS[kind]
    return struct.unpack(fmt, fh.read(struct.calcsize(fmt)))[0]


def _string(fh: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", fh.read(8))
    return fh.read(length).decode("utf-8", errors="replace")


def _tensor_info(fh: BinaryIO) -> TensorInfo:
    name = _string(fh)
    (n_dims,) = struct.unpack("<I", fh.read(4))
    dims = struct.unpack(f"<{n_dims}Q", fh.read(8 * n_dims))
    kind, offset = struct.unpack("<IQ", fh.read(12))
    return TensorInfo(name, GGML(kind), tuple(int(d) for d in reversed(dims)), offset)


def _f16(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The float16 at byte offset `at` of every block, as float32 [rows, blocks]."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 codes: the low nibbles are the block's first 16 values, the high ones the rest."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(raw: np.ndarray) -> Int4Codes:
    blocks = raw.reshape(raw.shape[0], -1, 18)
    d = _f16(blocks, 0)
    codes = torch.from_numpy(_nibbles(blocks[..., 2:]).reshape(raw.shape[0], -1))
    return Int4Codes(codes, d, torch.zeros_like(d))


def _q4_1(raw: np.ndarray) -> Int4Codes:
    blocks = raw.reshape(raw.shape[0], -1, 20)
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    codes = torch.from_numpy(_nibbles(blocks[..., 4:]).reshape(raw.shape[0], -1))
    return Int4Codes(codes, d, m + 8 * d)


def _q8_0(raw: np.ndarray) -> Q8Codes:
    blocks = raw.reshape(raw.shape[0], -1, 34)
    codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(raw.shape[0], -1))
    return Q8Codes(codes, _f16(blocks, 0))


def _q4_k(raw: np.ndarray) -> Int4Codes:
    """Super-blocks of 256: d, dmin (f16), 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of codes in
    four 64-value chunks (each chunk: 32 low nibbles, then their 32 high nibbles)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 144)
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    sc, mn = (torch.from_numpy(a.astype(np.float32)) for a in _k_scale_mins(blocks[..., 4:16]))
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)
    codes = torch.from_numpy(np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1))
    scales = (d * sc).reshape(rows, -1)
    return Int4Codes(codes, scales, 8 * scales - (dmin * mn).reshape(rows, -1))


def _k_scale_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for j = 0..7: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    (mins); 4-7 in bytes 8-11's nibbles with their top two bits in the high bits of bytes 0-3 / 4-7."""
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales, mins


_DECODERS: dict[GGML, Callable[[np.ndarray], Int4Codes | Q8Codes]] = {
    GGML.Q4_0: _q4_0,
    GGML.Q4_1: _q4_1,
    GGML.Q4_K: _q4_k,
    GGML.Q8_0: _q8_0,
}
