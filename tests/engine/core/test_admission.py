"""Admission: the one check (context length, KV capacity, width, the prompt and its parameters) and its one
set of messages, shared by the server (lengths and its width cap) and the engine (everything)."""

from __future__ import annotations

import pickle
import re

import pytest

from streamd.engine import Admission
from streamd.engine.core.block_manager import BlockManager
from streamd.engine.errors import ContextLengthError, KVCacheCapacityError, RequestError
from streamd.engine.sampling_params import SamplingParams

ENGINE = Admission(100, BlockManager(12, 4, watermark=0.0), max_num_seqs=4)  # 48 tokens of KV
SERVER = Admission(100, max_width=16)


def _refusal(admission: Admission, num_prompt_tokens: int, **params) -> RequestError:
    with pytest.raises(RequestError) as caught:
        admission.check(num_prompt_tokens, SamplingParams(**params))
    return caught.value


@pytest.mark.parametrize("admission", [ENGINE, SERVER])
def test_context_length_messages_are_the_same_for_server_and_engine(admission: Admission) -> None:
    alone = _refusal(admission, 100, max_tokens=None)
    assert type(alone) is ContextLengthError and alone.code == "context_length_exceeded"
    assert str(alone) == "the prompt has 100 tokens; this model's context (max_model_len) is 100 tokens"
    assert alone.param == "prompt"
    plus = _refusal(admission, 90, max_tokens=11)
    assert type(plus) is ContextLengthError and plus.param == "max_tokens"
    assert str(plus) == ("the prompt (90 tokens) plus max_tokens (11) exceeds this model's context of 100 tokens "
                         "(max_model_len)")


def test_kv_capacity_counts_the_prompt_and_its_output() -> None:
    ENGINE.check(40, SamplingParams(max_tokens=8))  # 48 tokens: exactly the pool
    error = _refusal(ENGINE, 40, max_tokens=9)
    assert type(error) is KVCacheCapacityError and error.code == "kv_cache_capacity_exceeded"
    assert str(error) == ("the prompt (40 tokens) plus max_tokens (9) needs more KV cache blocks than the pool can "
                          "ever hold (12 blocks of 4 tokens, less the watermark)")
    SERVER.check(40, SamplingParams(max_tokens=59))  # the server does not know the pool


def test_width_messages() -> None:
    assert str(_refusal(SERVER, 5, n=17)) == "n must be <= 16, got 17"
    assert _refusal(SERVER, 5, n=17).param == "n"
    wide = _refusal(SERVER, 5, use_beam_search=True, beam_width=17, temperature=0.0)
    assert (str(wide), wide.param) == ("beam_width must be <= 16, got 17", "beam_width")
    beams = _refusal(ENGINE, 5, use_beam_search=True, beam_width=5, temperature=0.0, max_tokens=4)
    assert type(beams) is KVCacheCapacityError
    assert str(beams) == "beam_width=5 exceeds the sequences one step can run (4); all beams decode in the same step"
    samples = _refusal(ENGINE, 10, n=4, max_tokens=30)
    assert type(samples) is KVCacheCapacityError and samples.param == "n"
    assert str(samples) == ("n=4 sequences of up to 10 prompt + 30 output tokens need up to 34 KV cache blocks but "
                            "the KV cache can hold at most 12; lower n or max_tokens")
    ENGINE.check(10, SamplingParams(n=2, max_tokens=8))


def test_prompt_and_parameter_messages() -> None:
    assert Admission.prompt_ids([3, 4], None, None, 10) == (None, [3, 4])
    assert Admission.prompt_ids("hi", [3], None, 10) == ("hi", [3])
    for prompt, ids, needle in [("", None, "this model has no tokenizer"), ([], None, "prompt must not be empty"),
                                (None, [10], r"prompt_token_ids must be integers in \[0, 10\)"),
                                (None, [1, -1], "prompt_token_ids"), (None, [1.0], "prompt_token_ids"),
                                (5, None, "prompt must be a string or a list of token ids")]:
        with pytest.raises(RequestError, match=needle):
            Admission.prompt_ids(prompt, ids, None, 10)
    with pytest.raises(RequestError, match="params must be a SamplingParams"):
        Admission.check_params({"max_tokens": 3}, object())
    with pytest.raises(RequestError, match="set detokenize=False"):
        Admission.check_params(SamplingParams(), None)


def test_a_refusal_crosses_processes_with_its_field() -> None:
    error = pickle.loads(pickle.dumps(_refusal(ENGINE, 90, max_tokens=11)))
    assert type(error) is ContextLengthError and error.param == "max_tokens" and "plus max_tokens" in str(error)


def test_logit_bias_is_checked_against_the_vocabulary_and_openais_range() -> None:
    from streamd.engine.core.admission import MAX_LOGIT_BIAS

    Admission.check_logit_bias(SamplingParams(logit_bias={"0": -100, "99": 100}), vocab_size=100)
    too_many = {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}
    for bias, needle in (({"100": 1}, "not in [0, 100)"), ({"5": 100.5}, "[-100, 100]"), (too_many, "at most")):
        with pytest.raises(RequestError, match=re.escape(needle)) as caught:
            Admission.check_logit_bias(SamplingParams(logit_bias=bias), vocab_size=100)
        assert caught.value.param == "logit_bias"
