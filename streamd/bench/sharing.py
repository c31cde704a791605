"""`streamd bench memory --sharing`: KV blocks saved by sharing within a request (the paper's Fig. 15).

Block-manager level, CPU only: the real Scheduler and BlockManager serve a saturated stream of requests
(the workloads of `workloads.py`), each with n parallel samples or a beam of width k, and no model. Per step
it counts the device blocks in use (shared blocks once) and the blocks the same sequences would hold
without sharing (each sequence's own table); the saving is 1 - used / unshared over the run, after a
warm-up, as the paper measures it.

- Parallel sampling: the prompt's sequence is forked into n samples when its prompt is done (as the
  engine does); samples append their own tokens, copy-on-write copies the last partly filled block.
- Beam search: beam search requests (`use_beam_search`, so the scheduler runs their beams together) whose
  next beams' parents are drawn uniformly from the k beams each step (the genealogy of neutral selection),
  applied by the engine's own `Scheduler.replace_beams`: a parent drawn j times continues and is forked
  j - 1 times, a parent never drawn is freed at once.
- With `--sharing-model`, `sharing_engine.py` also measures the engine's real beam search on the default
  model, where the model's scores pick the parents.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

from streamd.bench.simulate import Progress
from streamd.bench.workloads import MAX_SEQ_LEN, RequestStream, Workload
from streamd.config import SchedulerConfig
from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.scheduler import Scheduler
from streamd.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from streamd.engine.sampling_params import SamplingParams

_ID_STRIDE = 4096  # token ids of request i start at i * _ID_STRIDE: no prefix shared across requests


def simulate_sharing(
    stream: RequestStream,
    mode: str,
    width: int,
    steps: int,
    warmup: int,
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    seed: int,
    progress: Progress,
) -> dict[str, object]:
    """One saturated run; `mode` is "parallel" (n = width) or "beam" (beam width = width)."""
    bm = BlockManager(num_blocks, block_size, num_swap_blocks=0)
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, "recompute"), bm, MAX_SEQ_LEN)
    rng = random.Random(seed)
    output_lens: dict[str, int] = {}
    used = unshared = 0
    next_req, every = 0, max(1, steps // 20)
    for step in range(steps):
        while sched.num_waiting < 8:  # a backlog: memory, not arrivals, is the limit
            prompt_len, output_len = stream[next_req]
            base = next_req * _ID_STRIDE
            params = (
                SamplingParams(use_beam_search=True, beam_width=width, max_tokens=output_len)
                if mode == "beam"
                else SamplingParams(n=width, max_tokens=output_len)
            )
            group = SequenceGroup(str(next_req), [Sequence(list(range(base, base + prompt_len)))], params)
            output_lens[group.request_id] = output_len
            sched.add_seq_group(group)
            next_req += 1
        out = sched.schedule()
        if step >= warmup:
            used += num_blocks - bm.num_free_blocks()
            unshared += sum(len(s.block_table) for g in sched.running for s in g.seqs)
        groups = list({id(item.group): item.group for item in out.scheduled if item.samples}.values())
        sched.on_step_done(out)
        for group in groups:
            _advance(sched, group, mode, output_lens[group.request_id], rng)
        for group in sched.free_finished(groups):
            del output_lens[group.request_id]
        if step % every == 0:
            progress(step / steps)
    return {
        "mode": mode,
        "width": width,
        "blocks_used": used / max(1, steps - warmup),
        "blocks_unshared": unshared / max(1, steps - warmup),
        "saving": 1 - used / max(1, unshared),
    }


def _advance(sched: Scheduler, group: SequenceGroup, mode: str, output_len: int, rng: random.Random) -> None:
    """The group's sequences that sampled this step get their token (and beams their new parents)."""
    live = [s for s in group.seqs if s.status is SequenceStatus.RUNNING and s.num_tokens == s.num_computed_tokens]
    if not live:
        return
    if mode == "beam":  # the next beams' parents, drawn uniformly (the prompt's alone at first)
        live = sched.replace_beams(group, [live[rng.randrange(len(live))] for _ in range(group.width)])
    elif len(group.seqs) == 1 and live[0].num_output_tokens == 0:
        for _ in range(group.width - 1):  # the prompt is done: fork the samples
            live.append(sched.fork_seq(group, live[0]))
    for seq in live:
        seq.append_token(0)
    sched.finish_seqs([s for s in live if s.num_output_tokens >= output_len], SequenceStatus.FINISHED_LENGTH)
    group.seqs = [s for s in group.seqs if s.block_table or not s.status.finished]


# The paper's Fig. 15 (OPT-13B, Alpaca): memory saved by sharing.
PAPER_ALPACA = {"parallel": "6.1% - 9.8%", "beam": "37.6% - 55.2%"}
WIDTHS = (2, 4, 6)
SHARING_WORKLOADS = ("alpaca", "sharegpt")


def run_sharing(
    args: argparse.Namespace, workloads: dict[str, Workload], progress_line: Callable[[str, str], Progress]
) -> dict[str, object]:
    """Every (workload, mode, width) run; the report (without writing it)."""
    lifetimes = 1.0 if args.quick else args.sharing_lifetimes
    results: dict[str, list[dict[str, object]]] = {}
    for name in SHARING_WORKLOADS:
        workload = workloads[name]
        steps = int(lifetimes * workload.output_mean)
        runs = []
        for mode in ("parallel", "beam"):
            for width in WIDTHS:
                progress = progress_line(name, f"{mode}-{width}")
                runs.append(
                    simulate_sharing(
                        RequestStream(workload, args.seed),
                        mode,
                        width,
                        steps,
                        steps // 10,
                        args.num_blocks,
                        args.block_size,
                        args.max_num_seqs,
                        args.max_num_batched_tokens,
                        args.seed,
                        progress,
                    )
                )
                progress(1.0)
        results[name] = runs
    return {
        "benchmark": "memory-sharing",
        "config": {
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
            "lifetimes": lifetimes,
            "seed": args.seed,
            "quick": args.quick,
        },
        "workloads": results,
        "paper_alpaca": PAPER_ALPACA,
    }


def render_sharing(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"# Memory saved by sharing ({report['date']}, {report['device']}, commit {report['commit']})",
        "",
        f"Block-manager level (no model): the real Scheduler and BlockManager, {cfg['num_blocks']} blocks x "
        f"{cfg['block_size']} tokens, saturated, {cfg['lifetimes']} mean output lengths per run, seed "
        f"{cfg['seed']}" + (" (QUICK run: not a measurement)" if cfg["quick"] else "") + ". Saving = 1 - "
        "blocks in use / blocks the same sequences would hold without sharing (the paper's Fig. 15).",
        "",
        "| workload | mode | width | blocks used | blocks without sharing | saving | paper (Alpaca) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for name, runs in report["workloads"].items():
        for r in runs:
            paper = report["paper_alpaca"][r["mode"]] if name == "alpaca" else ""
            lines.append(
                f"| {name} | {r['mode']} | {r['width']} | {r['blocks_used']:.1f} | "
                f"{r['blocks_unshared']:.1f} | {r['saving']:.1%} | {paper} |"
            )
    lines += [
        "",
        "Simulated beam rows: parents drawn uniformly (neutral selection), applied by the engine's "
        "own fork/free path (`Scheduler.replace_beams`); a model's scores concentrate parents on fewer "
        "beams, which shares longer prefixes (see the engine rows, when measured).",
    ]
    if report.get("engine_beams"):
        lines += render_engine_beams(report["engine_beams"])
    return "\n".join(lines) + "\n"


def render_engine_beams(engine: dict) -> list[str]:
    """The markdown of `sharing_engine.measure_engine_beams`' runs."""
    lines = [
        "",
        f"## The engine's beam search ({engine['model']}, CPU)",
        "",
        f"The real engine (`use_beam_search`, early_stopping false, length_penalty 1) on {engine['requests']} "
        "Alpaca-like instructions at once, max_tokens drawn from the Alpaca-like output lengths, prefix "
        "caching off (only sharing within a request counts): the model's scores pick the parents. Blocks "
        "counted after every step, averaged over the run.",
        "",
        "| width | steps | blocks used | blocks without sharing | saving | paper (Alpaca) |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for r in engine["runs"]:
        lines.append(
            f"| {r['width']} | {r['steps']} | {r['blocks_used']:.1f} | {r['blocks_unshared']:.1f} | "
            f"{r['saving']:.1%} | {PAPER_ALPACA['beam']} |"
        )
    return lines
