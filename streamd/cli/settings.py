"""The arguments of every command that reads the configuration: `--config FILE`, `--set KEY=VALUE`, and one
flag per config key, generated from the config's fields (`add_config_flags`).

A key's flag is its name with dashes (`cache.max_num_batched_tokens` -> `--max-num-batched-tokens`): the
keys carry vLLM's names, so a `vllm serve` command line works as it is. Where vLLM spells a key otherwise,
`FLAG_NAMES` gives its spellings (`-tp`, `--api-key`, `--swap-space`, `--uvicorn-log-level`). vLLM flags that
streamd does not support are refused by name with the reason (`REFUSED`); the few that change nothing here
are accepted with a note (`NO_EFFECT`), so a deployment's command line keeps working. vLLM's
`--speculative-config` JSON (and its older `--speculative-model`) is read into the `[speculative]` keys it
names (`_SpeculativeConfig`). `--help` groups the flags by config section.

`streamd serve` and `streamd chat` load the configuration the same way (defaults < `--config` file <
`STREAMD_<SECTION>__<KEY>` < `--set` < flags), so `streamd chat` finds the server `streamd serve` started
with the same settings.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from streamd.config import Config, key_types, load_config, parse_assignment, parse_value

# `section.key` -> its flags where they are not `--<key>` (vLLM's spelling first, then streamd's).
FLAG_NAMES: dict[str, tuple[str, ...]] = {
    "model.name": ("--model",),
    "model.num_threads": ("--num-threads", "--threads"),
    "model.quantization": ("--quantization", "-q"),
    "cache.num_kv_blocks": ("--num-gpu-blocks-override", "--num-kv-blocks"),
    "cache.swap_space_gib": ("--swap-space", "--swap-space-gib"),
    "parallel.tensor_parallel_size": ("--tensor-parallel-size", "-tp", "--tp"),
    "engine.process": ("--engine-process",),
    "engine.batches_ahead": ("--engine-batches-ahead",),
    "server.api_keys": ("--api-key", "--api-keys"),
    "server.keep_alive_timeout_s": ("--timeout-keep-alive", "--keep-alive-timeout-s"),
    "logging.level": ("--log-level", "--uvicorn-log-level"),
    "logging.format": ("--log-format",),
}

# vLLM's spellings of values, per key.
_VALUE_SPELLINGS: dict[str, dict[str, str]] = {
    "model.dtype": {"half": "float16", "float": "float32"},
    "model.quantization": {"gguf": "auto"},
    "cache.kv_cache_dtype": {"fp8_e4m3": "fp8"},
    "logging.level": {"critical": "error", "trace": "debug"},
}

# vLLM flags streamd does not support -> why (each refused by name: the command stops with the reason).
REFUSED: dict[tuple[str, ...], str] = {
    ("--pipeline-parallel-size", "-pp"): "a model is split over GPUs by tensor parallelism only (-tp N)",
    ("--data-parallel-size", "-dp"): "run replicas behind a router instead: `streamd cluster --replicas N`",
    ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank"): "LoRA adapters are not supported",
    ("--tokenizer", "--tokenizer-mode"): "the tokenizer is always the model's own (--model)",
    ("--revision", "--tokenizer-revision", "--download-dir"): "streamd never downloads: a Hub id must already "
    "be in the local Hugging Face cache (HF_HOME)",
    ("--load-format",): "weights load as found (safetensors directory or GGUF file)",
    ("--cpu-offload-gb",): "weights are not offloaded",
    ("--distributed-executor-backend",): "tensor-parallel ranks are always local processes",
    ("--no-enable-chunked-prefill",): "prefills are always chunked (scheduler.max_num_batched_tokens)",
    ("--max-logprobs",): "top_logprobs is at most 20",
    ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs"): "TLS is terminated in front of streamd (nginx, a "
    "load balancer)",
    ("--root-path",): "serve under a path prefix from the proxy in front",
    ("--guided-decoding-backend", "--structured-outputs-config"): "structured outputs always use xgrammar",
    ("--task", "--runner"): "streamd serves text generation only",
    ("--limit-mm-per-prompt",): "prompts are text only",
}

# vLLM flags that change nothing in streamd -> why (accepted with a note on stderr).
NO_EFFECT: dict[str, str] = {
    "--trust-remote-code": "streamd never runs a model's own code: models load through transformers' "
    "built-in architectures",
    "--enable-auto-tool-choice": "tool calls are parsed whenever the chat template has a known tool format",
    "--tool-call-parser": "the tool-call format is read from the chat template",
    "--reasoning-parser": "the <think> reasoning format is read from the chat template",
    "--enable-chunked-prefill": "prefills are always chunked",
    "--disable-log-requests": "requests are logged without their prompts (one request_done line each)",
    "--disable-uvicorn-access-log": "the access log is always off",
}

_TAKES_VALUE = frozenset({"--tool-call-parser", "--reasoning-parser"})

# vLLM's --speculative-config keys -> streamd's [speculative] keys ("method" is read apart).
_SPECULATIVE_KEYS = {
    "model": "draft_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
    "disable_by_batch_size": "disable_by_batch_size",
}
# vLLM's speculative methods streamd has -> the [speculative] keys each sets.
_SPECULATIVE_METHODS: dict[str, dict[str, Any]] = {"ngram": {"prompt_lookup": True}, "draft_model": {}}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a streamd.toml file")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set server.api_keys=k1,k2 (repeatable)",
    )


def add_config_flags(parser: argparse.ArgumentParser, sections: Sequence[str]) -> None:
    """One flag per key of `sections` (an argument group each), and vLLM's flags refused or noted."""
    defaults = Config()
    for section in sections:
        group = parser.add_argument_group(
            f"[{section}] settings",
            f"config/streamd.toml documents each; a flag beats --set, STREAMD_{section.upper()}__<KEY> and --config",
        )
        for key, hint in key_types(section).items():
            _add_flag(group, f"{section}.{key}", hint, getattr(getattr(defaults, section), key))
    _add_vllm_flags(parser)


def _add_flag(group: argparse._ArgumentGroup, setting: str, hint: Any, default: Any) -> None:
    names = FLAG_NAMES.get(setting, ("--" + setting.partition(".")[2].replace("_", "-"),))
    shown = "none" if default is None else default
    kind = {"metavar": setting.partition(".")[2].upper(), **_kind(setting, hint)}
    group.add_argument(*names, dest=setting, default=None, help=f"{setting} (default: {shown})", **kind)


def _kind(setting: str, hint: Any) -> dict[str, Any]:
    """How a flag of this type reads its value(s)."""
    options = set(typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)) - {type(None)}
    kinds = {typing.get_origin(o) or o for o in options}
    if kinds == {bool}:
        return {"action": argparse.BooleanOptionalAction}
    if kinds == {list}:
        return {"nargs": "+", "action": _ExtendList, "metavar": "VALUE"}
    if setting in _VALUE_SPELLINGS:
        return {"type": _Spelled(_VALUE_SPELLINGS[setting])}
    if len(kinds) > 1:
        return {"type": parse_value}  # bool | str: TOML's true/false, else the string
    convert: Callable[[str], Any] = {int: int, float: float}.get(kinds.pop(), str)
    return {"type": convert}


@dataclass(frozen=True, slots=True, eq=False)  # hashable by identity: argparse looks types up in a dict
class _Spelled:
    """A string value that vLLM spells otherwise (`--dtype half`)."""

    spellings: dict[str, str]

    def __call__(self, raw: str) -> str:
        return self.spellings.get(raw.lower(), raw)


class _ExtendList(argparse.Action):
    """A list key: `--flag a b`, `--flag a,b`, or a JSON/TOML list (`--allowed-origins '["*"]'`); repeatable."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        items: list[str] = list(getattr(namespace, self.dest) or [])
        for raw in values:
            value = parse_value(raw) if raw.startswith("[") else raw
            items.extend(value if isinstance(value, list) else (v.strip() for v in raw.split(",") if v.strip()))
        setattr(namespace, self.dest, items)


class _VllmFlag(argparse.Action):
    """A vLLM flag with no streamd setting (hidden from --help): `refused` stops the command naming it and
    `why`; otherwise it is accepted with a note saying why it changes nothing."""

    def __init__(self, option_strings: list[str], dest: str, why: str, refused: bool, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.why, self.refused = why, refused

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        if self.refused:
            raise argparse.ArgumentError(self, f"vLLM's {option} is not supported by streamd: {self.why}")
        print(f"{parser.prog}: note: {option} has no effect: {self.why}", file=sys.stderr)


class _SpeculativeConfig(argparse.Action):
    """vLLM's `--speculative-config '{"model": "...", "num_speculative_tokens": 5}'` (method `draft_model`, the
    default with a model, or `ngram`: prompt lookup) and `--speculative-model NAME`: the `[speculative]` keys
    they name; a method or key streamd lacks stops the command naming it (hidden from --help: the keys' own
    flags are the documented ones)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        settings = {"draft_model": values} if option == "--speculative-model" else self._read(option, values)
        for key, value in settings.items():
            setattr(namespace, f"speculative.{key}", value)

    def _read(self, option: str | None, raw: str) -> dict[str, Any]:
        try:
            given = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentError(self, f"{option} takes a JSON object: {exc}") from exc
        if not isinstance(given, dict):
            raise argparse.ArgumentError(self, f"{option} takes a JSON object, got {raw!r}")
        method = given.pop("method", "draft_model" if "model" in given else None)
        if method not in _SPECULATIVE_METHODS:
            raise argparse.ArgumentError(
                self, f"{option}: method {method!r} is not supported by streamd (ngram: prompt lookup; draft_model)"
            )
        unknown = sorted(set(given) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise argparse.ArgumentError(
                self,
                f"{option}: {', '.join(unknown)} not supported by streamd (it reads method, "
                f"{', '.join(_SPECULATIVE_KEYS)})",
            )
        return {**_SPECULATIVE_METHODS[method], **{_SPECULATIVE_KEYS[k]: v for k, v in given.items()}}


def _add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative-config",
        "--speculative-model",
        action=_SpeculativeConfig,
        dest=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    for names, why in REFUSED.items():
        parser.add_argument(*names, nargs="?", action=_VllmFlag, dest=argparse.SUPPRESS, why=why, refused=True)
    for name, why in NO_EFFECT.items():
        nargs = 1 if name in _TAKES_VALUE else 0
        parser.add_argument(name, nargs=nargs, action=_VllmFlag, dest=argparse.SUPPRESS, why=why, refused=False)


def command_line_overrides(args: argparse.Namespace, flags: dict[str, Any] | None = None) -> dict[str, Any]:
    """`--set`, then the config flags given, then `flags` (section.key -> value; None: not given)."""
    overrides: dict[str, Any] = dict(parse_assignment(item) for item in args.set)
    overrides.update({key: value for key, value in vars(args).items() if "." in key and value is not None})
    overrides.update({key: value for key, value in (flags or {}).items() if value is not None})
    return overrides


def load_settings(args: argparse.Namespace, flags: dict[str, Any] | None = None) -> Config:
    """The configuration of `--config`, the environment, then the command line (`command_line_overrides`)."""
    return load_config(args.config, command_line_overrides(args, flags))
