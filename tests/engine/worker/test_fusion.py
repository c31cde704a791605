"""The fused decoder layers (streamd/engine/worker/fusion.py) give the greedy tokens of Hugging Face `generate` on
random-weight Llama, Qwen2 (QKV bias) and Qwen3 (q/k norm) models, through the reference kernels, the
Triton kernels (interpreted on CPU), torch.compile and the CPU's lean path; low-bit models through the CPU's path
give the tokens of transformers' modules over the same low-bit layers; and `model.fuse_layers` is wired and
validated."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from streamd import LLM, SamplingParams
from streamd.engine.worker.fusion import CpuPath, FusedDecoder, fuse_layers
from streamd.engine.worker.quantized import QuantizedLinear
from tests.helpers import (
    hf_greedy,
    random_engine_and_hf_twin,
    register_engine,
    run_to_completion,
    sizes,
    tiny_arch_config,
)


def _tiny(kind: str):
    return tiny_arch_config(kind, hidden_size=96, intermediate_size=200, num_attention_heads=6, qwen3_head_dim=24)


def _engine_and_reference(kind: str, num_prompts: int):
    """An unfused CPU engine of random weights whose norms and biases matter, and the same weights in HF."""
    return random_engine_and_hf_twin(_tiny(kind), perturb_seed=5, num_prompts=num_prompts, max_prompt_len=50,
                                     num_kv_blocks=120, block_size=8, max_num_batched_tokens=40, seed=11)


def _modes() -> list:
    """(mode, (prompts, max tokens)). The interpreted Triton kernels and torch.compile are slow on CPU: fewer
    requests there (the kernel tests cover shapes), lighter still in `make test` (their full size is slow)."""
    modes = [pytest.param("reference", (6, 12), id="reference"), pytest.param("cpu", (6, 12), id="cpu")]
    for mode in ("triton", "compile"):
        modes += [pytest.param(mode, *size.values, id=f"{mode}-{size.id}", marks=size.marks)
                  for size in sizes((2, 6), (4, 8))]
    return modes


# Mistral without a window is a Llama to the fused layer: the references alone (the kernels are the Llama's).
@pytest.mark.parametrize("kind, mode, shape", [pytest.param(kind, *mode.values, id=f"{kind}-{mode.id}", marks=mode.marks)
                                               for kind in ("llama", "qwen2", "qwen3") for mode in _modes()]
                         + [pytest.param("mistral", mode, (6, 12), id=f"mistral-{mode}") for mode in ("reference", "cpu")])
def test_fused_layers_match_hf_generate(kind: str, mode: str, shape: tuple[int, int]) -> None:
    num_prompts, max_tokens = shape
    llm, reference, prompts = _engine_and_reference(kind, num_prompts)
    model = llm.engine.runner.model
    torch._dynamo.reset()  # compiled variants of other tests' models share the stretches' code objects
    # "compile" through a backend that traces and runs the same graph without a C++ build (fullgraph: no breaks).
    assert fuse_layers(model, mode, torch.device("cpu"), compile_backend="aot_eager") == mode
    assert isinstance(model.model, FusedDecoder)
    layer = model.model.layers[0]
    q_size, kv_size, head_dim = layer.qkv_sizes
    assert not hasattr(layer, "self_attn") and (q_size, kv_size) == (6 * head_dim, 2 * head_dim)
    assert layer.qkv_proj.out_features == q_size + 2 * kv_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = run_to_completion(llm.engine, prompts, params)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(reference, ids, max_tokens, None), f"{kind}/{mode} diverged"


def test_default_model_fused_matches_hf_generate(hf_smol) -> None:
    """The real SmolLM2-135M (GGUF, tied embeddings) rewired through the config key, against transformers."""
    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, num_swap_blocks=0,
              fuse_layers="reference", quantization="none")
    register_engine(llm.engine)
    assert isinstance(llm.engine.runner.model.model, FusedDecoder)
    chats = ["What is the capital of France?", "List three prime numbers."]
    prompts = [llm.engine.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    outs = run_to_completion(llm.engine, prompts, SamplingParams(temperature=0.0, max_tokens=12))
    eos = llm.tokenizer.eos_token_id
    for chat, ids, out in zip(chats, prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_smol, ids, 12, eos), chat


def test_config_key_rewires_the_engine_and_off_leaves_it_alone() -> None:
    config = _tiny("llama")
    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=16, block_size=8, num_swap_blocks=0)
    fused = register_engine(LLM(config, fuse_layers="reference", **kwargs).engine)
    assert isinstance(fused.runner.model.model, FusedDecoder)
    for mode in ("off", "auto"):  # auto: Triton on CUDA only
        plain = register_engine(LLM(config, fuse_layers=mode, **kwargs).engine)
        assert not isinstance(plain.runner.model.model, FusedDecoder)
        assert hasattr(plain.runner.model.model.layers[0], "self_attn")


def test_bad_mode_and_unsupported_models_are_named() -> None:
    from streamd.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.fuse_layers"):
        load_config(overrides={"fuse_layers": "fast"})
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="fuse_layers.*gpt2"):
        fuse_layers(gpt2, "triton", torch.device("cpu"))
    assert fuse_layers(gpt2, "auto", torch.device("cuda")) == "off"
    sliding = AutoModelForCausalLM.from_config(Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64, use_sliding_window=True, sliding_window=16, max_window_layers=1))
    with pytest.raises(ValueError, match="sliding"):
        fuse_layers(sliding, "reference", torch.device("cpu"))
    # Mistral 7B v0.1's window lives in its config alone (no layer_types)
    windowed = AutoModelForCausalLM.from_config(MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64, sliding_window=16))
    with pytest.raises(ValueError, match="without sliding windows"):
        fuse_layers(windowed, "reference", torch.device("cpu"))
    assert fuse_layers(windowed, "auto", torch.device("cuda")) == "off"


@pytest.mark.parametrize("attr, value, reason", [("attn_logit_softcapping", 30.0, "soft-capping"),
                                                 ("sinks", torch.zeros(2), "sinks"),
                                                 ("sliding_window", 16, "sliding")])
def test_a_layer_with_attention_extras_is_not_fused(attr, value, reason) -> None:
    """The fused layer hands the attention kernels no extras: a layer whose attention module has one (as
    transformers' Gemma 2 / gpt-oss / windowed modules do) keeps transformers' layer, whatever its model type."""
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64))
    setattr(model.model.layers[1].self_attn, attr, value)
    with pytest.raises(ValueError, match=reason):
        fuse_layers(model, "reference", torch.device("cpu"))
    assert fuse_layers(model, "auto", torch.device("cuda")) == "off"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["triton", "compile"])
def test_fused_engine_on_cuda_matches_transformers(mode: str) -> None:
    """Compiled kernels (or Inductor's) inside the decode CUDA graphs, float32 so any difference is a bug."""
    config = LlamaConfig(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=2048, rope_theta=500000.0)
    kwargs = dict(device="cuda", dtype="float32", num_kv_blocks=2048, max_num_batched_tokens=512, num_swap_blocks=0,
                  seed=3)
    plain = LLM(config, fuse_layers="off", **kwargs)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    reference.load_state_dict(plain.engine.runner.model.state_dict())
    reference = reference.cuda().eval()
    reference.generation_config.eos_token_id = None
    del plain
    torch._dynamo.reset()
    llm = LLM(config, fuse_layers=mode, **kwargs)
    model = llm.engine.runner.model
    assert isinstance(model.model, FusedDecoder)
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight), "same seed, same weights"
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 300, (12,), generator=gen)]
    replays_before = llm.engine.runner.graphs.replays
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 40, None), f"{mode}: prompt {i} diverged"
    assert llm.engine.runner.graphs.replays > replays_before, "decode steps should have replayed CUDA graphs"


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_a_low_bit_model_on_the_cpu_path_computes_what_transformers_modules_compute(quantization: str) -> None:
    """`cpu` takes a low-bit model through `CpuPath` (q/k/v and gate/up merged into one low-bit layer each); its
    greedy tokens equal transformers' modules over the same low-bit layers, prompts long enough for the dense
    path and a batch of decodes. The latency budget is off: it sizes prompt chunks from measured step times,
    and a chunk's row count picks the packed or the dense matmul, which round differently. (`auto` picks
    `native` where a C compiler is at hand, whose sums round otherwise: test_native_decode.py.)"""
    config = _tiny("llama")
    kwargs = dict(device="cpu", dtype="float32", num_swap_blocks=0, quantization=quantization, max_step_ms=0,
                  num_kv_blocks=120, block_size=8, seed=11)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 150, (6,), generator=gen)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    outs = {}
    for mode in ("off", "cpu"):
        llm = LLM(config, fuse_layers=mode, **kwargs)
        register_engine(llm.engine)
        decoder = llm.engine.runner.model.model
        assert isinstance(decoder, FusedDecoder) == (mode == "cpu")
        outs[mode] = [out.outputs[0].token_ids for out in run_to_completion(llm.engine, prompts, params)]
    assert isinstance(decoder.path, CpuPath) and decoder.native is None
    assert isinstance(decoder.layers[0].qkv_proj, QuantizedLinear)
    assert outs["cpu"] == outs["off"]


def test_low_bit_layers_that_do_not_merge_keep_transformers_layer() -> None:
    """W8A8 layers (int8 activations) are not merged: `auto` leaves such a model alone, a named mode says why;
    the compiled stretch takes no low-bit layer."""
    config = _tiny("llama")
    kwargs = dict(device="cpu", dtype="float32", num_swap_blocks=0, num_kv_blocks=16, block_size=8)
    llm = register_engine(LLM(config, quantization="int8", low_bit_matmul="w8a8", **kwargs).engine)
    assert not isinstance(llm.runner.model.model, FusedDecoder)
    with pytest.raises(ValueError, match="W8A8Linear"):
        fuse_layers(llm.runner.model, "cpu", torch.device("cpu"))
    int4 = register_engine(LLM(config, quantization="int4", fuse_layers="off", **kwargs).engine)
    with pytest.raises(ValueError, match="low-bit"):
        fuse_layers(int4.runner.model, "compile", torch.device("cpu"))
