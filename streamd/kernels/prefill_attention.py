"""Paged varlen causal prefill attention as a Triton kernel.

Owns ``paged_prefill_attention``. Several sequences are flattened into one query tensor; sequence i's
queries are rows ``query_start_loc[i]:query_start_loc[i+1]`` and are its *last* ``query_len_i`` tokens,
whose K/V are already in the paged cache. Keys before them (a cached prefix, or earlier chunks of a
chunked prefill) are read from the same cache, so prefix caching and chunked prefill need nothing else.

Grid without host sync: the host cannot know each sequence's query length without reading
``query_start_loc``, so the grid is ``num_tokens // BLOCK_M + num_seqs`` query tiles (an upper bound:
sequence i owns the tile indices ``[qsl[i] // BLOCK_M + i, qsl[i+1] // BLOCK_M + i + 1)``, at least
``ceil(query_len_i / BLOCK_M)`` of them) times ``num_heads``. Each program finds its sequence by a binary
search over that monotone tile start and exits its loops at once when it has no rows.

Each program streams K/V in two phases: tiles wholly below the tile's first query position need no
causal mask; only the last few tiles (at most ``BLOCK_M / BLOCK_N + 1``) pay for it.

Extras (``attention_extras``): a sliding window W adds a masked phase before those two, for the window's
lower edge (keys some rows of the tile no longer see), and starts the unmasked phase at the first tile
every row still sees; keys wholly before the window are never loaded. Soft-capping rewrites each score
tile; sinks join the denominator in the epilogue. An 8-bit pool: as in the decode kernel (`kv_quant`), scales
multiply score and probability columns.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from streamd.kernels._triton_utils import dot_upcast, dual_kernel, next_pow2
from streamd.kernels.attention_extras import LOG2E_C, capped, fold_sink, logit_extras
from streamd.kernels.kv_quant import scale_args
from streamd.kernels.layout import check_cache

_NEG_BIG = tl.constexpr(-1.0e30)  # finite running-max floor: rows with no visible key stay NaN-free


@dual_kernel(do_not_specialize=("num_seqs", "num_tiles", "s_bt_seq"))
def _prefill_kernel(
    q_ptr: tl.tensor,
    kv_ptr: tl.tensor,
    bt_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    sl_ptr: tl.tensor,
    out_ptr: tl.tensor,
    layer_off: tl.tensor,
    qk_scale: tl.tensor,
    sinks_ptr: tl.tensor,
    window: tl.tensor,
    cap_log2: tl.tensor,
    num_seqs: tl.tensor,
    num_tiles: tl.tensor,
    s_q_tok: tl.tensor,
    s_q_head: tl.tensor,
    s_q_dim: tl.tensor,
    s_kv_blk: tl.tensor,
    s_kv_kv: tl.tensor,
    s_kv_head: tl.tensor,
    s_kv_tok: tl.tensor,
    s_kv_dim: tl.tensor,
    s_bt_seq: tl.tensor,
    s_o_tok: tl.tensor,
    s_o_head: tl.tensor,
    s_o_dim: tl.tensor,
    sc_ptr: tl.tensor,
    sc_layer_off: tl.tensor,
    s_sc_blk: tl.tensor,
    s_sc_kv: tl.tensor,
    s_sc_head: tl.tensor,
    s_sc_tok: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_INT8: tl.constexpr,
    KV_QMAX: tl.constexpr,
) -> None:
    # Highest tile index first: with causal masking the last tiles of a sequence do the most work,
    # so starting them first shortens the tail of the launch.
    tile = num_tiles - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # Largest seq with qsl[seq] // BLOCK_M + seq <= tile (invariant: f(lo) <= tile < f(hi)).
    lo = tl.program_id(0) * 0
    hi = lo + num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go = tl.load(qsl_ptr + mid) // BLOCK_M + mid <= tile
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    seq = lo

    q_begin = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    m_start = (tile - (q_begin // BLOCK_M + seq)) * BLOCK_M
    seq_len = tl.load(sl_ptr + seq)
    ctx = seq_len - q_len  # tokens before this sequence's first query
    active = m_start < q_len

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    if BLOCK_D == HEAD_DIM:
        qd_mask = m_mask[:, None]
    else:
        qd_mask = m_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = (q_begin + offs_m).to(tl.int64)

    kv_dtype = kv_ptr.dtype.element_ty  # the dots' operand dtype
    if KV_QUANT:
        kv_dtype = q_ptr.dtype.element_ty
    q = tl.load(
        q_ptr + rows[:, None] * s_q_tok + head * s_q_head + offs_d[None, :] * s_q_dim,
        mask=qd_mask,
        other=0.0,
    ).to(kv_dtype)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx + offs_m

    # Keys < ctx + m_start + 1 are visible to every row of the tile; later ones need the causal mask.
    full_end = tl.where(active, (ctx + m_start + 1) // BLOCK_N * BLOCK_N, 0)
    causal_end = tl.where(active, tl.minimum(seq_len, ctx + m_start + BLOCK_M), 0)
    inner_lo = full_end * 0
    causal_lo = full_end
    if WINDOW:
        # The tile's first row sees keys from edge_lo; its last row only from ctx + m_start + BLOCK_M - W.
        edge_lo = tl.maximum(ctx + m_start + 1 - window, 0)
        inner_lo = tl.minimum(tl.cdiv(tl.maximum(ctx + m_start + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N, full_end)
        causal_lo = tl.maximum(full_end, edge_lo)

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_base = kv_ptr + layer_off + kv_head * s_kv_head
    sc_base = sc_ptr + sc_layer_off + kv_head * s_sc_head
    bt_base = bt_ptr + seq * s_bt_seq

    # Phases: 0 the window's lower edge (masked; compiled only with a window), 1 keys every row of the tile
    # sees (unmasked), 2 the causal diagonal (masked).
    for phase in tl.static_range(0 if WINDOW else 1, 3):
        if phase == 0:
            lo_n = edge_lo
            hi_n = inner_lo
        elif phase == 1:
            lo_n = inner_lo
            hi_n = full_end
        else:
            lo_n = causal_lo
            hi_n = causal_end
        for n0 in range(lo_n, hi_n, BLOCK_N):
            k_pos = n0 + offs_n
            if phase == 1:
                # Every key of these tiles exists: no token mask, only the head-dim padding.
                blk = tl.load(bt_base + k_pos // PAGE).to(tl.int64)
                ptrs = kv_base + (blk * s_kv_blk + (k_pos % PAGE) * s_kv_tok)[:, None] + offs_d[None, :] * s_kv_dim
                if BLOCK_D == HEAD_DIM:
                    k = tl.load(ptrs)
                    v = tl.load(ptrs + s_kv_kv)
                else:
                    d_mask = (offs_d < HEAD_DIM)[None, :]
                    k = tl.load(ptrs, mask=d_mask, other=0.0)
                    v = tl.load(ptrs + s_kv_kv, mask=d_mask, other=0.0)
            else:
                n_mask = k_pos < hi_n
                blk = tl.load(bt_base + k_pos // PAGE, mask=n_mask, other=0).to(tl.int64)
                ptrs = kv_base + (blk * s_kv_blk + (k_pos % PAGE) * s_kv_tok)[:, None] + offs_d[None, :] * s_kv_dim
                if BLOCK_D == HEAD_DIM:
                    kv_mask = n_mask[:, None]
                else:
                    kv_mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
                k = tl.load(ptrs, mask=kv_mask, other=0.0)
                v = tl.load(ptrs + s_kv_kv, mask=kv_mask, other=0.0)
            if KV_QUANT:
                # Past the phase's end (phases 0, 2) a slot may hold any bits: its scales read as 0, so a NaN
                # there never meets the zero probability that would multiply it.
                sc = sc_base + blk * s_sc_blk + (k_pos % PAGE) * s_sc_tok
                if phase == 1:
                    k_scale = tl.load(sc)
                    v_scale = tl.load(sc + s_sc_kv)
                else:
                    k_scale = tl.load(sc, mask=k_pos < hi_n, other=0.0)
                    v_scale = tl.load(sc + s_sc_kv, mask=k_pos < hi_n, other=0.0)
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
            if phase != 1:
                visible = k_pos[None, :] < hi_n
                if phase == 2:
                    visible &= k_pos[None, :] <= q_pos[:, None]
                if WINDOW:
                    visible &= k_pos[None, :] > q_pos[:, None] - window
                qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if KV_QUANT:
                p = p * v_scale[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_C
        l_i, acc = fold_sink(m_i, l_i, acc, sink)
    denom = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / denom[:, None]
    tl.store(
        out_ptr + rows[:, None] * s_o_tok + head * s_o_head + offs_d[None, :] * s_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=qd_mask,
    )


def _default_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by head dim.

    64x64 tiles, 4 warps: the best of the sweep for head dims 64 and 128, or close to it (benchmarks/KERNELS.md),
    and twice the programs of 128-row tiles for short prompts.
    """
    if next_pow2(head_dim) <= 128:
        return 64, 64, 4, 3
    return 64, 32, 4, 2


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention for flattened prompts (or prompt chunks) over their paged context.

    query [num_tokens, num_heads, head_dim]; query_start_loc int32 [num_seqs + 1]; seq_lens int32
    [num_seqs] (context including the queries). Query token j of sequence i sits at position
    seq_len_i - query_len_i + j and attends to positions <= that. Returns [num_tokens, num_heads,
    head_dim] in the query's dtype; rows past ``query_start_loc[-1]`` are not written. The tile sizes
    can be overridden (tests, benchmarks); nothing here reads device memory on the host. ``key`` and
    ``value`` (the step's stored K/V, which the reference attends over for sequences without earlier
    context) are accepted for the same signature and not read: every tile loads its K/V from the pool.
    ``sliding_window``, ``softcap`` and ``sinks`` [num_heads] are transformers' extras (module doc; None: off).
    An 8-bit pool takes its ``kv_scales`` (`layout.check_scales`).
    """
    check_cache(kv_cache, layer)
    scales = scale_args(kv_cache, kv_scales, layer)
    num_tokens, num_heads, head_dim = query.shape
    _, _, _, num_kv_heads, page, kv_head_dim = kv_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {kv_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    extras = logit_extras(query, scale, sliding_window, softcap, sinks)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0 or num_tokens == 0:
        return out

    cfg = _default_config(head_dim)
    block_m = block_m or cfg[0]
    block_n = block_n or cfg[1]
    num_warps = num_warps or cfg[2]
    num_stages = num_stages or cfg[3]
    num_tiles = num_tokens // block_m + num_seqs
    s_kv = kv_cache.stride()
    dot_dtype = query.dtype if scales.quant else kv_cache.dtype
    _prefill_kernel.launch(
        query.device,
        (num_tiles, num_heads),
        query,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        layer * s_kv[1],
        extras.qk_scale,
        extras.sinks,
        extras.window,
        extras.cap_log2,
        num_seqs,
        num_tiles,
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
        *scales.args,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # Extra steps of the search are no-ops once it has converged; a floor of 9 (511 sequences) keeps one
        # compiled variant for every batch the default max_num_seqs allows.
        SEARCH_STEPS=max(9, math.ceil(math.log2(num_seqs + 1))),
        DOT_PRECISION="ieee" if dot_dtype == torch.float32 else "tf32",
        UPCAST=dot_upcast(query.device, dot_dtype),
        **extras.flags(),
        **scales.flags,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


__all__ = ["paged_prefill_attention"]
