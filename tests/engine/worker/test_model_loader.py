"""Model loading from every supported source, through transformers' loaders, never the network."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from streamd.engine.worker.model_loader import (
    _converted_gguf,
    default_gguf_path,
    default_model_dir,
    load_model,
    resolve_dtype,
)


def test_gguf_conversion_is_cached(smol_dir: Path, tmp_path: Path) -> None:
    # smol_dir was converted by the session fixture; converting again must return the cached copy untouched.
    stamp = (smol_dir / "config.json").stat().st_mtime_ns
    start = time.perf_counter()
    again = _converted_gguf(default_gguf_path(), smol_dir.parent.parent)
    assert again == smol_dir
    assert (again / "config.json").stat().st_mtime_ns == stamp
    assert time.perf_counter() - start < 1.0, "a cached conversion must not dequantize again"


def test_conversion_cache_is_keyed_by_content_not_path(smol_dir: Path, tmp_path: Path) -> None:
    """Another checkout (another copy of the same GGUF file) finds the converted copy; other bytes do not."""
    import shutil

    elsewhere = tmp_path / "other-venv" / default_gguf_path().name
    elsewhere.parent.mkdir()
    shutil.copyfile(default_gguf_path(), elsewhere)
    assert _converted_gguf(elsewhere, smol_dir.parent.parent) == smol_dir
    assert default_model_dir() == smol_dir
    with elsewhere.open("r+b") as fh:  # one byte changed: another file, another key
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 1]))
    from streamd.engine.worker.model_loader import gguf_content_key

    assert gguf_content_key(elsewhere) != gguf_content_key(default_gguf_path())


def test_local_directory_loads_weights_and_tokenizer(smol_dir: Path) -> None:
    loaded = load_model(str(smol_dir), torch.float32, torch.device("cpu"))
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert loaded.name == smol_dir.name


def test_unknown_sources_fail_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="local Hugging Face cache"):
        load_model("no-such-org/no-such-model", torch.float32, torch.device("cpu"))


def test_dtype_defaults() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
