"""Throughput of 256 requests of which 0%, 50% and 100% are JSON-schema constrained (issue 14).

A small random-weight Llama with the real SmolLM2 tokenizer (49,152 tokens) on the CPU, every request 32
prompt tokens and 32 output tokens (the schema's string must end with " THE END", which a random model does
not write, so constrained replies run to max_tokens like the unconstrained ones, which ignore EOS), all
admitted at once (batch 256). (Not `minLength`: xgrammar expands a counted repetition, which makes each
accepted token ~30x dearer, 19 us instead of 0.4-0.6 us, and is not what typical schemas cost.)

The development box is shared, so one run of each share is noise: the shares are run in interleaved rounds
(0%, 50%, 100%, 0%, ...) and each figure is the median over rounds. Torch runs on one thread (`--threads`),
so the process CPU time measures the work done rather than how long other processes kept the cores busy
(spinning intra-op threads count as CPU time too). Per share it reports the process CPU time (all threads,
xgrammar's included) and the wall time per output token, and the decode-only wall time per token (the
steps after the one that prefills every prompt), each relative to the unconstrained run. Run:

    PYTHONPATH=$PWD python benchmarks/structured_throughput.py --rounds 3 --out benchmarks/results/structured-...json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamd.bench.report import git_commit  # noqa: E402
from streamd.config import load_config  # noqa: E402
from streamd.engine.llm_engine import LLMEngine  # noqa: E402
from streamd.engine.worker.model_loader import load_model  # noqa: E402
from streamd.engine.sampling_params import SamplingParams  # noqa: E402

MODEL = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    eos_token_id=2, bos_token_id=1)
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "pattern": "^.* THE END$"}},
          "required": ["text"]}
NUM, PROMPT, OUTPUT = 256, 32, 32
SHARES = (0.0, 0.5, 1.0)


def build(threads: int) -> LLMEngine:
    from tests.smollm2_tokenizer import smollm2_tokenizer

    torch.set_num_threads(threads)
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
    tokens = decode_tokens = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    decode_start = None
    while engine.has_unfinished_requests():
        new = sum(len(c.token_ids) for d in engine.step() for c in d.outputs)
        tokens += new
        if decode_start is None:
            decode_start = time.perf_counter()  # the prefill step is done (its tokens come one step later)
        else:
            decode_tokens += new
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    assert tokens == NUM * OUTPUT, f"expected {NUM * OUTPUT} output tokens, got {tokens}"
    assert decode_start is not None
    return {"constrained_share": share, "wall_s": wall, "cpu_s": cpu, "output_tokens": tokens,
            "tok_per_s": tokens / wall, "wall_ms_per_token": 1e3 * wall / tokens,
            "cpu_ms_per_token": 1e3 * cpu / tokens,
            "decode_wall_ms_per_token": 1e3 * (time.perf_counter() - decode_start) / max(decode_tokens, 1)}


def summarize(runs: list[dict[str, float]]) -> list[dict[str, float]]:
    """Median of each figure per share, and each relative to the unconstrained share's median."""
    keys = ("wall_ms_per_token", "cpu_ms_per_token", "decode_wall_ms_per_token")
    rows = []
    for share in SHARES:
        mine = [r for r in runs if r["constrained_share"] == share]
        rows.append({"constrained_share": share, "rounds": len(mine),
                     **{k: statistics.median(r[k] for r in mine) for k in keys}})
    for row in rows:
        for k in keys:
            row[k.replace("_ms_per_token", "_cost_vs_unconstrained")] = row[k] / rows[0][k]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = build(args.threads)
    run(engine, 0.5, "warm")  # compiles the schema's grammar once and warms the allocator
    runs = []
    for k in range(args.rounds):
        for share in SHARES:
            runs.append(run(engine, share, f"r{k}-{share}-"))
            print(json.dumps(runs[-1]), flush=True)
    summary = summarize(runs)
    for row in summary:
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"model": "random llama h256 L4, SmolLM2 tokenizer", "device": "cpu",
                                        "torch_threads": args.threads, "commit": git_commit(), "requests": NUM, "prompt_tokens": PROMPT,
                                        "output_tokens": OUTPUT, "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
