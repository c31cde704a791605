"""`echo` with `logprobs` on /v1/completions (OpenAI's legacy shape: the prompt's tokens first, the first one's
logprob and top logprobs null, then the generated tokens'), streamed (the prompt's in the first chunk) or
whole, and vLLM's `prompt_logprobs` field (each choice's `prompt_logprobs`: null, then {id: {logprob, rank,
decoded_token}}). The engine's values are checked against a plain forward in tests/engine/test_prompt_logprobs.py;
here against the same reference, through the server."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.server.util import Server

PROMPT = "The quick brown fox jumps over the lazy"
TOLERANCE = 1e-3


async def _post(server: Server, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=300) as http:
        return await http.post(f"{server.http}/v1/completions", json={"model": server.services.model_name, **body})


def _prompt_ids(server: Server) -> list[int]:
    return list(server.services.engine.tokenizer(PROMPT).input_ids)


@torch.inference_mode()
def _reference(hf_model, ids: list[int]) -> list[float]:
    logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


async def test_echo_with_logprobs_puts_the_prompt_tokens_first(server: Server, hf_smol) -> None:
    ids = _prompt_ids(server)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "logprobs": 2}
    plain = (await _post(server, body)).json()["choices"][0]
    reply = await _post(server, {**body, "echo": True})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT + plain["text"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(_reference(hf_smol, ids), abs=TOLERANCE)
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][: len(ids)]) == PROMPT
    assert lp["text_offset"][: len(ids) + 1] == [len("".join(lp["tokens"][:i])) for i in range(len(ids) + 1)]
    # the generated tokens' entries are those of the same request without echo
    assert lp["tokens"][len(ids) :] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][len(ids) :] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=TOLERANCE)


async def test_streamed_echo_carries_the_prompt_logprobs_in_its_first_chunk(server: Server) -> None:
    ids = _prompt_ids(server)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "logprobs": 1, "echo": True, "stream": True}
    async with httpx.AsyncClient(timeout=300) as http:
        answer = await http.post(f"{server.http}/v1/completions", json={"model": server.services.model_name, **body})
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT
    assert len(first["logprobs"]["tokens"]) == len(ids) and first["logprobs"]["token_logprobs"][0] is None
    tokens = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    assert len(tokens) == len(ids) + 3


async def test_a_long_streamed_prompt_still_carries_its_logprobs_first(server: Server) -> None:
    """A prompt read in several chunks (256 tokens a step here) reports its progress before the first token;
    those reports carry no logprobs, and the first chunk still has every prompt token's."""
    prompt = " ".join(f"Line {i} holds a red brick." for i in range(36))  # ~290 tokens
    ids = list(server.services.engine.tokenizer(prompt).input_ids)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0, "logprobs": 0, "echo": True, "stream": True,
            "prompt_logprobs": 0}
    async with httpx.AsyncClient(timeout=300) as http:
        answer = await http.post(f"{server.http}/v1/completions", json={"model": server.services.model_name, **body})
    first = json.loads(next(line[6:] for line in answer.text.splitlines() if line.startswith("data: {")))
    choice = first["choices"][0]
    assert len(ids) > 256 and choice["text"] == prompt
    assert len(choice["logprobs"]["tokens"]) == len(ids) and len(choice["prompt_logprobs"]) == len(ids)


async def test_prompt_logprobs_field_as_vllm_returns_it(server: Server, hf_smol) -> None:
    ids = _prompt_ids(server)
    reply = await _post(server, {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    assert reply.status_code == 200, reply.text
    entries = reply.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    expected = _reference(hf_smol, ids)
    for p in range(1, len(ids)):
        entry = entries[p]
        assert entry[str(ids[p])]["logprob"] == pytest.approx(expected[p - 1], abs=TOLERANCE)
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks == [1, 2]
    stream = await _post(server, {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 0, "stream": True})
    first = json.loads(next(line[6:] for line in stream.text.splitlines() if line.startswith("data: {")))
    streamed = first["choices"][0]["prompt_logprobs"]
    assert len(streamed) == len(ids) and streamed[0] is None and list(streamed[1]) == [str(ids[1])]


@pytest.mark.parametrize("value", [-1, 21, "3"])
async def test_a_bad_prompt_logprobs_is_refused_by_name(server: Server, value) -> None:
    reply = await _post(server, {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": value})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_logprobs"


async def test_every_choice_echoes_the_prompt_logprobs(server: Server) -> None:
    ids = _prompt_ids(server)
    reply = await _post(server, {"prompt": PROMPT, "max_tokens": 2, "n": 2, "seed": 3, "logprobs": 0, "echo": True})
    choices = reply.json()["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [len(ids) + 2] * 2
    assert choices[0]["logprobs"]["token_logprobs"][: len(ids)] == choices[1]["logprobs"]["token_logprobs"][: len(ids)]
