"""SamplingParams validation: every bad value raises ValueError naming the field; good ones pass through."""

from __future__ import annotations

import pytest

from streamd.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0),
    ("n", 0), ("n", True),
    ("min_tokens", -1),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("seed", 1.5), ("seed", "7"),
    ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("logprobs", -1), ("logprobs", 21),
    ("ignore_eos", 1), ("include_stop_str_in_output", "yes"), ("skip_special_tokens", None),
    # issue 10: OpenAI's bounds, no infinities, nothing so small that scaled logits overflow to NaN
    ("temperature", float("inf")), ("temperature", 1e-300), ("temperature", 2.5), ("top_p", float("inf")),
    ("repetition_penalty", 1e-300), ("repetition_penalty", float("inf")), ("presence_penalty", float("-inf")),
    # issue 10: a non-list stop names `stop` (not "'int' object is not iterable"); number and length capped
    ("stop", 5), ("stop", ["x"] * 65), ("stop", ["x" * 257]), ("stop_token_ids", 7),
])
def test_bad_value_names_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(temperature=2), dict(top_p=1.0), dict(top_p=1e-6), dict(top_k=-1),
    dict(top_k=0), dict(top_k=50), dict(min_p=1.0), dict(max_tokens=1), dict(max_tokens=None),
    dict(n=3), dict(presence_penalty=-2), dict(frequency_penalty=2), dict(repetition_penalty=1.3),
    dict(seed=-5), dict(seed=2**70), dict(logprobs=0), dict(logprobs=20), dict(min_tokens=16),
])
def test_good_values_accepted(kwargs) -> None:
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_stop_normalized_to_list_and_flags() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.1).uses_penalties


def test_from_dict() -> None:
    params = SamplingParams.from_dict({"max_tokens": 5, "temperature": 0, "stop": "\n"})
    assert (params.max_tokens, params.temperature, params.stop) == (5, 0, ["\n"])
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams.from_dict({"best_of": 2})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 0})


@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=2), "beam_width"), (dict(length_penalty=0.5), "length_penalty"),
    (dict(early_stopping=True), "early_stopping"),  # beam settings without use_beam_search
    (dict(use_beam_search=True, beam_width=0), "beam_width"),
    (dict(use_beam_search=True, beam_width=2, n=3), "n"),
    (dict(use_beam_search=True, early_stopping="always"), "early_stopping"),
    (dict(use_beam_search=True, early_stopping=1), "early_stopping"),
    (dict(use_beam_search=True, length_penalty=float("inf")), "length_penalty"),
    (dict(use_beam_search=True, temperature=0.7), "temperature"),
    (dict(use_beam_search=True, top_p=0.9), "top_p"), (dict(use_beam_search=True, top_k=5), "top_k"),
    (dict(use_beam_search=True, min_p=0.1), "min_p"), (dict(use_beam_search=True, seed=1), "seed"),
    (dict(use_beam_search=True, repetition_penalty=1.2), "repetition_penalty"),
    (dict(use_beam_search=True, stop=["\n"]), "stop"), (dict(use_beam_search=True, logprobs=2), "logprobs"),
    (dict(use_beam_search="yes"), "use_beam_search"),
])
def test_beam_search_refuses_what_it_cannot_honour(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_beam_search_settings() -> None:
    params = SamplingParams(use_beam_search=True, n=2)
    assert params.beam_width == 2 and params.needs_host_tokens  # beam_width defaults to n (vLLM)
    params = SamplingParams.from_dict({"use_beam_search": True, "beam_width": 4, "length_penalty": -1.0,
                                       "early_stopping": "never", "temperature": 0, "stop_token_ids": [7],
                                       "min_tokens": 2, "ignore_eos": True})
    assert (params.beam_width, params.length_penalty, params.early_stopping) == (4, -1.0, "never")
