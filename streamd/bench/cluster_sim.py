"""Simulation of R streamd replicas behind a router, for `streamd bench cluster`. No model, no torch.

It owns four things:
- `StepCost`: the wall time of one engine step as `base + per_token * batched tokens + per_context_token *
  context tokens attended`, calibrated from committed GPU results (`calibrate`);
- the workload: ShareGPT-like multi-turn conversations (turn lengths from the ShareGPT fit of
  `workloads.py`) that open with one of a few shared system prompts (Zipf popularity); each turn's prompt is
  the whole conversation so far, so a turn can hit the KV of the previous turn and of the system prompt.
  Closed loop: a fixed number of users per replica, each holding one conversation at a time, thinking
  between turns and taking the next conversation when one ends, for a fixed simulated time;
- routers: round-robin, and prefix-aware (the longest prefix already routed to a replica, in the manner of
  SGLang's cache-aware router: taken when it covers at least half the prompt and the loads are balanced,
  else the least-loaded replica);
- `simulate`: an event-driven run in which every replica is the real Scheduler and BlockManager (prefix
  caching on), stepping whenever it has work, each step lasting what `StepCost` says.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from streamd.bench.workloads import WORKLOADS, RequestStream
from streamd.config import SchedulerConfig
from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.prefix_cache import SeqHashes
from streamd.engine.core.scheduler import Scheduler
from streamd.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from streamd.engine.sampling_params import SamplingParams

_PARAMS = SamplingParams(max_tokens=None)
_SYSTEM_ID_BASE = 1 << 40  # token ids: system prompts, then one disjoint range per conversation
_CONV_ID_BASE = 1 << 48
_CONV_ID_STRIDE = 1 << 24


@dataclass(slots=True, frozen=True)
class StepCost:
    base_s: float
    per_token_s: float
    per_context_token_s: float

    def seconds(self, tokens: int, context_tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens + self.per_context_token_s * context_tokens


@dataclass(slots=True, frozen=True)
class EngineShape:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 16384
    enable_prefix_caching: bool = True


@dataclass(slots=True)
class StepTotals:
    """What a replayed run did, summed over its steps (the terms of `StepCost`)."""

    steps: int = 0
    tokens: int = 0
    context_tokens: int = 0


@dataclass(slots=True)
class StepResult:
    tokens: int
    prefill_tokens: int
    context_tokens: int
    sampled: list[SequenceGroup]  # groups that got a token this step
    finished: list[SequenceGroup]


class Replica:
    """One engine's scheduling and memory, for real; the forward pass only costs time."""

    def __init__(self, shape: EngineShape) -> None:
        self.block_manager = BlockManager(
            shape.num_blocks, shape.block_size, num_swap_blocks=0, enable_prefix_caching=shape.enable_prefix_caching
        )
        # No step latency budget: no step is measured here, and the runs this replays were made before it.
        config = SchedulerConfig(shape.max_num_seqs, shape.max_num_batched_tokens, "recompute", max_step_ms=0)
        self.scheduler = Scheduler(config, self.block_manager, shape.max_model_len)
        self.outstanding = 0  # requests routed here and not finished (the router's load signal)
        self.busy = False  # a step is under way
        self.outputs: dict[str, list[int]] = {}  # request id -> the token ids it will generate

    def add(self, group: SequenceGroup, outputs: list[int]) -> None:
        self.scheduler.add_seq_group(group)
        self.outputs[group.request_id] = outputs
        self.outstanding += 1

    def step(self) -> StepResult:
        """One iteration; `outputs` holds the token ids each request will generate."""
        out = self.scheduler.schedule()
        context = sum(item.seq.num_computed_tokens + item.num_new_tokens for item in out.scheduled)
        sampled = [item for item in out.scheduled if item.samples]
        self.scheduler.on_step_done(out)
        for item in sampled:
            seq, outputs = item.seq, self.outputs[item.group.request_id]
            seq.append_token(outputs[seq.num_output_tokens])
            if seq.num_output_tokens >= len(outputs):
                self.scheduler.finish_seqs([seq], SequenceStatus.FINISHED_LENGTH)
        finished = self.scheduler.free_finished([item.group for item in sampled])
        for group in finished:
            del self.outputs[group.request_id]
        self.outstanding -= len(finished)
        return StepResult(
            out.num_prefill_tokens + out.num_decode_tokens,
            out.num_prefill_tokens,
            context,
            [item.group for item in sampled],
            finished,
        )


def replay_offline(prompts: list[list[int]], output_lens: list[int], shape: EngineShape) -> StepTotals:
    """Every request arrives at once (an offline throughput run): the schedule does not depend on time,
    so the totals are those of the measured run whatever the step cost."""
    replica = Replica(shape)
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        group = SequenceGroup(str(i), [Sequence(list(prompt))], _PARAMS, arrival_time=0.0)
        replica.add(group, [0] * n)
    totals = StepTotals()
    while replica.scheduler.has_unfinished_seqs():
        result = replica.step()
        totals.steps += 1
        totals.tokens += result.tokens
        totals.context_tokens += result.context_tokens
    return totals


# ---- workload ------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ConversationConfig:
    conversations: int
    num_system_prompts: int = 16
    system_prompt_len: tuple[int, int] = (200, 800)
    zipf_s: float = 1.0  # popularity of the system prompts
    mean_turns: float = 3.0  # turns = 1 + floor(Exp(mean_turns - 1)), at most max_turns (mean ~2.5 for 3)
    max_turns: int = 8
    think_time_s: float = 3.0  # mean (exponential) between a turn's answer and the next question
    max_context: int = 8192
    seed: int = 0


@dataclass(slots=True)
class Turn:
    user_ids: list[int]
    output_ids: list[int]
    think_s: float  # after the previous turn's answer (the first turn: after the user's previous conversation)


@dataclass(slots=True)
class Conversation:
    index: int
    system: list[int]
    turns: list[Turn]
    history: list[int] = field(default_factory=list)  # the tokens of the turns done so far (in a run)
    turns_done: int = 0


def make_conversations(config: ConversationConfig) -> list[Conversation]:
    rng = random.Random(config.seed)
    systems = []
    for s in range(config.num_system_prompts):
        n = rng.randint(*config.system_prompt_len)
        systems.append([_SYSTEM_ID_BASE + s * _CONV_ID_STRIDE + j for j in range(n)])
    weights = [1 / (rank + 1) ** config.zipf_s for rank in range(config.num_system_prompts)]
    lengths = RequestStream(WORKLOADS["sharegpt"], config.seed)
    draw = itertools.count()
    conversations = []
    for c in range(config.conversations):
        system = rng.choices(systems, weights)[0]
        ids = itertools.count(_CONV_ID_BASE + c * _CONV_ID_STRIDE)
        turns, context = [], len(system)
        for _ in range(min(config.max_turns, 1 + int(rng.expovariate(1 / (config.mean_turns - 1))))):
            user_len, output_len = lengths[next(draw)]
            if context + user_len + output_len > config.max_context:
                break
            think = rng.expovariate(1 / config.think_time_s)
            turns.append(Turn([next(ids) for _ in range(user_len)], [next(ids) for _ in range(output_len)], think))
            context += user_len + output_len
        if turns:
            conversations.append(Conversation(c, system, turns))
    return conversations


# ---- routers -------------------------------------------------------------------------------------


class RoundRobin:
    name = "round_robin"

    def __init__(self, replicas: list[Replica], block_size: int) -> None:
        self._next = itertools.cycle(range(len(replicas)))

    def route(self, prompt: list[int]) -> int:
        return next(self._next)


class PrefixAware:
    """Per replica, the chained hashes of the full blocks of the prompts routed there (bounded, least
    recently used out: the router's approximation of each replica's prefix cache)."""

    name = "prefix_aware"
    MATCH_THRESHOLD = 0.5  # share of the prompt's blocks the best match must cover
    BALANCE_ABS = 32  # outstanding requests: loads count as unbalanced when both thresholds are crossed
    BALANCE_REL = 1.5

    def __init__(self, replicas: list[Replica], block_size: int, capacity_blocks: int) -> None:
        self.replicas = replicas
        self.block_size = block_size
        self.capacity = capacity_blocks
        self._trees: list[OrderedDict[int, None]] = [OrderedDict() for _ in replicas]

    def route(self, prompt: list[int]) -> int:
        hashes = self._hashes(prompt)
        loads = [r.outstanding for r in self.replicas]
        least = min(range(len(loads)), key=loads.__getitem__)
        matches = [self._match(tree, hashes) for tree in self._trees]
        best = max(range(len(matches)), key=lambda i: (matches[i], -loads[i]))
        unbalanced = max(loads) - min(loads) > self.BALANCE_ABS and max(loads) > self.BALANCE_REL * min(loads)
        covered = hashes and matches[best] >= self.MATCH_THRESHOLD * len(hashes)
        choice = best if covered and not unbalanced else least
        self._insert(self._trees[choice], hashes)
        return choice

    def _hashes(self, prompt: list[int]) -> list[int]:
        """The chained hashes of the prompt's full blocks, as the replicas' prefix caches compute them."""
        chain = SeqHashes(self.block_size)
        return [chain.block_hash(prompt, i) for i in range(len(prompt) // self.block_size)]

    @staticmethod
    def _match(tree: OrderedDict[int, None], hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def _insert(self, tree: OrderedDict[int, None], hashes: list[int]) -> None:
        for h in hashes:
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.capacity:
            tree.popitem(last=False)


# ---- the run -------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class RunConfig:
    users_per_replica: int
    duration_s: float  # users start conversations until then; the run ends when they are all answered
    warmup_s: float  # throughput and TTFT are measured over [warmup_s, duration_s]


@dataclass(slots=True)
class ClusterResult:
    replicas: int
    policy: str
    requests: int  # answered turns whose request arrived in the measured window
    output_tok_s: float  # output tokens of steps that ended in the window / its length
    mean_ttft_s: float
    p50_ttft_s: float
    p99_ttft_s: float
    prefix_hit_rate: float  # prompt tokens found in a replica's prefix cache / prompt tokens looked up
    prefill_tokens: int  # prompt tokens computed (not found in a cache), whole run
    busy_share: float  # the replicas' time in steps / (replicas x run length)
    max_replica_requests: int
    min_replica_requests: int
    blocks_in_use_at_end: int  # over all replicas: 0 unless a block leaked


@dataclass(slots=True)
class _User:
    conversation: Conversation


def _start(conv: Conversation) -> Conversation:
    conv.turns_done, conv.history = 0, []
    return conv


def simulate(
    conversations: list[Conversation],
    num_replicas: int,
    policy: str,
    shape: EngineShape,
    cost: StepCost,
    run: RunConfig,
) -> ClusterResult:
    """Each turn arrives `think_s` after the previous answer (a user's first turn `think_s` after t = 0);
    a user whose conversation ended takes the next one from `conversations`, until `run.duration_s`."""
    replicas = [Replica(shape) for _ in range(num_replicas)]
    router = (
        RoundRobin(replicas, shape.block_size)
        if policy == RoundRobin.name
        else PrefixAware(replicas, shape.block_size, shape.num_blocks)
    )
    pool = iter(conversations)
    events: list[tuple[float, int, _User | Replica]] = []  # (time, tie-break, what)
    order = itertools.count()
    for _ in range(run.users_per_replica * num_replicas):
        conv = _start(next(pool))
        heapq.heappush(events, (conv.turns[0].think_s, next(order), _User(conv)))
    owner: dict[str, _User] = {}
    started: set[str] = set()  # requests that have their first token
    ttfts: list[float] = []
    routed = [0] * num_replicas
    window_tokens, last, busy, prefill = 0, 0.0, 0.0, 0
    while events:
        now, _, what = heapq.heappop(events)
        if isinstance(what, _User):
            replica = _arrive(what, now, router, replicas, routed, owner)
        else:
            replica = what
            replica.busy = False
        if replica.busy or not replica.scheduler.has_unfinished_seqs():
            continue
        result = replica.step()
        end = now + cost.seconds(result.tokens, result.context_tokens)
        busy += end - now
        prefill += result.prefill_tokens
        measured = run.warmup_s <= end <= run.duration_s
        window_tokens += len(result.sampled) if measured else 0
        for group in result.sampled:
            if group.request_id not in started:
                started.add(group.request_id)
                if run.warmup_s <= group.arrival_time <= run.duration_s:
                    ttfts.append(end - group.arrival_time)
        for group in result.finished:
            started.discard(group.request_id)
            user = owner.pop(group.request_id)
            conv = user.conversation
            turn = conv.turns[conv.turns_done]
            conv.history += turn.user_ids + turn.output_ids
            conv.turns_done += 1
            last = max(last, end)
            if conv.turns_done == len(conv.turns):
                following = next(pool, None) if end < run.duration_s else None
                if following is None:
                    continue  # this user is done
                user.conversation = conv = _start(following)
            heapq.heappush(events, (end + conv.turns[conv.turns_done].think_s, next(order), user))
        replica.busy = True
        heapq.heappush(events, (end, next(order), replica))
    queried = sum(r.block_manager.prefix_cache_queried_tokens for r in replicas)
    hit = sum(r.block_manager.prefix_cache_hit_tokens for r in replicas)
    if not ttfts:
        raise ValueError("no request arrived in the measured window: more users or a longer duration")
    ttfts.sort()
    return ClusterResult(
        replicas=num_replicas,
        policy=policy,
        requests=len(ttfts),
        output_tok_s=window_tokens / (run.duration_s - run.warmup_s),
        mean_ttft_s=sum(ttfts) / len(ttfts),
        p50_ttft_s=ttfts[len(ttfts) // 2],
        p99_ttft_s=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        prefix_hit_rate=hit / max(queried, 1),
        prefill_tokens=prefill,
        busy_share=busy / (num_replicas * max(last, 1e-9)),
        max_replica_requests=max(routed),
        min_replica_requests=min(routed),
        blocks_in_use_at_end=sum(r.block_manager.num_blocks - r.block_manager.num_free_blocks() for r in replicas),
    )


def _arrive(
    user: _User,
    now: float,
    router: RoundRobin | PrefixAware,
    replicas: list[Replica],
    routed: list[int],
    owner: dict[str, _User],
) -> Replica:
    """The user's next turn reaches the router, which hands it to a replica."""
    conv = user.conversation
    turn = conv.turns[conv.turns_done]
    prompt = conv.system + conv.history + turn.user_ids
    index = router.route(prompt)
    group = SequenceGroup(f"{conv.index}.{conv.turns_done}", [Sequence(prompt)], _PARAMS, arrival_time=now)
    owner[group.request_id] = user
    replicas[index].add(group, turn.output_ids)
    routed[index] += 1
    return replicas[index]
