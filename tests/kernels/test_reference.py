"""The plain-torch references (streamd.kernels.reference) against the spec: dense float64 attention
and explicit per-token loops. No Triton here; these run in well under a second each."""

from __future__ import annotations

import pytest
import torch
from paged_testlib import assert_close, eager_attention, make_paged, naive_attention, sink_logits
from torch.utils._python_dispatch import TorchDispatchMode

from streamd.kernels import reference as ref


@pytest.mark.parametrize(
    "dtype,page,num_kv_heads,group,head_dim",
    [
        (torch.float32, 16, 2, 1, 64),
        (torch.bfloat16, 8, 1, 3, 80),
        (torch.float16, 32, 2, 7, 96),
        (torch.float32, 128, 1, 4, 256),
    ],
)
def test_decode_reference_matches_dense_float64(dtype, page, num_kv_heads, group, head_dim):
    lens = [1, page - 1, page, page + 1, 3 * page + 5, 0]
    case = make_paged(lens, page=page, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, extra_cols=2)
    # The reference must not dereference padded entries, whatever they hold.
    need = [-(-n // page) for n in lens]
    for i, n in enumerate(need):
        case.block_tables[i, n:] = torch.tensor([-7, 10**6] * 8, dtype=torch.int32)[: case.block_tables.shape[1] - n]
    h = num_kv_heads * group
    query = torch.randn(len(lens), h, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = ref.paged_decode_attention(query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    expect = naive_attention(query, case, [[n - 1] for n in lens], scale)
    assert_close(out, expect, dtype, "decode reference")
    assert torch.all(out[-1] == 0), "seq_len 0 must give zeros"


@pytest.mark.parametrize("step_kv", [False, True])
@pytest.mark.parametrize("dtype,page,group,head_dim", [(torch.float32, 16, 3, 64), (torch.bfloat16, 8, 7, 80),
                                                       (torch.float16, 8, 2, 64)])
def test_prefill_reference_matches_dense_float64(dtype, page, group, head_dim, step_kv):
    """With `step_kv` the step's K/V (what it stored) are handed over too: fresh sequences attend over them."""
    lens = [1, page - 1, page + 1, 40, 70, 9]
    q_lens = [1, page - 1, 5, 40, 1, 3]  # fresh prompts, a prefix-cached chunk, decode-like rows
    case = make_paged(lens, page=page, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 2 * group, head_dim).to(dtype)
    scale = 0.7 * head_dim**-0.5
    kv = case.kv_cache[:, case.layer]
    slots = [(int(case.block_tables[i, p // page]), p % page) for i, (n, q) in enumerate(zip(lens, q_lens))
             for p in range(n - q, n)]
    step = {"key": torch.stack([kv[b, 0, :, o] for b, o in slots]),
            "value": torch.stack([kv[b, 1, :, o] for b, o in slots])} if step_kv else {}
    out = ref.paged_prefill_attention(query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, scale,
                                      **step)
    positions = [list(range(n - q, n)) for n, q in zip(lens, q_lens)]
    assert_close(out, naive_attention(query, case, positions, scale), dtype, "prefill reference")


def test_store_kv_reference_matches_loop():
    kv = torch.randn(6, 3, 2, 2, 8, 64)
    expect = kv.clone()
    key, value = torch.randn(10, 2, 64), torch.randn(10, 2, 64)
    slots = torch.randperm(48)[:10]
    slots[[2, 5]] = -1
    ref.store_kv(key, value, kv, 2, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect[slot // 8, 2, 0, :, slot % 8] = key[t]
            expect[slot // 8, 2, 1, :, slot % 8] = value[t]
    assert torch.equal(kv, expect)


def test_copy_blocks_reference_matches_loop():
    kv = torch.randn(8, 2, 2, 3, 16, 64)
    expect = kv.clone()
    src, dst = torch.tensor([1, 1, 4]), torch.tensor([0, 6, 7])
    ref.copy_blocks(kv, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        expect[d] = expect[s]
    assert torch.equal(kv, expect)


class _OpCount(TorchDispatchMode):
    """Counts the aten ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _decode_ops(num_seqs: int) -> int:
    lens = torch.randint(400, 600, (num_seqs,)).tolist()
    case = make_paged(lens, page=16, num_kv_heads=3, head_dim=64, dtype=torch.float32, num_layers=1, layer=0)
    query = torch.randn(num_seqs, 9, 64)
    with _OpCount() as count:
        ref.paged_decode_attention(query, case.kv_cache, 0, case.block_tables, case.seq_lens, 0.125)
    return count.ops


def test_decode_reference_is_batched_on_cpu():
    """The CPU serves decode through the reference: one batch of ops for any number of sequences (a loop
    over sequences would make a 100-sequence step, SmolLM2-135M's attention shapes, ~100x the ops of one).
    Counted, not timed: a timing bound fails on a loaded machine."""
    assert _decode_ops(100) == _decode_ops(3)


def test_prefill_reference_wants_the_steps_key_and_value_together():
    case = make_paged([4], page=8, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    query, qsl = torch.randn(4, 1, 16), torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="key and value together"):
        ref.paged_prefill_attention(query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, 0.1,
                                    key=torch.randn(4, 1, 16))


# transformers' extras: a sliding window (W tokens, the query's own included), Gemma 2's logit soft-capping,
# gpt-oss's sinks. Queries are scaled up so the logits are large enough for a cap of 2.5 to bite.
EXTRAS = [
    # window, softcap, sinks
    (1, None, False),
    (16, None, False),
    (23, 2.5, False),
    (None, 2.5, False),
    (None, None, True),
    (5, 2.5, True),
    (1000, None, True),
]


def _sinks(heads: int, dtype: torch.dtype, on: bool) -> torch.Tensor | None:
    return sink_logits(heads).to(dtype) if on else None


def _assert_extras_matter(out: torch.Tensor, plain: torch.Tensor, window: int | None, dtype: torch.dtype) -> None:
    """The case is not vacuous: what the extras change is well beyond the tolerance (a window wider
    than every context changes nothing by itself)."""
    if window is None or window < 100:
        assert (out.double() - plain).abs().max() > 0.1, "the extras changed nothing: the test proves nothing"


@pytest.mark.parametrize("window,softcap,sinks_on", EXTRAS)
@pytest.mark.parametrize("dtype,page,group", [(torch.float32, 8, 3), (torch.bfloat16, 16, 1)])
def test_decode_reference_with_extras_matches_eager(dtype, page, group, window, softcap, sinks_on):
    lens = [1, 4, page - 1, page, page + 1, 3 * page + 5, 0, 57]
    case = make_paged(lens, page=page, num_kv_heads=2, head_dim=64, dtype=dtype, extra_cols=2)
    need = [-(-n // page) for n in lens]
    for i, n in enumerate(need):  # padded entries hold garbage: never dereferenced, windowed or not
        case.block_tables[i, n:] = torch.tensor([-7, 10**6] * 8, dtype=torch.int32)[: case.block_tables.shape[1] - n]
    query = (3 * torch.randn(len(lens), 2 * group, 64)).to(dtype)
    sinks = _sinks(2 * group, dtype, sinks_on)
    out = ref.paged_decode_attention(query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, 0.125,
                                     sliding_window=window, softcap=softcap, sinks=sinks)
    positions = [[n - 1] for n in lens]
    expect = eager_attention(query, case, positions, 0.125, window=window, softcap=softcap, sinks=sinks)
    assert_close(out, expect, dtype, f"decode reference window={window} softcap={softcap} sinks={sinks_on}")
    assert torch.all(out[6] == 0), "seq_len 0 must give zeros"
    _assert_extras_matter(out, naive_attention(query, case, positions, 0.125), window, dtype)


@pytest.mark.parametrize("step_kv", [False, True])
@pytest.mark.parametrize("window,softcap,sinks_on", EXTRAS)
def test_prefill_reference_with_extras_matches_eager(window, softcap, sinks_on, step_kv):
    """Fresh prompts (with `step_kv`: over the step's own K/V), chunks over earlier context of every size
    relative to the window, decode-like single rows."""
    dtype, page, group = torch.float32, 8, 3
    lens = [1, 9, 40, 70, 33, 9, 26]
    q_lens = [1, 9, 40, 13, 1, 3, 26]
    case = make_paged(lens, page=page, num_kv_heads=2, head_dim=64, dtype=dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = 3 * torch.randn(int(qsl[-1]), 2 * group, 64)
    kv = case.kv_cache[:, case.layer]
    slots = [(int(case.block_tables[i, p // page]), p % page) for i, (n, q) in enumerate(zip(lens, q_lens))
             for p in range(n - q, n)]
    step = {"key": torch.stack([kv[b, 0, :, o] for b, o in slots]),
            "value": torch.stack([kv[b, 1, :, o] for b, o in slots])} if step_kv else {}
    sinks = _sinks(2 * group, dtype, sinks_on)
    out = ref.paged_prefill_attention(query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, 0.125,
                                      sliding_window=window, softcap=softcap, sinks=sinks, **step)
    positions = [list(range(n - q, n)) for n, q in zip(lens, q_lens)]
    expect = eager_attention(query, case, positions, 0.125, window=window, softcap=softcap, sinks=sinks)
    assert_close(out, expect, dtype, f"prefill reference window={window} softcap={softcap} sinks={sinks_on}")
    _assert_extras_matter(out, naive_attention(query, case, positions, 0.125), window, dtype)


def test_prefill_reference_in_chunks_equals_one_pass_with_a_window():
    """A prompt prefilled in three chunks (each over the pool the earlier ones filled) gives the rows the
    whole prompt gives in one pass: the window's lower edge moves with each chunk."""
    n, window = 45, 11
    case = make_paged([n], page=8, num_kv_heads=1, head_dim=32, dtype=torch.float32)
    query = 3 * torch.randn(n, 2, 32)
    sinks = torch.randn(2)
    one = ref.paged_prefill_attention(query, case.kv_cache, case.layer, case.block_tables,
                                      torch.tensor([0, n], dtype=torch.int32), case.seq_lens, 0.2,
                                      sliding_window=window, softcap=3.0, sinks=sinks)
    for lo, hi in [(0, 13), (13, 30), (30, 45)]:
        chunk = ref.paged_prefill_attention(query[lo:hi], case.kv_cache, case.layer, case.block_tables,
                                            torch.tensor([0, hi - lo], dtype=torch.int32),
                                            torch.tensor([hi], dtype=torch.int32), 0.2,
                                            sliding_window=window, softcap=3.0, sinks=sinks)
        torch.testing.assert_close(chunk, one[lo:hi], atol=1e-5, rtol=1e-5)
