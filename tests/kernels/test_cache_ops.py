"""Triton store_kv and copy_blocks against the references, on CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

import streamd.kernels as K
from streamd.kernels import reference as ref


@pytest.mark.parametrize(
    "dtype,src_dtype,page,num_kv_heads,head_dim",
    [
        (torch.bfloat16, torch.bfloat16, 16, 2, 128),
        (torch.float16, torch.float16, 8, 7, 80),
        (torch.float32, torch.float32, 128, 1, 256),
        (torch.bfloat16, torch.float32, 32, 3, 96),  # the store casts to the cache dtype
    ],
)
def test_store_kv_matches_reference(dtype, src_dtype, page, num_kv_heads, head_dim):
    num_blocks, num_tokens = 7, 23
    kv = torch.randn(num_blocks, 3, 2, num_kv_heads, page, head_dim).to(dtype)
    expect = kv.clone()
    # Key and value as slices of one fused projection output: non-contiguous rows.
    qkv = torch.randn(num_tokens, 2 + 2 * num_kv_heads, head_dim).to(src_dtype)
    key, value = qkv[:, 2 : 2 + num_kv_heads], qkv[:, 2 + num_kv_heads :]
    slots = torch.randperm(num_blocks * page)[:num_tokens]
    slots[[0, 7, 22]] = -1
    K.store_kv(key, value, kv, 1, slots)
    ref.store_kv(key, value, expect, 1, slots)
    if src_dtype == dtype:
        assert torch.equal(kv, expect)
    else:
        # The interpreter rounds float32 -> bf16 toward zero, CUDA to nearest: allow one bf16 ulp.
        torch.testing.assert_close(kv, expect, atol=0, rtol=2**-7)


def test_store_kv_all_skipped_and_empty():
    kv = torch.randn(2, 1, 2, 1, 8, 64)
    before = kv.clone()
    K.store_kv(torch.randn(3, 1, 64), torch.randn(3, 1, 64), kv, 0, torch.full((3,), -1, dtype=torch.int64))
    K.store_kv(torch.randn(0, 1, 64), torch.randn(0, 1, 64), kv, 0, torch.zeros(0, dtype=torch.int64))
    assert torch.equal(kv, before)


@pytest.mark.parametrize("contiguous", [True, False])
def test_copy_blocks_matches_reference(contiguous):
    num_blocks = 9
    full = torch.randn(num_blocks, 2, 2, 3, 16, 80 if contiguous else 96, dtype=torch.bfloat16)
    kv = full if contiguous else full[..., :80]
    expect = kv.clone()
    padding = full[..., 80:].clone()
    src = torch.tensor([1, 1, 4, 8], dtype=torch.int64)
    dst = torch.tensor([0, 6, 7, 2], dtype=torch.int64)
    K.copy_blocks(kv, src, dst)
    ref.copy_blocks(expect, src, dst)
    assert torch.equal(kv, expect)
    if not contiguous:
        assert torch.equal(full[..., 80:], padding), "bytes outside the view were written"


def test_copy_blocks_empty_is_a_no_op():
    kv = torch.randn(3, 1, 2, 1, 8, 64)
    before = kv.clone()
    K.copy_blocks(kv, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(kv, before)
