"""Beam search in the engine: token ids equal Hugging Face `generate(num_beams=K, do_sample=False)` on the
default model (float32) for widths 2-4, both early-stopping modes and "never"; beam groups of different
widths share one batched candidate selection; a preempted beam group (swap and recompute) gives the same
beams; an aborted one frees every candidate's blocks at once; copy-on-write copies only the last, partly
filled block of a forked beam."""

from __future__ import annotations

import pytest
import torch

from streamd import LLM, SamplingParams
from streamd.engine.core.sequence import Sequence
from streamd.engine.errors import KVCacheCapacityError
from streamd.engine.sample.beam_search import BeamHypothesis, BeamSearch, BeamStep, Candidate
from tests.helpers import fold_deltas, random_prompt, run_to_completion, sizes, tiny_llm

CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
# (beam width, early_stopping, length_penalty)
SEARCHES = [(2, True, 1.0), (3, False, 1.0), (4, True, 1.0), (4, False, 0.5), (3, "never", 1.0)]
MAX_TOKENS = 20
# (chat, search) pairs: light, every search once and every chat in turn; full (slow), every search on every chat.
LIGHT_CASES = [(CHATS[i % len(CHATS)], search) for i, search in enumerate(SEARCHES)]
FULL_CASES = [(chat, search) for search in SEARCHES for chat in CHATS]


def _beams(width: int, early_stopping: bool | str = False, length_penalty: float = 1.0, **kw) -> SamplingParams:
    return SamplingParams(use_beam_search=True, beam_width=width, n=kw.pop("n", width), early_stopping=early_stopping,
                          length_penalty=length_penalty, **{"max_tokens": MAX_TOKENS, "detokenize": False, **kw})


@torch.inference_mode()
def _hf_beams(model, ids: list[int], width: int, early_stopping: bool | str, length_penalty: float,
              eos: int | list[int], min_new_tokens: int = 0) -> list[list[int]]:
    stops = eos if isinstance(eos, list) else [eos]
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), num_beams=width, num_return_sequences=width,
                         do_sample=False, early_stopping=early_stopping, length_penalty=length_penalty,
                         max_new_tokens=MAX_TOKENS, min_new_tokens=min_new_tokens or None, eos_token_id=stops,
                         pad_token_id=stops[0])
    beams = []
    for row in out[:, len(ids):].tolist():  # shorter beams are padded (with EOS) after their stop token
        end = next((i for i, t in enumerate(row) if t in stops), None)
        beams.append(row if end is None else row[:end + 1])
    return beams


@pytest.mark.parametrize("chats_and_searches", sizes(LIGHT_CASES, FULL_CASES))
def test_beams_equal_hf_generate(smol_llm: LLM, hf_smol, chats_and_searches) -> None:
    engine = smol_llm.engine
    (eos,) = engine.eos_token_ids
    cases = [(engine.apply_chat_template([{"role": "user", "content": chat}]), search)
             for chat, search in chats_and_searches]
    # Every case in one run: groups of widths 2, 3 and 4 share each step's candidate selection.
    outputs = run_to_completion(engine, [ids for ids, _ in cases], [_beams(*search) for _, search in cases])
    finishes = set()
    for (ids, search), out in zip(cases, outputs):
        got = [choice.token_ids for choice in out.outputs]
        assert got == _hf_beams(hf_smol, ids, *search, eos), f"{search} on {ids[-12:]} diverged from transformers"
        finishes |= {choice.finish_reason for choice in out.outputs}
    assert finishes == {"stop", "length"}  # beams ended by EOS and by max_tokens both compared


def test_min_tokens_and_stop_token_ids_equal_hf_generate(smol_llm: LLM, hf_smol) -> None:
    engine = smol_llm.engine
    (eos,) = engine.eos_token_ids
    ids = engine.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    period = smol_llm.tokenizer.convert_tokens_to_ids(".")
    params = [_beams(2, False, min_tokens=12), _beams(3, True, stop_token_ids=[period])]
    late, stopped = run_to_completion(engine, [ids, ids], params)
    assert [c.token_ids for c in late.outputs] == _hf_beams(hf_smol, ids, 2, False, 1.0, eos, min_new_tokens=12)
    assert all(len(c.token_ids) > 12 for c in late.outputs)
    assert [c.token_ids for c in stopped.outputs] == _hf_beams(hf_smol, ids, 3, True, 1.0, [eos, period])
    assert {c.finish_reason for c in stopped.outputs} == {"stop"}
    assert any(c.stop_reason == period and c.token_ids[-1] == period for c in stopped.outputs)


def test_best_n_of_the_beams_with_text(smol_llm: LLM) -> None:
    ids = smol_llm.engine.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    params = _beams(4, True, detokenize=True)
    best2 = run_to_completion(smol_llm.engine, [ids], _beams(4, True, n=2, detokenize=True))[0]
    every = run_to_completion(smol_llm.engine, [ids], params)[0]
    assert [c.index for c in best2.outputs] == [0, 1]
    assert [c.token_ids for c in best2.outputs] == [c.token_ids for c in every.outputs[:2]]
    for choice in every.outputs:  # the text is the beam's, without the EOS token's
        body = choice.token_ids[:-1] if choice.finish_reason == "stop" else choice.token_ids
        assert choice.text == smol_llm.tokenizer.decode(body, skip_special_tokens=True)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempting_a_beam_group_keeps_its_beams(mode: str) -> None:
    prompts = [random_prompt(i, 10) for i in range(6)] + [random_prompt(9, 20)]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, detokenize=False)
    params = [greedy] * 6 + [_beams(3, False, max_tokens=40, ignore_eos=True)]
    roomy = run_to_completion(tiny_llm(num_kv_blocks=200, num_swap_blocks=0).engine, prompts, params)
    # 34 blocks of 8: the beam group's worst case (20 blocks) fits at admission beside the six prompts, but
    # not beside the six single sequences growing: the group, the latest arrival, is preempted.
    engine = tiny_llm(num_kv_blocks=34, num_swap_blocks=64 if mode == "swap" else 0, preemption_mode=mode,
                   enable_prefix_caching=False).engine  # recomputed beams share nothing: their prefills are chunked
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    folded: dict = {}
    beams_preempted = False
    while engine.has_unfinished_requests():
        fold_deltas(engine.step(), folded)
        preempted = engine.scheduler.swapped if mode == "swap" else engine.scheduler.waiting
        beams_preempted |= any(g.request_id == "r6" and len(g.seqs) == 3 for g in preempted)
    assert beams_preempted
    tight = [folded[f"r{i}"].build() for i in range(len(prompts))]
    assert [[c.token_ids for c in o.outputs] for o in tight] == [[c.token_ids for c in o.outputs] for o in roomy]
    assert len({tuple(c.token_ids) for c in tight[6].outputs}) == 3


@pytest.mark.parametrize("steps", [1, 6])  # before the beams are forked, and after
def test_aborting_a_beam_group_frees_every_candidate(steps: int) -> None:
    engine = tiny_llm(num_kv_blocks=60, num_swap_blocks=0).engine
    engine.add_request("b", random_prompt(4, 21), _beams(4, n=2, max_tokens=30, ignore_eos=True))
    folded: dict = {}
    for _ in range(steps):
        fold_deltas(engine.step(), folded)
    live = engine.stats().kv
    assert live.blocks_free < live.blocks_total
    engine.abort("b")
    assert engine.stats().kv.blocks_free == engine.stats().kv.blocks_total
    while engine.has_unfinished_requests():
        fold_deltas(engine.step(), folded)
    out = folded["b"].build()
    assert [c.index for c in out.outputs] == [0, 1]
    assert {c.finish_reason for c in out.outputs} == {"abort"}


@pytest.mark.parametrize("prompt_len", [37, 40])  # the prompt's last block partly filled, and full
def test_copy_on_write_copies_only_the_last_partly_filled_block(prompt_len: int) -> None:
    llm = tiny_llm(num_kv_blocks=120, num_swap_blocks=0)
    engine, bs = llm.engine, 8
    copies: list[tuple[int, int]] = []
    expected = [0]  # copies due: forks whose next write lands inside a partly filled block
    copy, replace = engine.cache.copy, engine.scheduler.replace_beams

    def recording_copy(pairs):
        copies.extend(pairs)
        return copy(pairs)

    def recording_replace(group, parents):
        for parent in set(parents):
            if parent.num_computed_tokens % bs:
                expected[0] += parents.count(parent) - 1
        return replace(group, parents)

    engine.cache.copy, engine.scheduler.replace_beams = recording_copy, recording_replace
    try:
        before = engine.stats().kv
        out = run_to_completion(engine, [random_prompt(prompt_len, prompt_len)],
                                _beams(4, max_tokens=24, ignore_eos=True))[0]
    finally:
        del engine.cache.copy, engine.scheduler.replace_beams
    assert all(len(c.token_ids) == 24 for c in out.outputs)
    copied = engine.stats().kv.copied_blocks - before.copied_blocks
    assert copied == len(copies) == expected[0] > 0


def test_a_beam_group_whose_worst_case_never_fits_is_refused() -> None:
    engine = tiny_llm(num_kv_blocks=30, num_swap_blocks=0).engine
    with pytest.raises(KVCacheCapacityError, match="beam_width=6"):
        engine.add_request("big", random_prompt(5, 20), _beams(6, max_tokens=60))


def _search(width: int, early_stopping: bool | str, length_penalty: float = 1.0, max_tokens: int = 10) -> BeamSearch:
    params = SamplingParams(use_beam_search=True, beam_width=width, early_stopping=early_stopping,
                            length_penalty=length_penalty, max_tokens=max_tokens)
    return BeamSearch.create(params, {2}, max_tokens)


def _step(search: BeamSearch, beams: list[Sequence], candidates: list[tuple[float, int, int]]) -> BeamStep:
    return search.step([Candidate(score, beam, token) for score, beam, token in candidates], beams)


def test_beam_step_rules() -> None:
    """HF's rules on hand-made candidates (EOS is token 2; two beams of one output token each)."""
    beams = [Sequence([7, 8], token_ids=[7, 8, t]) for t in (5, 6)]
    # An EOS candidate ranked below K is not kept; one within the top K is, scored sum / length.
    search = _search(2, True)
    step = _step(search, beams, [(-1.0, 0, 9), (-1.5, 1, 9), (-2.0, 1, 2), (-3.0, 0, 4)])
    assert not step.done and not search.finished
    assert [(c.beam, c.token_id) for c in step.beams] == [(0, 9), (1, 9)] and search.scores == [-1.0, -1.5]
    step = _step(search, beams, [(-1.0, 0, 2), (-1.2, 1, 3), (-1.4, 1, 4), (-5.0, 0, 2)])
    assert [(h.token_ids, h.score, h.finish_reason) for h in search.finished] == [([5, 2], -0.5, "stop")]
    assert [(c.beam, c.token_id) for c in step.beams] == [(1, 3), (1, 4)] and not step.done
    # With K hypotheses finished (here from earlier steps), early_stopping=True stops; False goes on while
    # the best running beam, at the current length, beats the worst of them; "never" (positive penalty)
    # measures it at the longest length (10 tokens).
    earlier = [BeamHypothesis([4, 2], -1.0, "stop", None), BeamHypothesis([3, 2], -1.0, "stop", None)]
    for early, running, done in ((True, -1.5, True), (False, -1.5, False), (False, -2.5, True),
                                 ("never", -2.5, False)):
        search = _search(2, early)
        search.finished = list(earlier)
        step = _step(search, beams, [(running, 0, 3), (running - 0.1, 1, 3), (running - 0.2, 0, 4)])
        assert step.done is done, (early, running)  # -1.5 / 2 > -1.0 >= -2.5 / 2; -2.5 / 10 > -1.0
    # At the length limit the top K candidates finish by length.
    search = _search(2, False, max_tokens=2)
    step = _step(search, beams, [(-1.0, 0, 9), (-1.1, 1, 2), (-1.2, 0, 3)])
    assert step.done and [(h.token_ids, h.finish_reason) for h in search.finished] == [([5, 9], "length"),
                                                                                       ([6, 2], "stop")]


def test_one_batched_candidate_selection_per_step(monkeypatch) -> None:
    """Every beam request's candidates come from one device operation per step (one transfer to the
    host), whatever the number of requests and their widths; other requests still sample beside them."""
    from streamd.engine.sample import beam_search

    engine = tiny_llm(num_kv_blocks=200, num_swap_blocks=0).engine
    calls: list[list[tuple[str, int]]] = []
    select = beam_search.select_candidates

    def recording_select(logits, groups, vocab_size, bitmask=None):
        calls.append([(g.request_id, len(g.rows)) for g in groups])
        return select(logits, groups, vocab_size, bitmask)

    monkeypatch.setattr(beam_search, "select_candidates", recording_select)
    for i, width in enumerate((2, 3, 4)):
        engine.add_request(f"b{i}", random_prompt(20 + i, 12 + i), _beams(width, max_tokens=10, ignore_eos=True))
    engine.add_request("g", random_prompt(30, 9), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                                  detokenize=False))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert len(calls) <= steps and {rid for call in calls for rid, _ in call} == {"b0", "b1", "b2"}
    assert calls[1] == [("b0", 2), ("b1", 3), ("b2", 4)]  # after the prompts: every beam of every request


class _GrammarMask:
    """A transformers logits processor for the reference: each row's mask from a fresh xgrammar matcher fed
    that row's generated tokens (stateless, so it stays right however beam search reorders rows)."""

    def __init__(self, compiled, prompt_len: int, vocab_size: int) -> None:
        self.compiled, self.prompt_len, self.vocab_size = compiled, prompt_len, vocab_size

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(input_ids.shape[0], self.vocab_size)
        for row, ids in enumerate(input_ids.tolist()):
            matcher = xgr.GrammarMatcher(self.compiled)
            assert all(matcher.accept_token(t) for t in ids[self.prompt_len:])
            matcher.fill_next_token_bitmask(mask, row)
        xgr.apply_token_bitmask_inplace(scores, mask, vocab_size=self.vocab_size)
        return scores


@pytest.mark.parametrize("width", [2, 3])
def test_constrained_beams_equal_hf_generate_under_the_same_grammar(smol_llm: LLM, hf_smol, width: int) -> None:
    """Beam search with a JSON schema: every beam parses and validates, and the beams equal transformers'
    beam search gated by the same grammar (masks after the log-softmax, as transformers applies them)."""
    import json

    import jsonschema
    from transformers import LogitsProcessorList

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    engine = smol_llm.engine
    (eos,) = engine.eos_token_ids
    ids = engine.apply_chat_template([{"role": "user", "content": "Name a city in France as JSON."}])
    params = _beams(width, True, detokenize=True, max_tokens=24, structured_outputs={"json": schema})
    (out,) = run_to_completion(engine, [ids], [params])
    for choice in out.outputs:
        jsonschema.validate(json.loads(choice.text), schema)
    assert len(engine.grammars) == 0  # dropped and finished beams left no grammar state behind
    compiled = engine.grammars.compiler.compile(params.structured_outputs)
    x = torch.tensor([ids])
    with torch.inference_mode():
        ref = hf_smol.generate(x, attention_mask=torch.ones_like(x), num_beams=width, num_return_sequences=width,
                               do_sample=False, early_stopping=True, max_new_tokens=24, eos_token_id=eos,
                               pad_token_id=eos,
                               logits_processor=LogitsProcessorList([_GrammarMask(compiled, len(ids),
                                                                                  engine.vocab_size)]))
    want = [row[:row.index(eos) + 1] if eos in row else row for row in ref[:, len(ids):].tolist()]
    assert [c.token_ids for c in out.outputs] == want[:len(out.outputs)]
    assert len(out.outputs) == width
