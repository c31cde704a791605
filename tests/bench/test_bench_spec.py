"""`streamd bench spec`: the edit workload's texts are as long as the issue asks, and the light form's report
has every workload and mode, identical greedy tokens with speculation on, and drafts kept on the edit."""

from __future__ import annotations

import argparse
import json

from streamd.bench import spec


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
