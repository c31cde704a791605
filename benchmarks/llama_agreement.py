"""How far streamd's greedy tokens agree with llama.cpp's on the same GGUF (issue 25's quality criterion).

The two round differently (llama.cpp quantizes each activation block to 8 bits for its dot products; streamd
multiplies bfloat16 activations by the 4-bit codes), so after a first near-tie their free-running replies part;
what says whether two paths compute the same model is the teacher-forced agreement: along llama.cpp's greedy
reply, the share of positions where streamd, reading the same tokens, chooses llama.cpp's next token
(`streamd.bench.quality.greedy_choices`). Also reported: free-running replies identical, the mean share before
the first difference, tokens equal position by position. Each `--quantization` setting of streamd is one row
("auto": the GGUF kept 4-bit, the default; "none": the same GGUF dequantized to float32, the exact model).

The peer is a running `llama-server` on the default GGUF (docs/models.md says how to build it here), whose
`/completion` takes token ids and returns them (`return_tokens`). Prompts: `streamd bench quality`'s built-in
chat prompts under the default model's chat template, so both read the same ids. Run:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/llama_agreement.py --url http://127.0.0.1:8080
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def llama_greedy(url: str, ids: list[int], max_tokens: int) -> list[int]:
    body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": False}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return list(json.loads(response.read())["tokens"])


def measure(url: str, quantization: str, count: int, max_tokens: int) -> dict[str, Any]:
    from streamd import LLM, SamplingParams
    from streamd.bench.quality import agreement, builtin_prompts, greedy_choices, same_share

    llm = LLM(quantization=quantization)
    prompts = [llm.engine.apply_chat_template([{"role": "user", "content": t}]) for t in builtin_prompts(count)]
    theirs = [llama_greedy(url, p, max_tokens) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    forced = same_share(greedy_choices(llm, prompts, theirs), theirs)
    llm.engine.close()
    return {"quantization": quantization, **asdict(agreement(theirs, ours, forced))}


def markdown(report: dict[str, Any]) -> str:
    from streamd.bench.report import markdown_table

    header = ["streamd model.quantization", "teacher-forced agreement", "identical", "mean prefix", "positional"]
    rows: list[list[object]] = [
        [r["quantization"], f"{r['teacher_forced']:.1%}", f"{r['identical_share']:.0%}",
         f"{r['prefix_agreement']:.1%}", f"{r['positional_agreement']:.1%}"]
        for r in report["rows"]
    ]  # fmt: skip
    return "\n".join([
        f"# streamd against llama.cpp, greedy agreement ({report['date']}, commit {report['git_commit']}, cpu)",
        "",
        f"Peer: llama-server at {report['peer_url']} on the default GGUF. Command: `python "
        f"benchmarks/llama_agreement.py {' '.join(report['argv'])}`. {report['prompts']} chat prompts x "
        f"{report['tokens']} greedy tokens, EOS ignored; teacher-forced along llama.cpp's reply.",
        "",
        *markdown_table(header, rows),
        "",
    ])  # fmt: skip


def main() -> int:
    from streamd.bench.report import report_header, save_report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="llama-server's base URL")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quantization", default="auto,none", help="streamd settings compared, comma-separated")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args()
    url = args.url.rstrip("/")
    rows = [measure(url, q, args.prompts, args.max_tokens) for q in args.quantization.split(",")]
    report = {**report_header("cpu"), "argv": sys.argv[1:], "peer_url": url, "prompts": args.prompts,
              "tokens": args.max_tokens, "rows": rows}  # fmt: skip
    stem = save_report(report, args.out, "llama-agreement", markdown(report))
    print(markdown(report))
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
