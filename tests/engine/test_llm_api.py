"""The offline Python API and CLI: shapes of outputs, chat, bad input rejected with the field named."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streamd import LLM, RequestOutput, SamplingParams
from streamd.engine.errors import ContextLengthError, KVCacheCapacityError, RequestError
from tests.helpers import register_engine


def test_generate_returns_outputs_in_prompt_order(smol_llm: LLM) -> None:
    prompts = ["The capital of France is", smol_llm.tokenizer("def fib(n):").input_ids]
    outs = smol_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    assert outs[0].prompt == "The capital of France is"
    assert outs[1].prompt_token_ids == prompts[1]
    for out in outs:
        completion = out.outputs[0]
        assert out.finished and completion.index == 0
        assert completion.finish_reason in ("stop", "length")
        assert 1 <= len(completion.token_ids) <= 8
        assert completion.text == smol_llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    single = smol_llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8))
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chat_applies_the_models_template(smol_llm: LLM) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    out = smol_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6))[0]
    expected_ids = smol_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(expected_ids, "keys"):
        expected_ids = expected_ids["input_ids"]
    assert out.prompt_token_ids == list(expected_ids)
    assert out.outputs[0].text


def test_logprobs_are_reported_per_token(smol_llm: LLM) -> None:
    out = smol_llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for token, top in zip(out.token_ids, out.logprobs):
        assert token in top and len(top) >= 3
        assert max(top.values()) == top[token]  # greedy picks the most likely token


@pytest.mark.parametrize("prompt, params, error, needle", [
    ("", SamplingParams(), RequestError, "empty"),
    ([], SamplingParams(), RequestError, "empty"),
    ("hi", SamplingParams(max_tokens=10**6), ContextLengthError, "context"),
    ([10**9], SamplingParams(), RequestError, "prompt_token_ids"),
    ([5, -1], SamplingParams(), RequestError, "prompt_token_ids"),
    ([5, True], SamplingParams(), RequestError, "prompt_token_ids"),
    ([5, 7.0], SamplingParams(), RequestError, "prompt_token_ids"),
    ([5, "7"], SamplingParams(), RequestError, "prompt_token_ids"),
    ("hi", SamplingParams(n=64, max_tokens=200), KVCacheCapacityError, "n=64"),
])
def test_bad_requests_raise_value_error(smol_llm: LLM, prompt, params, error, needle) -> None:
    with pytest.raises(error, match=needle):
        smol_llm.generate(prompt if prompt != [] else [[]], params)
    assert issubclass(error, ValueError)


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2),
                                          ("max_tokens", 0), ("n", 0)])
def test_bad_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_cli_generate_prints_a_completion() -> None:
    proc = subprocess.run([sys.executable, "-m", "streamd.cli.main", "generate", "--max-tokens", "5", "--device", "cpu",
                           "The sky is"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # the library with the CLI's settings (the default model low-bit: its greedy tokens may differ from the
    # dequantized `smol_llm`'s where two logits tie)
    llm = LLM(device="cpu")
    register_engine(llm.engine)
    expected = llm.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0].text
    assert f"--- The sky is\n{expected}\n" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "streamd.cli.main", "generate", "--temperature", "-1", "x"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "temperature" in bad.stderr


def test_a_chat_template_that_raises_is_a_request_error(smol_llm: LLM) -> None:
    import copy

    from streamd.engine.output.chat_template import chat_template_ids

    strict = copy.deepcopy(smol_llm.tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(RequestError, match="no system messages"):
        chat_template_ids(strict, [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])
    assert chat_template_ids(strict, [{"role": "user", "content": "hi"}]) == strict("hi").input_ids
    with pytest.raises(RequestError, match=r"messages\[0\]"):
        smol_llm.chat([{"role": "user"}])
