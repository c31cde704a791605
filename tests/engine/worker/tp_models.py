"""Random-weight models of real architectures saved as model directories, for the tensor-parallel tests:
every rank loads the same weights from disk (biases and norms perturbed so that they matter), with a
word-level tokenizer so that the directory loads like any Hugging Face model."""

from __future__ import annotations

from pathlib import Path

from transformers import PretrainedConfig

from tests import helpers

VOCAB = 256


def tiny_config(kind: str) -> PretrainedConfig:
    """2 layers, hidden 64, real GQA ratios: 8 query heads over 2 KV heads, or 4 over 2 (Qwen2)."""
    if kind == "qwen2":  # q/k/v biases
        return helpers.tiny_config(kind, vocab_size=VOCAB, num_attention_heads=4, max_position_embeddings=256)
    return helpers.tiny_config(kind, vocab_size=VOCAB, num_attention_heads=8, head_dim=16, max_position_embeddings=256)


def save_random_model(kind: str, path: Path, seed: int = 0) -> Path:
    return helpers.save_random_checkpoint(tiny_config(kind), path, seed)
