"""SchedulerOutput: one iteration's plan, handed from the Scheduler to the CacheEngine and ModelRunner; StepOutcome:
what the iteration's sampled tokens did, handed back to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from streamd.engine.core.kv_tiers import TierOrders
from streamd.engine.core.sequence import Sequence, SequenceGroup
from streamd.engine.core.speculation import Draft
from streamd.engine.core.step_cost import StepShape
from streamd.engine.outputs import RequestUpdate


@dataclass(slots=True)
class ScheduledSeq:
    """`num_new_tokens` tokens of `seq`, starting at `seq.num_computed_tokens`, run through the model
    this step (a whole or partial prompt chunk, or 1 for a decode). The step samples a token for this
    sequence only when the chunk reaches the end of `seq.token_ids`."""

    seq: Sequence
    group: SequenceGroup
    num_new_tokens: int
    # A decode's draft tokens, run after its token in the same forward (speculative decoding); the step's
    # verification keeps those the model agrees with. Not counted in `num_new_tokens`.
    draft: Draft | None = None

    @property
    def samples(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    # Prefill chunks first, then decodes; the model runner keeps this order.
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # (host block, device block) pairs to copy in before the forward.
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # (device block, host block) pairs to copy out before the forward.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (src device block, dst device block) copy-on-write orders, executed before the forward.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Groups that can never run (e.g. prompt larger than the KV pool); the engine finishes them with an error.
    rejected: list[tuple[SequenceGroup, str]] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_draft_tokens: int = 0  # draft tokens of the decodes (speculative decoding), beside `num_decode_tokens`
    shape: StepShape = field(default_factory=StepShape)  # what the step cost model reads of it
    # Moves to and from the prefix cache's lower tiers (spills read first, restores before the forward);
    # None when the step has none (most steps, and all without a tier).
    tier_orders: TierOrders | None = None

    def sampling(self) -> list[ScheduledSeq]:
        """The items that sample, in schedule order: the prompt chunks that reach their sequence's end, and
        every decode (the last `num_decode_tokens` items), which needs no check."""
        num_prefills = len(self.scheduled) - self.num_decode_tokens
        return [item for item in self.scheduled[:num_prefills] if item.samples] + self.scheduled[num_prefills:]


@dataclass(slots=True)
class StepOutcome:
    """What a step's sampled tokens did (`Scheduler.update_from_output`): each request's news, the groups
    in which a sequence ended (to free), and how many tokens were kept."""

    updates: dict[str, RequestUpdate]
    ended: list[SequenceGroup]
    num_tokens: int = 0
