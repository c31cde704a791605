"""Speculative decoding: time per output token with speculation off and on, the same requests, one invocation.

Two workloads on the offline engine (the default model on the CPU unless `--model`):

- edit: a 600-1,500-token text and an instruction to change one detail of it (the answer is mostly a copy),
  one stream; modes `off`, `prompt_lookup` (drafts from n-grams of the prompt and output) and `prediction`
  (the request's `prediction` is the original text, as an editor would send it);
- chat: questions whose answers are unlike their prompts, at 1 and at `--streams` streams; modes `off` and
  `prompt_lookup` (the drafts mostly fail there: this measures what failing drafts cost).

Per request, the time per output token is (last token's time - first token's time) / (tokens - 1), so
prefill does not count (and an untimed pass puts every prompt in the prefix cache first, so every mode
admits its requests alike); the report gives each mode's median,
the output rate of the whole run, the drafts' acceptance, whether the greedy tokens were identical to the
`off` run's, and the ratios against `off`. Greedy decoding throughout. The machine's noise applies to every
mode alike only if nothing else runs: say so beside the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

from streamd.bench.report import BenchError, add_out_argument, markdown_table, report_header, save_report

_NAMES = ["Ada", "Bruno", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kira", "Lev"]
_PLACES = ["harbour", "library", "market", "station", "bakery", "garden", "museum", "workshop", "school"]
_THINGS = ["apples", "lamps", "maps", "letters", "boxes", "tickets", "chairs", "books", "kettles", "coins"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
CHAT_QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, for a ten year old.",
    "Give me five ideas for a birthday party in winter.",
    "What are the pros and cons of working from home?",
    "Describe the water cycle in a few sentences.",
    "Suggest a three day itinerary for a trip to the mountains.",
    "Why do cats purr? Give a few possible reasons.",
    "Write a haiku about autumn and explain it.",
]


Predictions = list[str | list[int]]  # per request: the text, or its token ids


@dataclass(slots=True, frozen=True)
class Sizes:
    edit_requests: int = 3
    edit_sentences: int = 40  # about 15-20 tokens each: 600-800 tokens of text
    edit_max_tokens: int = 160
    chat_requests: int = 4
    chat_max_tokens: int = 96
    streams: int = 32


FULL = Sizes()
LIGHT = Sizes(edit_requests=1, edit_sentences=4, edit_max_tokens=12, chat_requests=2, chat_max_tokens=8, streams=2)


@dataclass(slots=True)
class ModeResult:
    """One mode's run of a workload."""

    tpot_ms: list[float] = field(default_factory=list)  # per request
    tokens: int = 0
    seconds: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)  # per request, its output token ids

    def summary(self, reference: ModeResult | None) -> dict[str, Any]:
        return {
            "tpot_ms_median": round(statistics.median(self.tpot_ms), 3),
            "tpot_ms_per_request": [round(t, 3) for t in self.tpot_ms],
            "output_tokens": self.tokens,
            "tokens_per_s": round(self.tokens / self.seconds, 3),
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens else None,
            "identical_to_off": None if reference is None else self.outputs == reference.outputs,
        }

    @classmethod
    def pooled(cls, rounds: list[ModeResult]) -> ModeResult:
        """The rounds of one mode as one run: requests and counts together; the outputs kept only where every
        round gave the same (greedy: they must), else none (then never identical to off)."""
        first = rounds[0]
        same = all(r.outputs == first.outputs for r in rounds)
        return cls(
            [t for r in rounds for t in r.tpot_ms],
            sum(r.tokens for r in rounds),
            sum(r.seconds for r in rounds),
            sum(r.draft_tokens for r in rounds),
            sum(r.accepted_tokens for r in rounds),
            first.outputs if same else [[] for _ in first.outputs],
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model path or GGUF file (default: the default model)")
    parser.add_argument("--light", action="store_true", help="tiny sizes (the test's light form)")
    parser.add_argument("--edit-requests", type=int, default=FULL.edit_requests)
    parser.add_argument("--edit-sentences", type=int, default=FULL.edit_sentences, help="sentences of the text")
    parser.add_argument("--edit-max-tokens", type=int, default=FULL.edit_max_tokens)
    parser.add_argument("--chat-requests", type=int, default=FULL.chat_requests, help="per stream count")
    parser.add_argument("--chat-max-tokens", type=int, default=FULL.chat_max_tokens)
    parser.add_argument("--streams", type=int, default=FULL.streams, help="the chat workload's wide level")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="speculative.num_speculative_tokens")
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds of every mode, their order rotated each round; figures pooled"
    )
    parser.add_argument(
        "--oracle-acceptance",
        type=float,
        default=None,
        help="also the chat workload at one stream with an oracle's drafts (OracleDrafts: each request's own greedy "
        "answer, each position kept with this probability, the rest a random token)",
    )
    add_out_argument(parser)


def edit_text(seed: int, sentences: int) -> str:
    """A seeded text of plain sentences with names, places, days and counts (details an edit can change)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        lines.append(
            f"On {rng.choice(_DAYS)}, {rng.choice(_NAMES)} went to the {rng.choice(_PLACES)} and brought back "
            f"{rng.randint(2, 40)} {rng.choice(_THINGS)} for the {rng.choice(_PLACES)}."
        )
    return " ".join(lines)


def edit_requests(sizes: Sizes) -> list[tuple[str, str]]:
    """(instruction with the text, the text itself: the prediction) per request."""
    out = []
    for i in range(sizes.edit_requests):
        text = edit_text(i, sizes.edit_sentences)
        day = next(d for d in _DAYS if d in text)
        instruction = f"Rewrite the following text exactly as it is, but change every {day} to Holiday.\n\n{text}"
        out.append((instruction, text))
    return out


def run_mode(engine: Any, prompts: list[list[int]], params: list[Any], streams: int) -> ModeResult:
    """Runs the requests `streams` at a time (a new one starts as one ends); times every token's arrival."""
    result = ModeResult(outputs=[[] for _ in prompts])
    before = engine.stats().scheduler
    arrivals: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    live: dict[str, int] = {}
    began = time.perf_counter()
    while pending or live:
        while pending and len(live) < streams:
            i = pending.pop(0)
            request_id = f"spec-bench-{i}-{time.monotonic_ns()}"
            live[request_id] = i
            engine.add_request(request_id, None, params[i], prompt_token_ids=prompts[i])
        for delta in engine.step():
            i = live.get(delta.request_id, -1)
            if i < 0:
                continue
            for choice in delta.outputs:
                arrivals[i] += [time.perf_counter()] * len(choice.token_ids)
                result.outputs[i] += choice.token_ids
            if delta.finished:
                del live[delta.request_id]
    result.seconds = time.perf_counter() - began
    for times in arrivals.values():
        if len(times) > 1:
            result.tpot_ms.append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
        result.tokens += len(times)
    after = engine.stats().scheduler
    result.draft_tokens = after.spec_draft_tokens - before.spec_draft_tokens
    result.accepted_tokens = after.spec_accepted_tokens - before.spec_accepted_tokens
    return result


# each speculator's own draft source (its draft model, or None), kept while a mode puts an oracle in its place
_OWN_SOURCES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _speculation(engine: Any, prompt_lookup: bool, source: Any = None) -> None:
    """Prompt lookup on or off, and the draft source (`OracleDrafts`, or the engine's own draft model: None)."""
    spec = engine.scheduler.speculator
    spec.config = dataclasses.replace(spec.config, prompt_lookup=prompt_lookup)
    own = _OWN_SOURCES.setdefault(spec, spec.draft_source)
    spec.draft_source = own if source is None else source


class OracleDrafts:
    """A draft source that knows each prompt's greedy answer (a benchmark's, not a proposer anyone could have): it
    drafts the answer's next tokens, each position kept with probability `keep` and otherwise a random token, the
    same one whenever that position is drafted. Drafts then hold as a geometric run of rate `keep`, whatever the
    model, so the bench can show what a verify step buys at a set acceptance."""

    def __init__(self, prompts: list[list[int]], answers: list[list[int]], keep: float, vocab: int) -> None:
        rng = random.Random(0)
        self.prompts = prompts
        self.drafts = [[t if rng.random() < keep else rng.randrange(vocab) for t in answer] for answer in answers]

    def propose(self, seq_id: int, token_ids: list[int], limit: int) -> list[int]:
        for prompt, drafts in zip(self.prompts, self.drafts):
            if token_ids[: len(prompt)] == prompt:
                start = len(token_ids) - len(prompt)
                return drafts[start : start + limit]
        return []

    def forget(self, seq_id: int) -> None:
        pass


def workload(
    engine: Any,
    name: str,
    chats: list[str],
    max_tokens: int,
    streams: int,
    predictions: Predictions | None,
    rounds: int = 1,
    oracle: float | None = None,
) -> dict[str, Any]:
    """Runs one workload in every mode it has, `rounds` times with the modes' order rotated each round (each
    takes every place, so the machine's drift weighs on all alike); returns its report entry, the requests'
    times pooled over the rounds and each round's ratio beside."""
    from streamd.engine.sampling_params import SamplingParams

    prompts = [engine.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    plain = [SamplingParams(temperature=0, max_tokens=max_tokens) for _ in prompts]
    settings: dict[str, tuple[bool, list[Any], Any]] = {"off": (False, plain, None)}
    if oracle is None:
        settings["prompt_lookup"] = (True, plain, None)
    else:
        settings["oracle"] = (False, plain, oracle_drafts(engine, prompts, plain, oracle))
    if predictions is not None:
        with_prediction = [dataclasses.replace(p, prediction=t) for p, t in zip(plain, predictions)]
        settings["prediction"] = (False, with_prediction, None)
    _speculation(engine, False)
    # Untimed: the prompts' blocks enter the prefix cache, so no mode (the first one least) pays more prefill.
    run_mode(engine, prompts, [dataclasses.replace(p, max_tokens=1) for p in plain], streams)
    names = list(settings)
    per_round: list[dict[str, ModeResult]] = []
    for round_index in range(rounds):
        results: dict[str, ModeResult] = {}
        for mode in names[round_index % len(names) :] + names[: round_index % len(names)]:
            lookup, params, source = settings[mode]
            _speculation(engine, lookup, source)
            results[mode] = run_mode(engine, prompts, params, streams)
        _speculation(engine, False)
        per_round.append(results)
    modes = {mode: ModeResult.pooled([r[mode] for r in per_round]) for mode in names}
    off = modes["off"]
    entry: dict[str, Any] = {
        "workload": name,
        "streams": streams,
        "requests": len(prompts),
        "rounds": rounds,
        "prompt_tokens": [len(p) for p in prompts],
        "max_tokens": max_tokens,
        "modes": {mode: r.summary(None if mode == "off" else off) for mode, r in modes.items()},
    }
    entry["tpot_lower_x"] = {m: _lower_x(off, r) for m, r in modes.items() if m != "off"}
    entry["tpot_lower_x_rounds"] = {m: [_lower_x(r["off"], r[m]) for r in per_round] for m in names if m != "off"}
    rate = off.tokens / off.seconds
    entry["rate_vs_off"] = {m: round(r.tokens / r.seconds / rate, 3) for m, r in modes.items() if m != "off"}
    return entry


def _lower_x(off: ModeResult, mode: ModeResult) -> float:
    """How many times lower `mode`'s median time per output token is than `off`'s."""
    return round(statistics.median(off.tpot_ms) / statistics.median(mode.tpot_ms), 3)


def oracle_drafts(engine: Any, prompts: list[list[int]], params: list[Any], keep: float) -> OracleDrafts:
    """`OracleDrafts` of the prompts' greedy answers (one untimed run, nothing drafted)."""
    if not 0.0 < keep <= 1.0:
        raise BenchError(f"--oracle-acceptance must be in (0, 1], got {keep}")
    _speculation(engine, False)
    answers = run_mode(engine, prompts, params, 1).outputs
    return OracleDrafts([list(p) for p in prompts], answers, keep, engine.vocab_size)


def measure(engine: Any, sizes: Sizes, rounds: int = 1, oracle: float | None = None) -> list[dict[str, Any]]:
    edits = edit_requests(sizes)
    chats = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(sizes.chat_requests)]
    wide = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] + f" (variant {i})" for i in range(sizes.streams)]
    # (name, prompts, max tokens, streams, predictions, the oracle's acceptance)
    workloads: list[tuple[str, list[str], int, int, Predictions | None, float | None]] = [
        ("edit", [e[0] for e in edits], sizes.edit_max_tokens, 1, [e[1] for e in edits], None),
        ("chat", chats, sizes.chat_max_tokens, 1, None, None),
        ("chat", wide, sizes.chat_max_tokens, sizes.streams, None, None),
    ]
    if oracle is not None:
        workloads.append((f"chat, oracle keeping {oracle:.0%}", chats, sizes.chat_max_tokens, 1, None, oracle))
    results = []
    for name, prompts, max_tokens, streams, predictions, keep in workloads:
        results.append(workload(engine, name, prompts, max_tokens, streams, predictions, rounds, keep))
        print(json.dumps(results[-1]), flush=True)  # each workload as it ends (a long run shows progress)
    return results


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# streamd bench spec — {report['date']}, {report['device']}, {report['model']} "
        f"(commit {report['git_commit']})",
        "",
        f"Command: `{report['command']}`. {report['note']}",
        "",
        *markdown_table(
            [
                "workload",
                "streams",
                "mode",
                "median ms/token",
                "tokens/s",
                "acceptance",
                "identical",
                "ms/token lower x",
                "rate vs off",
            ],
            (
                [
                    entry["workload"],
                    entry["streams"],
                    mode,
                    m["tpot_ms_median"],
                    m["tokens_per_s"],
                    m["acceptance_rate"],
                    m["identical_to_off"],
                    entry["tpot_lower_x"].get(mode, ""),
                    entry["rate_vs_off"].get(mode, ""),
                ]
                for entry in report["results"]
                for mode, m in entry["modes"].items()
            ),
        ),
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from streamd.llm import LLM

    if args.rounds < 1:
        raise BenchError(f"--rounds must be >= 1, got {args.rounds}")
    sizes = (
        LIGHT
        if args.light
        else Sizes(
            args.edit_requests,
            args.edit_sentences,
            args.edit_max_tokens,
            args.chat_requests,
            args.chat_max_tokens,
            args.streams,
        )
    )
    overrides: dict[str, Any] = {"max_num_seqs": max(sizes.streams, 1)}
    if args.num_speculative_tokens is not None:
        overrides["num_speculative_tokens"] = args.num_speculative_tokens
    engine = LLM(args.model, **overrides).engine
    speculator = engine.scheduler.speculator
    assert speculator is not None
    report = {
        **report_header(str(engine.device.type)),
        "model": engine.model_name,
        "command": "streamd bench spec "
        + ("--light" if args.light else " ".join(f"--{k.replace('_', '-')} {v}" for k, v in asdict(sizes).items()))
        + (f" --rounds {args.rounds}" if args.rounds > 1 else "")
        + (f" --oracle-acceptance {args.oracle_acceptance}" if args.oracle_acceptance is not None else ""),
        "note": ("One GPU" if engine.device.type == "cuda" else "Shared, noisy 2-core machine")
        + ": compare modes within this one run only.",
        "speculative": dataclasses.asdict(speculator.config),
        "results": measure(engine, sizes, args.rounds, args.oracle_acceptance),
    }
    stem = save_report(report, args.out, "spec", markdown(report))
    print(markdown(report))
    print(f"wrote {stem}.json and .md")
    return 0
