"""What the second wave's request features cost on a GPU (issue 18, item 5), in one process:

- parallel sampling: 64 requests with n=4 (256 sequences) against 256 requests with n=1, same prompts' length;
- structured outputs: 256 requests of which 0%, 50% and 100% are JSON-schema constrained (xgrammar).

A random-weight SmolLM2-135M-shaped model in bf16 with the real tokenizer (a directory made by
`benchmarks/gpu_session.sh setup`). Prints a table and writes JSON to --out. Beam search is not built yet.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from streamd import LLM, SamplingParams
from streamd.bench.report import git_commit

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="/tmp/streamd-serve-model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    llm = LLM(args.model, dtype="bfloat16", num_kv_blocks=16384, max_num_seqs=256)
    prompts = [[(7 * i + j) % 40000 + 100 for j in range(100)] for i in range(256)]
    plain = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0, seed=1)
    timed(llm, prompts[:32], [plain] * 32)  # warm-up
    rows: dict[str, dict[str, float]] = {}
    rows["n=1 x256"] = timed(llm, prompts, [plain] * 256)
    four = SamplingParams(n=4, max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0, seed=1)
    rows["n=4 x64"] = timed(llm, prompts[:64], [four] * 64)
    json_params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1,
                                 structured_outputs={"json": SCHEMA})
    for share in (0.0, 0.5, 1.0):
        k = int(256 * share)
        rows[f"json {int(share * 100)}%"] = timed(llm, prompts, [json_params] * k + [plain] * (256 - k))
    base = rows["json 0%"]["tok_s"]
    for name, row in rows.items():
        row["cost_per_token_vs_unconstrained"] = base / row["tok_s"] if name.startswith("json") else None
        print(f"{name:<10} {row['tok_s']:10.0f} tok/s  {row['output_tokens']:7d} tokens  {row['seconds']:.2f} s")
    report = {"device": __import__("torch").cuda.get_device_name(0), "git_commit": git_commit(),
              "model": "random smollm2-135m shape, bf16, real tokenizer", "max_tokens": args.max_tokens,
              "rows": rows}
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
