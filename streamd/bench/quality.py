"""What a quantized setting costs in quality: greedy agreement and perplexity against the same model unquantized.

Issue 28's quality criterion, for the 8-bit KV cache (`--kv-cache-dtype int8`) or any other setting (`--set
KEY=VALUE`, e.g. `model.quantization=fp8` on a GPU): two engines of one model, the reference (the settings as
given, KV in the model's dtype) and the candidate (the same plus the change), run the same chat prompts greedily,
EOS ignored, and a fixed text teacher-forced. Reported:

- the greedy agreement of the first `--max-tokens` tokens: along the reference's greedy reply, the share of
  positions where both engines, reading the same tokens (prompt and reply teacher-forced), choose the same next
  token. One early flip does not count as every later token (a tiny model's near-ties make free-running replies
  part after a flip, whatever caused it);
- free-running: the share of prompts whose replies are identical, the mean share of tokens before the first
  difference, the share equal position by position;
- both perplexities of the text, and their ratio.

Prompts: `--prompts FILE` (one per line, or JSON lines with a "prompt" field), else 100 built in (topics times
question forms; no data set is downloaded). Text: `--text FILE`, else the checkout's docs/ARCHITECTURE.md, its first
`--text-tokens` tokens.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from streamd.bench.report import BenchError, add_out_argument, markdown_table, report_header, save_report

_TOPICS = (
    "the water cycle",
    "black holes",
    "the French Revolution",
    "photosynthesis",
    "compound interest",
    "the immune system",
    "plate tectonics",
    "the printing press",
    "machine learning",
    "the Roman Empire",
    "climate change",
    "the human heart",
    "electric cars",
    "the stock market",
    "volcanoes",
    "the internet",
    "vaccines",
    "the Moon landing",
    "honey bees",
    "quantum computers",
)
_FORMS = (
    "Explain {} to a ten-year-old.",
    "Write three short facts about {}.",
    "What is the most common misconception about {}?",
    "Write a short poem about {}.",
    "Summarize the history of {} in two sentences.",
)


@dataclass(slots=True)
class Agreement:
    prompts: int
    tokens_per_prompt: int
    teacher_forced: float  # positions where both choose the same next token, reading the reference's reply
    identical_share: float  # prompts whose tokens are all identical
    prefix_agreement: float  # mean share of tokens before the first difference
    positional_agreement: float  # mean share of positions holding the same token


@dataclass(slots=True)
class QualityResult:
    reference: str
    candidate: str
    agreement: Agreement
    perplexity_reference: float
    perplexity_candidate: float
    text_tokens: int

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity_candidate / self.perplexity_reference


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model path or GGUF file (default: the default model)")
    parser.add_argument("--kv-cache-dtype", default=None, help="the candidate's cache.kv_cache_dtype (int8, fp8)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="the candidate's other changes (repeatable)"
    )
    parser.add_argument(
        "--base", action="append", default=[], metavar="KEY=VALUE", help="settings of both engines (repeatable)"
    )
    parser.add_argument("--prompts", default=None, help="a file of prompts (default: 100 built in)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--text", default=None, help="the perplexity text (default: docs/ARCHITECTURE.md)")
    parser.add_argument("--text-tokens", type=int, default=1024)
    add_out_argument(parser)


def builtin_prompts(count: int) -> list[str]:
    forms = [form.format(topic) for form in _FORMS for topic in _TOPICS]
    return [forms[i % len(forms)] for i in range(count)]


def read_prompts(path: str | None, count: int) -> list[str]:
    if path is None:
        return builtin_prompts(count)
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    prompts = [json.loads(line)["prompt"] if line.lstrip().startswith("{") else line for line in lines]
    if not prompts:
        raise BenchError(f"--prompts {path}: no prompts in the file")
    return prompts[:count]


def agreement(reference: list[list[int]], candidate: list[list[int]], teacher_forced: float) -> Agreement:
    """How the candidate's greedy tokens agree with the reference's, prompt by prompt."""
    n = max(len(r) for r in reference)
    prefix, positional, identical = [], [], 0
    for ref, cand in zip(reference, candidate, strict=True):
        same = [a == b for a, b in zip(ref, cand, strict=False)]
        first_diff = same.index(False) if False in same else len(same)
        prefix.append(first_diff / n)
        positional.append(sum(same) / n)
        identical += ref == cand
    count = len(reference)
    return Agreement(count, n, teacher_forced, identical / count, sum(prefix) / count, sum(positional) / count)


def greedy_choices(llm: Any, prompts: list[list[int]], replies: list[list[int]]) -> list[list[int]]:
    """For each prompt + reply read teacher-forced, the engine's top token at each of the reply's positions."""
    from streamd import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
    outs = llm.generate([p + r for p, r in zip(prompts, replies, strict=True)], params)
    choices = []
    for prompt, reply, out in zip(prompts, replies, outs, strict=True):
        entries = out.prompt_logprobs[len(prompt) : len(prompt) + len(reply)]
        choices.append([max(entry, key=entry.__getitem__) for entry in entries])
    return choices


def same_share(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def perplexity(llm: Any, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of `ids[1:]`, each given the tokens before it."""
    from streamd import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    entries = llm.generate(ids, params)[0].prompt_logprobs
    nll = [-entry[token] for token, entry in zip(ids[1:], entries[1:], strict=True)]
    return math.exp(sum(nll) / len(nll))


def _settings(pairs: list[str]) -> dict[str, Any]:
    from streamd.config import parse_assignment

    return dict(parse_assignment(pair, "--set/--base") for pair in pairs)


def _text_ids(llm: Any, path: str | None, tokens: int) -> list[int]:
    source = Path(path) if path else Path("docs/ARCHITECTURE.md")
    if not source.is_file():
        raise BenchError(f"no perplexity text at {source}: give --text FILE")
    return list(llm.tokenizer(source.read_text())["input_ids"][:tokens])


def _run(llm: Any, prompts: list[list[int]], max_tokens: int, text: list[int]) -> tuple[list[list[int]], float]:
    from streamd import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], perplexity(llm, text)


def measure(args: argparse.Namespace) -> tuple[QualityResult, str, str]:
    from streamd import LLM

    base = _settings(args.base)
    change = _settings(args.set)
    if args.kv_cache_dtype:
        change["cache.kv_cache_dtype"] = args.kv_cache_dtype
    if not change:
        raise BenchError("nothing to compare: give --kv-cache-dtype or --set KEY=VALUE")
    texts = read_prompts(args.prompts, args.num_prompts)
    results, choices = [], []
    for overrides in (base, {**base, **change}):
        llm = LLM(args.model, **overrides)
        prompts = [llm.engine.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        text = _text_ids(llm, args.text, args.text_tokens)
        results.append((*_run(llm, prompts, args.max_tokens, text), len(text)))
        choices.append(greedy_choices(llm, prompts, results[0][0]))  # both read the reference's replies
        device, model = str(llm.engine.device.type), llm.engine.model_name
        llm.engine.close()
        del llm
    (ref_tokens, ref_ppl, n_text), (cand_tokens, cand_ppl, _) = results
    agreed = agreement(ref_tokens, cand_tokens, same_share(choices[0], choices[1]))
    result = QualityResult(describe(base), describe(change), agreed, ref_ppl, cand_ppl, n_text)
    return result, device, model


def describe(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items()) or "defaults"


def markdown(report: dict[str, Any]) -> str:
    r = report["result"]
    a = r["agreement"]
    lines = [
        f"# Quality: {r['candidate']} against {r['reference']}",
        "",
        f"{report['model']} on {report['device']}, commit {report['git_commit']}: `{report['command']}`",
        "",
        *markdown_table(
            ("measure", "value"),
            [
                ("prompts x greedy tokens (EOS ignored)", f"{a['prompts']} x {a['tokens_per_prompt']}"),
                ("**greedy agreement** (same next token, reading the reference's reply)", f"{a['teacher_forced']:.1%}"),
                ("free-running: mean share of tokens before the first difference", f"{a['prefix_agreement']:.1%}"),
                ("free-running: tokens equal position by position", f"{a['positional_agreement']:.1%}"),
                ("free-running: replies identical throughout", f"{a['identical_share']:.1%}"),
                (f"perplexity, reference ({r['text_tokens']} tokens)", f"{r['perplexity_reference']:.3f}"),
                ("perplexity, candidate", f"{r['perplexity_candidate']:.3f}"),
                ("perplexity ratio", f"{r['perplexity_ratio']:.4f}"),
            ],
        ),
        "",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result, device, model = measure(args)
    flags = [f"--kv-cache-dtype {args.kv_cache_dtype}"] if args.kv_cache_dtype else []
    flags += [f"--set {s}" for s in args.set] + [f"--base {s}" for s in args.base]
    flags += [f"--num-prompts {args.num_prompts}", f"--max-tokens {args.max_tokens}"]
    report = {
        **report_header(device),
        "model": model,
        "command": "streamd bench quality " + " ".join(flags),
        "prompts": args.prompts or "built in (streamd/bench/quality.py)",
        "result": {**asdict(result), "perplexity_ratio": result.perplexity_ratio},
    }
    name = "quality-" + (args.kv_cache_dtype or "settings")
    stem = save_report(report, args.out, name, markdown(report))
    print(markdown(report))
    print(f"wrote {stem}.json and .md")
    return 0
