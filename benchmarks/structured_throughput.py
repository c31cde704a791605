"""Throughput of 256 requests of which 0%, 50% and 100% are JSON-schema constrained (issue 14).

A small random-weight Llama with the real SmolLM2 tokenizer (49,152 tokens) on the CPU, every request 32
prompt tokens and exactly 32 output tokens (the schema's free string never closes before max_tokens, and
unconstrained requests ignore EOS), all admitted at once (batch 256). Reports wall time, output tokens per
second and the cost per token relative to the unconstrained run. Run:

    PYTHONPATH=$PWD python benchmarks/structured_throughput.py --out benchmarks/results/structured-...json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamd.config import load_config  # noqa: E402
from streamd.engine.llm_engine import LLMEngine  # noqa: E402
from streamd.engine.model_loader import load_model  # noqa: E402
from streamd.engine.sampling_params import SamplingParams  # noqa: E402

MODEL = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    eos_token_id=2, bos_token_id=1)
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
NUM, PROMPT, OUTPUT = 256, 32, 32


def build() -> LLMEngine:
    from tests.smollm2_tokenizer import smollm2_tokenizer

    config = load_config(None, {"model.device": "cpu", "model.dtype": "float32", "cache.num_kv_blocks": 2048,
                                "cache.num_swap_blocks": 0, "scheduler.max_num_seqs": NUM,
                                "scheduler.max_num_batched_tokens": NUM * PROMPT})
    loaded = load_model(MODEL, torch.float32, torch.device("cpu"), seed=0)
    loaded.tokenizer = smollm2_tokenizer()
    return LLMEngine(config, loaded, torch.device("cpu"))


def run(engine: LLMEngine, share: float, tag: str) -> dict[str, float]:
    plain = SamplingParams(max_tokens=OUTPUT, temperature=1.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=OUTPUT, temperature=1.0, structured_outputs={"json": SCHEMA})
    num_constrained = int(NUM * share)
    for i in range(NUM):
        prompt = [(7 * i + 13 * j) % 49000 + 100 for j in range(PROMPT)]
        engine.add_request(f"{tag}{i}", prompt, constrained if i < num_constrained else plain)
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(c.token_ids) for d in engine.step() for c in d.outputs)
    wall = time.perf_counter() - start
    return {"constrained_share": share, "wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = build()
    run(engine, 0.5, "warm")  # compiles the schema's grammar once and warms the allocator
    results = [run(engine, share, f"r{share}-") for share in (0.0, 0.5, 1.0)]
    base = results[0]["wall_s"] / results[0]["output_tokens"]
    for r in results:
        r["cost_per_token_vs_unconstrained"] = (r["wall_s"] / r["output_tokens"]) / base
        print(json.dumps(r), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"model": "random llama h256 L4, SmolLM2 tokenizer", "device": "cpu",
                                        "requests": NUM, "prompt_tokens": PROMPT, "output_tokens": OUTPUT,
                                        "results": results}, indent=1))


if __name__ == "__main__":
    main()
