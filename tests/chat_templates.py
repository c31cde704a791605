"""Real chat templates (as published in the models' tokenizer_config.json) for tests that need a model
family's own tool-call format: Qwen2.5-Instruct (Hermes-style `<tool_call>` blocks) and Llama 3.2-Instruct
(a JSON call `{"name": ..., "parameters": ...}`)."""

from __future__ import annotations

from pathlib import Path

_DATA = Path(__file__).parent / "data"
QWEN_2_5_TEMPLATE = (_DATA / "qwen2.5-instruct.jinja").read_text()
LLAMA_3_2_TEMPLATE = (_DATA / "llama3.2-instruct.jinja").read_text()
