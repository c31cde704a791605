"""FP8 weights on a GPU with FP8 tensor cores (device machine, sm_89+: an H100): `Fp8Linear` (cuBLAS's per-tensor
FP8 GEMM and the Triton scale pass) agrees with its float reference at awkward shapes (padded to 16) and row counts; an engine with
`model.quantization = "fp8"` (CUDA graphs, unfused) gives transformers' greedy tokens with the same FP8 layers
(float32 around them), and in bfloat16 its prompt logprobs stay near the bfloat16 model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from streamd import LLM, SamplingParams
from streamd.engine.worker import fp8
from streamd.kernels import reference
from tests.helpers import assert_pool_whole, hf_greedy

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY,
        reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)",
    ),
]
EXACT_BF16 = 1e-2  # vs quantized activations x dequantized weight: the bfloat16 output's rounding (CPU: 3e-3)
# The bfloat16 model's prompt logprobs (of the prompt's own tokens) vs the FP8 one's, absolute: on the CPU, a 4-layer
# hidden-1024 Llama measured mean 0.071, max 0.25 (tests/engine/worker/test_fp8.py has the per-layer numbers).
LOGPROB_MEAN, LOGPROB_MAX = 0.15, 0.75


def _config(layers: int = 4) -> LlamaConfig:  # Llama-3.2-1B's shape, fewer layers
    return LlamaConfig(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                       max_position_embeddings=2048, rope_theta=500000.0)


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in torch.randint(1, 200, (n,), generator=gen)]


@pytest.mark.parametrize("in_out", [(2048, 8192), (40, 24), (33, 7)])
@pytest.mark.parametrize("rows", [1, 3, 17, 256])
def test_fp8_linear_on_cuda_matches_its_reference(rows: int, in_out: tuple[int, int]) -> None:
    in_features, out_features = in_out
    gen = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    bias = torch.randn(out_features, generator=gen) * 0.1
    stored = fp8.quantize_weight(weight)
    layer = fp8.Fp8Linear(stored, bias.bfloat16()).cuda()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    out = layer(x.cuda())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    exact = reference.quantize_fp8(x).dequantize(torch.float32) @ stored.dequantize(torch.float32).T + bias
    assert ((out.cpu().float() - exact).norm() / exact.norm()).item() < EXACT_BF16


def test_fp8_engine_gives_transformers_greedy_tokens_with_the_same_layers() -> None:
    config = _config()
    # Unfused, so the engine's FP8 layers keep transformers' names and can be shared with the reference.
    llm = LLM(config, device="cuda", dtype="float32", quantization="fp8", max_num_batched_tokens=512, num_kv_blocks=256,
              num_swap_blocks=0, fuse_layers="off")
    model = llm.engine.runner.model
    layers = {name: m for name, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)}
    assert len(layers) == 4 * 7 and isinstance(model.lm_head, nn.Linear)
    prompts = _prompts(config.vocab_size, 8, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    replays_before = llm.engine.runner.graphs.replays
    outs = llm.generate(prompts, params)
    assert llm.engine.runner.graphs.replays > replays_before, "decode steps should have replayed CUDA graphs"
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    reference.load_state_dict(model.state_dict(), strict=False)  # the norms and embeddings; the FP8 layers shared:
    for name, layer in layers.items():
        parent, _, attr = name.rpartition(".")
        setattr(reference.get_submodule(parent), attr, layer)
    reference = reference.cuda().eval()
    reference.generation_config.eos_token_id = None
    # The layers are shared, only the attention differs (paged Triton vs SDPA); the FP8 layers round their output to
    # bfloat16, and a random model's flat logits turn that rounding into different greedy tokens within a few steps
    # (seen on an H100: the second token). So: the first token of every prompt, and each prompt's teacher-forced
    # log-probabilities far closer than the FP8-vs-bfloat16 bound of the next test.
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids[:1] == hf_greedy(reference, prompt, 1), f"prompt {i} (len {len(prompt)})"
    got = _prompt_logprobs(llm, [p for p in prompts if len(p) > 1])
    want = torch.cat([_hf_prompt_logprobs(reference, p) for p in prompts if len(p) > 1])
    assert (got - want).abs().mean().item() < LOGPROB_MEAN / 4
    assert_pool_whole(llm.engine)


@torch.inference_mode()
def _hf_prompt_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt], device="cuda")
    logprobs = model(ids).logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(1, ids[0, 1:, None])[:, 0].cpu()


def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False, prompt_logprobs=1)
    values = []
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        entries = out.prompt_logprobs
        assert entries is not None
        values += [entries[pos][prompt[pos]] for pos in range(1, len(prompt))]
    assert_pool_whole(llm.engine)
    return torch.tensor(values)


def test_fp8_bfloat16_engine_stays_near_the_bfloat16_model() -> None:
    config = _config()
    prompts = [p for p in _prompts(config.vocab_size, 6, seed=2) if len(p) > 1]
    quantized = LLM(config, device="cuda", dtype="bfloat16", quantization="fp8", max_num_batched_tokens=512, num_kv_blocks=256,
                    num_swap_blocks=0)
    # The fused Triton layer (auto on CUDA): q/k/v and gate/up merged, so 4 FP8 layers per decoder layer.
    assert sum(isinstance(m, fp8.Fp8Linear) for m in quantized.engine.runner.model.modules()) == 4 * 4
    got = _prompt_logprobs(quantized, prompts)
    del quantized
    plain = LLM(config, device="cuda", dtype="bfloat16", quantization="none", max_num_batched_tokens=512, num_kv_blocks=256,
                num_swap_blocks=0)  # the same seed: the same weights before quantization
    want = _prompt_logprobs(plain, prompts)
    difference = (got - want).abs()
    assert difference.mean().item() < LOGPROB_MEAN and difference.max().item() < LOGPROB_MAX, difference
