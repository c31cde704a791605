"""Sampler: each sampling parameter changes the result the way it should (exact logits for penalties,
fixed-seed statistics for distributions), seeded rows are reproducible whatever the batch, and logprobs
are those of the raw distribution."""

from __future__ import annotations

import math

import pytest
import torch

from streamd.engine.core.sequence import Sequence
from streamd.engine.sample.sampler import Sampler, SamplerOutput
from streamd.engine.sampling_params import SamplingParams

EOS = 0
ROWS = 4000  # rows per statistical check: std of a frequency <= 0.008, checks allow >= 4 std


def _seq(prompt=(1, 2, 3), output=(), sample_index: int = 0) -> Sequence:
    seq = Sequence(prompt_token_ids=list(prompt))
    for t in output:
        seq.append_token(t)
    seq.sample_index = sample_index
    return seq


def _batch(logits_row: list[float], params: SamplingParams, rows: int = ROWS):
    logits = torch.tensor([logits_row] * rows)
    return logits, [_seq() for _ in range(rows)], [params] * rows


def _freqs(tokens: list[int], vocab: int) -> list[float]:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab)
    return (counts.float() / len(tokens)).tolist()


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(vocab_size=8, eos_token_ids={EOS}, seed=1234)


def test_greedy_is_argmax_and_input_untouched(sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 8)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0)] * 16
    out = sampler(logits, [_seq() for _ in range(16)], params)
    assert isinstance(out, SamplerOutput) and out.logprobs is None
    assert out.token_ids == logits.argmax(-1).tolist()
    # Penalties too never modify the caller's tensor.
    sampler(logits, [_seq(output=[1, 2]) for _ in range(16)],
            [SamplingParams(temperature=0.7, repetition_penalty=1.5, presence_penalty=1.0)] * 16)
    assert torch.equal(logits, before)


def test_temperature_follows_softmax_of_scaled_logits(sampler) -> None:
    row = [0.0, math.log(2.0)] + [-1e9] * 6  # T=1: p = (1/3, 2/3)
    for temperature, p1 in [(1.0, 2 / 3), (0.5, 4 / 5), (2.0, math.sqrt(2) / (1 + math.sqrt(2)))]:
        out = sampler(*_batch(row, SamplingParams(temperature=temperature)))
        assert abs(_freqs(out.token_ids, 8)[1] - p1) < 0.03, temperature


def test_mixed_temperatures_and_greedy_rows_in_one_batch(sampler) -> None:
    row = [0.0, math.log(2.0)] + [-1e9] * 6
    hot, cold, greedy = SamplingParams(temperature=2.0), SamplingParams(temperature=0.5), SamplingParams(temperature=0)
    params = [hot, cold, greedy] * (ROWS // 2)
    out = sampler(torch.tensor([row] * len(params)), [_seq() for _ in params], params)
    assert abs(_freqs(out.token_ids[0::3], 8)[1] - math.sqrt(2) / (1 + math.sqrt(2))) < 0.03
    assert abs(_freqs(out.token_ids[1::3], 8)[1] - 0.8) < 0.03
    assert set(out.token_ids[2::3]) == {1}


def test_mixed_batch_gives_each_row_the_token_it_gets_alone() -> None:
    """Greedy rows beside sampled ones (seeded, so their draw is fixed), with every truncation path in
    one batch: each row's token equals the one it gets in a batch of its own."""
    torch.manual_seed(0)
    vocab = 64
    logits = torch.randn(9, vocab) * 3
    params = [SamplingParams(temperature=0), SamplingParams(seed=1, top_p=0.8),
              SamplingParams(temperature=0, repetition_penalty=1.3), SamplingParams(seed=2, top_k=5),
              SamplingParams(seed=3, temperature=0.7), SamplingParams(seed=4, top_k=10, top_p=0.5),
              SamplingParams(temperature=0), SamplingParams(seed=5, min_p=0.1, temperature=1.5),
              SamplingParams(seed=6, top_p=0.3, temperature=0.9)]
    seqs = [_seq(output=[i, 2 * i]) for i in range(len(params))]
    batched = Sampler(vocab, {EOS}).sample_async(logits, seqs, params).result().token_ids
    alone = [Sampler(vocab, {EOS})(logits[i:i + 1], [seqs[i]], [params[i]]).token_ids[0] for i in range(len(params))]
    assert batched == alone
    greedy_rows = [0, 6]
    assert [batched[i] for i in greedy_rows] == logits[greedy_rows].argmax(-1).tolist()


def test_top_k(sampler) -> None:
    row = [1.0, 0.5, 0.9, 0.2, 0.8, 0.0, 0.3, 0.1]
    out = sampler(*_batch(row, SamplingParams(temperature=2.0, top_k=1)))
    assert set(out.token_ids) == {0}  # top_k=1 is the argmax even at a high temperature
    out = sampler(*_batch(row, SamplingParams(temperature=2.0, top_k=3)))
    assert set(out.token_ids) == {0, 2, 4}
    # Renormalized over the kept 3 at T=2.
    kept = torch.softmax(torch.tensor([1.0, 0.9, 0.8]) / 2, 0).tolist()
    f = _freqs(out.token_ids, 8)
    assert all(abs(f[t] - p) < 0.03 for t, p in zip([0, 2, 4], kept))
    out = sampler(*_batch(row, SamplingParams(temperature=2.0, top_k=-1)))
    assert len(set(out.token_ids)) == 8


def test_top_p(sampler) -> None:
    probs = [0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]
    row = [math.log(p) if p else -1e9 for p in probs]
    out = sampler(*_batch(row, SamplingParams(top_p=0.01)))
    assert set(out.token_ids) == {0}
    # 0.5 + 0.3 reaches 0.6: keep exactly those two, renormalized to 5/8 and 3/8.
    out = sampler(*_batch(row, SamplingParams(top_p=0.6)))
    f = _freqs(out.token_ids, 8)
    assert set(out.token_ids) == {0, 1} and abs(f[0] - 0.625) < 0.03
    out = sampler(*_batch(row, SamplingParams(top_p=0.9)))
    assert set(out.token_ids) == {0, 1, 2}


def test_top_k_and_top_p_together_and_per_row(sampler) -> None:
    probs = [0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0]
    row = [math.log(p) if p else -1e9 for p in probs]
    a = SamplingParams(top_k=3, top_p=0.95)  # top-k keeps 3, top-p over those (0.4, 0.3, 0.2)/0.9 keeps all 3
    b = SamplingParams(top_k=-1, top_p=0.5)  # keeps 0.4 and 0.3
    c = SamplingParams(top_k=2)              # keeps 0.4 and 0.3
    params = [a, b, c] * (ROWS // 3)
    out = sampler(torch.tensor([row] * len(params)), [_seq() for _ in params], params)
    assert set(out.token_ids[0::3]) == {0, 1, 2}
    assert set(out.token_ids[1::3]) == {0, 1}
    assert set(out.token_ids[2::3]) == {0, 1}
    # Every top-p row also has a top-k (the path that avoids sorting the vocabulary): among the top 3,
    # renormalized (.44, .33, .22), top_p=0.6 keeps two; top_p=0.8 keeps three.
    d = SamplingParams(top_k=3, top_p=0.6)
    e = SamplingParams(top_k=3, top_p=0.8)
    f = SamplingParams(top_k=1, temperature=2.0)
    g = SamplingParams()
    params = [d, e, f, g] * (ROWS // 4)
    out = sampler(torch.tensor([row] * len(params)), [_seq() for _ in params], params)
    assert set(out.token_ids[0::4]) == {0, 1}
    assert abs(_freqs(out.token_ids[0::4], 8)[0] - 4 / 7) < 0.04
    assert set(out.token_ids[1::4]) == {0, 1, 2}
    assert set(out.token_ids[2::4]) == {0}
    assert set(out.token_ids[3::4]) == {0, 1, 2, 3}


def test_min_p(sampler) -> None:
    probs = [0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]
    row = [math.log(p) if p else -1e9 for p in probs]
    out = sampler(*_batch(row, SamplingParams(min_p=0.2)))  # threshold 0.1: drops 0.05
    assert set(out.token_ids) == {0, 1, 2}
    out = sampler(*_batch(row, SamplingParams(min_p=0.5)))  # threshold 0.25
    assert set(out.token_ids) == {0, 1}
    assert abs(_freqs(out.token_ids, 8)[0] - 0.625) < 0.03


HAND = [2.0, 1.0, -1.0, 0.5, 3.0, 0.0, -2.0, 1.5]


@pytest.mark.parametrize("kwargs, expected", [
    # prompt [0], output [1, 1, 2]
    (dict(repetition_penalty=2.0), [1.0, 0.5, -2.0, 0.5, 3.0, 0.0, -2.0, 1.5]),
    (dict(frequency_penalty=0.5), [2.0, 0.0, -1.5, 0.5, 3.0, 0.0, -2.0, 1.5]),
    (dict(presence_penalty=0.5), [2.0, 0.5, -1.5, 0.5, 3.0, 0.0, -2.0, 1.5]),
    (dict(frequency_penalty=-1.0), [2.0, 3.0, 0.0, 0.5, 3.0, 0.0, -2.0, 1.5]),
    # Repetition first, then frequency, then presence.
    (dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.5),
     [1.0, -1.0, -3.0, 0.5, 3.0, 0.0, -2.0, 1.5]),
])
def test_penalties_exact(sampler, kwargs, expected) -> None:
    logits = torch.tensor([HAND, HAND])
    seqs = [_seq(prompt=[0], output=[1, 1, 2]), _seq(prompt=[0], output=[1, 1, 2])]
    params = [SamplingParams(**kwargs), SamplingParams()]  # second row: no penalties, unchanged
    got = sampler.penalize(logits, seqs, params)
    assert torch.allclose(got[0], torch.tensor(expected)), got[0]
    assert torch.equal(got[1], torch.tensor(HAND))


def test_penalties_change_greedy_choice(sampler) -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, 0, 0, 0, 0, 0]])
    seen_1 = [_seq(prompt=[5], output=[1])]
    assert sampler(logits, seen_1, [SamplingParams(temperature=0)]).token_ids == [1]
    for kw in (dict(presence_penalty=0.2), dict(frequency_penalty=0.2), dict(repetition_penalty=1.1)):
        assert sampler(logits, seen_1, [SamplingParams(temperature=0, **kw)]).token_ids == [2], kw
    # Repetition penalty also covers prompt tokens; OpenAI penalties do not.
    in_prompt = [_seq(prompt=[1], output=[])]
    assert sampler(logits, in_prompt, [SamplingParams(temperature=0, repetition_penalty=1.1)]).token_ids == [2]
    assert sampler(logits, in_prompt, [SamplingParams(temperature=0, presence_penalty=2.0)]).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_tokens(sampler) -> None:
    logits = torch.tensor([[9.0, 1.0, 8.0, 0, 0, 0, 0, 0]])  # EOS (0) best, then stop token 2
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2])
    assert sampler(logits, [_seq(output=[5])], [params]).token_ids == [1]
    assert sampler(logits, [_seq(output=[5, 5, 5])], [params]).token_ids == [0]
    assert sampler(logits, [_seq(output=[5])], [SamplingParams(temperature=0)]).token_ids == [0]
    # ignore_eos: EOS is not a stop, so min_tokens leaves it alone (only the stop token is masked).
    ignore = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2], ignore_eos=True)
    assert sampler(logits, [_seq(output=[5])], [ignore]).token_ids == [0]
    # Sampled rows too: EOS never drawn, however likely.
    out = sampler(*_batch([5.0] + [0.0] * 7, SamplingParams(min_tokens=1), rows=500))
    assert EOS not in out.token_ids


def test_seeded_rows_reproducible_across_batches_and_positions() -> None:
    torch.manual_seed(0)
    vocab = 50
    logit_rows = torch.randn(20, vocab)  # the seeded sequence's logits at output positions 0..19
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(sampler: Sampler, companions: int, where: int) -> list[int]:
        seq = _seq()
        for step in range(20):
            others = [_seq(output=[1] * step) for _ in range(companions)]
            other_params = [SamplingParams(temperature=0.8, top_k=10) if i % 2 else SamplingParams(seed=i)
                            for i in range(companions)]
            pos = min(where, companions)
            seqs = others[:pos] + [seq] + others[pos:]
            params = other_params[:pos] + [seeded] + other_params[pos:]
            logits = torch.randn(len(seqs), vocab)
            logits[pos] = logit_rows[step]
            token = sampler(logits, seqs, params).token_ids[pos]
            seq.append_token(token)
        return seq.output_token_ids

    ref = run(Sampler(vocab, {EOS}), 0, 0)
    assert run(Sampler(vocab, {EOS}, seed=5), 7, 3) == ref
    assert run(Sampler(vocab, {EOS}), 12, 12) == ref
    # Stateless: the token at a given position does not depend on what was sampled before (recompute).
    again = Sampler(vocab, {EOS})(logit_rows[7:8], [_seq(output=ref[:7])], [seeded]).token_ids
    assert again == [ref[7]]
    # A different seed or sample index gives a different stream.
    other = Sampler(vocab, {EOS})
    assert [other(logit_rows[i:i + 1], [_seq(output=ref[:i])], [SamplingParams(seed=43)]).token_ids[0]
            for i in range(20)] != ref
    assert [other(logit_rows[i:i + 1], [_seq(output=ref[:i], sample_index=1)], [seeded]).token_ids[0]
            for i in range(20)] != ref


def test_seeded_sampling_has_the_right_distribution(sampler) -> None:
    row = [0.0, math.log(3.0)] + [-1e9] * 6  # p = (1/4, 3/4)
    params = [SamplingParams(seed=s) for s in range(ROWS)]
    out = sampler(torch.tensor([row] * ROWS), [_seq() for _ in params], params)
    assert abs(_freqs(out.token_ids, 8)[1] - 0.75) < 0.03


def test_engine_seed_makes_unseeded_rows_reproducible() -> None:
    logits, seqs, params = _batch([0.0] * 8, SamplingParams(), rows=64)
    a = Sampler(8, {EOS}, seed=3)(logits, seqs, params).token_ids
    assert Sampler(8, {EOS}, seed=3)(logits, seqs, params).token_ids == a
    assert Sampler(8, {EOS}, seed=4)(logits, seqs, params).token_ids != a


def test_logprobs_are_raw_top_n_plus_sampled(sampler) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 0.2, 0.1]] * 3)
    raw = torch.log_softmax(logits[0], -1)
    seqs = [_seq(output=[3]) for _ in range(3)]
    params = [
        SamplingParams(temperature=0, logprobs=2),
        # Presence penalty moves the greedy choice off the top token; logprobs stay the raw ones.
        SamplingParams(temperature=0, presence_penalty=2.0, logprobs=1),
        SamplingParams(temperature=0),
    ]
    out = sampler(logits, seqs, params)
    assert out.token_ids == [3, 0, 3]
    assert list(out.logprobs[0]) == [3, 0]
    assert out.logprobs[0][3] == pytest.approx(raw[3].item()) and out.logprobs[0][0] == pytest.approx(raw[0].item())
    # Top-1 is token 3, and the sampled token 0 is there too, with its raw logprob.
    assert set(out.logprobs[1]) == {3, 0} and out.logprobs[1][0] == pytest.approx(raw[0].item())
    assert out.logprobs[2] == {}
    out = sampler(logits[:1], seqs[:1], [SamplingParams(temperature=0, logprobs=0)])
    assert out.logprobs == [{3: pytest.approx(raw[3].item())}]


def test_padded_vocab_columns_never_sampled() -> None:
    sampler = Sampler(vocab_size=4, eos_token_ids={EOS})
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 50.0, 50.0]] * 200)
    assert max(sampler(logits, [_seq()] * 200, [SamplingParams(temperature=0)] * 200).token_ids) < 4
    assert max(sampler(logits, [_seq()] * 200, [SamplingParams()] * 200).token_ids) < 4


def test_empty_batch_and_mismatched_lengths(sampler) -> None:
    assert sampler(torch.zeros(0, 8), [], []).token_ids == []
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 8), [_seq()], [SamplingParams()])


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@CUDA
def test_no_host_sync_in_a_call_on_cuda() -> None:
    """Every feature at once, and the common cases: no synchronizing operation at all (the tokens' copy to
    the host is waited on through an event; parameter tensors are staged through pinned memory without
    blocking; measured on an H100 at 9f22c38: 0 for each case)."""
    import warnings

    dev = torch.device("cuda")
    vocab, n = 1000, 12
    sampler = Sampler(vocab, {EOS})
    seqs = [_seq(prompt=[5, 6, 7], output=[8, 9, 9][: i % 4], sample_index=i % 2) for i in range(n)]
    everything = [
        SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
        SamplingParams(top_p=0.5), SamplingParams(min_p=0.1, seed=3), SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.2, min_tokens=5, stop_token_ids=[7]),
        SamplingParams(logprobs=3, temperature=1.3), SamplingParams(top_k=5, seed=11),
    ]
    cases = {
        "greedy": [SamplingParams(temperature=0)] * n,
        "temperature": [SamplingParams(temperature=0.8)] * n,
        "everything": [everything[i % len(everything)] for i in range(n)],
    }
    for name, params in cases.items():
        logits = torch.randn(n, vocab, device=dev)
        sampler(logits, seqs, params)  # warm-up: pinned allocator, kernels
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = sampler(logits, seqs, params)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
        assert syncs == [], (name, syncs)
        assert len(out.token_ids) == n and all(0 <= t < vocab for t in out.token_ids)


@pytest.mark.cuda
@CUDA
def test_seeded_reproducible_on_cuda() -> None:
    dev = torch.device("cuda")
    vocab = 500
    row = torch.randn(vocab, device=dev)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=99)
    sampler = Sampler(vocab, {EOS})
    picks = []
    for companions in (0, 5, 31):
        logits = torch.randn(companions + 1, vocab, device=dev)
        logits[companions // 2] = row
        params = [SamplingParams(temperature=0.9)] * companions
        params.insert(companions // 2, seeded)
        out = sampler(logits, [_seq(output=[1, 2]) for _ in params], params)
        picks.append(out.token_ids[companions // 2])
    assert len(set(picks)) == 1


@pytest.mark.cuda
@CUDA
def test_distributions_on_cuda() -> None:
    """The CUDA draw (exponential_) has the same statistics as the CPU one, seeded rows too."""
    dev = torch.device("cuda")
    sampler = Sampler(8, {EOS}, seed=5)
    row = [0.0, math.log(3.0)] + [-1e9] * 6  # p = (1/4, 3/4)
    params = [SamplingParams(), SamplingParams(seed=0)] * (ROWS // 2)
    params = [p if i % 2 == 0 else SamplingParams(seed=i) for i, p in enumerate(params)]
    out = sampler(torch.tensor([row] * ROWS, device=dev), [_seq() for _ in params], params)
    assert abs(_freqs(out.token_ids[0::2], 8)[1] - 0.75) < 0.04
    assert abs(_freqs(out.token_ids[1::2], 8)[1] - 0.75) < 0.04
    top = sampler(torch.tensor([row] * 64, device=dev), [_seq()] * 64, [SamplingParams(top_k=1)] * 64)
    assert set(top.token_ids) == {1}


def test_logit_bias_adds_per_row_and_keeps_the_callers_logits(sampler) -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, logit_bias={"3": -100}), SamplingParams(temperature=0.0,
                                                                                        logit_bias={5: 100})]
    assert sampler(logits, [_seq(), _seq()], params).token_ids == [2, 5]
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"-1": 1})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("nan")})


END = [6, 7]  # a two-token `</think>`


def _budget(budget: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, thinking_token_budget=budget, thinking_end_token_ids=END)


@pytest.mark.parametrize("output, forced", [
    ([1, 2], None),  # within budget
    ([1, 2, 3], 6),  # budget spent: the closing sequence's first token
    ([1, 2, 3, 6], 7),  # then its next
    ([1, 2, 3, 6, 7], None),  # closed
    ([1, 6, 7], None),  # the model closed it itself before the budget
    ([1, 6, 7, 4, 6], None),  # ... and went on
    ([1, 2, 3, 5], None),  # something else after the budget (cannot happen while forcing): left alone
])
def test_forced_thinking_token(output: list[int], forced: int | None) -> None:
    from streamd.engine.sample.sampler import forced_thinking_token

    assert forced_thinking_token(output, _budget(3)) == forced


def test_the_budget_forces_the_closing_tokens_whatever_the_logits(sampler) -> None:
    logits = torch.tensor([[9.0, 9.0, 9.0, 9.0, 9.0, 9.0, -50.0, -50.0]] * 3)
    seqs = [_seq(output=(1, 2)), _seq(output=(1, 2, 3)), _seq(output=(1, 2, 3, 6))]
    assert sampler(logits, seqs, [_budget(3)] * 3).token_ids[1:] == [6, 7]
    with pytest.raises(ValueError, match="thinking_end_token_ids"):
        SamplingParams(thinking_token_budget=3)
    assert _budget(3).needs_host_tokens
