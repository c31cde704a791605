"""Generate text from the command line with the offline engine."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="one or more prompts (each quoted)")
    parser.add_argument("--model", default=None, help="model directory, .gguf file or cached Hub id")
    parser.add_argument("--config", default=None, help="a streamd.toml file")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (model.num_threads)")


def run(args: argparse.Namespace) -> int:
    """Generate text from the command line with the offline engine."""
    from streamd.engine.sampling_params import SamplingParams
    from streamd.llm import LLM
    from streamd.logs import configure_logging

    configure_logging()
    overrides = {
        k: v
        for k, v in (("device", args.device), ("dtype", args.dtype), ("num_threads", args.threads))
        if v is not None
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    llm = LLM(args.model, config_path=args.config, **overrides)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for prompt, output in zip(args.prompt, outputs):
        print(f"--- {prompt}")
        print(output.outputs[0].text)
    return 0
