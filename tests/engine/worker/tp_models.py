"""Random-weight models of real architectures saved as model directories, for the tensor-parallel tests:
every rank loads the same weights from disk (biases and norms perturbed so that they matter), with a
word-level tokenizer so that the directory loads like any Hugging Face model."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

from tests import helpers

VOCAB = 256


def tiny_config(kind: str) -> PretrainedConfig:
    """2 layers, hidden 64, real GQA ratios: 8 query heads over 2 KV heads, or 4 over 2 (Qwen2)."""
    if kind == "qwen2":  # q/k/v biases
        return helpers.tiny_config(kind, vocab_size=VOCAB, num_attention_heads=4, max_position_embeddings=256)
    return helpers.tiny_config(kind, vocab_size=VOCAB, num_attention_heads=8, head_dim=16, max_position_embeddings=256)


def save_random_model(kind: str, path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers initialises biases to 0 and norms to 1: make them matter
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    words = WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0")
    tokenizer = Tokenizer(words)
    tokenizer.pre_tokenizer = WhitespaceSplit()  # "w3 w17" -> ids 3, 17
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(path)
    return path
