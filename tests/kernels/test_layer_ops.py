"""Triton decoder-layer kernels (RMSNorm with residual add, SiLU-and-mul, rotary + KV store) against their
torch references: on CPU through Triton's interpreter, and compiled on a CUDA GPU where there is one
(`cuda` marker). Awkward sizes (hidden sizes no power of two, one row, many rows, odd head counts),
float32 and bfloat16, strided inputs (slices of a fused projection)."""

from __future__ import annotations

import pytest
import torch

import streamd.kernels as K
from streamd.kernels import reference as ref

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]

# bf16 compared to a reference that rounds after every op: a few ulps of the largest value.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _wide(rows: int, cols: int, extra: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """[rows, cols] as a slice of a wider tensor: a row stride that is not the row length."""
    return torch.randn(rows, cols + extra).to(device, dtype)[:, extra:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 100), (300, 2048), (5, 7)])
def test_rmsnorm_and_fused_add_match_reference(rows: int, hidden: int, dtype: torch.dtype, device: str) -> None:
    x = _wide(rows, hidden, 3, dtype, device)
    residual = torch.randn(rows, hidden).to(device, dtype)
    weight = (1 + 0.3 * torch.randn(hidden)).to(device, dtype)
    x_before, res_before = x.clone(), residual.clone()
    torch.testing.assert_close(K.rmsnorm(x, weight, 1e-5), ref.rmsnorm(x, weight, 1e-5), **TOL[dtype])
    out, res_out = K.fused_add_rmsnorm(x, residual, weight, 1e-6)
    want_out, want_res = ref.fused_add_rmsnorm(x, residual, weight, 1e-6)
    torch.testing.assert_close(res_out, want_res, **TOL[dtype])
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, res_before), "inputs were written"


def test_rmsnorm_normalises_and_rejects_bad_shapes() -> None:
    x = torch.randn(4, 33) * 50
    out = K.rmsnorm(x, torch.ones(33), 0.0)
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(4))  # the spec, independent of the reference
    assert K.rmsnorm(torch.zeros(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    with pytest.raises(ValueError, match="weight"):
        K.rmsnorm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        K.fused_add_rmsnorm(x, torch.randn(4, 32), torch.ones(33), 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (29, 100), (257, 2050), (3, 1)])
def test_silu_and_mul_matches_reference(rows: int, inter: int, dtype: torch.dtype, device: str) -> None:
    x = _wide(rows, 2 * inter, 5, dtype, device) * 3
    got = K.silu_and_mul(x)
    torch.testing.assert_close(got, ref.silu_and_mul(x), **TOL[dtype])
    gate, up = x.float()[:, :inter], x.float()[:, inter:]
    torch.testing.assert_close(got.float(), gate * torch.sigmoid(gate) * up, **TOL[dtype])  # the spec
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        K.silu_and_mul(torch.randn(2, 7, device=device))


def _rope_tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    emb = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim,page,qk_norm", [
    (1, 9, 3, 64, 16, False),     # smollm2-135m, one decode row
    (45, 32, 8, 64, 8, False),    # llama3.2-1b heads, many rows
    (13, 7, 1, 80, 32, True),     # odd head counts, head_dim no power of two, Qwen3's q/k norm
    (6, 4, 4, 6, 8, True),        # tiny head_dim
])
def test_rotary_store_kv_matches_reference(num_tokens, heads, kv_heads, head_dim, page, qk_norm, dtype,
                                           device) -> None:
    num_blocks = -(-num_tokens // page) + 3
    kv = torch.randn(num_blocks, 2, 2, kv_heads, page, head_dim).to(device, dtype)
    expect = kv.clone()
    # q, k, v as slices of one fused projection output, as the rewired model passes them.
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim).to(device, dtype)
    q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4000, (num_tokens,), device=device)
    cos, sin = _rope_tables(positions, head_dim, dtype)
    slots = torch.randperm(num_blocks * page)[:num_tokens].to(device)
    slots[num_tokens // 2] = -1  # padding row: query rotated, nothing stored
    norms = (1 + 0.2 * torch.randn(2, head_dim)).to(device, dtype) if qk_norm else (None, None)
    got = K.rotary_store_kv(q, k, v, cos, sin, kv, 1, slots, norms[0], norms[1], 1e-6)
    want = ref.rotary_store_kv(q, k, v, cos, sin, expect, 1, slots, norms[0], norms[1], 1e-6)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(kv, expect, **TOL[dtype])
    assert torch.equal(kv[:, 0], expect[:, 0]), "another layer was written"


def test_rotary_preserves_norm_and_position_zero_is_identity() -> None:
    """The spec, not the reference: a rotation keeps each head's norm, and position 0 rotates nothing."""
    kv = torch.zeros(2, 1, 2, 2, 8, 16)
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    positions = torch.tensor([0, 5, 900])
    cos, sin = _rope_tables(positions, 16, torch.float32)
    out = K.rotary_store_kv(q, k, v, cos, sin, kv, 0, torch.tensor([0, 9, -1]))
    torch.testing.assert_close(out.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(out[0], q[0])
    torch.testing.assert_close(kv[0, 0, 0, :, 0], k[0])  # slot 0, position 0: the key as it came
    torch.testing.assert_close(kv[1, 0, 1, :, 1], v[1])  # slot 9 = block 1, offset 1: the value
    torch.testing.assert_close(kv[1, 0, 0, :, 1].norm(dim=-1), k[1].norm(dim=-1))
    assert kv[:, :, :, :, 2:].abs().sum() == 0 and kv[0, :, :, :, 1:].abs().sum() == 0, "slot -1 was stored"


@pytest.mark.parametrize("impl", [K.rotary_store_kv, ref.rotary_store_kv], ids=["triton", "reference"])
def test_rotary_store_kv_rejects_bad_shapes(impl) -> None:
    kv = torch.zeros(2, 1, 2, 2, 8, 16)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    cos, sin = _rope_tables(torch.arange(3), 16, torch.float32)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="cos"):
        impl(q, k, k, cos[:2], sin[:2], kv, 0, slots)
    with pytest.raises(ValueError, match="cache"):
        impl(q, q, q, cos, sin, kv, 0, slots)
    with pytest.raises(ValueError, match="together"):
        impl(q, k, k, cos, sin, kv, 0, slots, torch.ones(16))
    with pytest.raises(ValueError, match="k_norm must be \\[16\\]"):
        impl(q, k, k, cos, sin, kv, 0, slots, torch.ones(16), torch.ones(8))
    assert kv.abs().sum() == 0, "a refused call stored into the cache"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layer_kernels_capture_in_a_cuda_graph() -> None:
    """No host synchronisation in any of them: replaying the captured graph reproduces the eager results."""
    dev, dtype = "cuda", torch.bfloat16
    x, res = torch.randn(256, 576, device=dev, dtype=dtype), torch.randn(256, 576, device=dev, dtype=dtype)
    weight = torch.randn(576, device=dev, dtype=dtype)
    gate_up = torch.randn(256, 3072, device=dev, dtype=dtype)
    qkv = torch.randn(256, 15 * 64, device=dev, dtype=dtype)
    q, k, v = (t.unflatten(-1, (-1, 64)) for t in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1))
    cos, sin = _rope_tables(torch.arange(256, device=dev), 64, dtype)
    kv = torch.zeros(20, 1, 2, 3, 16, 64, device=dev, dtype=dtype)
    slots = torch.randperm(320, device=dev)[:256]

    def run() -> list[torch.Tensor]:
        return [*K.fused_add_rmsnorm(x, res, weight, 1e-5), K.rmsnorm(x, weight, 1e-5), K.silu_and_mul(gate_up),
                K.rotary_store_kv(q, k, v, cos, sin, kv, 0, slots)]

    eager = run()
    eager_kv = kv.clone()
    kv.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)
    assert torch.equal(kv, eager_kv)
