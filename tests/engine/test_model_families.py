"""The families chatbot operators run most beyond Llama and Qwen (issue 27): Mistral (with and without its
sliding window), Gemma 2 (alternating windows, soft-capped scores and logits, head_dim above hidden / heads),
Gemma 3 (a rotary base per layer type, q/k norm; the text model, and the image-text one served as text),
gpt-oss (mixture of experts, attention sinks, YaRN) and Phi-3 (a window on every layer, merged projections)
give the greedy tokens of transformers' `generate` (float32, CPU, eager attention) on random-weight models of
their real configurations saved as model directories: prompts and outputs longer than the window, prompts
read in chunks, a prefix-cache hit, n = 2 and a recompute preemption, all in one run. What streamd cannot run
is refused at load, naming the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GptOssConfig,
    MambaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    SiglipVisionConfig,
)

from streamd import LLM, SamplingParams
from streamd.engine.worker import families
from streamd.engine.worker.model_loader import load_model
from streamd.engine.worker.parallel.shard import planned_splits
from tests.helpers import (
    fold_deltas,
    hf_greedy,
    hf_logprobs,
    random_prompt,
    register_engine,
    save_random_checkpoint,
    sizes,
)

VOCAB = 320
WINDOW = 12  # not a multiple of the block size (8): a window's edge falls inside a block
BLOCK = 8
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.08)
_ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention"]


def family_config(family: str) -> PretrainedConfig:
    """A tiny random-weight model of `family` with its real configuration's features (3 layers, hidden 64)."""
    if family == "mistral":  # Mistral 7B v0.3 and Nemo: no window
        return MistralConfig(**_COMMON, sliding_window=None)
    if family == "mistral-window":  # Mistral 7B v0.1: one window (4096) on every layer, read from the config
        return MistralConfig(**_COMMON, sliding_window=WINDOW)
    # Each family's initial scale picked so that greedy outputs vary and the window, the cap and the sinks
    # change them (a window one wider changes 20-50 of 60 tokens, as does dropping the cap or the sinks).
    if family == "gemma2":  # scores scaled by 1 (query_pre_attn_scalar): large enough for the cap of 1 to bite
        return Gemma2Config(**{**_COMMON, "initializer_range": 0.02}, head_dim=32, query_pre_attn_scalar=1,
                            sliding_window=WINDOW, layer_types=_ALTERNATING, attn_logit_softcapping=1.0,
                            final_logit_softcapping=1.0)
    if family == "gemma3":  # the 1B text model's shape: local layers then a global one, each with its rotary base
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}}
        return Gemma3TextConfig(**{**_COMMON, "initializer_range": 0.02}, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                rope_parameters=rope)
    if family == "gemma3-vision":  # Gemma 3 4B-27B ship as image-text models: streamd serves their text
        text = family_config("gemma3").to_dict()
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=VOCAB - 3,
                            eoi_token_index=VOCAB - 2, image_token_index=VOCAB - 1)
    if family == "gpt-oss":
        yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 64, "rope_theta": 150_000.0}
        return GptOssConfig(**{**_COMMON, "intermediate_size": 64, "initializer_range": 0.2}, head_dim=16, sliding_window=WINDOW,
                            layer_types=_ALTERNATING, num_local_experts=4, num_experts_per_tok=2, rope_parameters=yarn)
    if family == "phi3":  # Phi-3-mini: a window on every layer, fused qkv and gate/up projections
        return Phi3Config(**_COMMON, sliding_window=WINDOW, pad_token_id=0)
    raise ValueError(f"unknown family {family!r}")


FAMILIES = ["mistral", "mistral-window", "gemma2", "gemma3", "gemma3-vision", "gpt-oss", "phi3"]


def _saved(family: str, tmp_path: Path) -> Path:
    return save_random_checkpoint(family_config(family), tmp_path / family, seed=3)


def _reference(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """The first request alone until its first token (its prompt's blocks are then in the prefix cache), then
    the rest while it decodes; final outputs by index."""
    engine, folded = llm.engine, {}
    engine.add_request("r0", prompts[0], params[0])
    while "r0" not in folded or not folded["r0"].build().outputs[0].token_ids:
        fold_deltas(engine.step(), folded)
    for i, (ids, p) in enumerate(zip(prompts[1:], params[1:]), start=1):
        engine.add_request(f"r{i}", ids, p)
    while engine.has_unfinished_requests():
        fold_deltas(engine.step(), folded)
    return {int(rid[1:]): b.build() for rid, b in folded.items()}


def scenario(lengths: list[int], max_tokens: int) -> tuple[list[list[int]], list[list[int]], list[SamplingParams]]:
    """(the distinct prompts, the requests' prompts, their parameters): one prompt per length, the first asked
    twice (the second time a prefix hit), the third request with n = 2; greedy, EOS ignored."""
    distinct = [random_prompt(i, n, VOCAB) for i, n in enumerate(lengths)]
    prompts = [distinct[0], *distinct]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    params = [greedy] * len(prompts)
    params[3] = SamplingParams(n=2, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    return distinct, prompts, params


def assert_hf_greedy(path: Path, family: str, tokens: dict[int, list[list[int]]], distinct: list[list[int]],
                     max_tokens: int) -> None:
    """Every choice of request i (`tokens[i]`) equals transformers' greedy continuation of its prompt."""
    reference = _reference(path)
    want = [hf_greedy(reference, ids, max_tokens, None) for ids in distinct]
    for i, choices in tokens.items():
        for index, got in enumerate(choices):
            assert got == want[max(i - 1, 0)], f"{family}: request {i} choice {index} diverged"


def choice_tokens(outs: dict) -> dict[int, list[list[int]]]:
    return {i: [choice.token_ids for choice in out.outputs] for i, out in outs.items()}


# (prompt lengths, max_tokens, KV blocks). Light: four requests (one a repeat, one n = 2) of 20 tokens in 12
# blocks; full (slow): seven of 40 in 20.
@pytest.mark.parametrize("shape", sizes(([37, 9, 26], 20, 12), ([61, 9, 26, 45, 17, 33], 40, 20)))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf_generate(family: str, shape: tuple[list[int], int, int], tmp_path: Path) -> None:
    lengths, max_tokens, num_blocks = shape
    path = _saved(family, tmp_path)
    # The pool holds the longest request but not all of them at once: a recompute preemption.
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=16,
              num_kv_blocks=num_blocks, num_swap_blocks=0, watermark=0.0)
    register_engine(llm.engine)
    distinct, prompts, params = scenario(lengths, max_tokens)
    outs = _run(llm, prompts, params)
    assert_hf_greedy(path, family, choice_tokens(outs), distinct, max_tokens)
    assert len(outs[3].outputs) == 2
    assert outs[1].num_cached_tokens >= BLOCK, "the repeated prompt found no cached block"
    assert llm.engine.stats().scheduler.preemptions_recompute > 0, "the pool was never short"
    assert max(lengths) > WINDOW and max_tokens > WINDOW


@pytest.mark.parametrize(("family", "engine_args"), [
    ("gemma3", {"preemption_mode": "swap", "num_swap_blocks": 40}),  # the hybrid layout, preempted by swapping
    ("gpt-oss", {"preemption_mode": "swap", "num_swap_blocks": 40}),
    ("gemma3", {"disable_hybrid_kv_cache_manager": True, "num_swap_blocks": 0}),  # every layer keeps it all
])
def test_hybrid_layout_swaps_and_its_off_switch(family: str, engine_args: dict, tmp_path: Path) -> None:
    """The light scenario of `test_family_matches_hf_generate` with swap preemption in the hybrid layout (both
    pools go to the host and back), and with the layout off; the same greedy tokens as transformers."""
    path = _saved(family, tmp_path)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=16,
              num_kv_blocks=12, watermark=0.0, **engine_args)
    register_engine(llm.engine)
    hybrid = not engine_args.get("disable_hybrid_kv_cache_manager", False)
    assert (llm.engine.stats().kv.window_blocks_total > 0) == hybrid
    distinct, prompts, params = scenario([37, 9, 26], 20)
    assert_hf_greedy(path, family, choice_tokens(_run(llm, prompts, params)), distinct, 20)
    sched = llm.engine.stats().scheduler
    assert sched.preemptions_swap + sched.preemptions_recompute > 0, "the pool was never short"
    if engine_args.get("preemption_mode") == "swap":
        assert sched.preemptions_swap > 0


@torch.inference_mode()
def test_beam_search_in_the_hybrid_layout_equals_hf(tmp_path: Path) -> None:
    """Beams fork and free sequences every step: in the hybrid layout both groups' tables follow (the window
    group's holes included), and the beams equal transformers' `generate(num_beams=3)` past the window."""
    path = _saved("gemma3", tmp_path)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=16,
              num_kv_blocks=40, num_swap_blocks=0)
    register_engine(llm.engine)
    assert llm.engine.stats().kv.window_blocks_total > 0
    prompt = random_prompt(4, 30, VOCAB)
    params = SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=16, ignore_eos=True,
                            detokenize=False)
    got = [choice.token_ids for choice in llm.generate(prompt, params)[0].outputs]
    x = torch.tensor([prompt])
    want = _reference(path).generate(x, attention_mask=torch.ones_like(x), num_beams=3, num_return_sequences=3,
                                     do_sample=False, max_new_tokens=16, length_penalty=1.0)[:, len(prompt):]
    assert got == want.tolist()


def test_gemma2_final_logit_softcap_reaches_the_logprobs(tmp_path: Path) -> None:
    """streamd's logits come out of the causal LM's own forward, so Gemma 2's head soft cap (tanh(x / c) * c)
    is in every logprob. Every layer global and no score cap here: only the head's cap is looked at."""
    config = family_config("gemma2")
    config.layer_types, config.attn_logit_softcapping = ["full_attention"] * 3, None
    path = save_random_checkpoint(config, tmp_path / "gemma2", seed=3)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=32, num_swap_blocks=0)
    register_engine(llm.engine)
    prompt = random_prompt(5, 20, VOCAB)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, detokenize=False))[0]
    choice = out.outputs[0]
    capped = hf_logprobs(_reference(path), prompt, choice.token_ids)
    uncapped_model = _reference(path)
    uncapped_model.config.final_logit_softcapping = None
    uncapped = hf_logprobs(uncapped_model, prompt, choice.token_ids)
    for step, (token, top) in enumerate(zip(choice.token_ids, choice.logprobs)):
        assert top[token] == pytest.approx(capped[step][token].item(), abs=1e-4)
        assert abs(capped[step][token].item() - uncapped[step][token].item()) > 1e-2, "the cap changes nothing here"


def _refused(config: PretrainedConfig) -> str:
    with pytest.raises(ValueError, match="streamd cannot run") as refused:
        load_model(config, torch.float32, torch.device("cpu"))
    return str(refused.value)


@pytest.mark.parametrize(("family", "named"), [
    ("gemma2", ["sliding windows (2 of 3 layers, window 12)", "soft-capping (attn_logit_softcapping 1.0)"]),
    ("gpt-oss", ["sliding windows", "attention sinks"]),
    ("mistral-window", ["sliding windows (3 of 3 layers, window 12)"]),
    ("phi3", ["sliding windows (3 of 3 layers"]),
])
def test_attention_the_kernels_lack_is_refused_at_load(family: str, named: list[str], monkeypatch) -> None:
    monkeypatch.setattr(families, "ATTENTION_FEATURES", frozenset())
    message = _refused(family_config(family))
    assert all(part in message for part in named), message


def test_models_streamd_cannot_run_are_refused_at_load_with_the_reason(tmp_path: Path) -> None:
    mamba = MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2)
    assert "outside the KV cache" in _refused(mamba)
    embedding = Gemma3TextConfig(**_COMMON, head_dim=16, use_bidirectional_attention=True)
    assert "bidirectional" in _refused(embedding)
    latent = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=2, n_routed_experts=2, num_experts_per_tok=1,
                              n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8)
    assert "latent attention" in _refused(latent)
    remote = tmp_path / "phi3small"  # Phi-3-small's code ships with its checkpoint, not with transformers
    remote.mkdir()
    (remote / "config.json").write_text('{"model_type": "phi3small", "architectures": ["Phi3SmallForCausalLM"]}')
    with pytest.raises(ValueError, match=r"phi3small.*trust_remote_code.*no remote code"):
        LLM(str(remote), device="cpu", dtype="float32")


def test_tensor_parallelism_refuses_a_plan_that_splits_nothing() -> None:
    """transformers plans only gpt-oss's embedding: followed, every rank would run the whole model."""
    model = AutoModelForCausalLM.from_config(family_config("gpt-oss"))
    with pytest.raises(ValueError, match="splits none of its layers"):
        planned_splits(model, 2)
    for family in ("mistral", "gemma3-vision"):  # q, k, v, o, gate, up, down of 3 layers (the image-text
        # model's text layers: their names are the text plan's under its language model)
        assert len(planned_splits(AutoModelForCausalLM.from_config(family_config(family)), 2)) == 3 * 7, family


# OCP MX: E2M1 values (the low nibble first), one E8M0 scale (bias 127) per 32 values
_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4(path: Path) -> dict[str, torch.Tensor]:
    """Rewrites the saved gpt-oss checkpoint's experts as an MXFP4 one (random blocks and scales, as
    gpt-oss ships them); returns each expert weight's value, dequantized here."""
    tensors, dequantized = load_file(path / "model.safetensors"), {}
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, n_in, n_out = tensors.pop(name).shape  # [experts, in, out], stored as [experts, out, in / 32, 16]
        blocks = torch.randint(0, 256, (experts, n_out, n_in // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(120, 130, (experts, n_out, n_in // 32), generator=gen, dtype=torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        values = torch.stack([_FP4[(blocks & 0x0F).long()], _FP4[(blocks >> 4).long()]], -1).flatten(-2)
        dequantized[name] = (values * 2.0 ** (scales.long() - 127)[..., None]).flatten(-2).transpose(1, 2)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return dequantized


def test_gpt_oss_mxfp4_checkpoint_loads_dequantized(tmp_path: Path, monkeypatch) -> None:
    """gpt-oss ships its experts in MXFP4: streamd loads them dequantized to model.dtype (never through the
    MXFP4 kernels transformers fetches from the Hub), every value as the format defines it."""
    monkeypatch.setattr(families, "ATTENTION_FEATURES", frozenset({families.SLIDING_WINDOW, families.SINKS}))
    want = _mxfp4(_saved("gpt-oss", tmp_path))
    model = load_model(str(tmp_path / "gpt-oss"), torch.float32, torch.device("cpu")).model
    assert not getattr(model, "is_quantized", False)
    weights = dict(model.named_parameters())
    for name, value in want.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], value), name
