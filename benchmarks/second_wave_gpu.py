"""What the second wave's request features cost on a GPU (issue 18, item 5), in one process:

- parallel sampling: 64 requests with n=4 (256 sequences) against 256 requests with n=1, same prompts' length;
- beam search: 64 requests of beam width 4 (256 candidate sequences a step), counted as the tokens the
  candidates decode (width x max_tokens per request), against the same two;
- structured outputs: 256 requests of which 0%, 50% and 100% are JSON-schema constrained (xgrammar).

A random-weight SmolLM2-135M-shaped model in bf16 with the real tokenizer (a directory made by
`benchmarks/gpu_session.sh setup`). Each row is the median of --repeats runs. Prints a table and writes JSON
to --out.
"""

from __future__ import annotations

import argparse
import datetime
import time

from streamd import LLM, SamplingParams
from streamd.bench.report import add_out_argument, git_commit, save_report

# The string must end in " THE END" (which a random-ish reply does not write): constrained replies run to
# max_tokens like the unconstrained ones, so both shares are timed at the same batch size throughout.
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "pattern": "^.* THE END$"}},
          "required": ["text"]}


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], repeats: int = 1,
          sequence_tokens: int | None = None) -> dict[str, float]:
    """Median over `repeats` runs; `sequence_tokens` counts what the candidates decoded (beam search returns
    fewer tokens than it computes)."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sequence_tokens or sum(len(c.token_ids) for o in outs for c in o.outputs)
        runs.append((seconds, tokens))
    seconds, tokens = sorted(runs)[len(runs) // 2]
    return {"seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="/tmp/streamd-serve-model")
    add_out_argument(parser)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    r = args.repeats
    llm = LLM(args.model, dtype="bfloat16", num_kv_blocks=16384, max_num_seqs=256)
    prompts = [[(7 * i + j) % 40000 + 100 for j in range(100)] for i in range(256)]
    plain = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0, seed=1)
    timed(llm, prompts[:32], [plain] * 32)  # warm-up
    rows: dict[str, dict[str, float]] = {}
    rows["n=1 x256"] = timed(llm, prompts, [plain] * 256, r)
    four = SamplingParams(n=4, max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0, seed=1)
    rows["n=4 x64"] = timed(llm, prompts[:64], [four] * 64, r)
    beam = SamplingParams(use_beam_search=True, beam_width=4, max_tokens=args.max_tokens, ignore_eos=True)
    rows["beam width 4 x64"] = timed(llm, prompts[:64], [beam] * 64, r, sequence_tokens=64 * 4 * args.max_tokens)
    json_params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1,
                                 structured_outputs={"json": SCHEMA})
    for share in (0.0, 0.5, 1.0):
        k = int(256 * share)
        rows[f"json {int(share * 100)}%"] = timed(llm, prompts, [json_params] * k + [plain] * (256 - k), r)
    base = rows["json 0%"]["tok_s"]
    for name, row in rows.items():
        row["cost_per_token_vs_unconstrained"] = base / row["tok_s"] if name.startswith("json") else None
        print(f"{name:<10} {row['tok_s']:10.0f} tok/s  {row['output_tokens']:7d} tokens  {row['seconds']:.2f} s")
    report = {"date": datetime.date.today().isoformat(), "device": __import__("torch").cuda.get_device_name(0),
              "git_commit": git_commit(), "model": "random smollm2-135m shape, bf16, real tokenizer",
              "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows}
    lines = [f"# Second-wave features on {report['device']}, {report['date']} (commit {report['git_commit']})", "",
             f"{report['model']}, {args.max_tokens} output tokens a sequence, median of {args.repeats}.", "",
             "| run | tok/s | tokens | seconds | cost per token vs unconstrained |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        cost = row["cost_per_token_vs_unconstrained"]
        lines.append(f"| {name} | {row['tok_s']:.0f} | {row['output_tokens']} | {row['seconds']:.2f} | "
                     f"{'' if cost is None else f'{cost:.2f}x'} |")
    save_report(report, args.out, "second-wave", "\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
