"""Test helpers: the engine leak check, reference generation with plain Hugging Face transformers, and the
two sizes of a heavy scenario (`sizes`)."""

from __future__ import annotations

import itertools

import pytest
import torch

_REQUEST_IDS = itertools.count()

# Engines under the leak check that ends every test (see conftest.py).
ENGINES: list = []


def sizes(light, full) -> list:
    """A scenario's size as two parameters: `light` runs in `make test`, `full` is marked slow and runs in
    `make test-all` (same behaviour and assertions, a smaller workload)."""
    return [pytest.param(light, id="light"), pytest.param(full, id="full", marks=pytest.mark.slow)]


def register_engine(engine):
    """Puts an engine under the per-test leak check; returns it."""
    ENGINES.append(engine)
    return engine


def assert_pool_whole(engine) -> None:
    """No request in flight, every KV block (and swap block) free again, no draft model's cache kept."""
    stats = engine.stats()
    assert not engine.has_unfinished_requests(), "requests still in flight after the test"
    assert stats.pool_whole, f"KV blocks leaked: {stats}"
    speculator = engine.scheduler.speculator
    draft = speculator.draft_source if speculator is not None else None
    assert draft is None or not draft.cached_sequences, f"draft caches leaked: {draft.cached_sequences}"


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy continuation of one unpadded prompt; stops at EOS like streamd does (EOS included)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id or 0)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def hf_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[torch.Tensor]:
    """The raw (temperature 1, unpenalised) log-probabilities over the vocabulary that `model` gives before
    each of `output_ids`, continuing `prompt_ids`: one row per output token."""
    ids = torch.tensor([prompt_ids + output_ids])
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt_ids) - 1:-1]
    return list(torch.log_softmax(logits.float(), -1))

def run_to_completion(engine, prompts: list, params) -> list:
    """Adds every prompt to `engine` (with one SamplingParams, or one each) and steps until all finish;
    final RequestOutputs in prompt order."""
    from streamd.engine.outputs import RequestOutputBuilder
    from streamd.llm import run_to_completion as fold

    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    builders = []
    for prompt, p in zip(prompts, per_prompt):
        request_id = f"t{next(_REQUEST_IDS)}"
        ids = engine.add_request(request_id, prompt, p)
        builders.append(RequestOutputBuilder(request_id, prompt if isinstance(prompt, str) else None, ids, p.n))
    return fold(engine, builders)


def step_until_idle(engine, folded: dict | None = None) -> dict:
    """Steps `engine` until no request is in flight, folding every request's deltas; returns
    {request_id: RequestOutput} of the requests that finished (with `folded`, continues that fold)."""
    builders = folded if folded is not None else {}
    while engine.has_unfinished_requests():
        fold_deltas(engine.step(), builders)
    return {rid: b.build() for rid, b in builders.items() if b.finished}


def fold_deltas(deltas, builders: dict) -> None:
    """Folds `deltas` into `builders` ({request_id: RequestOutputBuilder}, created on first sight)."""
    from streamd.engine.outputs import RequestOutputBuilder

    for delta in deltas:
        builder = builders.get(delta.request_id)
        if builder is None:
            builder = builders[delta.request_id] = RequestOutputBuilder(delta.request_id, None, [])
        builder.add(delta)


def random_engine_and_hf_twin(config, perturb_seed: int, num_prompts: int, max_prompt_len: int, **engine_kwargs):
    """A CPU float32 engine of random weights whose 1-D parameters are perturbed (transformers initialises
    biases to 0 and norms to 1: make them matter), the same weights in a transformers model (EOS off), and
    `num_prompts` random prompts of 1..max_prompt_len-1 tokens."""
    from transformers import AutoModelForCausalLM

    from streamd import LLM

    llm = LLM(config, device="cpu", dtype="float32", num_swap_blocks=0, **engine_kwargs)
    register_engine(llm.engine)
    model = llm.engine.runner.model
    gen = torch.Generator().manual_seed(perturb_seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reference.load_state_dict(model.state_dict())
    reference.generation_config.eos_token_id = None
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, max_prompt_len, (num_prompts,), generator=gen)]
    return llm, reference, prompts


def tiny_config(kind: str = "llama", *, vocab_size: int = 300, hidden_size: int = 64, intermediate_size: int = 128,
                num_hidden_layers: int = 2, num_attention_heads: int = 4, head_dim: int | None = None,
                max_position_embeddings: int = 512, initializer_range: float = 0.1):
    """A random-weight model of a real architecture with 2 KV heads and untied embeddings: "llama" (GQA),
    "mistral" (a Llama without a window: v0.3, Nemo), "qwen2" (QKV bias) or "qwen3" (per-head q/k norm).
    `head_dim` None: hidden_size / num_attention_heads. The defaults are the 2-layer Llama (hidden 64, 4 query
    heads over 2 KV heads) of the engine unit tests."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if kind not in classes:
        raise ValueError(f"tiny_config kind must be one of {', '.join(classes)}, got {kind!r}")
    extra = {} if head_dim is None else {"head_dim": head_dim}
    if kind == "mistral":
        extra["sliding_window"] = None
    return classes[kind](vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         initializer_range=initializer_range, tie_word_embeddings=False, **extra)


def tiny_arch_config(kind: str, hidden_size: int, intermediate_size: int, num_attention_heads: int,
                     qwen3_head_dim: int):
    """The parity tests' `tiny_config`: 3 layers, vocabulary 320, head_dim `qwen3_head_dim` for "qwen3"."""
    return tiny_config(kind, vocab_size=320, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=3, num_attention_heads=num_attention_heads,
                       head_dim=qwen3_head_dim if kind == "qwen3" else None, initializer_range=0.08)


def save_random_checkpoint(config, path, seed: int = 0):
    """A random-weight model of `config` saved as a model directory (`save_pretrained`) with a word-level
    tokenizer over its vocabulary ("w3 w17" -> ids 3, 17), so that it loads like any Hugging Face model;
    1-D parameters (biases, norms, sinks) perturbed so that they matter, EOS off. Returns `path`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers initialises biases to 0 and norms to 1: make them matter
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    vocab = config.get_text_config().vocab_size
    tokenizer = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(path)
    return path


def tiny_llm(**overrides):
    """An LLM of `tiny_config()` on CPU (float32, blocks of 8, seed 5, no watermark) under the leak check;
    `overrides` are LLM keyword arguments (num_kv_blocks, num_swap_blocks, preemption_mode, ...)."""
    from streamd import LLM

    base = dict(device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=64, seed=5, watermark=0.0)
    llm = LLM(tiny_config(), **{**base, **overrides})
    register_engine(llm.engine)
    return llm


def random_prompt(seed: int, length: int, vocab_size: int = 300) -> list[int]:
    """`length` token ids drawn (seeded) from 10..vocab_size-1: clear of the special tokens."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab_size, (length,), generator=gen).tolist()
