"""`streamd bench multiturn`: conversations behind one long system prompt, with the prefix cache's lower tiers
(disk; on CUDA the host-RAM tier above it) against device-only caching (issue 31).

C conversations of T turns each share an S-token system prompt; every turn adds U user tokens, and the
model's R-token greedy reply joins the history. Turns go round-robin over the conversations (every
conversation's turn t, then turn t + 1), one request at a time, so each conversation returns after all the
others: the device pool (`cache.num_kv_blocks`) is sized to hold at most `--device-share` of all the
conversations' KV, so device-only caching loses the histories in between and recomputes them, where the disk
tier restores them. Reported per system: follow-up-turn TTFT (p50), prompt tokens prefilled and recomputed, and
whether the greedy replies are identical; for the disk tier also the tier's work per step against the median
step; then restarts on the disk tier's directory. A third run, a device pool that never evicts, is the
reference for the replies: the tiers promise the KV that was computed, so theirs must equal it token for
token in any dtype; device-only caching recomputes evicted blocks in other chunks, equal only in float32.
That needs prompts chunked alike in every run: by default no latency budget (`--max-step-ms 0`), since a budget
sizes chunks by measured step times (with it, even two runs without any tier differ on the CPU's low-bit
default model, whose bfloat16 matmuls round each chunk size otherwise).

The defaults are sized to run in minutes on a 2-core CPU; the issue's full sizes (`--conversations 128
--turns 8 --system-tokens 2048 --turn-tokens 300`) are for the GPU. The model is the default one, or with
`--shape` random weights of a named shape (`offline.SHAPES`, as `bench throughput --shapes` takes them; built
on the device, seeded, so every restart has the same weights): a TTFT gain from the tiers needs a model whose
prefill of a history costs more than a step (the 135M default prefills ~1k tokens inside one ~15 ms step on
an H200; `llama3.2-3b` does not).

What counts as recomputed: a prompt token is *recomputed* when its KV had been computed before (by any
earlier request: the same prefix at the same position) and was computed again; the tokens no cache could
hold (each turn's new user text, the last reply token, which is sampled but never fed through the model)
are *never computed before* and are reported apart (`SeenPrefixes`). Cached prefixes are whole blocks, so
the tokens of a history's last, partly filled block are recomputed by any block cache: reported as what
the blocks could not hold, against `missed_cacheable_tokens` (seen, in whole blocks, and still recomputed:
what a perfect block cache would have saved; 0 when the tier misses nothing).

Stalls: every step is timed, and so is the tier's work inside it (reading a restored block from disk and
writing it into the pool; reading an evicted block out of the pool and handing it to the tier). The target
reads "restores never stall a step beyond 1.2x the median step": the most tier work any step did, against
the median step (at most 0.2x). Each tier-working step's own stretch (its time over its time without the
tier's work) is reported beside it.

Restores against the link: the host tier's restores are swap-ins, whose bytes and copy time the cache engine
keeps (`CopyClock`: the copy stream's time between events around each swap-in, on CUDA); their rate while
copying is reported against the pinned link measured in the same run (one 256 MiB copy from pinned host memory,
best of three).

Restart: each round measures a new conversation's first turn (reusing the system prompt) on a warm engine,
closes it (its cached blocks go to disk, most recently used first: reported as the blocks written and the
seconds the close took), opens a new one on the same directory and measures the same there. Each engine is
released before the next opens (`offline.free_cuda`), so a large shape's weights are held at most twice.
Both measurements run one unrelated warm-up request first (random tokens, no system prompt), so the ratio
compares the cache, not a new engine's first forward; that warm-up's TTFT on the restarted engine and the
engine's start time are reported beside it, and so are the restarted disk tier's two estimates when the
measured request came (it reads only while a block's read time beats its prefill time: where it does not,
the system prompt is recomputed, and the report names those rounds). (One process: a restarted server also
pays torch's start.)
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamd.bench.offline import SHAPES, free_cuda
from streamd.bench.report import add_out_argument, markdown_table, report_header, save_report
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import TierStats

if TYPE_CHECKING:  # (the CLI imports this module to build its parser: no torch there)
    from streamd.llm import LLM

MakeLLM = Callable[[dict[str, Any]], "LLM"]  # config overrides -> an engine
_MOD = (1 << 61) - 1  # the prefix hashes' modulus (a Mersenne prime)


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
    restarts: int = 3  # restart rounds (each: a warm measurement, a restart, a restarted measurement)

    def longest_prompt(self) -> int:
        """A conversation's last turn: the system prompt and every turn's text and reply."""
        return self.system_tokens + self.turns * (self.turn_tokens + self.reply_tokens)

    def num_kv_blocks(self) -> int:
        """At most `device_share` of every conversation's final KV (the system prompt's blocks counted
        once), but at least one whole last turn plus its reply, above the 1% admission watermark."""
        one = -(-(self.longest_prompt() + self.reply_tokens) // self.block_size) + 1
        return max(int(self.device_share * self.all_blocks()), int(one / 0.98) + 1)

    def all_blocks(self) -> int:
        """Every conversation's final KV in blocks, the system prompt's counted once (each history's partly
        filled blocks once more): a pool this large never evicts."""
        bs = self.block_size
        history = self.turns * (self.turn_tokens + self.reply_tokens)
        return -(-self.system_tokens // bs) + self.conversations * (-(-history // bs) + 1)


def prefix_hashes(token_ids: list[int]) -> Iterator[int]:
    """One hash per prefix of `token_ids` (lengths 1, 2, ...), its length folded in."""
    h = 0
    for length, token in enumerate(token_ids, 1):
        h = (h * 1_000_003 + token + 1) % _MOD
        yield h ^ (length << 61)


@dataclass(slots=True)
class SeenPrefixes:
    """Every token prefix whose KV some earlier request computed: how much of a new prompt had been
    computed before (whatever any cache still holds)."""

    hashes: set[int] = field(default_factory=set)

    def add(self, computed: list[int]) -> None:
        self.hashes.update(prefix_hashes(computed))

    def seen_length(self, prompt: list[int]) -> int:
        length = 0
        for h in prefix_hashes(prompt):
            if h not in self.hashes:
                break
            length += 1
        return length


def cacheable(seen: int, prompt_len: int, block_size: int) -> int:
    """Tokens a perfect block cache would serve: the seen prefix's whole blocks, never the last token."""
    return min(seen, prompt_len - 1) // block_size * block_size


@dataclass(slots=True)
class Run:
    """One system's run: per request its TTFT, prompt, seen and cached tokens and reply; per step its time
    and the tier's work in it."""

    block_size: int
    ttft_s: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    seen_tokens: list[int] = field(default_factory=list)  # computed before by an earlier request
    cached_tokens: list[int] = field(default_factory=list)
    replies: list[list[int]] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    tier_s: list[float] = field(default_factory=list)  # per step: seconds of the tier's reads and writes
    seen: SeenPrefixes = field(default_factory=SeenPrefixes)

    def summary(self) -> dict[str, Any]:
        return self.ttfts() | self.tokens() | self.stalls()

    def ttfts(self) -> dict[str, Any]:
        follow = [t for t, turn in zip(self.ttft_s, self.turn, strict=True) if turn > 0]
        first = [t for t, turn in zip(self.ttft_s, self.turn, strict=True) if turn == 0]
        return {
            "requests": len(self.ttft_s),
            "follow_up_ttft_p50_s": statistics.median(follow) if follow else None,
            "first_turn_ttft_p50_s": statistics.median(first) if first else None,
        }

    def tokens(self) -> dict[str, int]:
        prompt, seen, cached = sum(self.prompt_tokens), sum(self.seen_tokens), sum(self.cached_tokens)
        rows = zip(self.seen_tokens, self.prompt_tokens, strict=True)
        whole_blocks = sum(cacheable(s, p, self.block_size) for s, p in rows)
        return {
            "prompt_tokens": prompt,
            "prefilled_prompt_tokens": prompt - cached,
            "never_computed_tokens": prompt - seen,
            "recomputed_prompt_tokens": seen - cached,
            "recomputed_in_partial_blocks": seen - whole_blocks,
            "missed_cacheable_tokens": whole_blocks - cached,
        }

    def stalls(self) -> dict[str, Any]:
        median_step = statistics.median(self.step_s) if self.step_s else 0.0
        working = [(s, t) for s, t in zip(self.step_s, self.tier_s, strict=True) if t > 0]
        return {
            "median_step_s": median_step,
            "steps": len(self.step_s),
            "steps_with_tier_work": len(working),
            "max_tier_s_in_a_step": max(self.tier_s, default=0.0),
            "max_tier_step_stretch": max((s / max(s - t, 1e-9) for s, t in working), default=1.0),
            "slowest_tier_step_s": max((s for s, _ in working), default=0.0),
        }


_CLOCKS: weakref.WeakKeyDictionary[Any, TierClock] = weakref.WeakKeyDictionary()  # engine -> its clock


class TierClock:
    """Times the tiers' work inside each step: the disk tier's reads and hand-overs (`fetch`, `put`), the
    pool's block reads and writes for it (the executor's `read_blocks`, `read_host_blocks`, `write_blocks`),
    and the host tier's moves (`swap_in`, `swap_out`; a preemption's swap too, which this bench's pools make
    rare). A call with nothing to move is not tier work. One clock per engine (`of`): a second would wrap
    the wrapped methods again."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        engine = llm.engine
        tier = engine.block_manager.tier
        if tier is not None:
            self.wrap(tier, "fetch", "put")
        self.wrap(engine.executor, "read_blocks", "read_host_blocks", "write_blocks", "swap_in", "swap_out")

    @staticmethod
    def of(llm: LLM) -> TierClock:
        """The engine's clock, made on first use."""
        clock = _CLOCKS.get(llm.engine)
        if clock is None:
            clock = _CLOCKS[llm.engine] = TierClock(llm)
        return clock

    def wrap(self, owner: Any, *names: str) -> None:
        for name in names:
            setattr(owner, name, self.timed(getattr(owner, name)))

    def timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            if args and not args[0]:  # nothing to move
                return method(*args)
            began = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - began

        return call


def tokens(rng: random.Random, n: int, sizes: Sizes) -> list[int]:
    return [rng.randrange(100, sizes.vocab) for _ in range(n)]


def ask(llm: LLM, prompt: list[int], sizes: Sizes, run: Run, turn: int, clock: TierClock | None = None) -> list[int]:
    """One request alone: its TTFT (arrival to the step that gives its first token) and reply."""
    engine = llm.engine
    params = SamplingParams(max_tokens=sizes.reply_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    began = time.perf_counter()
    engine.add_request(f"mt{len(run.ttft_s)}", prompt, params)
    reply: list[int] = []
    ttft = cached = None
    while engine.has_unfinished_requests():
        before_tier = clock.seconds if clock else 0.0
        step_began = time.perf_counter()
        for delta in engine.step():
            reply += [t for c in delta.outputs for t in c.token_ids]
            cached = delta.num_cached_tokens or cached
            if ttft is None and reply:
                ttft = time.perf_counter() - began
        run.step_s.append(time.perf_counter() - step_began)
        run.tier_s.append((clock.seconds if clock else 0.0) - before_tier)
    record(run, prompt, reply, turn, ttft or 0.0, cached or 0)
    return reply


def record(run: Run, prompt: list[int], reply: list[int], turn: int, ttft: float, cached: int) -> None:
    run.ttft_s.append(ttft)
    run.turn.append(turn)
    run.prompt_tokens.append(len(prompt))
    run.seen_tokens.append(run.seen.seen_length(prompt))
    run.cached_tokens.append(cached)
    run.replies.append(reply)
    run.seen.add(prompt + reply[:-1])  # the last reply token is sampled, never fed through the model


def conversations(llm: LLM, sizes: Sizes, system: list[int], clock: TierClock | None = None) -> Run:
    """Every conversation's turns, round-robin, one request at a time."""
    rng = random.Random(sizes.seed + 1)
    users = [[tokens(rng, sizes.turn_tokens, sizes) for _ in range(sizes.turns)] for _ in range(sizes.conversations)]
    history: list[list[int]] = [list(system) for _ in range(sizes.conversations)]
    run = Run(sizes.block_size)
    for turn in range(sizes.turns):
        for c in range(sizes.conversations):
            history[c] += users[c][turn]
            history[c] += ask(llm, history[c], sizes, run, turn, clock)
    return run


@dataclass(slots=True)
class RestartRound:
    """One restart: the warm engine's and the restarted engine's TTFT for a new conversation's first turn
    (each after one unrelated warm-up request), and what the restarted process's first request cost."""

    warm_ttft_s: float
    ttft_s: float
    cached_tokens: int
    start_s: float  # opening the restarted engine (model load, the disk tier's probe and index)
    first_request_ttft_s: float  # the restarted engine's unrelated warm-up request (its first forward)
    tier_s: float  # the tier's work during the measured request
    written_at_close: int  # blocks the closing engine wrote to disk (the rest were there already, or beyond)
    close_s: float  # the closing engine's `close` (its writes at shutdown)
    read_s_per_block: float | None  # the restarted disk tier's estimates when the measured request came:
    recompute_s_per_block: float | None  # it reads only while the first is below the second

    def reading_lost(self) -> bool:
        """Whether the disk tier's cost rule kept the measured request from reading (the prefix recomputed)."""
        read, recompute = self.read_s_per_block, self.recompute_s_per_block
        return read is not None and recompute is not None and read >= recompute


@dataclass(slots=True)
class Fresh:
    """`fresh_request`'s runs, and the disk tier's estimates when its measured request was admitted."""

    warm_up: Run
    measured: Run
    read_s_per_block: float | None = None
    recompute_s_per_block: float | None = None


def fresh_request(llm: LLM, sizes: Sizes, system: list[int], rng: random.Random) -> Fresh:
    """An unrelated warm-up request, then a new conversation's first turn."""
    fresh = Fresh(Run(sizes.block_size), Run(sizes.block_size))
    ask(llm, tokens(rng, sizes.turn_tokens, sizes), sizes, fresh.warm_up, 0)
    tier = llm.engine.block_manager.tier
    fresh.read_s_per_block = getattr(tier, "read_s_per_block", None)
    fresh.recompute_s_per_block = getattr(tier, "recompute_s_per_block", None)
    ask(llm, system + tokens(rng, sizes.turn_tokens, sizes), sizes, fresh.measured, 0, TierClock.of(llm))
    return fresh


def restarts(make_llm: MakeLLM, llm: LLM, sizes: Sizes, system: list[int]) -> list[RestartRound]:
    """`sizes.restarts` rounds: measure warm, close, reopen on the same directory, measure restarted."""
    rng, rounds = random.Random(sizes.seed + 2), []
    for _ in range(sizes.restarts):
        warm = fresh_request(llm, sizes, system, rng).measured
        began = time.perf_counter()
        persisted = llm.engine.close()
        close_s = time.perf_counter() - began
        del llm
        free_cuda()
        began = time.perf_counter()
        llm = make_llm({})
        start_s = time.perf_counter() - began
        fresh = fresh_request(llm, sizes, system, rng)
        restarted = fresh.measured
        rounds.append(
            RestartRound(
                warm.ttft_s[0],
                restarted.ttft_s[0],
                restarted.cached_tokens[0],
                start_s,
                fresh.warm_up.ttft_s[0],
                sum(restarted.tier_s),
                persisted.written if persisted else 0,
                close_s,
                fresh.read_s_per_block,
                fresh.recompute_s_per_block,
            )
        )
    llm.engine.close()
    return rounds


def _dropped_spills(llm: LLM) -> int:
    return int(getattr(llm.engine.block_manager.tier, "dropped_spills", 0))


def measure(make_llm: MakeLLM, sizes: Sizes, disk_dir: Path, model: str = "default") -> dict[str, Any]:
    """Device-only caching, then the disk tier, then restarts on the disk tier's directory."""
    system = tokens(random.Random(sizes.seed), sizes.system_tokens, sizes)
    base = {"cache.num_kv_blocks": sizes.num_kv_blocks(), "cache.block_size": sizes.block_size}
    device_only = conversations(make_llm({**base, "cache.host_cache_gib": 0.0}), sizes, system)
    free_cuda()
    unevicted_config = {**base, "cache.num_kv_blocks": sizes.all_blocks() + 2, "cache.host_cache_gib": 0.0}
    unevicted = conversations(make_llm(unevicted_config), sizes, system)
    free_cuda()
    # The tiers: the disk tier, and the host tier by its default (on with CUDA, off on the CPU).
    tiered_config = {**base, "cache.disk_cache_dir": str(disk_dir)}
    tiered_llm = make_llm(tiered_config)
    before = swapped_in(tiered_llm)  # (the engine's start-up probe of the link swaps blocks in too)
    tiered = conversations(tiered_llm, sizes, system, TierClock.of(tiered_llm))
    link = restore_rate(tiered_llm, before)
    dropped = _dropped_spills(tiered_llm)
    disk_stats: TierStats = tiered_llm.engine.stats().kv.tiers[-1]
    rounds = restarts(lambda extra: make_llm({**tiered_config, **extra}), tiered_llm, sizes, system)
    report = report_of(sizes, device_only, tiered, rounds, disk_stats, dropped)
    return {"model": model} | report | identity_to_unevicted(unevicted, tiered) | {"restores": link}


_LINK_PROBE_BYTES = 256 << 20


def swapped_in(llm: LLM) -> tuple[int, float]:
    """The engine's swap-ins so far, all finished: bytes and copy seconds (the cache engine's `CopyClock`: the copy
    stream's time on CUDA)."""
    import torch

    cache = llm.engine.executor.cache
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)
    return cache.restores.settle()


def restore_rate(llm: LLM, before: tuple[int, float]) -> dict[str, float]:
    """What the swap-ins since `before` (`swapped_in`) moved and how fast, against the pinned link measured now: one
    256 MiB copy from pinned host memory, best of three (on the CPU a plain copy between two host tensors)."""
    now = swapped_in(llm)
    moved, seconds = now[0] - before[0], now[1] - before[1]
    device = llm.engine.executor.cache.device
    link = max(_pinned_copy_rate(device) for _ in range(3))
    rate = moved / seconds if seconds else 0.0
    return {"bytes": moved, "seconds": seconds, "bytes_per_s": rate, "link_bytes_per_s": link, "of_link": rate / link}


def _pinned_copy_rate(device: Any) -> float:
    import torch

    host = torch.empty(_LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(_LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
    if device.type != "cuda":
        began = time.perf_counter()
        target.copy_(host)
        return _LINK_PROBE_BYTES / max(time.perf_counter() - began, 1e-9)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    target.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    return _LINK_PROBE_BYTES / (start.elapsed_time(end) / 1e3)


def identity_to_unevicted(unevicted: Run, tiered: Run) -> dict[str, Any]:
    """The tiers' promise: a restored block is the KV that was computed, so the replies are those of a device
    that never evicts (the same requests, one at a time: the same steps). Device-only caching recomputes
    evicted blocks in other chunks, which round otherwise in bfloat16 (identical only in float32)."""
    return {
        "unevicted_device": unevicted.summary(),
        "greedy_outputs_identical_to_unevicted": unevicted.replies == tiered.replies,
    }


def report_of(
    sizes: Sizes, device_only: Run, tiered: Run, rounds: list[RestartRound], disk: TierStats, dropped: int
) -> dict[str, Any]:
    plain, disk_run = device_only.summary(), tiered.summary()
    full_system = sizes.system_tokens // sizes.block_size * sizes.block_size
    ratios = [r.ttft_s / r.warm_ttft_s for r in rounds]
    return {
        "sizes": asdict(sizes) | {"num_kv_blocks": sizes.num_kv_blocks()},
        "device_only": plain,
        "disk_tier": disk_run | {"tier": asdict(disk), "dropped_spills": dropped},
        "follow_up_ttft_speedup": plain["follow_up_ttft_p50_s"] / disk_run["follow_up_ttft_p50_s"],
        "recomputed_tokens_reduction": reduction(plain, disk_run, "recomputed_prompt_tokens"),
        "prefilled_tokens_reduction": reduction(plain, disk_run, "prefilled_prompt_tokens"),
        "greedy_outputs_identical": device_only.replies == tiered.replies,
        "restart": {
            "rounds": [asdict(r) for r in rounds],
            "system_prompt_full_block_tokens": full_system,
            "ttft_vs_warm": ratios,
            "max_ttft_vs_warm": max(ratios, default=float("nan")),  # (--restarts 0: none measured)
            "system_prompt_restored": all(r.cached_tokens >= full_system for r in rounds),
            "rounds_reading_lost": [i + 1 for i, r in enumerate(rounds) if r.reading_lost()],
        },
        "max_tier_vs_median_step": disk_run["max_tier_s_in_a_step"] / disk_run["median_step_s"],
    }


def reduction(before: dict[str, Any], after: dict[str, Any], key: str) -> float:
    """How much smaller `key` is after than before (0 where there was nothing before)."""
    return 1 - after[key] / before[key] if before[key] else 0.0


def markdown(report: dict[str, Any]) -> str:
    s = report["sizes"]
    return "\n".join(
        [
            f"# streamd bench multiturn ({report['model']} model, {report['device']}, {report['date']}, "
            f"commit {report['git_commit']})",
            "",
            f"{s['conversations']} conversations x {s['turns']} turns behind a {s['system_tokens']}-token system "
            f"prompt, +{s['turn_tokens']} tokens a turn, {s['reply_tokens']}-token greedy replies; "
            f"{s['num_kv_blocks']} device blocks (<= {s['device_share']:.0%} of all KV). Shared, noisy machine.",
            "",
            *systems_table(report),
            "",
            *findings(report),
            "",
            *restart_table(report),
            "",
        ]
    )


def systems_table(report: dict[str, Any]) -> list[str]:
    rows = [("device only", report["device_only"]), ("disk tier", report["disk_tier"])]
    if "unevicted_device" in report:
        rows.append(("device that never evicts (reference)", report["unevicted_device"]))
    return markdown_table(
        [
            "system",
            "follow-up TTFT p50",
            "first-turn TTFT p50",
            "prefilled",
            "never computed before",
            "recomputed",
            "of which in partial blocks",
            "missed in whole blocks",
        ],
        (
            [
                name,
                f"{r['follow_up_ttft_p50_s'] * 1e3:.0f} ms",
                f"{r['first_turn_ttft_p50_s'] * 1e3:.0f} ms",
                f"{r['prefilled_prompt_tokens']} of {r['prompt_tokens']}",
                r["never_computed_tokens"],
                r["recomputed_prompt_tokens"],
                r["recomputed_in_partial_blocks"],
                r["missed_cacheable_tokens"],
            ]
            for name, r in rows
        ),
    )


def findings(report: dict[str, Any]) -> list[str]:
    disk, restart = report["disk_tier"], report["restart"]
    return [
        f"- follow-up TTFT {report['follow_up_ttft_speedup']:.2f}x lower; recomputed prompt tokens "
        f"-{report['recomputed_tokens_reduction']:.0%} (prefilled -{report['prefilled_tokens_reduction']:.0%}); "
        f"greedy outputs identical to device-only (recomputing): {report['greedy_outputs_identical']}, to a "
        f"device that never evicts: {report.get('greedy_outputs_identical_to_unevicted')}",
        f"- restart: TTFT vs warm {', '.join(f'{r:.2f}x' for r in restart['ttft_vs_warm'])} (max "
        f"{restart['max_ttft_vs_warm']:.2f}x); the system prompt's full blocks "
        f"({restart['system_prompt_full_block_tokens']} tokens) restored every time: "
        f"{restart['system_prompt_restored']}{why_not_read(restart)}",
        *restores_finding(report),
        f"- stalls: the most tier work in a step {disk['max_tier_s_in_a_step'] * 1e3:.1f} ms = "
        f"{report['max_tier_vs_median_step']:.3f}x the median step ({disk['median_step_s'] * 1e3:.1f} ms); "
        f"{disk['steps_with_tier_work']} of {disk['steps']} steps did tier work, the most stretched by "
        f"{disk['max_tier_step_stretch']:.3f}x; spills dropped: {disk['dropped_spills']}",
    ]


def restores_finding(report: dict[str, Any]) -> list[str]:
    r = report.get("restores")
    if not r:
        return []
    return [
        f"- restores (swap-ins: the host tier's, and preempted blocks swapped back): {r['bytes'] / 2**20:.0f} MiB "
        f"at {r['bytes_per_s'] / 2**30:.1f} GiB/s while copying = {r['of_link']:.0%} of the pinned link measured in "
        f"this run ({r['link_bytes_per_s'] / 2**30:.1f} GiB/s, one 256 MiB copy)"
    ]


def why_not_read(restart: dict[str, Any]) -> str:
    """The rounds whose measured request the disk tier's cost rule kept from reading, with its estimates."""
    lost = restart["rounds_reading_lost"]
    if not lost:
        return ""
    costs = ", ".join(read_vs_recompute(restart["rounds"][i - 1]) for i in lost)
    return f" (reading lost to recomputing in round {', '.join(map(str, lost))}: {costs} ms a block)"


def read_vs_recompute(r: dict[str, Any]) -> str:
    read, recompute = r["read_s_per_block"], r["recompute_s_per_block"]
    if read is None or recompute is None:
        return "-"
    return f"{read * 1e3:.2f} vs {recompute * 1e3:.2f}"


def restart_table(report: dict[str, Any]) -> list[str]:
    return markdown_table(
        [
            "round",
            "warm TTFT",
            "restarted TTFT",
            "ratio",
            "cached tokens",
            "engine start",
            "first request (unrelated)",
            "tier work",
            "disk read vs recompute (ms a block)",
            "written at close",
        ],
        (
            [
                i + 1,
                f"{r['warm_ttft_s'] * 1e3:.0f} ms",
                f"{r['ttft_s'] * 1e3:.0f} ms",
                f"{r['ttft_s'] / r['warm_ttft_s']:.2f}x",
                r["cached_tokens"],
                f"{r['start_s']:.1f} s",
                f"{r['first_request_ttft_s'] * 1e3:.0f} ms",
                f"{r['tier_s'] * 1e3:.1f} ms",
                read_vs_recompute(r),
                f"{r['written_at_close']} in {r['close_s']:.1f} s",
            ]
            for i, r in enumerate(report["restart"]["rounds"])
        ),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Sizes()
    parser.add_argument("--conversations", type=int, default=d.conversations)
    parser.add_argument("--turns", type=int, default=d.turns)
    parser.add_argument("--system-tokens", type=int, default=d.system_tokens)
    parser.add_argument("--turn-tokens", type=int, default=d.turn_tokens)
    parser.add_argument("--reply-tokens", type=int, default=d.reply_tokens)
    parser.add_argument("--device-share", type=float, default=d.device_share, help="of all KV the device holds")
    parser.add_argument("--restarts", type=int, default=d.restarts, help="restart rounds measured")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--max-step-ms",
        type=float,
        default=0.0,
        help="scheduler.max_step_ms (default 0: no latency budget, so prompts are chunked alike in every run; a "
        "budget cuts chunks by measured step times, and chunks of other sizes round otherwise)",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="random weights of this model shape instead of the default model (e.g. llama3.2-3b on a GPU)",
    )
    parser.add_argument("--disk-dir", default=None, help="the disk tier's directory (default: a fresh temporary one)")
    add_out_argument(parser)


def run(args: argparse.Namespace) -> int:
    sizes = Sizes(
        args.conversations,
        args.turns,
        args.system_tokens,
        args.turn_tokens,
        args.reply_tokens,
        args.device_share,
        restarts=args.restarts,
    )
    dtype = "float32" if args.device == "cpu" else "auto"

    from streamd.bench.offline import model_config
    from streamd.llm import LLM

    model = None if args.shape is None else model_config(args.shape, max_len=max(4096, sizes.longest_prompt() + 64))

    def make_llm(overrides: dict[str, Any]) -> LLM:
        fixed = {"scheduler.max_step_ms": args.max_step_ms}
        return LLM(model, device=args.device, dtype=dtype, num_swap_blocks=0, **fixed, **overrides)

    with tempfile.TemporaryDirectory(prefix="streamd-multiturn-") as scratch:
        directory = Path(args.disk_dir or scratch)
        report = report_header(args.device) | measure(make_llm, sizes, directory, args.shape or "default")

    text = markdown(report)
    stem = save_report(report, args.out, "multiturn", text)
    print(text)
    print(f"written: {stem}.json, {stem}.md")
    return 0
