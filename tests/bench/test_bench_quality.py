"""`streamd bench quality` on the default model (light sizes): an unchanged setting agrees with itself everywhere, the
int8 KV cache nearly everywhere, and the report says so; the metrics' arithmetic on hand-made replies."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from streamd.bench import quality
from streamd.bench.report import BenchError


def _args(tmp_path: Path, **kw) -> Namespace:
    base = dict(model=None, kv_cache_dtype=None, set=[], base=["cache.num_kv_blocks=256", "cache.num_swap_blocks=0"],
                prompts=None, num_prompts=3, max_tokens=6, text=None, text_tokens=96, out=str(tmp_path))
    return Namespace(**{**base, **kw})


def test_agreement_counts_the_first_difference_and_positions() -> None:
    a = quality.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]], teacher_forced=0.5)
    assert (a.identical_share, a.prefix_agreement, a.positional_agreement) == (0.5, 0.75, 0.875)
    assert quality.same_share([[1, 2], [3]], [[1, 0], [3]]) == pytest.approx(2 / 3)
    assert len(quality.builtin_prompts(100)) == len(set(quality.builtin_prompts(100))) == 100


def test_an_unchanged_setting_agrees_with_itself(tmp_path: Path) -> None:
    result, device, _ = quality.measure(_args(tmp_path, set=["cache.kv_cache_dtype=auto"]))
    assert device == "cpu"
    assert result.agreement.teacher_forced == 1.0 and result.agreement.identical_share == 1.0
    assert result.perplexity_ratio == 1.0


def test_int8_kv_agrees_and_writes_its_report(tmp_path: Path) -> None:
    assert quality.run(_args(tmp_path, kv_cache_dtype="int8")) == 0
    report = json.loads(next(tmp_path.glob("quality-int8-*.json")).read_text())
    result = report["result"]
    assert result["candidate"] == "cache.kv_cache_dtype=int8"
    assert result["agreement"]["teacher_forced"] >= 0.8
    assert result["perplexity_ratio"] == pytest.approx(1.0, abs=0.05)
    assert result["perplexity_ratio"] != 1.0, "the int8 pool computed nothing the float pool did not"
    assert "greedy agreement" in next(tmp_path.glob("quality-int8-*.md")).read_text()


def test_nothing_to_compare_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="nothing to compare"):
        quality.measure(_args(tmp_path))
