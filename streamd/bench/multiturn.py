"""`streamd bench multiturn`: conversations behind one long system prompt, with the prefix cache's lower tiers
(disk; on CUDA the host-RAM tier above it) against device-only caching (issue 31).

C conversations of T turns each share an S-token system prompt; every turn adds U user tokens, and the
model's R-token greedy reply joins the history. Turns go round-robin over the conversations (every
conversation's turn t, then turn t + 1), one request at a time, so each conversation returns after all the
others: the device pool (`cache.num_kv_blocks`) is sized to hold at most `--device-share` of all the
conversations' KV, so device-only caching loses the histories in between and recomputes them, where the disk
tier restores them. Reported per system: follow-up-turn TTFT (p50), prompt tokens recomputed, and whether the
greedy replies are identical; for the disk tier also the slowest step's restore time against the median
step. Then the restart: the engine is closed (its cached blocks go to disk) and a new one opens the same
directory; a new conversation's first turn there (reusing the system prompt) reports its cached tokens and
TTFT, against the same kind of request on the warm engine before the restart.

The defaults are sized to run in minutes on a 2-core CPU; the issue's full sizes (`--conversations 128
--turns 8 --system-tokens 2048 --turn-tokens 300`) are for the GPU.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from streamd.bench.report import add_out_argument, markdown_table, report_header, save_report
from streamd.engine.core.kv_tiers import BlockKey
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import TierStats
from streamd.llm import LLM

MakeLLM = Callable[[dict[str, Any]], LLM]  # config overrides -> an engine


@dataclass(slots=True, frozen=True)
class Sizes:
    conversations: int = 8
    turns: int = 3
    system_tokens: int = 256
    turn_tokens: int = 48
    reply_tokens: int = 8
    device_share: float = 0.3
    block_size: int = 16
    seed: int = 0
    vocab: int = 20000  # token ids are drawn below this (and from 100 up: clear of special tokens)

    def num_kv_blocks(self) -> int:
        """At most `device_share` of every conversation's final KV (the system prompt's blocks counted
        once), but at least one whole last turn plus its reply."""
        bs = self.block_size
        history = self.turns * (self.turn_tokens + self.reply_tokens)
        total = -(-self.system_tokens // bs) + self.conversations * (-(-history // bs) + 1)
        one = -(-(self.system_tokens + history) // bs) + 2
        return max(int(self.device_share * total), one)


@dataclass(slots=True)
class Run:
    """One system's run: per request its TTFT, prompt and cached tokens and reply."""

    ttft_s: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    replies: list[list[int]] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)  # per step: seconds reading the tier

    def summary(self) -> dict[str, Any]:
        follow = [t for t, turn in zip(self.ttft_s, self.turn, strict=True) if turn > 0]
        median_step = statistics.median(self.step_s) if self.step_s else 0.0
        return {
            "requests": len(self.ttft_s),
            "follow_up_ttft_p50_s": statistics.median(follow) if follow else None,
            "first_turn_ttft_p50_s": statistics.median([t for t, n in zip(self.ttft_s, self.turn) if n == 0]),
            "prompt_tokens": sum(self.prompt_tokens),
            "recomputed_prompt_tokens": sum(self.prompt_tokens) - sum(self.cached_tokens),
            "median_step_s": median_step,
            "max_restore_s_in_a_step": max(self.restore_s, default=0.0),
        }


class TimedTier:
    """The engine's tier, its reads timed (the bench's view of restore stalls); everything else passes."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.fetch_s = 0.0

    def fetch(self, key: BlockKey) -> bytes | None:
        began = time.perf_counter()
        try:
            payload: bytes | None = self.tier.fetch(key)
            return payload
        finally:
            self.fetch_s += time.perf_counter() - began

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tier, name)


def tokens(rng: random.Random, n: int, sizes: Sizes) -> list[int]:
    return [rng.randrange(100, sizes.vocab) for _ in range(n)]


def ask(llm: LLM, prompt: list[int], sizes: Sizes, run: Run, turn: int) -> list[int]:
    """One request alone: its TTFT (arrival to the step that gives its first token) and reply."""
    engine = llm.engine
    params = SamplingParams(max_tokens=sizes.reply_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    request_id = f"mt{len(run.ttft_s)}"
    timed = engine.block_manager.tier if isinstance(engine.block_manager.tier, TimedTier) else None
    began = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    reply: list[int] = []
    ttft = cached = None
    while engine.has_unfinished_requests():
        before_fetch = timed.fetch_s if timed else 0.0
        step_began = time.perf_counter()
        for delta in engine.step():
            reply += [t for c in delta.outputs for t in c.token_ids]
            cached = delta.num_cached_tokens or cached
            if ttft is None and reply:
                ttft = time.perf_counter() - began
        run.step_s.append(time.perf_counter() - step_began)
        run.restore_s.append((timed.fetch_s if timed else 0.0) - before_fetch)
    run.ttft_s.append(ttft or 0.0)
    run.turn.append(turn)
    run.prompt_tokens.append(len(prompt))
    run.cached_tokens.append(cached or 0)
    run.replies.append(reply)
    return reply


def conversations(llm: LLM, sizes: Sizes, system: list[int]) -> Run:
    """Every conversation's turns, round-robin, one request at a time."""
    rng = random.Random(sizes.seed + 1)
    users = [[tokens(rng, sizes.turn_tokens, sizes) for _ in range(sizes.turns)] for _ in range(sizes.conversations)]
    history: list[list[int]] = [list(system) for _ in range(sizes.conversations)]
    run = Run()
    for turn in range(sizes.turns):
        for c in range(sizes.conversations):
            history[c] += users[c][turn]
            history[c] += ask(llm, history[c], sizes, run, turn)
    return run


def measure(make_llm: MakeLLM, sizes: Sizes, disk_dir: Path) -> dict[str, Any]:
    """Device-only caching, then the disk tier, then a restart on the disk tier's directory."""
    system = tokens(random.Random(sizes.seed), sizes.system_tokens, sizes)
    base = {"cache.num_kv_blocks": sizes.num_kv_blocks(), "cache.block_size": sizes.block_size}
    device_only = conversations(make_llm({**base, "cache.host_cache_gib": 0.0}), sizes, system)
    # The tiers: the disk tier, and the host tier by its default (on with CUDA, off on the CPU).
    tiered_llm = make_llm({**base, "cache.disk_cache_dir": str(disk_dir)})
    bm = tiered_llm.engine.block_manager
    bm.tier = TimedTier(bm.tier)
    tiered = conversations(tiered_llm, sizes, system)
    fresh = random.Random(sizes.seed + 2)
    warm = Run()
    ask(tiered_llm, system + tokens(fresh, sizes.turn_tokens, sizes), sizes, warm, 0)
    disk_stats: TierStats = tiered_llm.engine.stats().kv.tiers[-1]
    tiered_llm.engine.close()
    restarted_llm = make_llm({**base, "cache.disk_cache_dir": str(disk_dir)})
    restarted = Run()
    ask(restarted_llm, system + tokens(fresh, sizes.turn_tokens, sizes), sizes, restarted, 0)
    restarted_llm.engine.close()
    return report_of(sizes, device_only, tiered, warm, restarted, disk_stats)


def report_of(
    sizes: Sizes, device_only: Run, tiered: Run, warm: Run, restarted: Run, disk: TierStats
) -> dict[str, Any]:
    plain, disk_run = device_only.summary(), tiered.summary()
    full_system = sizes.system_tokens // sizes.block_size * sizes.block_size
    return {
        "sizes": asdict(sizes) | {"num_kv_blocks": sizes.num_kv_blocks()},
        "device_only": plain,
        "disk_tier": disk_run | {"tier": asdict(disk)},
        "follow_up_ttft_speedup": plain["follow_up_ttft_p50_s"] / disk_run["follow_up_ttft_p50_s"],
        "recomputed_tokens_reduction": 1 - disk_run["recomputed_prompt_tokens"] / plain["recomputed_prompt_tokens"],
        "greedy_outputs_identical": device_only.replies == tiered.replies,
        "restart": {
            "cached_tokens": restarted.cached_tokens[0],
            "system_prompt_full_block_tokens": full_system,
            "ttft_s": restarted.ttft_s[0],
            "warm_ttft_s": warm.ttft_s[0],
            "ttft_vs_warm": restarted.ttft_s[0] / warm.ttft_s[0],
            "system_prompt_restored": restarted.cached_tokens[0] >= full_system,
        },
        "max_restore_vs_median_step": disk_run["max_restore_s_in_a_step"] / disk_run["median_step_s"],
    }


def markdown(report: dict[str, Any]) -> str:
    s, plain, disk, restart = report["sizes"], report["device_only"], report["disk_tier"], report["restart"]
    return "\n".join(
        [
            f"# streamd bench multiturn ({report['device']}, {report['date']}, commit {report['git_commit']})",
            "",
            f"{s['conversations']} conversations x {s['turns']} turns behind a {s['system_tokens']}-token system "
            f"prompt, +{s['turn_tokens']} tokens a turn, {s['reply_tokens']}-token greedy replies; "
            f"{s['num_kv_blocks']} device blocks (<= {s['device_share']:.0%} of all KV). Shared, noisy machine.",
            "",
            *markdown_table(
                ["system", "follow-up TTFT p50", "first-turn TTFT p50", "prompt tokens recomputed"],
                (
                    [
                        name,
                        f"{r['follow_up_ttft_p50_s'] * 1e3:.0f} ms",
                        f"{r['first_turn_ttft_p50_s'] * 1e3:.0f} ms",
                        f"{r['recomputed_prompt_tokens']} of {r['prompt_tokens']}",
                    ]
                    for name, r in (("device only", plain), ("disk tier", disk))
                ),
            ),
            "",
            f"- follow-up TTFT {report['follow_up_ttft_speedup']:.2f}x lower; recomputed tokens "
            f"-{report['recomputed_tokens_reduction']:.0%}; greedy outputs identical: "
            f"{report['greedy_outputs_identical']}",
            f"- restart: cached_tokens {restart['cached_tokens']} (system prompt's full blocks: "
            f"{restart['system_prompt_full_block_tokens']}), TTFT {restart['ttft_s'] * 1e3:.0f} ms vs warm "
            f"{restart['warm_ttft_s'] * 1e3:.0f} ms ({restart['ttft_vs_warm']:.2f}x)",
            f"- slowest step's restore reads {disk['max_restore_s_in_a_step'] * 1e3:.1f} ms = "
            f"{report['max_restore_vs_median_step']:.2f}x the median step ({disk['median_step_s'] * 1e3:.1f} ms)",
            "",
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Sizes()
    parser.add_argument("--conversations", type=int, default=d.conversations)
    parser.add_argument("--turns", type=int, default=d.turns)
    parser.add_argument("--system-tokens", type=int, default=d.system_tokens)
    parser.add_argument("--turn-tokens", type=int, default=d.turn_tokens)
    parser.add_argument("--reply-tokens", type=int, default=d.reply_tokens)
    parser.add_argument("--device-share", type=float, default=d.device_share, help="of all KV the device holds")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--disk-dir", default=None, help="the disk tier's directory (default: a fresh temporary one)")
    add_out_argument(parser)


def run(args: argparse.Namespace) -> int:
    sizes = Sizes(
        args.conversations, args.turns, args.system_tokens, args.turn_tokens, args.reply_tokens, args.device_share
    )
    dtype = "float32" if args.device == "cpu" else "auto"

    def make_llm(overrides: dict[str, Any]) -> LLM:
        return LLM(device=args.device, dtype=dtype, num_swap_blocks=0, **overrides)

    with tempfile.TemporaryDirectory(prefix="streamd-multiturn-") as scratch:
        report = report_header(args.device) | measure(make_llm, sizes, Path(args.disk_dir or scratch))
    text = markdown(report)
    stem = save_report(report, args.out, "multiturn", text)
    print(text)
    print(f"written: {stem}.json, {stem}.md")
    return 0
