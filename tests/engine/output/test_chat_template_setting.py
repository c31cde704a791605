"""`model.chat_template` (`streamd serve --chat-template`, vLLM's flag): a file or the template itself replaces
the tokenizer's own template for every chat request; a path that cannot be read is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamd import LLM
from streamd.engine.output.chat_template import read_chat_template

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_a_file_or_the_template_itself(tmp_path: Path) -> None:
    file = tmp_path / "t.jinja"
    file.write_text(TEMPLATE)
    assert read_chat_template(str(file)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match=r"model\.chat_template '/no/such/template\.jinja'"):
        read_chat_template("/no/such/template.jinja")


def test_the_setting_renders_every_chat(smol_dir: Path, tmp_path: Path) -> None:
    file = tmp_path / "t.jinja"
    file.write_text(TEMPLATE)
    llm = LLM(str(smol_dir), device="cpu", dtype="float32", num_kv_blocks=16, num_swap_blocks=0,
              chat_template=str(file))
    ids = llm.engine.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert llm.tokenizer.decode(ids) == "[user] Hi there\n"
