"""Paged decode attention (one query token per sequence) as Triton kernels.

Owns ``paged_decode_attention``: the main kernel, its split-K partial path and the reduction kernel
that merges the partials, plus the host-side choice of tile sizes and split count.

One program handles one (sequence, KV head, context partition). It loads the query rows of every query
head that shares that KV head (the GQA group, padded to 16 rows because ``tl.dot`` needs M >= 16), and
streams the partition's keys and values in tiles of ``BLOCK_N`` tokens, translating each token's
position through the block table. Each K/V tile is loaded once for the whole group: that is what makes
GQA decode memory-bound on K/V bytes rather than on query heads.

Split-K: when ``num_seqs * num_kv_heads`` programs cannot fill the GPU, the context is cut into
``num_splits`` partitions; each writes an unnormalised partial (running max, sum of exponentials and
accumulator, all in the exp2 domain) and a second kernel merges them. The split count is computed from
shapes only (the block table's width gives the largest possible context), so the launch is the same
for every batch of a given shape and can be captured in a CUDA graph. Each sequence cuts its own context
into the splits (`seq_partition`, at least a few tiles a partition), so a decode graph captured for tables
as wide as `max_model_len` still spreads a short context over its splits rather than giving it all to the
first (benchmarks/NOTES.md, "Issue 34: ... a partition a sequence").

Extras (``attention_extras``): with a sliding window W a program streams only the last W positions of its
context (partitions cut that span, so blocks wholly before the window are never loaded and the split
count follows W, not the table's width); soft-capping rewrites each score tile; sinks join the
denominator once, where the softmax is normalised: the unsplit kernel's epilogue or the reduction.

An 8-bit pool (`kv_quant`): the codes convert exactly to the query's dtype for the dots, each token's key scale
multiplies its score column and its value scale its probability column (tile loads of 1 byte per element).
"""

from __future__ import annotations

import torch
import triton.language as tl

from streamd.kernels._triton_utils import cdiv, dot_upcast, dual_kernel, jit_helper, next_pow2, num_sms
from streamd.kernels.attention_extras import LOG2E_C, capped, fold_sink, logit_extras
from streamd.kernels.kv_quant import scale_args
from streamd.kernels.layout import check_cache

# A finite "minus infinity" for running maxima: exp2(-inf - -inf) would be NaN for rows that see no
# key (seq_len 0, padding rows), whereas exp2(x - 1e30-ish) is cleanly 0 or 1.
_NEG_BIG = tl.constexpr(-1.0e30)


@jit_helper
def seq_partition(span: tl.tensor, num_splits: tl.tensor, min_partition: tl.tensor, BLOCK_N: tl.constexpr) -> tl.tensor:
    """One sequence's partition length: its attended span cut into `num_splits`, a whole number of tiles, at least
    `min_partition` (splits past the span's end stay empty)."""
    return tl.maximum(tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N, min_partition)


@dual_kernel(do_not_specialize=("partition_size", "num_splits", "s_bt_seq"))
def _decode_kernel(
    q_ptr: tl.tensor,
    kv_ptr: tl.tensor,
    bt_ptr: tl.tensor,
    sl_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_m_ptr: tl.tensor,
    part_l_ptr: tl.tensor,
    part_acc_ptr: tl.tensor,
    layer_off: tl.tensor,
    qk_scale: tl.tensor,
    sinks_ptr: tl.tensor,
    window: tl.tensor,
    cap_log2: tl.tensor,
    partition_size: tl.tensor,
    num_splits: tl.tensor,
    s_q_seq: tl.tensor,
    s_q_head: tl.tensor,
    s_q_dim: tl.tensor,
    s_kv_blk: tl.tensor,
    s_kv_kv: tl.tensor,
    s_kv_head: tl.tensor,
    s_kv_tok: tl.tensor,
    s_kv_dim: tl.tensor,
    s_bt_seq: tl.tensor,
    s_o_seq: tl.tensor,
    s_o_head: tl.tensor,
    s_o_dim: tl.tensor,
    num_heads: tl.tensor,
    sc_ptr: tl.tensor,
    sc_layer_off: tl.tensor,
    s_sc_blk: tl.tensor,
    s_sc_kv: tl.tensor,
    s_sc_head: tl.tensor,
    s_sc_tok: tl.tensor,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_INT8: tl.constexpr,
    KV_QMAX: tl.constexpr,
) -> None:
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    if BLOCK_D == HEAD_DIM:
        qd_mask = g_mask[:, None]
    else:
        qd_mask = g_mask[:, None] & (offs_d[None, :] < HEAD_DIM)

    kv_dtype = kv_ptr.dtype.element_ty  # the dots' operand dtype
    if KV_QUANT:
        kv_dtype = q_ptr.dtype.element_ty
    q = tl.load(
        q_ptr + seq * s_q_seq + heads[:, None] * s_q_head + offs_d[None, :] * s_q_dim,
        mask=qd_mask,
        other=0.0,
    ).to(kv_dtype)
    if UPCAST:
        q = q.to(tl.float32)

    seq_len = tl.load(sl_ptr + seq)
    first = seq_len * 0
    if WINDOW:  # partitions cut the window's span [seq_len - W, seq_len)
        first = tl.maximum(seq_len - window, 0)
    partition = seq_partition(seq_len - first, num_splits, partition_size, BLOCK_N)
    start = first + split * partition
    end = tl.minimum(start + partition, seq_len)

    m_i = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    kv_base = kv_ptr + layer_off + kv_head * s_kv_head
    sc_base = sc_ptr + sc_layer_off + kv_head * s_sc_head
    bt_base = bt_ptr + seq * s_bt_seq
    # Block-table entries are fetched one tile ahead, so the K/V addresses of a tile do not wait on a
    # load issued in the same iteration and the pipeliner can keep several K/V tiles in flight.
    nxt = start + offs_n
    blk_next = tl.load(bt_base + nxt // PAGE, mask=nxt < end, other=0)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk = blk_next.to(tl.int64)
        nxt = pos + BLOCK_N
        # Masked so padded block-table entries (any value) are never dereferenced.
        blk_next = tl.load(bt_base + nxt // PAGE, mask=nxt < end, other=0)
        tok_off = blk * s_kv_blk + (pos % PAGE) * s_kv_tok
        ptrs = kv_base + tok_off[:, None] + offs_d[None, :] * s_kv_dim
        if BLOCK_D == HEAD_DIM:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(ptrs, mask=kv_mask, other=0.0)
        v = tl.load(ptrs + s_kv_kv, mask=kv_mask, other=0.0)
        if KV_QUANT:
            sc = sc_base + blk * s_sc_blk + (pos % PAGE) * s_sc_tok
            k_scale = tl.load(sc, mask=n_mask, other=0.0)
            v_scale = tl.load(sc + s_sc_kv, mask=n_mask, other=0.0)
        if UPCAST:  # (8-bit codes too: the interpreter's integer -> bfloat16 conversion is wrong)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_QUANT:  # codes convert exactly to the query's dtype
            k = k.to(kv_dtype)
            v = v.to(kv_dtype)

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if KV_QUANT:
            qk = qk * k_scale[None, :]
        if SOFTCAP:
            qk = capped(qk, cap_log2)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_QUANT:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # Partials are [num_seqs, num_heads, num_splits] (+ [HEAD_DIM] for acc), float32, contiguous.
        row = (seq * num_heads + heads) * num_splits + split
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=qd_mask)
    else:
        if SINKS:
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * LOG2E_C
            l_i, acc = fold_sink(m_i, l_i, acc, sink)
        denom = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len 0 -> zeros, not NaN
        out = acc / denom[:, None]
        tl.store(
            out_ptr + seq * s_o_seq + heads[:, None] * s_o_head + offs_d[None, :] * s_o_dim,
            out.to(out_ptr.dtype.element_ty),
            mask=qd_mask,
        )


@dual_kernel
def _reduce_kernel(
    sl_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_m_ptr: tl.tensor,
    part_l_ptr: tl.tensor,
    part_acc_ptr: tl.tensor,
    sinks_ptr: tl.tensor,
    window: tl.tensor,
    partition_size: tl.tensor,
    num_splits: tl.tensor,
    s_o_seq: tl.tensor,
    s_o_head: tl.tensor,
    s_o_dim: tl.tensor,
    num_heads: tl.tensor,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
) -> None:
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)

    seq_len = tl.load(sl_ptr + seq)
    span = seq_len
    if WINDOW:
        span = tl.minimum(seq_len, window)
    # Only partitions that hold at least one token wrote meaningful partials.
    n_valid = tl.cdiv(span, seq_partition(span, num_splits, partition_size, BLOCK_N))
    s_mask = offs_s < n_valid
    row = (seq * num_heads + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=_NEG_BIG)
    l = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_C
        m_max = tl.maximum(m_max, sink)
    w = tl.exp2(m - m_max)
    w = tl.where(s_mask, w, 0.0)
    denom = tl.sum(w * l, 0)
    if SINKS:
        denom += tl.exp2(sink - m_max)
    denom = tl.where(denom > 0.0, denom, 1.0)
    d_mask = offs_d < HEAD_DIM
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(
        out_ptr + seq * s_o_seq + head * s_o_head + offs_d * s_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


# Shortest partition worth its own program: a few tiles, so the loads still pipeline.
_MIN_PARTITION_TILES = 4
_MAX_SPLITS = 64


# 8-bit pools at head dim 128 (benchmarks/results/quantized-decode-sweep-2026-11-27-h100.json, 256 sequences of
# 1,024 tokens, 8 KV heads x 4): int8 0.231 ms with 64-token tiles on 2 warps against 0.297 at the bf16 tiles;
# fp8 0.252 ms with 128-token tiles, 2 stages, against 0.311 (bf16's own: 0.371 ms at 2.9 TB/s).
_QUANT_CONFIG_128 = {torch.int8: (64, 2, 3), torch.float8_e4m3fn: (128, 4, 2)}


def _default_config(head_dim: int, kv_dtype: torch.dtype | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) by head dim: K+V tiles of ~32 KB per stage in bf16 (an 8-bit pool of head
    dim 128: as swept for it)."""
    block_d = next_pow2(head_dim)
    if block_d == 128 and kv_dtype in _QUANT_CONFIG_128:
        return _QUANT_CONFIG_128[kv_dtype]
    if block_d <= 64:
        return 128, 4, 3
    if block_d <= 128:
        return 64, 4, 3
    return 32, 4, 2


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Split count from shapes alone (no sync), as tuned on an H200 (benchmarks/KERNELS.md).

    Few programs: split until there are about 2 per multiprocessor, all resident in one wave (a second,
    partial wave of long programs would run on a mostly idle GPU). Between 2 and 4 per multiprocessor: 2
    splits, so the tail of the last wave is short. More: no split. Partitions stay at least 4 tiles long,
    so each program still pipelines its loads.
    """
    programs = max(1, num_seqs * num_kv_heads)
    sms = num_sms(device)
    if programs <= 2 * sms:
        want = (2 * sms) // programs
    else:
        want = cdiv(4 * sms, programs)
    by_len = max(1, cdiv(max_context, _MIN_PARTITION_TILES * block_n))
    return max(1, min(want, by_len, _MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    query [num_seqs, num_heads, head_dim]; kv_cache [num_blocks, num_layers, 2, num_kv_heads,
    block_size, head_dim]; block_tables int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs]
    (context length including the new token, whose K/V is already stored). Returns
    [num_seqs, num_heads, head_dim] in the query's dtype (written into ``out`` when given). Sequences
    with seq_len 0 get zeros. ``sliding_window``, ``softcap`` and ``sinks`` [num_heads] are transformers'
    extras (module doc; None: off); an 8-bit pool takes its ``kv_scales`` (`layout.check_scales`).
    ``num_splits`` / ``block_n`` / ``num_warps`` / ``num_stages`` override
    the heuristics (tests and benchmarks); no argument triggers a device-to-host sync.
    """
    check_cache(kv_cache, layer)
    scales = scale_args(kv_cache, kv_scales, layer)
    num_seqs, num_heads, head_dim = query.shape
    _, _, _, num_kv_heads, page, kv_head_dim = kv_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {kv_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    extras = logit_extras(query, scale, sliding_window, softcap, sinks)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out

    cfg_n, cfg_w, cfg_s = _default_config(head_dim, kv_cache.dtype)
    block_n = block_n or cfg_n
    num_warps = num_warps or cfg_w
    num_stages = num_stages or cfg_s
    max_context = block_tables.shape[1] * page
    if sliding_window is not None:
        max_context = min(max_context, sliding_window)  # the longest span a program streams
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, block_n, query.device)
    # The longest partition: a whole number of tiles; recompute the split count so none is empty by shape. Each
    # sequence cuts its own span (`seq_partition`), into partitions of at least `min_partition`.
    partition = cdiv(cdiv(max(max_context, 1), num_splits), block_n) * block_n
    num_splits = max(1, cdiv(max_context, partition))
    split = num_splits > 1
    min_partition = min(partition, _MIN_PARTITION_TILES * block_n)

    if split:
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out  # unused placeholders (the SPLIT=False body never touches them)

    block_d = max(16, next_pow2(head_dim))
    s_kv = kv_cache.stride()
    dot_dtype = query.dtype if scales.quant else kv_cache.dtype
    _decode_kernel.launch(
        query.device,
        (num_seqs, num_kv_heads, num_splits),
        query,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        part_m,
        part_l,
        part_acc,
        layer * s_kv[1],
        extras.qk_scale,
        extras.sinks,
        extras.window,
        extras.cap_log2,
        min_partition,
        num_splits,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        s_kv[0],
        s_kv[2],
        s_kv[3],
        s_kv[4],
        s_kv[5],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        num_heads,
        *scales.args,
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE=page,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_PRECISION="ieee" if dot_dtype == torch.float32 else "tf32",
        UPCAST=dot_upcast(query.device, dot_dtype),
        **extras.flags(),
        **scales.flags,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _reduce_kernel.launch(
            query.device,
            (num_seqs, num_heads),
            seq_lens,
            out,
            part_m,
            part_l,
            part_acc,
            extras.sinks,
            extras.window,
            min_partition,
            num_splits,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=max(2, next_pow2(num_splits)),
            BLOCK_N=block_n,
            WINDOW=extras.has_window,
            SINKS=extras.has_sinks,
            num_warps=4 if head_dim * num_splits <= 8192 else 8,
        )
    return out


__all__ = ["choose_num_splits", "paged_decode_attention"]
