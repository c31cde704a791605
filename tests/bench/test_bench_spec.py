"""`streamd bench spec`: the edit workload's texts are as long as the issue asks, and the light form's report
has every workload and mode, identical greedy tokens with speculation on, and drafts kept on the edit."""

from __future__ import annotations

import argparse
import json

import pytest

from streamd.bench import spec
from streamd.bench.report import BenchError


def test_edit_texts_are_600_to_1500_tokens(smol_llm) -> None:
    requests = spec.edit_requests(spec.FULL)
    assert len(requests) == spec.FULL.edit_requests and len({text for _, text in requests}) == len(requests)
    for instruction, text in requests:
        assert text in instruction and "Holiday" in instruction
        assert 600 <= len(smol_llm.tokenizer.encode(text)) <= 1500


def test_light_run_reports_every_mode_and_identical_tokens(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    spec.add_arguments(parser)
    assert spec.run(parser.parse_args(["--light", "--out", str(tmp_path)])) == 0
    (path,) = tmp_path.glob("spec-*.json")
    report = json.loads(path.read_text())
    assert report["git_commit"] and report["torch"] and report["device"] == "cpu"
    assert [(r["workload"], r["streams"]) for r in report["results"]] == [("edit", 1), ("chat", 1), ("chat", 2)]
    edit = report["results"][0]
    assert set(edit["modes"]) == {"off", "prompt_lookup", "prediction"}
    # Each mode is what it says: `off` drafts nothing, prompt lookup drafts from the copied text, and the
    # prediction's drafts are kept.
    assert edit["modes"]["prompt_lookup"]["draft_tokens"] > 0
    assert edit["modes"]["prediction"]["accepted_tokens"] > 0
    for result in report["results"]:
        assert set(result["tpot_lower_x"]) == set(result["rate_vs_off"]) == set(result["modes"]) - {"off"}
        assert result["modes"]["off"]["draft_tokens"] == 0 and result["modes"]["off"]["acceptance_rate"] is None
        for mode, numbers in result["modes"].items():
            assert numbers["identical_to_off"] is (None if mode == "off" else True)
            assert numbers["accepted_tokens"] <= numbers["draft_tokens"]
            assert numbers["output_tokens"] == result["requests"] * result["max_tokens"] or result["workload"] == "chat"
    text = (tmp_path / path.name.replace(".json", ".md")).read_text()
    assert text.startswith("# streamd bench spec")
    assert text.count("\n| ") == 1 + sum(len(r["modes"]) for r in report["results"])  # header, a row per mode


def test_rounds_rotate_the_modes_and_pool_their_requests(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    spec.add_arguments(parser)
    order: list[list[int]] = []
    real = spec.run_mode

    def noted(engine, prompts, params, streams):  # which mode each run is: its params' max_tokens and prediction
        order.append([params[0].max_tokens, bool(params[0].prediction), engine.scheduler.speculator.config.prompt_lookup])
        return real(engine, prompts, params, streams)

    monkeypatch.setattr(spec, "run_mode", noted)
    assert spec.run(parser.parse_args(["--light", "--rounds", "2", "--out", str(tmp_path)])) == 0
    report = json.loads(next(tmp_path.glob("spec-*.json")).read_text())
    assert report["command"].endswith("--rounds 2")
    edit = report["results"][0]
    assert edit["rounds"] == 2
    for mode, numbers in edit["modes"].items():
        assert len(numbers["tpot_ms_per_request"]) == 2 * edit["requests"]  # both rounds' requests, pooled
        assert numbers["identical_to_off"] is (None if mode == "off" else True)
    assert all(len(ratios) == 2 for ratios in edit["tpot_lower_x_rounds"].values())
    # The edit workload: the untimed warm-up, then off, lookup, prediction, then lookup, prediction, off.
    off, lookup, prediction = [12, False, False], [12, False, True], [12, True, False]
    assert order[:7] == [[1, False, False], off, lookup, prediction, lookup, prediction, off]
    with pytest.raises(BenchError, match="--rounds"):
        spec.run(parser.parse_args(["--light", "--rounds", "0", "--out", str(tmp_path)]))


def test_an_oracle_s_drafts_hold_about_as_often_as_it_is_told(smol_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = smol_llm.engine
    # the unmeasured row price (drafts of several tokens): how many drafts pay on this machine is not the question
    monkeypatch.setattr(engine.scheduler.step_cost, "row_cost", lambda tokens: None)
    chats = spec.CHAT_QUESTIONS[:1]
    own = engine.scheduler.speculator.draft_source
    rates = {}
    for keep in (1.0, 0.4):
        entry = spec.workload(engine, "oracle", chats, 20, 1, None, oracle=keep)
        assert set(entry["modes"]) == {"off", "oracle"}
        oracle = entry["modes"]["oracle"]
        assert oracle["identical_to_off"] is True and oracle["draft_tokens"] > 0
        rates[keep] = oracle["acceptance_rate"]
    assert rates[1.0] > 0.9 and 0 < rates[0.4] < 0.6
    assert engine.scheduler.speculator.draft_source is own  # the engine's own proposer back after the bench
    with pytest.raises(BenchError, match="oracle-acceptance"):
        spec.workload(engine, "oracle", chats, 4, 1, None, oracle=0.0)
