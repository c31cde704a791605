"""Triton paged attention with transformers' extras (sliding window, logit soft-capping, sinks) against the
references, on CPU through Triton's interpreter: windows narrower than, equal to and wider than the
contexts and not multiples of the block or tile sizes, caps and sinks on and off, GQA, split and unsplit
decode. Every block wholly before a sequence's window is NaN, so a kernel that loads one shows it; the
references are themselves checked against transformers' eager arithmetic in test_reference.py."""

from __future__ import annotations

import pytest
import torch
from paged_testlib import PagedCase, assert_close, interpreter_runs_dynamic_loops, make_paged, sink_logits

import streamd.kernels as K
from streamd.kernels import reference as ref
from streamd.kernels._triton_utils import DualKernel

pytestmark = pytest.mark.skipif(
    not interpreter_runs_dynamic_loops(), reason="this triton's interpreter cannot run data-dependent loops"
)


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def _poison_before_window(case: PagedCase, first_keys: list[int]) -> int:
    """NaN into every block wholly before each sequence's first visible key; returns how many."""
    page = case.kv_cache.shape[4]
    poisoned = 0
    for i, first in enumerate(first_keys):
        for j in range(first // page):
            case.kv_cache[int(case.block_tables[i, j]), case.layer] = float("nan")
            poisoned += 1
    return poisoned


def _sinks(heads: int, on: bool) -> torch.Tensor | None:
    return sink_logits(heads) if on else None


DECODE_CASES = [
    # dtype, page, group, head_dim, window, softcap, sinks, num_splits
    (torch.float32, 8, 3, 64, 1, None, False, 1),
    (torch.float32, 8, 3, 64, 5, 2.5, True, 3),
    (torch.bfloat16, 16, 2, 80, 16, None, True, None),
    (torch.float32, 16, 1, 64, 45, None, False, 3),
    (torch.float16, 8, 4, 64, 37, 2.5, False, 1),
    (torch.float32, 8, 3, 64, 1000, None, True, 3),
    (torch.bfloat16, 8, 3, 64, None, 2.5, True, 2),
]


@pytest.mark.parametrize("dtype,page,group,head_dim,window,softcap,sinks_on,num_splits", DECODE_CASES)
def test_decode_with_extras_matches_reference(dtype, page, group, head_dim, window, softcap, sinks_on, num_splits):
    lens = [1, 4, page, page + 1, 3 * page + 5, 0, 70]
    case = make_paged(lens, page=page, num_kv_heads=2, head_dim=head_dim, dtype=dtype, extra_cols=2)
    if window is not None:
        _poison_before_window(case, [max(0, n - window) for n in lens])
    query = (3 * torch.randn(len(lens), 2 * group, head_dim)).to(dtype)
    kw = {"sliding_window": window, "softcap": softcap, "sinks": _sinks(2 * group, sinks_on)}
    args = (query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, head_dim**-0.5)
    out = K.paged_decode_attention(*args, **kw, out=_poisoned(query), num_splits=num_splits, block_n=16)
    assert_close(out, ref.paged_decode_attention(*args, **kw), dtype, f"decode {kw}, splits={num_splits}")
    assert torch.all(out[5] == 0), "seq_len 0 must give zeros"


def test_decode_window_sets_the_split_count_by_its_span(monkeypatch):
    """A window much narrower than the table: the automatic split count follows the window's span (2
    partitions of 64 for W = 100, against 5 for the table's 320 positions), partitions start at each
    sequence's window, and the sinks are added once, in the reduction."""
    grids: list[tuple[int, ...]] = []
    original = DualKernel.launch

    def spy(self, device, grid, *args, **kwargs):
        grids.append(grid)
        return original(self, device, grid, *args, **kwargs)

    monkeypatch.setattr(DualKernel, "launch", spy)
    lens, window = [300, 41, 7], 100
    case = make_paged(lens, page=16, num_kv_heads=1, head_dim=64, dtype=torch.float32)
    _poison_before_window(case, [max(0, n - window) for n in lens])
    query = torch.randn(3, 4, 64)
    kw = {"sliding_window": window, "sinks": torch.randn(4)}
    args = (query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, 0.125)
    out = K.paged_decode_attention(*args, **kw, out=_poisoned(query), block_n=16)
    assert grids == [(3, 1, 2), (3, 4)], "the split kernel over (seq, kv head, split), then the reduction"
    assert_close(out, ref.paged_decode_attention(*args, **kw), torch.float32, "windowed auto split")


PREFILL_CASES = [
    # dtype, page, group, head_dim, block_m, block_n, window, softcap, sinks
    (torch.float32, 8, 3, 64, 16, 16, 1, None, False),
    (torch.float32, 8, 2, 64, 16, 16, 5, 2.5, True),
    (torch.bfloat16, 16, 3, 80, 32, 16, 16, None, False),
    (torch.float32, 8, 1, 64, 32, 16, 23, None, True),
    (torch.float16, 16, 2, 64, 16, 32, 40, 2.5, False),
    (torch.float32, 8, 1, 64, 16, 16, 1000, 2.5, True),
]


@pytest.mark.parametrize("dtype,page,group,head_dim,block_m,block_n,window,softcap,sinks_on", PREFILL_CASES)
def test_prefill_with_extras_matches_reference(dtype, page, group, head_dim, block_m, block_n, window, softcap,
                                               sinks_on):
    # Fresh prompts, chunks over earlier context longer and shorter than the window, single rows, an empty chunk.
    lens = [1, page + 1, 50, 70, 33, 9, 20]
    q_lens = [1, page + 1, 50, 21, 1, 3, 0]
    case = make_paged(lens, page=page, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    if window is not None:
        _poison_before_window(case, [max(0, n - q + 1 - window) for n, q in zip(lens, q_lens)])
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = (3 * torch.randn(int(qsl[-1]), 2 * group, head_dim)).to(dtype)
    kw = {"sliding_window": window, "softcap": softcap, "sinks": _sinks(2 * group, sinks_on)}
    args = (query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, head_dim**-0.5)
    out = K.paged_prefill_attention(*args, **kw, out=_poisoned(query), block_m=block_m, block_n=block_n)
    assert_close(out, ref.paged_prefill_attention(*args, **kw), dtype, f"prefill {kw}")


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_extras_are_checked(kernel):
    case = make_paged([4], page=8, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    query = torch.randn(1, 2, 16)
    args = (query, case.kv_cache, case.layer, case.block_tables)
    if kernel == "decode":
        call = lambda **kw: K.paged_decode_attention(*args, case.seq_lens, 0.1, **kw)  # noqa: E731
    else:
        qsl = torch.tensor([0, 1], dtype=torch.int32)
        call = lambda **kw: K.paged_prefill_attention(*args, qsl, case.seq_lens, 0.1, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="sliding_window"):
        call(sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        call(softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        call(sinks=torch.zeros(3))
