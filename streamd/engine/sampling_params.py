"""SamplingParams: how one request's tokens are chosen and when its generation stops.

Field names follow OpenAI / vLLM so users and the wire protocol share one vocabulary. Every value is
checked when the object is built; a bad one raises ValueError naming the field. Numeric values are bounded
as OpenAI bounds them (temperature in [0, 2], penalties in [-2, 2]); values so small that dividing logits by
them overflows (temperature or repetition_penalty of 1e-300) are out of range, not NaN at sampling time. Stop
strings are capped in number and length: every running request's are scanned on the engine thread each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, TypeGuard

_GREEDY_EPS = 1e-5
MIN_TEMPERATURE = 1e-3  # a temperature in (0, this) would overflow the scaled logits
MAX_TEMPERATURE = 2.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 100.0
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # top logprobs a request may ask for per token (as OpenAI)
SERVICE_TIERS = ("auto", "default", "priority", "flex")  # OpenAI's `service_tier` values
MAX_PRIORITY = 1 << 31  # |priority| at most this (vLLM's field is an int)


@dataclass(slots=True, frozen=True)
class StructuredOutputs:
    """What a constrained request's output must match: exactly one of a JSON schema (`json`, a dict or
    its JSON text), any JSON object (`json_object`), a regular expression, one of a list of strings
    (`choice`) or an EBNF grammar (xgrammar's GBNF dialect). Names follow vLLM's `structured_outputs`."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        _check(
            len(given) == 1,
            "structured_outputs",
            given,
            "must set exactly one of json, json_object, regex, choice, grammar",
        )
        _check(
            self.json is None or isinstance(self.json, (dict, str)),
            "structured_outputs.json",
            self.json,
            "must be a JSON schema object",
        )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, str) and bool(value)),
                f"structured_outputs.{name}",
                value,
                "must be a non-empty string",
            )
        _check(
            self.choice is None
            or (
                isinstance(self.choice, list)
                and bool(self.choice)
                and all(isinstance(c, str) and c for c in self.choice)
            ),
            "structured_outputs.choice",
            self.choice,
            "must be a non-empty list of non-empty strings",
        )

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputs:
        """From a StructuredOutputs or its wire dict (an unknown key is an error naming it)."""
        if isinstance(value, cls):
            return value
        _check(isinstance(value, dict), "structured_outputs", value, "must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        _check(not unknown, "structured_outputs", unknown[:1], f"has an unknown key (known: {sorted(known)})")
        return cls(**value)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # Prompt logprobs (vLLM's name): for every prompt position p >= 1, the logprob of prompt token p given
    # the tokens before it and the top `prompt_logprobs` alternatives, delivered with the first output
    # (`RequestDelta.prompt_logprobs`; position 0 is None). Checked in `Admission.check` (0..MAX_LOGPROBS).
    # Such a request takes no prefix-cache hit: every prompt position is computed.
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    # Added to the logits of these token ids before sampling (OpenAI's `logit_bias`; wire keys are the ids'
    # decimal strings). Ids and values are checked against the vocabulary in `Admission.check_logit_bias`.
    logit_bias: dict[int, float] | None = None
    # Reasoning models: after this many output tokens the reply's reasoning is closed by forcing
    # `thinking_end_token_ids` (`</think>` as the model's tokenizer spells it; the server sets them), unless
    # the model closed it itself (vLLM's `thinking_token_budget`).
    thinking_token_budget: int | None = None
    thinking_end_token_ids: list[int] = field(default_factory=list)
    # Beam search (Hugging Face `generate(num_beams=beam_width)` semantics; `beam_search.py`): the best `n`
    # of `beam_width` beams are returned. `beam_width` None means n (vLLM's legacy default).
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    timeout_s: float | None = None  # seconds from arrival to the end: then it finishes with "timeout"
    # OpenAI's Predicted Outputs: text the output is expected to be mostly (a file being edited), or its token
    # ids. It is only a source of draft tokens for speculative decoding (engine/core/speculation.py): the output
    # is the same.
    prediction: str | list[int] | None = None
    # Seconds it may wait before its first scheduling; past it, it ends with "timeout" and no output (the
    # server sets it from `server.max_queue_time_s` and answers "overloaded"). Not a wire parameter.
    queue_timeout_s: float | None = None
    # Scheduling order (engine/core/fairness.py): OpenAI's `service_tier` ("priority" first, "flex" only on
    # spare capacity; "auto" is "default"), then vLLM's `priority` (lower first), then the tenant's fair share.
    service_tier: str = "default"
    priority: int = 0
    # Whose fair share this request draws on: a name from the server's config or a digest of the key or
    # `user` (never a raw key). Set by the server; not a wire parameter.
    tenant: str = ""
    # Whether the engine reports its place in the queue while it waits (engine/core/progress.py): the server
    # turns it off on routes that send nothing of it (chat and completions; each report is a delta through the
    # output path). Not a wire parameter.
    queue_reports: bool = True
    # Mixed into the root of the prefix cache's hash chain (vLLM's `cache_salt`): only requests with the
    # same salt share cached blocks.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.from_value(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            isinstance(self.stop, (list, tuple)) or self.stop is None,
            "stop",
            self.stop,
            "must be a string or a list of strings",
        )
        _check(
            isinstance(self.stop_token_ids, (list, tuple)) or self.stop_token_ids is None,
            "stop_token_ids",
            self.stop_token_ids,
            "must be a list of non-negative integers",
        )
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = _token_id_keys(self.logit_bias)
        self._validate()
        if self.use_beam_search:
            if self.beam_width is None:
                self.beam_width = self.n
            self._validate_beam_search()
        else:
            for name, default in (("beam_width", None), ("length_penalty", 1.0), ("early_stopping", False)):
                _check(getattr(self, name) == default, name, getattr(self, name), "needs use_beam_search=true")

    def _validate(self) -> None:
        _check(is_int(self.n) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _check(
            self.prediction is None
            or isinstance(self.prediction, str)
            or (isinstance(self.prediction, list) and all(is_int(t) for t in self.prediction)),
            "prediction",
            self.prediction,
            "must be a string or a list of token ids",
        )
        if self.max_tokens is not None:
            _check(
                is_int(self.max_tokens) and self.max_tokens >= 1,
                "max_tokens",
                self.max_tokens,
                "must be an integer >= 1",
            )
        _check(
            is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be an integer >= 0"
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"must not exceed max_tokens ({self.max_tokens})",
            )
        _check(
            is_num(self.temperature)
            and (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE),
            "temperature",
            self.temperature,
            f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]",
        )
        _check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(
            is_int(self.top_k) and self.top_k >= -1,
            "top_k",
            self.top_k,
            "must be an integer >= -1 (-1 or 0 disables it)",
        )
        _check(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(is_num(value) and -2 <= value <= 2, name, value, "must be in [-2, 2]")
        _check(
            is_num(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            self.repetition_penalty,
            f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] (1 disables it)",
        )
        if self.seed is not None:
            _check(is_int(self.seed), "seed", self.seed, "must be an integer")
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "must be a non-empty string or a list of them",
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"{len(self.stop)} strings",
            f"must have at most {MAX_STOP_STRINGS} strings",
        )
        _check(
            all(len(s) <= MAX_STOP_CHARS for s in self.stop),
            "stop",
            "a longer string",
            f"strings must have at most {MAX_STOP_CHARS} characters",
        )
        _check(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "must be a list of non-negative integers",
        )
        if self.logprobs is not None:
            _check(
                is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                self.logprobs,
                f"must be an integer in [0, {MAX_LOGPROBS}]",
            )
        self._validate_thinking()
        self._validate_scheduling()
        for name in ("timeout_s", "queue_timeout_s"):
            value = getattr(self, name)
            _check(value is None or (is_num(value) and value > 0), name, value, "must be a number of seconds > 0")
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "use_beam_search",
        ):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be a boolean")

    def _validate_scheduling(self) -> None:
        _check(
            self.service_tier in SERVICE_TIERS,
            "service_tier",
            self.service_tier,
            f"must be one of {list(SERVICE_TIERS)}",
        )
        _check(
            is_int(self.priority) and abs(self.priority) <= MAX_PRIORITY,
            "priority",
            self.priority,
            f"must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}] (lower is scheduled first)",
        )
        _check(isinstance(self.tenant, str), "tenant", self.tenant, "must be a string")
        _check(
            self.cache_salt is None or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= 256),
            "cache_salt",
            self.cache_salt,
            "must be a non-empty string of at most 256 characters",
        )

    def _validate_thinking(self) -> None:
        budget = self.thinking_token_budget
        if budget is None:
            return
        _check(is_int(budget) and budget >= 0, "thinking_token_budget", budget, "must be an integer >= 0")
        _check(
            bool(self.thinking_end_token_ids) and all(is_int(t) and t >= 0 for t in self.thinking_end_token_ids),
            "thinking_token_budget",
            budget,
            "needs thinking_end_token_ids (the token ids that close the reasoning)",
        )
        _check(
            self.structured_outputs is None,
            "thinking_token_budget",
            budget,
            "cannot be combined with structured_outputs",
        )

    def _validate_beam_search(self) -> None:
        """Beam search scores the model's own log-probabilities (as Hugging Face beam search without
        sampling): parameters that would sample, reshape the distribution or read text mid-way are refused."""
        width = self.beam_width
        _check(is_int(width) and width >= 1, "beam_width", width, "must be an integer >= 1")
        assert width is not None
        _check(self.n <= width, "n", self.n, f"must not exceed beam_width ({width}) with use_beam_search")
        _check(
            is_num(self.length_penalty) and abs(self.length_penalty) != float("inf"),
            "length_penalty",
            self.length_penalty,
            "must be a finite number",
        )
        _check(
            self.early_stopping in (True, False, "never") and not is_int(self.early_stopping),
            "early_stopping",
            self.early_stopping,
            'must be true, false or "never"',
        )
        _check(
            self.temperature in (0, 1),
            "temperature",
            self.temperature,
            "must be 1 (the default) or 0 with use_beam_search: beam search does not sample, it scores the "
            "model's log-probabilities",
        )
        for name, default in _NOT_WITH_BEAMS:
            value = getattr(self, name)
            _check(
                value == default or (name == "top_k" and value == 0),
                name,
                value,
                "is not supported with use_beam_search (beam search does not sample)"
                if name in _SAMPLING_ONLY
                else "is not supported with use_beam_search",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_host_tokens(self) -> bool:
        """Whether sampling this request's next token needs its token history on the host (penalties read
        it; beams are chosen on the host before the next step), which rules out the engine's overlap. A
        grammar's mask also follows every token, but the engine reads the previous tokens back while the
        forward runs (see `LLMEngine.step`). A thinking budget reads the output to force its closing tokens."""
        return self.uses_penalties or self.use_beam_search or self.thinking_token_budget is not None

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> SamplingParams:
        """Builds from a wire/JSON dict; an unknown key is an error naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter {unknown[0]!r}")
        return cls(**params)


# What beam search refuses, with the value that means "unused" (sampling knobs, then features that would
# need text or per-token state across beams that swap parents).
_SAMPLING_ONLY = frozenset({"top_p", "top_k", "min_p", "seed"})
_NOT_WITH_BEAMS: tuple[tuple[str, object], ...] = (
    ("top_p", 1.0),
    ("top_k", -1),
    ("min_p", 0.0),
    ("seed", None),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("stop", []),
    ("logprobs", None),
    ("prompt_logprobs", None),
    ("logit_bias", None),
    ("thinking_token_budget", None),
    ("prediction", None),
)


def _token_id_keys(bias: Any) -> dict[int, float] | None:
    """`logit_bias` with its keys as ints (JSON object keys are strings: "50256"); None when empty."""
    if bias is None or bias == {}:
        return None
    _check(isinstance(bias, dict), "logit_bias", bias, "must be an object of token id -> bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() and key.isascii() else key
        _check(is_int(token), "logit_bias", key, "keys must be token ids (non-negative integers)")
        _check(is_num(value), "logit_bias", value, "values must be finite numbers")
        out[token] = float(value)
    return out


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_num(value: Any) -> bool:
    """A finite int or float (no bool, NaN or infinity, no int beyond a double: JSON allows 400 digits)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large to be a float
        return False


def _check(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {_shown(value)}")


def _shown(value: Any) -> str:
    """A refused value as an error message quotes it: cut short (a 400-digit number is not worth echoing)."""
    if is_int(value) and value.bit_length() > 128:  # (str() of an int over 4,300 digits raises)
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
