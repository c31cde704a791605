"""NativeDecode: a fused CPU model's decode steps with the work between the matmuls in C (`kernels/native_cpu`).

`model.fuse_layers = "native"` (what `auto` picks on the CPU for a low-bit Llama-family model where a C compiler
is at hand) is the `cpu` mode's path whose decode steps, speculative verifies and short prompt chunks (at most
`MAX_QUERY_ROWS` in the step, each query token a row: `row_view`) run here: per layer four matmuls (the low-bit
layers' own kernel choice) and three C calls (residual add + RMSNorm; rotary, K/V store and paged attention, its
(row, KV head) pairs on torch's threads; SiLU-and-mul), instead of ~45 torch operators; where all four matmuls
run in C (`lowbit.NativeInt4`, AVX-512 BF16) the layer is one C call (`decode_layer`: the same calls, in C).
It reads float32 pools and int8 ones (`cache.kv_cache_dtype = "int8"`: a quarter of the bytes, which is what a
long context's step is bound by here). Longer prompt chunks, steps over more context (`MAX_CONTEXT_TOKENS`) and
pools this path does not read (float8, a window pool) take the `cpu` path's torch operators (`takes`). The
arithmetic is transformers' in float32 in the same order; sums round in another order, so logits differ from the
torch path in the last bits (tests bound them).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from streamd.engine.worker.attention import AttentionMetadata, query_token_lens, query_token_tables
from streamd.engine.worker.quantized import NATIVE_DENSE_ROWS, QuantizedLinear
from streamd.kernels import lowbit, native_cpu


class Norm(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def variance_epsilon(self) -> float: ...


class FusedLayer(Protocol):
    """What this reads of `fusion.FusedLayer` (fusion imports this module: no import back)."""

    @property
    def layer_idx(self) -> int: ...
    @property
    def scale(self) -> float: ...
    @property
    def qkv_sizes(self) -> tuple[int, int, int]: ...
    @property
    def qkv_proj(self) -> nn.Module: ...
    @property
    def o_proj(self) -> nn.Module: ...
    @property
    def gate_up_proj(self) -> nn.Module: ...
    @property
    def down_proj(self) -> nn.Module: ...
    @property
    def input_layernorm(self) -> Norm: ...
    @property
    def post_attention_layernorm(self) -> Norm: ...
    @property
    def q_norm(self) -> Norm | None: ...


class FusedDecoder(Protocol):
    """What this reads of `fusion.FusedDecoder`."""

    @property
    def layers(self) -> nn.ModuleList: ...
    @property
    def norm(self) -> Norm: ...


# Context tokens (summed over the step's sequences) up to which a decode step runs here. With the C attention on
# one thread, torch's SDPA on every core won past ~4,096 (1 x 1,500 tokens even, 4 x 1,500 1.37x slower); with
# its (row, KV head) pairs on torch's threads the C path won at every size measured, up to 16 x ~1,500 tokens
# (2 threads: 1 x 2,250 1.33x faster, 4 x 2,250 1.23x, 16 x 1,500 2.2x; benchmarks/NOTES.md). Past what was
# measured the torch path runs.
MAX_CONTEXT_TOKENS = 32768
# The rows (query tokens) up to which a step with more than one query token a sequence (a speculative verify, a
# prompt chunk) runs here, each query token a row of its own over its own prefix (`row_view`): below the rows at
# which the layers' matmuls go dense (`quantized.NATIVE_DENSE_ROWS`) both paths run the same C matmul, and the C
# between the matmuls is what differs (one-request prefills, alternating: 32 tokens 74 -> 54 ms, 96 tokens 171 ->
# 159 ms; benchmarks/NOTES.md, "Issue 25, nineteenth session"); `MAX_CONTEXT_TOKENS` bounds the rows' reading.
MAX_QUERY_ROWS = NATIVE_DENSE_ROWS


@dataclass(frozen=True, slots=True)
class NativeLayer:
    # the low-bit layers' `matmul`s (bfloat16 rows in and out: their kernel choice, no dtype casts, no bias)
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    norm: torch.Tensor  # the input norm's weight (float32)
    eps: float
    post_norm: torch.Tensor
    post_eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    index: int
    intermediate: int  # the MLP's width (SiLU-and-mul's output)
    # the whole layer as one C call (`decode_layer`), where all four matmuls run in C (`lowbit.NativeInt4`)
    whole: LayerArgs | None = None


def unsupported_reason(decoder: FusedDecoder) -> str | None:
    """Why this decoder's decode steps cannot run natively (None: they can)."""
    reason = native_cpu.unavailable_reason()
    if reason is not None:
        return reason
    layers = _layers(decoder)
    for layer in layers:
        if layer.q_norm is not None:
            return "its layers normalise q and k per head (Qwen3)"
        linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        if not all(_bf16_low_bit(m) for m in linears):
            return "a projection is not a weight-only low-bit layer without bias computed in bfloat16"
    norms = [decoder.norm.weight] + [n.weight for layer in layers for n in _norms(layer)]
    if any(w.dtype != torch.float32 for w in norms):
        return "its norms are not float32"
    return None


def _bf16_low_bit(module: nn.Module) -> bool:
    return (
        isinstance(module, QuantizedLinear)
        and module.bias is None
        and all(p.compute_dtype == torch.bfloat16 for p in module.parts)
    )


def _norms(layer: FusedLayer) -> tuple[Norm, Norm]:
    return layer.input_layernorm, layer.post_attention_layernorm


def _layers(decoder: FusedDecoder) -> list[FusedLayer]:
    return cast("list[FusedLayer]", list(decoder.layers))


class NativeDecode:
    """The decode loop over a `FusedDecoder`'s layers (built once, after fusing)."""

    def __init__(self, decoder: FusedDecoder) -> None:
        lib = native_cpu.load()
        assert lib is not None, "NativeDecode needs the library (unsupported_reason first)"
        self.lib = lib
        self.layers = [_native_layer(layer) for layer in _layers(decoder)]
        self.final_norm = decoder.norm.weight
        self.final_eps = float(decoder.norm.variance_epsilon)
        self.dim = int(self.final_norm.shape[0])
        # after layer i: layer i + 1's input norm, after the last the final norm
        self.next_norms = [(n.norm, n.eps) for n in self.layers[1:]] + [(self.final_norm, self.final_eps)]
        # where every layer is one C call: each call's constant arguments (its layer, the next norm and its eps)
        wholes = [layer.whole for layer in self.layers]
        self.whole_calls = [
            (ctypes.byref(whole), weight.data_ptr(), eps)
            for whole, (weight, eps) in zip(wholes, self.next_norms)
            if whole is not None
        ]
        self.whole = len(self.whole_calls) == len(self.layers)

    @staticmethod
    def takes(md: AttentionMetadata, rows: int, dtype: torch.dtype) -> bool:
        """Whether this step runs here: a decode step, or a step of at most MAX_QUERY_ROWS query tokens (speculative
        verifies, prompt chunks), the rows' attention over at most MAX_CONTEXT_TOKENS in all, in a float32 pool of
        its own or an int8 one (`cache.kv_cache_dtype = "int8"`)."""
        if not (
            md.planned_on_cpu
            and dtype == torch.float32
            and md.layer_slots is None
            and (md.kv_cache.dtype, md.kv_scales is None) in ((torch.float32, True), (torch.int8, False))
            and md.kv_cache.stride(-1) == 1
        ):
            return False
        if md.decode_only:
            return int(md.seq_lens.sum()) <= MAX_CONTEXT_TOKENS
        queries = md.query_start_loc.diff()
        return (
            int(md.query_start_loc[-1]) == rows <= MAX_QUERY_ROWS
            and int((queries * md.seq_lens).sum()) <= MAX_CONTEXT_TOKENS
        )

    def run(self, md: AttentionMetadata, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden [rows, dim] (the embeddings) -> the final norm's output [rows, dim], storing each layer's K/V.
        Each layer's last call adds its MLP's output to the residual and norms it for the next layer (the final
        norm after the last, in float32)."""
        lib, rows, dim, first = self.lib, hidden.shape[0], self.dim, self.layers[0]
        residual = hidden.to(torch.float32, copy=True).contiguous()
        x = torch.empty(rows, dim, dtype=torch.bfloat16)
        out = torch.empty(rows, dim, dtype=torch.float32)
        step = _Step.of(md, cos, sin, first, residual, x)
        a = step.args
        lib.add_rmsnorm(rows, dim, a.residual, None, 0, first.norm.data_ptr(), first.eps, a.x, None)
        if self.whole:
            step.add_matmul_outputs(cast(LayerArgs, first.whole))
            self._run_whole(a, out)
            return out
        for layer, (weight, eps) in zip(self.layers, self.next_norms):
            qkv = layer.qkv(x)
            lib.rope_store_attend(rows, layer.heads, layer.kv_heads, layer.head_dim, qkv.data_ptr(), qkv.stride(0),
                                  a.cos, a.sin, a.pool, a.pool_strides, a.pool_scales, a.scale_strides,
                                  layer.index, a.slots, a.block_tables, a.table_width, a.seq_lens, a.page,
                                  layer.scale, a.threads, a.scratch, a.attn)  # fmt: skip
            o = layer.o(step.attn)
            lib.add_rmsnorm(rows, dim, a.residual, o.data_ptr(), o.stride(0), layer.post_norm.data_ptr(),
                            layer.post_eps, a.x, None)  # fmt: skip
            gate_up = layer.gate_up(x)
            lib.silu_and_mul(rows, layer.intermediate, gate_up.data_ptr(), gate_up.stride(0), a.act)
            down = layer.down(step.act)
            last = weight is self.final_norm
            lib.add_rmsnorm(rows, dim, a.residual, down.data_ptr(), down.stride(0), weight.data_ptr(), eps,
                            None if last else a.x, out.data_ptr() if last else None)  # fmt: skip
        return out

    def _run_whole(self, step: StepArgs, out: torch.Tensor) -> None:
        """Each layer in one C call (`decode_layer`), the last writing the final norm's output into `out`."""
        step_ref, last = ctypes.byref(step), len(self.whole_calls) - 1
        for i, (layer, weight, eps) in enumerate(self.whole_calls):
            if self.lib.decode_layer(layer, step_ref, weight, eps, out.data_ptr() if i == last else None):
                raise MemoryError("the C int4 matmul found no memory for its scratch")


@dataclass(slots=True)
class _Step:
    """What one step's layers share: `StepArgs` (the rows' pool and sequence arguments, the residual stream and
    the buffers every layer reuses, pointers taken once), and the tensors behind its pointers."""

    args: StepArgs
    held: list[Any]  # what the pointers point into, kept alive for the step
    attn: torch.Tensor  # [rows, heads x head_dim] bfloat16: the attention's output, the o matmul's input
    act: torch.Tensor  # [rows, intermediate] bfloat16: SiLU-and-mul's output, the down matmul's input

    @classmethod
    def of(
        cls, md: AttentionMetadata, cos: torch.Tensor, sin: torch.Tensor, layer: NativeLayer, residual: torch.Tensor,
        x: torch.Tensor,
    ) -> _Step:  # fmt: skip
        """`residual` [rows, dim] float32 and `x` [rows, dim] bfloat16: the stream and each layer's normed input."""
        pool, rows = md.kv_cache, cos.shape[0]
        cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
        slots = md.slot_mapping.to(torch.int64).contiguous()
        tables, lens = row_view(md)
        group, threads = layer.heads // layer.kv_heads, torch.get_num_threads()
        scratch = torch.empty(threads * group * (int(lens.max()) + 2 * layer.head_dim), dtype=torch.float32)
        attn = torch.empty(rows, layer.heads * layer.head_dim, dtype=torch.bfloat16)
        act = torch.empty(rows, layer.intermediate, dtype=torch.bfloat16)
        strides, scales, scale_strides = pool_pointers(md)
        args = StepArgs(
            rows=rows, dim=x.shape[1], threads=threads, table_width=tables.shape[1], page=int(pool.shape[4]),
            cos=cos.data_ptr(), sin=sin.data_ptr(), pool=pool.data_ptr(), pool_strides=ctypes.addressof(strides),
            pool_scales=scales, scale_strides=ctypes.addressof(scale_strides), slots=slots.data_ptr(),
            block_tables=tables.data_ptr(), seq_lens=lens.data_ptr(), scratch=scratch.data_ptr(),
            residual=residual.data_ptr(), x=x.data_ptr(), attn=attn.data_ptr(), act=act.data_ptr(),
        )  # fmt: skip
        held = [cos, sin, slots, tables, lens, scratch, strides, scale_strides, residual, x, attn, act]
        return cls(args, held, attn, act)

    def add_matmul_outputs(self, layer: LayerArgs) -> None:
        """A bfloat16 output for each of `decode_layer`'s four matmuls (every layer reusing them)."""
        for name in ("qkv", "o", "gate_up", "down"):
            buffer = torch.empty(self.args.rows, getattr(layer, name).out_features, dtype=torch.bfloat16)
            self.held.append(buffer)
            setattr(self.args, name, buffer.data_ptr())


class Int4Args(ctypes.Structure):
    """`cpu_decode.c`'s Int4Args: one matmul's `lowbit.NativeInt4`."""

    _fields_ = [("packed", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("parts", ctypes.c_int),
                ("group", ctypes.c_int), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64)]  # fmt: skip

    @classmethod
    def of(cls, native: lowbit.NativeInt4) -> Int4Args:
        pointers = (ctypes.cast(native.packed, ctypes.c_void_p), ctypes.cast(native.scales, ctypes.c_void_p))
        return cls(*pointers, len(native.parts), native.parts[0].group_size, native.in_features, native.out_features)


class LayerArgs(ctypes.Structure):
    """`cpu_decode.c`'s LayerArgs: one layer's constants for `decode_layer`."""

    _fields_ = [("qkv", Int4Args), ("o", Int4Args), ("gate_up", Int4Args), ("down", Int4Args),
                ("post_norm", ctypes.c_void_p), ("post_eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("index", ctypes.c_int), ("intermediate", ctypes.c_int)]  # fmt: skip


class StepArgs(ctypes.Structure):
    """`cpu_decode.c`'s StepArgs: one step's sequences, pool, stream and buffers for `decode_layer`."""

    _ints = ("rows", "dim", "threads", "table_width", "page")
    _pointers = ("cos", "sin", "pool", "pool_strides", "pool_scales", "scale_strides", "slots", "block_tables",
                 "seq_lens", "scratch", "residual", "x", "qkv", "attn", "o", "gate_up", "act", "down")  # fmt: skip
    _fields_ = [(name, ctypes.c_int) for name in _ints] + [(name, ctypes.c_void_p) for name in _pointers]


Strides = ctypes.Array[ctypes.c_int64]


def pool_pointers(md: AttentionMetadata) -> tuple[Strides, int | None, Strides]:
    """The pool as `cpu_decode.c` takes it: its strides (block, layer, k|v, head, offset), and an 8-bit pool's scales
    (None: a float32 pool) and their strides."""
    strides = (ctypes.c_int64 * 5)(*md.kv_cache.stride()[:5])
    scales = md.kv_scales
    if scales is None:
        return strides, None, (ctypes.c_int64 * 5)()
    return strides, scales.data_ptr(), (ctypes.c_int64 * 5)(*scales.stride())


def _layer_args(
    modules: tuple[QuantizedLinear, ...], post: Norm, scale: float, shape: tuple[int, ...]
) -> LayerArgs | None:
    """`decode_layer`'s constants for a layer (`shape`: heads, KV heads, head_dim, index, intermediate), or None
    where one of its matmuls does not run in C."""
    natives = [m.native for m in modules if m.native is not None]
    if len(natives) != len(modules):
        return None
    matmuls = [Int4Args.of(n) for n in natives]
    return LayerArgs(*matmuls, post.weight.data_ptr(), float(post.variance_epsilon), scale, *shape)


def row_view(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token as a row of its own: its sequence's block table (int32 [tokens, width]) and the context it
    attends over (int32 [tokens]), its own position + 1, so that the C attention, which stores every row's K/V
    before any row attends, is causal within a sequence's query tokens. A decode step's rows are its sequences."""
    if md.decode_only:
        return md.block_tables.to(torch.int32).contiguous(), md.seq_lens.to(torch.int32).contiguous()
    num_tokens = int(md.query_start_loc[-1])
    tables = query_token_tables(md.block_tables, md.query_start_loc, num_tokens)
    return tables.to(torch.int32).contiguous(), query_token_lens(md.seq_lens, md.query_start_loc, num_tokens)


def _native_layer(layer: FusedLayer) -> NativeLayer:
    q_size, kv_size, head_dim = layer.qkv_sizes
    norm, post = _norms(layer)
    modules = tuple(
        cast(QuantizedLinear, m) for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    )
    qkv, o, gate_up, down = modules
    shape = (q_size // head_dim, kv_size // head_dim, head_dim, layer.layer_idx, gate_up.out_features // 2)
    heads, kv_heads, _, index, intermediate = shape
    return NativeLayer(
        qkv.matmul, o.matmul, gate_up.matmul, down.matmul,
        norm.weight, float(norm.variance_epsilon), post.weight, float(post.variance_epsilon),
        heads, kv_heads, head_dim, float(layer.scale), index, intermediate,
        _layer_args(modules, post, float(layer.scale), shape),
    )  # fmt: skip
