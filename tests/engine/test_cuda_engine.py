"""The engine on a CUDA GPU (device machine): Triton kernels, CUDA graphs and the paged pool give the same
greedy tokens as transformers on a random-weight Llama-3.2-1B-shaped model in float32; bfloat16 runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from streamd import LLM, SamplingParams
from tests.helpers import assert_pool_whole, fold_deltas, hf_greedy, step_until_idle

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def llama_1b_shape(layers: int = 16) -> LlamaConfig:
    return LlamaConfig(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                       max_position_embeddings=2048, rope_theta=500000.0)


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 300, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lens]


def _transformers_reference(config: LlamaConfig, engine) -> torch.nn.Module:
    """transformers' model (sdpa, float32, on CUDA, no EOS) with the weights of `engine`'s unfused model."""
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    reference.load_state_dict(engine.runner.model.state_dict())
    reference = reference.cuda().eval()
    reference.generation_config.eos_token_id = None
    return reference


def _staggered(engine, prompts: list[list[int]], params: SamplingParams, steps_apart: int) -> dict[str, list[int]]:
    """Request r<i> arrives `steps_apart` engine steps after r<i - 1>, while its prompt and the others' decodes
    run; every request's tokens once all finished."""
    folded: dict = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        for _ in range(steps_apart):
            fold_deltas(engine.step(), folded)
    return {rid: out.outputs[0].token_ids for rid, out in step_until_idle(engine, folded).items()}


def test_llama_1b_float32_matches_transformers_on_cuda() -> None:
    config = llama_1b_shape()
    llm = LLM(config, device="cuda", dtype="float32", max_num_batched_tokens=512, num_swap_blocks=64,
              fuse_layers="off")  # the unfused path; tests/engine/worker/test_fusion.py checks the fused one on CUDA
    prompts = _prompts(config.vocab_size, 12, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)
    replays_before = llm.engine.runner.graphs.replays  # the start-up warm-up replays some already
    outs = llm.generate(prompts, params)
    reference = _transformers_reference(config, llm.engine)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        want = hf_greedy(reference, prompt, 40, None)
        assert out.outputs[0].token_ids == want, f"prompt {i} (len {len(prompt)}) diverged"
    graphs = llm.engine.runner.graphs
    assert graphs.replays > replays_before, "decode steps should have replayed CUDA graphs"
    assert_pool_whole(llm.engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_on_cuda_keeps_outputs_identical(mode: str) -> None:
    # float32, so that any difference is a memory-management bug and not bf16 rounding of another batch shape.
    config = llama_1b_shape(layers=4)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False)
    prompts = _prompts(config.vocab_size, 16, seed=2)
    tight = LLM(config, device="cuda", dtype="float32", num_kv_blocks=96, max_num_batched_tokens=256,
                num_swap_blocks=256 if mode == "swap" else 0, preemption_mode=mode)
    outs = tight.generate(prompts, params)
    assert getattr(tight.engine.stats().scheduler, f"preemptions_{mode}") > 0, tight.engine.stats()
    roomy = LLM(config, device="cuda", dtype="float32", max_num_batched_tokens=256, num_swap_blocks=0)
    again = roomy.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    assert_pool_whole(tight.engine)
    assert_pool_whole(roomy.engine)


def test_bfloat16_generation_runs() -> None:
    config = llama_1b_shape(layers=4)
    llm = LLM(config, device="cuda", dtype="bfloat16", max_num_batched_tokens=512, num_swap_blocks=0)
    outs = llm.generate(_prompts(config.vocab_size, 32, seed=3),
                        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=48, ignore_eos=True,
                                       detokenize=False, seed=1))
    assert all(len(o.outputs[0].token_ids) == 48 for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == len(outs)
    assert_pool_whole(llm.engine)


def test_prompt_logprobs_on_cuda_match_transformers() -> None:
    """Prompt logprobs through the Triton prefill, in chunks (128 tokens a step), beside decoding requests,
    and for a prompt whose prefix is cached: a float32 transformers forward within 2e-3."""
    config = llama_1b_shape(layers=2)
    llm = LLM(config, device="cuda", dtype="float32", max_num_batched_tokens=128, num_swap_blocks=0,
              fuse_layers="off")  # (the reference loads the model's own state dict: transformers' names)
    prompts = _prompts(config.vocab_size, 6, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False,
                             prompt_logprobs=3 if i % 2 == 0 else None) for i in range(len(prompts))]
    outs = llm.generate(prompts + [prompts[0]], params + [params[0]])  # the last one's prefix is cached
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    reference.load_state_dict(llm.engine.runner.model.state_dict())
    reference = reference.cuda().eval()
    for prompt, p, out in zip(prompts + [prompts[0]], params + [params[0]], outs):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        with torch.inference_mode():
            ids = torch.tensor([prompt], device="cuda")
            logprobs = torch.log_softmax(reference(ids).logits[0].float(), dim=-1)[:-1].cpu()
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        for pos in range(1, len(prompt)):
            entry = entries[pos]
            assert entry is not None
            assert entry[prompt[pos]] == pytest.approx(logprobs[pos - 1, prompt[pos]].item(), abs=2e-3)
            assert list(entry)[:3] == logprobs[pos - 1].topk(3).indices.tolist()
    assert_pool_whole(llm.engine)


def test_speculative_verifies_replay_the_decode_graphs_and_keep_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    # float32: a verify replayed as decode rows must give the tokens the plain decode steps give
    config = llama_1b_shape(layers=4)
    llm = LLM(config, device="cuda", dtype="float32", max_num_batched_tokens=512, num_swap_blocks=0)
    # drafts at the unmeasured row price and no lost overlap: both are measured from wall time, which this test must
    # not depend on
    monkeypatch.setattr(llm.engine.scheduler.step_periods, "serial_overhead", lambda: 0.0)
    monkeypatch.setattr(llm.engine.scheduler.step_cost, "row_cost", lambda tokens: None)
    prompts = _prompts(config.vocab_size, 4, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, detokenize=False)
    off = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # the oracle: each request's prediction is its own greedy output with every 5th token wrong
    drafts = iter([[t if i % 5 != 4 else (t + 1) % config.vocab_size for i, t in enumerate(o)] for o in off])
    engine = llm.engine
    engine._prediction_ids = lambda text: next(drafts)
    verify_rows: list[int] = []
    replay = engine.runner._replay

    def counting(batch):
        if not batch.decode_only and len(batch.sample_idx) == len(batch.input_ids):  # a verify, not a prompt chunk
            verify_rows.append(len(batch.input_ids))
        return replay(batch)

    engine.runner._replay = counting
    before = engine.stats().scheduler
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, dataclasses.replace(params, prediction="oracle"))]
    after = engine.stats().scheduler
    assert on == off
    assert verify_rows and max(verify_rows) > len(prompts), "verify steps should have replayed the decode graphs"
    assert after.spec_accepted_tokens > before.spec_accepted_tokens
    assert_pool_whole(engine)


def test_prompt_chunks_beside_decodes_replay_the_decode_graphs_and_keep_greedy_tokens() -> None:
    """Requests arriving while others decode: their prompt chunks (whole, and continuing a long prompt) run in the
    decode graphs as decode rows; float32, so the tokens must be transformers' exactly."""
    config = llama_1b_shape(layers=4)
    llm = LLM(config, device="cuda", dtype="float32", max_num_batched_tokens=96, num_swap_blocks=0,
              fuse_layers="off")  # transformers' weight names, for the reference
    engine = llm.engine
    replay = engine.runner._replay
    chunk_rows: list[int] = []

    def counting(batch):
        if len(batch.sample_idx) < len(batch.input_ids):
            chunk_rows.append(len(batch.input_ids))
        return replay(batch)

    engine.runner._replay = counting
    prompts = _prompts(config.vocab_size, 6, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    outputs = _staggered(engine, prompts, params, steps_apart=3)
    reference = _transformers_reference(config, engine)
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(reference, prompt, 24, None), f"prompt {i} (len {len(prompt)}) diverged"
    assert len(chunk_rows) >= 3, "prompt chunks should have replayed the decode graphs"
    assert_pool_whole(engine)


def test_prompt_steps_replay_the_prefill_graphs_and_keep_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step with a prompt chunk (no decode graph takes one here: the decode rows' cap is 0) replays a prefill
    graph: whole prompts, a long prompt's chunks, and chunks beside others' decodes, unfused and fused; float32, so
    the tokens must be transformers' exactly."""
    from streamd.engine.worker import model_runner

    monkeypatch.setattr(model_runner, "MAX_PROMPT_ROW_ATTENTION", 0)
    config = llama_1b_shape(layers=4)
    prompts = _prompts(config.vocab_size, 6, seed=5)
    prompts[2] = prompts[2] * 3  # (a prompt longer than a step's budget: chunked)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    reference = None
    for fuse in ("off", "auto"):
        llm = LLM(config, device="cuda", dtype="float32", max_num_batched_tokens=256, num_kv_blocks=1024,
                  num_swap_blocks=0, fuse_layers=fuse)
        engine = llm.engine
        graphs = engine.runner.prefill_graphs
        assert graphs is not None and graphs.sizes[-1] == 256
        before = graphs.replays
        eager: list[int] = []  # the steps with prompt chunks that ran eagerly
        metadata = engine.runner._metadata

        def noting(batch, metadata=metadata, eager=eager):
            if not batch.decode_only:
                eager.append(len(batch.input_ids))
            return metadata(batch)

        engine.runner._metadata = noting
        outputs = _staggered(engine, prompts, params, steps_apart=2)
        if reference is None:  # transformers' weight names: from the unfused model
            reference = _transformers_reference(config, engine)
            wants = [hf_greedy(reference, prompt, 24, None) for prompt in prompts]
        for i, want in enumerate(wants):
            assert outputs[f"r{i}"] == want, f"{fuse}: prompt {i} (len {len(prompts[i])}) diverged"
        assert graphs.replays - before >= len(prompts), "prompt steps should have replayed the prefill graphs"
        assert not eager, f"{fuse}: steps with prompt chunks of {eager} tokens ran eagerly"
        assert_pool_whole(engine)
        engine.runner.release_graphs()
        del llm, engine, graphs
