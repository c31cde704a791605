"""Builders and checks shared by the kernel tests (a uniquely named module: conftest is not importable).

``make_paged`` builds a pool in which everything a kernel must not read is NaN, ``naive_attention``
is the spec in float64 one query row at a time, ``eager_attention`` the spec with transformers' extras
(sliding window, soft-capping, sinks) as transformers' eager attention computes it, ``assert_close``
compares with dtype tolerances.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PagedCase:
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, Hkv, page, D]
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]
    layer: int


def make_paged(
    seq_lens: list[int],
    *,
    page: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    num_layers: int = 2,
    layer: int = 1,
    extra_cols: int = 1,
    head_dim_pad: int = 0,
) -> PagedCase:
    """A pool holding the given contexts in shuffled blocks; everything no kernel may read is NaN.

    NaN: other layers, positions at or past each seq_len, a spare block every padded table entry
    points at. ``head_dim_pad`` > 0 makes the pool a non-contiguous view (a wider tensor sliced).
    """
    need = [cdiv(n, page) for n in seq_lens]
    num_blocks = sum(need) + 2
    poison_block = num_blocks - 1
    full = torch.randn(num_blocks, num_layers, 2, num_kv_heads, page, head_dim + head_dim_pad,
                       dtype=torch.float32, device=device).to(dtype)
    kv = full[..., :head_dim] if head_dim_pad else full
    others = [i for i in range(num_layers) if i != layer]
    kv[:, others] = float("nan")
    kv[poison_block] = float("nan")
    perm = torch.randperm(num_blocks - 1).tolist()  # shuffled physical blocks (block 0 included)
    max_blocks = max(need + [0]) + extra_cols
    tables = torch.full((len(seq_lens), max_blocks), poison_block, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        for j in range(need[i]):
            tables[i, j] = perm.pop()
        if n % page:
            kv[int(tables[i, need[i] - 1]), layer, :, :, n % page:] = float("nan")
    return PagedCase(kv, tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), layer)


def naive_attention(query: torch.Tensor, case: PagedCase, q_positions: list[list[int]], scale: float) -> torch.Tensor:
    """Dense float64 attention, one query row at a time from explicit positions (the spec, spelled out).

    query [num_rows, H, D]; q_positions[i] lists, per sequence i, the positions of its query rows (rows
    are consecutive, sequence after sequence).
    """
    kv = case.kv_cache[:, case.layer].double()
    page = kv.shape[3]
    h, hkv = query.shape[1], kv.shape[2]
    group = h // hkv
    out = torch.zeros(query.shape, dtype=torch.float64)
    row = 0
    for i, positions in enumerate(q_positions):
        n = int(case.seq_lens[i])
        if n:
            idx = torch.arange(n)
            blocks = case.block_tables[i].cpu().long()[idx // page]
            k = kv[blocks, 0, :, idx % page].cpu()  # [n, Hkv, D]
            v = kv[blocks, 1, :, idx % page].cpu()
        for pos in positions:
            if n:
                for head in range(h):
                    s = (k[: pos + 1, head // group] @ query[row, head].double().cpu()) * scale
                    out[row, head] = torch.softmax(s, 0) @ v[: pos + 1, head // group]
            row += 1
    return out


def eager_attention(
    query: torch.Tensor,
    case: PagedCase,
    q_positions: list[list[int]],
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense float64 attention per sequence, spelled as transformers' eager path spells it: K/V repeated per
    query head, scores scaled then soft-capped, an additive mask built from positions (causal, and
    ``kv > q - window`` as ``sliding_window_overlay``), the sinks appended as one more logit column, softmax,
    the sink column dropped. Arguments as ``naive_attention``."""
    kv = case.kv_cache[:, case.layer].double().cpu()
    page = kv.shape[3]
    h, hkv = query.shape[1], kv.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    row = 0
    for i, positions in enumerate(q_positions):
        n, rows = int(case.seq_lens[i]), len(positions)
        if n == 0:
            row += rows
            continue
        idx = torch.arange(n)
        blocks = case.block_tables[i].cpu().long()[idx // page]
        k = kv[blocks, 0, :, idx % page].transpose(0, 1).repeat_interleave(h // hkv, 0)  # [H, n, D]
        v = kv[blocks, 1, :, idx % page].transpose(0, 1).repeat_interleave(h // hkv, 0)
        q = query[row : row + rows].double().cpu().transpose(0, 1)  # [H, rows, D]
        scores = q @ k.transpose(1, 2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos, k_pos = torch.tensor(positions)[:, None], idx[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores + torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().cpu()[:, None, None].expand(h, rows, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        out[row : row + rows] = (probs @ v).transpose(0, 1)
        row += rows
    return out


def sink_logits(heads: int) -> torch.Tensor:
    """gpt-oss-style sink logits, one per head, spread from -2 to 3 (jittered): the largest is on the scale of
    the test logits, so a test that says the sinks changed its output is true whatever the seed."""
    return torch.linspace(-2.0, 3.0, heads) + 0.3 * torch.randn(heads)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out64).any(), f"{what}: NaN in output (unwritten or poisoned read)"
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]
    err = (out64 - ref64).abs().max().item()
    assert err <= tol * (1 + ref64.abs().max().item()), f"{what}: max abs err {err:.3g} > {tol}"
    rel = ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
    assert rel <= {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype], f"{what}: rel {rel:.3g}"


def interpreter_runs_dynamic_loops() -> bool:
    """Whether Triton's interpreter can run ``range(loaded_scalar, ...)``.

    triton 3.6's interpreter converts loop bounds with ``int(ndarray of shape (1,))``, which numpy
    >= 2.4 rejects; triton 3.9's squeezes first. The attention kernels need such loops.
    """
    import triton
    import triton.language as tl

    from streamd.kernels._triton_utils import dual_kernel

    def probe(x_ptr, n_ptr):
        n = tl.load(n_ptr)
        for i in range(n):
            tl.store(x_ptr + i, i)

    kernel = dual_kernel(probe)
    x = torch.zeros(3, dtype=torch.int32)
    try:
        kernel.launch(x.device, (1,), x, torch.tensor([3], dtype=torch.int32))
    except triton.runtime.errors.InterpreterError as err:
        if "0-dimensional" in str(err):
            return False
        raise
    return x.tolist() == [0, 1, 2]
