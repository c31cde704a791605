"""Reference generation with plain Hugging Face transformers, for parity tests."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy continuation of one unpadded prompt; stops at EOS like streamd does (EOS included)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id or 0)
    return out[0, len(prompt_ids):].tolist()
