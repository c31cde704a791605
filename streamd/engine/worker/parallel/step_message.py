"""One step's inputs for the worker ranks: a small control message on the host, then the batch on the device.

The control message is one flat int64 host tensor broadcast over a gloo group: a 9-word header (command,
num_tokens, num_seqs, max_blocks, decode_only, number of cache-order words, the decode graph's size or 0 for
an eager forward, two command arguments), then the cache orders (`kind, n, src_0, dst_0, ...` per order, in
the order rank 0 executed them). A worker reads it without touching its device, so no step waits on a host
sync: the worker's CPU runs ahead of its GPU exactly as rank 0's does.

The batch (input_ids, positions, slot_mapping, seq_lens, query_start_loc and the padded block tables) is a
concatenation of the device tensors the model runner already made, broadcast on the layers' group (NCCL on
CUDA, gloo on CPU) into a buffer whose size the header gives. So the inputs that rank 0 fills on the device
from the previous step's sampled tokens (pipelined decoding) travel without a trip through the host;
`broadcast_object_list` of a dataclass would pickle host values, forcing that trip.

On the CPU the batch rides in the control message itself (after the orders): both are host memory there,
and each gloo broadcast costs a round trip between the processes (measured on the 2-core box, 64-sequence
decode: two broadcasts per step took about 3x one).

`StepChannel` sends control messages in a buffer of a fixed capacity that both sides know, so a control
message is exactly one collective; one that does not fit is preceded by a GROW message and the capacity
doubles until it fits (rare: the capacity settles at the largest step seen).
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

HEADER_WORDS = 9
INITIAL_CAPACITY = 1 << 10


class Command(enum.IntEnum):
    STEP = 1  # cache orders, then (when num_tokens > 0) a forward
    ALLOCATE = 2  # build the KV pools: args = (num_blocks, num_swap_blocks)
    SHUTDOWN = 3
    GROW = 4  # the next control message needs a buffer of args[0] words
    CAPTURE = 5  # capture the decode graphs of the layers: args = (max_batch, max_blocks)


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
    graph_size: int = 0  # the captured decode graph that runs this batch (0: an eager forward)


@dataclass(slots=True, frozen=True)
class Header:
    command: Command
    num_tokens: int
    num_seqs: int
    max_blocks: int
    decode_only: bool
    num_order_words: int
    graph_size: int
    args: tuple[int, int]

    @property
    def payload_words(self) -> int:
        """The batch's length on the device (0: no forward)."""
        if not self.num_tokens:
            return 0
        return 3 * self.num_tokens + 2 * self.num_seqs + 1 + self.num_seqs * self.max_blocks


def encode(message: StepMessage, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The message as its host control tensor and (with a batch) its int64 batch tensor on `device`."""
    words = _order_words(message.orders)
    batch = message.batch
    num_tokens, num_seqs, max_blocks, decode_only = 0, 0, 0, 0
    if batch is not None:
        num_tokens, (num_seqs, max_blocks) = len(batch.input_ids), batch.block_tables.shape
        decode_only = int(batch.decode_only)
    header = [int(message.command), num_tokens, num_seqs, max_blocks, decode_only, len(words), message.graph_size]
    control = torch.tensor(header + list(message.args) + words, dtype=torch.int64)
    return control, None if batch is None else _payload(batch).to(device)


def _order_words(orders: list[CacheOrder]) -> list[int]:
    words: list[int] = []
    for order in orders:
        words += [int(order.kind), len(order.pairs)]
        for src, dst in order.pairs:
            words += [src, dst]
    return words


def _payload(batch: ModelInput) -> torch.Tensor:
    parts = (
        batch.input_ids,
        batch.positions,
        batch.slot_mapping,
        batch.seq_lens,
        batch.query_start_loc,
        batch.block_tables.reshape(-1),
    )
    return torch.cat([p.to(torch.int64) for p in parts])


def decode_header(control: torch.Tensor) -> Header:
    command, num_tokens, num_seqs, max_blocks, decode_only, num_words, graph_size, arg0, arg1 = control[
        :HEADER_WORDS
    ].tolist()
    return Header(
        Command(command), num_tokens, num_seqs, max_blocks, bool(decode_only), num_words, graph_size, (arg0, arg1)
    )


def decode(control: torch.Tensor, payload: torch.Tensor | None, header: Header | None = None) -> StepMessage:
    """Inverse of `encode` (`header`: `control`'s, when already decoded); the batch's tensors are views of
    (or made from) `payload`."""
    if header is None:
        header = decode_header(control)
    words = header.num_order_words  # (most steps: none)
    orders = _decode_orders(control[HEADER_WORDS : HEADER_WORDS + words].tolist()) if words else []
    batch = None if payload is None or not header.num_tokens else _batch(header, payload)
    return StepMessage(header.command, orders, batch, header.args, header.graph_size)


def _batch(header: Header, payload: torch.Tensor) -> ModelInput:
    n, s = header.num_tokens, header.num_seqs
    ids, pos, slots, seq_lens, qsl, tables = payload.split((n, n, n, s, s + 1, s * header.max_blocks))
    return ModelInput(
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        block_tables=tables.to(torch.int32).view(s, header.max_blocks),
        seq_lens=seq_lens.to(torch.int32),
        query_start_loc=qsl.to(torch.int32),
        sample_idx=ids[:0],
        decode_only=header.decode_only,
    )


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
    """Rank 0 sends, every other rank receives: the control message on `control` (gloo, host memory), then
    the batch, if any, on `data` (the layers' group, the device's memory; on the CPU inside the control
    message). A received batch is a view of the channel's buffer: used before the next `recv`."""

    def __init__(self, control: Collectives, data: Collectives, device: torch.device) -> None:
        self.control = control
        self.data = data
        self.device = device
        self.capacity = INITIAL_CAPACITY
        self._buffer = torch.zeros(self.capacity, dtype=torch.int64)

    def send(self, message: StepMessage) -> None:
        control, payload = encode(message, self.device)
        if payload is not None and self._inline:
            control, payload = torch.cat([control, payload]), None
        if len(control) > self.capacity:
            capacity = self.capacity
            while capacity < len(control):
                capacity *= 2
            self._broadcast_control(encode(StepMessage(Command.GROW, args=(capacity, 0)), self.device)[0])
            self._resize(capacity)
        self._broadcast_control(control)
        if payload is not None:
            self.data.broadcast(payload, 0).wait()

    def recv(self) -> StepMessage:
        while True:
            self.control.broadcast(self._buffer, 0).wait()
            header = decode_header(self._buffer)
            if header.command != Command.GROW:
                return decode(self._buffer, self._recv_payload(header), header)
            self._resize(header.args[0])

    @property
    def _inline(self) -> bool:
        """Whether the batch travels inside the control message (on the CPU)."""
        return self.device.type == "cpu"

    def _recv_payload(self, header: Header) -> torch.Tensor | None:
        if not header.payload_words:
            return None
        if self._inline:
            start = HEADER_WORDS + header.num_order_words
            return self._buffer[start : start + header.payload_words]
        payload = torch.empty(header.payload_words, dtype=torch.int64, device=self.device)
        self.data.broadcast(payload, 0).wait()
        return payload

    def _broadcast_control(self, control: torch.Tensor) -> None:
        self._buffer[: len(control)] = control
        self.control.broadcast(self._buffer, 0).wait()

    def _resize(self, capacity: int) -> None:
        self.capacity = capacity
        self._buffer = torch.zeros(capacity, dtype=torch.int64)
