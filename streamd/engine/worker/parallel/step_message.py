"""One step's inputs for the worker ranks, as one flat int64 tensor sent with one broadcast.

Layout: an 8-word header (command, num_tokens, num_seqs, max_blocks, decode_only, number of cache-order
words, two command arguments), the cache orders (`kind, n, src_0, dst_0, ...` per order, in the order rank 0
executed them), then input_ids, positions, slot_mapping, seq_lens, query_start_loc and the padded block
tables. Built from the device tensors the model runner already made (a concatenation on the device), so
the inputs that rank 0 fills on the device from the previous step's sampled tokens (pipelined decoding)
travel without a trip through the host; `broadcast_object_list` of a dataclass would pickle host values,
forcing that trip, and is itself two broadcasts (sizes, then bytes).

`StepChannel` sends such messages in a buffer of a fixed capacity that both sides know, so a message is
exactly one collective; a message that does not fit is preceded by a GROW message and the capacity doubles
until it fits (rare: the capacity settles at the largest step seen).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from streamd.engine.worker.model_runner import ModelInput
from streamd.engine.worker.parallel.collectives import Collectives

if TYPE_CHECKING:
    from streamd.engine.worker.cache_engine import CacheEngine

HEADER_WORDS = 8
INITIAL_CAPACITY = 1 << 12


class Command(enum.IntEnum):
    STEP = 1  # cache orders, then (when num_tokens > 0) a forward
    ALLOCATE = 2  # build the KV pools: args = (num_blocks, num_swap_blocks)
    SHUTDOWN = 3
    GROW = 4  # the next message needs a buffer of args[0] words


class OrderKind(enum.IntEnum):
    SWAP_OUT = 0  # (device block, host block) pairs
    SWAP_IN = 1  # (host block, device block) pairs
    COPY = 2  # (src device block, dst device block) copy-on-write pairs


@dataclass(slots=True)
class CacheOrder:
    kind: OrderKind
    pairs: list[tuple[int, int]]


def apply_order(cache: CacheEngine, order: CacheOrder) -> None:
    """Carries out one cache order on this rank's pools (rank 0 as it is given, the others as received)."""
    if order.kind == OrderKind.SWAP_OUT:
        cache.swap_out(order.pairs)
    elif order.kind == OrderKind.SWAP_IN:
        cache.swap_in(order.pairs)
    else:
        cache.copy(order.pairs)


@dataclass(slots=True)
class StepMessage:
    command: Command
    orders: list[CacheOrder] = field(default_factory=list)
    batch: ModelInput | None = None
    args: tuple[int, int] = (0, 0)


def encode(message: StepMessage, device: torch.device) -> torch.Tensor:
    """The message as one int64 tensor on `device`."""
    words: list[int] = []
    for order in message.orders:
        words += [int(order.kind), len(order.pairs)]
        for src, dst in order.pairs:
            words += [src, dst]
    batch = message.batch
    if batch is None:
        header = [int(message.command), 0, 0, 0, 0, len(words), *message.args]
        return torch.tensor(header + words, dtype=torch.int64).to(device)
    num_seqs, max_blocks = batch.block_tables.shape
    header = [
        int(message.command),
        len(batch.input_ids),
        num_seqs,
        max_blocks,
        int(batch.decode_only),
        len(words),
        *message.args,
    ]
    head = torch.tensor(header + words, dtype=torch.int64).to(device, non_blocking=True)
    parts = (
        batch.input_ids,
        batch.positions,
        batch.slot_mapping,
        batch.seq_lens,
        batch.query_start_loc,
        batch.block_tables.reshape(-1),
    )
    return torch.cat([head, *(p.to(torch.int64) for p in parts)])


def decode(buffer: torch.Tensor) -> StepMessage:
    """Inverse of `encode`; the batch's tensors are views of (or made from) `buffer`: used before the next
    message overwrites it."""
    command, num_tokens, num_seqs, max_blocks, decode_only, num_words, *args = buffer[:HEADER_WORDS].tolist()
    at = HEADER_WORDS + num_words
    orders = _decode_orders(buffer[HEADER_WORDS:at].tolist())
    batch = None
    if num_tokens:
        sizes = (num_tokens, num_tokens, num_tokens, num_seqs, num_seqs + 1, num_seqs * max_blocks)
        ids, pos, slots, seq_lens, qsl, tables = buffer[at : at + sum(sizes)].split(sizes)
        batch = ModelInput(
            input_ids=ids,
            positions=pos,
            slot_mapping=slots,
            block_tables=tables.to(torch.int32).view(num_seqs, max_blocks),
            seq_lens=seq_lens.to(torch.int32),
            query_start_loc=qsl.to(torch.int32),
            sample_idx=ids[:0],
            decode_only=bool(decode_only),
        )
    return StepMessage(Command(command), orders, batch, (args[0], args[1]))


def _decode_orders(words: list[int]) -> list[CacheOrder]:
    orders = []
    i = 0
    while i < len(words):
        kind, n = words[i], words[i + 1]
        flat = words[i + 2 : i + 2 + 2 * n]
        orders.append(CacheOrder(OrderKind(kind), list(zip(flat[0::2], flat[1::2]))))
        i += 2 + 2 * n
    return orders


class StepChannel:
    """Rank 0 sends, every other rank receives; one broadcast per message on `group`."""

    def __init__(self, group: Collectives, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.capacity = INITIAL_CAPACITY

    def send(self, payload: torch.Tensor) -> None:
        if len(payload) > self.capacity:
            capacity = self.capacity
            while capacity < len(payload):
                capacity *= 2
            self._broadcast(encode(StepMessage(Command.GROW, args=(capacity, 0)), self.device))
            self.capacity = capacity
        self._broadcast(payload)

    def recv(self) -> StepMessage:
        while True:
            buffer = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
            self.group.broadcast(buffer, 0).wait()
            message = decode(buffer)
            if message.command != Command.GROW:
                return message
            self.capacity = message.args[0]

    def _broadcast(self, payload: torch.Tensor) -> None:
        buffer = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        buffer[: len(payload)] = payload
        self.group.broadcast(buffer, 0).wait()
