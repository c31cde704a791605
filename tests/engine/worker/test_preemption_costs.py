"""The start-up measurement behind preemption_mode="auto" runs once per machine and model shape: later
engines read it from `<cache_dir>/preemption-costs.json`."""

from __future__ import annotations

import json
from pathlib import Path

from streamd import LLM
from streamd.engine.worker.preemption_costs import COSTS_FILE
from tests.helpers import tiny_config

CONFIG = tiny_config(initializer_range=0.02)  # transformers' default: the weights this test always had


def _engine(cache_dir: Path, **overrides):
    return LLM(CONFIG, device="cpu", dtype="float32", num_kv_blocks=64, num_swap_blocks=64,
               cache_dir=str(cache_dir), **overrides).engine


def test_measured_once_then_read_from_the_cache(tmp_path: Path) -> None:
    first = _engine(tmp_path)
    file = tmp_path / COSTS_FILE
    entries = json.loads(file.read_text())
    assert len(entries) == 1
    (key, measured), = entries.items()
    assert measured["prefill_tokens_per_s"] > 0 and measured["host_link_bytes_per_s"] > 0
    assert first.scheduler.cost_model.prefill_tokens_per_s == measured["prefill_tokens_per_s"]
    # A later engine of the same shape takes the cached numbers (planted here, so a new measurement shows).
    file.write_text(json.dumps({key: {"host_link_bytes_per_s": 123.0, "prefill_tokens_per_s": 456.0}}))
    again = _engine(tmp_path).scheduler.cost_model
    assert (again.host_link_bytes_per_s, again.prefill_tokens_per_s) == (123.0, 456.0)
    # Another KV block size is another key: measured and added beside the first.
    _engine(tmp_path, block_size=32)
    assert len(json.loads(file.read_text())) == 2
    # So are weights held in another format (int8 Linears prefill at another rate than float32's).
    quantized = _engine(tmp_path, quantization="int8")
    entries = json.loads(file.read_text())
    assert len(entries) == 3 and quantized.scheduler.cost_model.prefill_tokens_per_s not in (123.0, 456.0)
    assert all("weights " in k and "streamd" in k for k in entries)


def test_damaged_cache_file_is_measured_again(tmp_path: Path) -> None:
    (tmp_path / COSTS_FILE).write_text("{not json")
    engine = _engine(tmp_path)
    assert engine.scheduler.cost_model.prefill_tokens_per_s > 0
    assert len(json.loads((tmp_path / COSTS_FILE).read_text())) == 1
