"""Generate text from the command line with the offline engine. Its engine flags are `streamd serve`'s
(the [model], [cache], [scheduler] and [parallel] settings, generated from the config's keys)."""

from __future__ import annotations

import argparse

from streamd.cli.settings import add_config_arguments, add_config_flags, command_line_overrides

ENGINE_SECTIONS = ("model", "cache", "scheduler", "parallel")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s [--FLAG VALUE ...] PROMPT [PROMPT ...]  (every flag: --help)"
    parser.add_argument("prompt", nargs="+", help="one or more prompts (each quoted)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    add_config_arguments(parser)
    add_config_flags(parser, ENGINE_SECTIONS)


def run(args: argparse.Namespace) -> int:
    """Generate text from the command line with the offline engine. The settings and sampling parameters are
    checked before torch is imported (seconds of CPU), so a bad flag's one-line error comes at once."""
    from streamd.config import load_config
    from streamd.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    overrides = command_line_overrides(args)
    load_config(args.config, overrides)

    from streamd.llm import LLM
    from streamd.logs import configure_logging

    configure_logging()
    llm = LLM(config_path=args.config, **overrides)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for prompt, output in zip(args.prompt, outputs):
        print(f"--- {prompt}")
        print(output.outputs[0].text)
    return 0
