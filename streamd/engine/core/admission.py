"""Admission: the one check of whether a request can ever be served as asked, with the one set of messages.

The server runs it before it submits (a refused request never reaches the engine, and the error names the
wire field at fault); the engine runs it in `add_request` before it creates any state for the request (the
offline API and every client that does not go through the server). What the caller knows decides what is
checked: the context length always; the request's width against `max_width` (the server's cap on n and
beam_width) when given; the KV pool (`blocks`) and the sequences one step runs (`max_num_seqs`) when given
(the engine's). A request admitted here can always run to its end; the scheduler never has to refuse one.
`prompt_ids` and `check_params` are the engine's checks of the prompt (text or token ids within the
vocabulary, not empty) and of the parameters' type. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamd.engine.errors import ContextLengthError, KVCacheCapacityError, RequestError
from streamd.engine.sampling_params import MAX_LOGPROBS, SamplingParams, is_int

MAX_LOGIT_BIAS = 300  # token ids one request may bias (as OpenAI)

if TYPE_CHECKING:
    from streamd.engine.core.hybrid_blocks import BlockSpace


@dataclass(frozen=True, slots=True)
class Admission:
    max_model_len: int
    blocks: BlockSpace | None = None  # the KV pool a request must fit (the engine's)
    max_num_seqs: int | None = None  # sequences one step runs: every beam of a request decodes in one step
    max_width: int | None = None  # the most parallel samples or beams a request may ask for

    def check(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Everything, in order: context length, KV capacity, width. Raises a RequestError saying why not."""
        self.check_lengths(num_prompt_tokens, params.max_tokens)
        self.check_capacity(num_prompt_tokens, params)
        self.check_width(params)
        self.check_worst_case(num_prompt_tokens, params)
        self.check_prompt_logprobs(params)

    @staticmethod
    def check_prompt_logprobs(params: SamplingParams) -> None:
        """`prompt_logprobs` as `logprobs` is bounded: an integer in [0, MAX_LOGPROBS], or None."""
        top = params.prompt_logprobs
        if top is not None and not (is_int(top) and 0 <= top <= MAX_LOGPROBS):
            raise RequestError(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}", "prompt_logprobs"
            )

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """The prompt must leave room for one output token; with max_tokens, the whole must fit the context."""
        context = self.max_model_len
        if num_prompt_tokens >= context:
            raise ContextLengthError(
                f"the prompt has {num_prompt_tokens} tokens; this model's context (max_model_len) is {context} tokens",
                "prompt",
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > context:
            raise ContextLengthError(
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
                f"context of {context} tokens (max_model_len)",
                "max_tokens",
            )

    def check_capacity(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """The prompt and its output must fit the KV pool (less the watermark), else the request would fail
        mid-generation instead of here."""
        bm = self.blocks
        if bm is None or bm.can_ever_fit(num_prompt_tokens + (params.max_tokens or 1)):
            return
        raise KVCacheCapacityError(
            f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) needs more KV cache "
            f"blocks than the pool can ever hold ({bm.num_blocks} blocks of {bm.block_size} tokens, less the "
            "watermark)",
            "max_tokens",
        )

    def check_width(self, params: SamplingParams) -> None:
        """n and beam_width within `max_width`; all of a request's beams within one step's sequences."""
        limit, beams = self.max_width, params.beam_width
        if limit is not None and params.n > limit:
            raise RequestError(f"n must be <= {limit}, got {params.n}", "n")
        if limit is not None and beams is not None and beams > limit:
            raise RequestError(f"beam_width must be <= {limit}, got {beams}", "beam_width")
        if params.use_beam_search and self.max_num_seqs is not None and _width(params) > self.max_num_seqs:
            raise KVCacheCapacityError(
                f"{_width_name(params)} exceeds the sequences one step can run ({self.max_num_seqs}); all "
                "beams decode in the same step",
                "beam_width",
            )

    def check_worst_case(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """A request of several sequences must fit the pool with every sequence at its longest."""
        bm = self.blocks
        worst = self.worst_case_blocks(num_prompt_tokens, params)
        if bm is None or worst <= bm.num_blocks - bm.watermark_blocks:
            return
        name = _width_name(params)
        raise KVCacheCapacityError(
            f"{name} sequences of up to {num_prompt_tokens} prompt + "
            f"{self.max_output_tokens(num_prompt_tokens, params)} output tokens need up to {worst} KV cache "
            f"blocks but the KV cache can hold at most {bm.num_blocks - bm.watermark_blocks}; lower "
            f"{name.split('=', maxsplit=1)[0]} or max_tokens",
            name.split("=", maxsplit=1)[0],
        )

    def max_output_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """max_tokens, or what the context leaves when that is less (or max_tokens is None)."""
        room = self.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def worst_case_blocks(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The most blocks a request holds at once (0 for one sequence: it is admitted on its prompt and
        grows through preemption like any other)."""
        width = _width(params)
        if width == 1 or self.blocks is None:
            return 0
        return self.blocks.worst_case_blocks(
            num_prompt_tokens, self.max_output_tokens(num_prompt_tokens, params), width
        )

    @staticmethod
    def prompt_ids(
        prompt: str | list[int] | None, prompt_token_ids: list[int] | None, tokenizer: Any, vocab_size: int
    ) -> tuple[str | None, list[int]]:
        """A request's prompt as (its text if it came as text, its token ids), or a RequestError saying why not.
        A list `prompt` is taken as token ids."""
        if prompt_token_ids is None and isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            # C-speed checks (a per-token generator cost ~1.5 us a token: most of a long prompt's admission)
            if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab_size):
                raise RequestError(f"prompt_token_ids must be integers in [0, {vocab_size})", "prompt")
            text = prompt if isinstance(prompt, str) else None
        elif isinstance(prompt, str):
            if tokenizer is None:
                raise RequestError("this model has no tokenizer: send prompt token ids", "prompt")
            ids, text = list(tokenizer(prompt).input_ids), prompt
        else:
            raise RequestError("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise RequestError("prompt must not be empty", "prompt")
        return text, ids

    @staticmethod
    def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
        """`logit_bias` as OpenAI bounds it: at most MAX_LOGIT_BIAS token ids, each in the vocabulary, each
        bias in [-100, 100]."""
        bias = params.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
        for token, value in bias.items():
            if not 0 <= token < vocab_size:
                raise RequestError(f"logit_bias: token id {token} is not in [0, {vocab_size})", "logit_bias")
            if not -100 <= value <= 100:
                raise RequestError(
                    f"logit_bias: token {token}'s bias must be in [-100, 100], got {value}", "logit_bias"
                )

    @staticmethod
    def check_params(params: object, tokenizer: Any) -> None:
        """The request's parameters are a SamplingParams this model can serve."""
        if not isinstance(params, SamplingParams):
            raise RequestError("params must be a SamplingParams")
        if params.detokenize and tokenizer is None:
            raise RequestError("this model has no tokenizer: set detokenize=False and send token ids", "detokenize")


def _width(params: SamplingParams) -> int:
    return params.beam_width if params.beam_width is not None else params.n


def _width_name(params: SamplingParams) -> str:
    return f"beam_width={_width(params)}" if params.use_beam_search else f"n={params.n}"
