"""What a step costs: its seconds predicted from its shape, fitted to the steps the engine measured.

Why: a long prompt prefilled in one step stalls every other stream for that whole step (issue 35: one
8,191-token prompt, a 42.9 s gap on a CPU). `max_num_batched_tokens` bounds a step's tokens, not its
time, and a chunk's time grows with the context before it (each new token attends to every earlier one),
so no fixed token count suits every context and device. The scheduler asks `StepCost.max_chunk` for the
largest chunk that keeps the predicted step under `scheduler.max_step_ms`.

The model: seconds = base + per_token * tokens + per_pair * pairs, where `tokens` counts every token the
step runs and `pairs` the attention (query, key) pairs of its prompt chunks (n tokens after c computed
ones: n * (c + (n + 1) / 2)). The coefficients are refitted (least squares, none negative, a light pull
toward the prior) after every measured step, over the last `WINDOW` steps that ran a prompt chunk and the
last `WINDOW` that did not, so a long run of decodes does not wash out what prompts cost. The prior per
token is the prefill rate measured at start-up when there is one. Plain Python: the core imports no torch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

WINDOW = 32  # measured steps kept of each kind (with prompt chunks, without)
TOKEN_UNIT = 1e3  # features scaled to about 1 so the normal equations stay well conditioned
PAIR_UNIT = 1e6
PRIOR_WEIGHT = 1e-6  # the pull toward the prior: decides only what the measurements leave open
REFIT_EVERY = 8  # decode-only steps measured between refits (a fit costs tens of microseconds, a step can be ~1 ms)


@dataclass(slots=True)
class StepShape:
    """What the cost model reads of a planned step."""

    tokens: int = 0  # every token the step runs: prompt chunks and decodes
    pairs: float = 0.0  # attention pairs of its prompt chunks (0: no chunk)

    def add_chunk(self, num_tokens: int, context: int) -> None:
        self.tokens += num_tokens
        self.pairs += chunk_pairs(num_tokens, context)

    def features(self) -> tuple[float, float, float]:
        return 1.0, self.tokens / TOKEN_UNIT, self.pairs / PAIR_UNIT


def chunk_pairs(num_tokens: int, context: int) -> float:
    """Attention pairs of `num_tokens` new tokens after `context` computed ones (causal)."""
    return num_tokens * (context + (num_tokens + 1) / 2)


Sample = tuple[tuple[float, float, float], float]  # (features, seconds)


class _Window:
    """The last WINDOW samples of one kind and their normal-equation sums, kept as samples come and go."""

    def __init__(self) -> None:
        self.samples: deque[Sample] = deque()
        self.gram = [[0.0] * 3 for _ in range(3)]  # sum of x x'
        self.moment = [0.0] * 3  # sum of x y

    def add(self, sample: Sample) -> None:
        self._count(sample, 1.0)
        self.samples.append(sample)
        if len(self.samples) > WINDOW:
            self._count(self.samples.popleft(), -1.0)

    def _count(self, sample: Sample, sign: float) -> None:
        x, y = sample
        for r in range(3):
            self.moment[r] += sign * x[r] * y
            for c in range(3):
                self.gram[r][c] += sign * x[r] * x[c]


class StepCost:
    """Seconds per step as base + per_token * tokens + per_pair * pairs, refitted as steps are measured."""

    def __init__(self, seconds_per_token: float) -> None:
        self.prior = (0.0, seconds_per_token * TOKEN_UNIT, 0.0)
        self._windows = (_Window(), _Window())  # steps with a prompt chunk, steps without
        self._fitted: tuple[float, float, float] | None = self.prior
        self._unfitted = 0  # decode-only steps observed since the last fit

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(base seconds, seconds per TOKEN_UNIT tokens, seconds per PAIR_UNIT pairs), fitted on demand."""
        if self._fitted is None:
            self._fitted = _fit(self._windows, self.prior)
        return self._fitted

    def predict(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients, shape.features(), strict=True))

    def row_cost(self, tokens: int) -> float | None:
        """What one more token adds to a step of `tokens` tokens and no prompt chunk, as a share of that step's
        predicted time (speculation's price of a draft row); None until such a step was measured."""
        if not self._windows[1].samples:
            return None
        base, per_token, _ = self.coefficients
        per = per_token / TOKEN_UNIT
        step = base + per * tokens
        return per / step if step > 0 else None

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A measured step: refitted at the next prediction after a step with a prompt chunk (whose cost the
        scheduler's chunk sizes follow at once), after each of the first `REFIT_EVERY` decode-only steps (a fit
        from one or two of them is a poor price for a draft row) and then after every `REFIT_EVERY`."""
        self._windows[0 if shape.pairs else 1].add((shape.features(), seconds))
        self._unfitted += 1
        if shape.pairs or self._unfitted >= REFIT_EVERY or len(self._windows[1].samples) <= REFIT_EVERY:
            self._fitted, self._unfitted = None, 0

    def max_chunk(self, shape: StepShape, context: int, budget_s: float) -> int:
        """The most tokens a chunk after `context` computed ones may have so that `shape` with it stays
        predicted within `budget_s` (0 when none fits)."""
        _, per_token, per_pair = self.coefficients
        spare = budget_s - self.predict(shape)
        if spare <= 0:
            return 0
        # per_token * n + per_pair * n * (context + (n + 1) / 2) <= spare, in the features' units
        linear = per_token / TOKEN_UNIT + per_pair * (context + 0.5) / PAIR_UNIT
        quadratic = per_pair / (2 * PAIR_UNIT)
        if quadratic <= 0:
            return int(spare / linear) if linear > 0 else 1 << 30
        return int((math.sqrt(linear * linear + 4 * quadratic * spare) - linear) / (2 * quadratic))


def _fit(windows: tuple[_Window, _Window], prior: tuple[float, float, float]) -> tuple[float, float, float]:
    """Least squares over both windows with a light pull toward `prior`; a coefficient that comes out
    negative is held at 0 and the others refitted (a step never costs less for being larger)."""
    gram = [[sum(w.gram[r][c] for w in windows) + PRIOR_WEIGHT * (r == c) for c in range(3)] for r in range(3)]
    moment = [sum(w.moment[r] for w in windows) + PRIOR_WEIGHT * prior[r] for r in range(3)]
    free = [0, 1, 2]
    while True:
        values = _solve([[gram[r][c] for c in free] + [moment[r]] for r in free])
        solution = [0.0, 0.0, 0.0]
        for i, value in zip(free, values, strict=True):
            solution[i] = value
        negative = [i for i in free if solution[i] < 0]
        if not negative:
            return solution[0], solution[1], solution[2]
        free.remove(negative[0])


def _solve(augmented: list[list[float]]) -> list[float]:
    """Gaussian elimination with partial pivoting of a small augmented system (positive definite here)."""
    size = len(augmented)
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(augmented[r][col]))
        augmented[col], augmented[pivot] = augmented[pivot], augmented[col]
        for r in range(col + 1, size):
            factor = augmented[r][col] / augmented[col][col]
            for c in range(col, size + 1):
                augmented[r][c] -= factor * augmented[col][c]
    values = [0.0] * size
    for r in range(size - 1, -1, -1):
        known = sum(augmented[r][c] * values[c] for c in range(r + 1, size))
        values[r] = (augmented[r][size] - known) / augmented[r][r]
    return values


PERIOD_WEIGHT = 0.2  # the newest period's weight in the running means
# The most `serial_overhead` says: one serial period that caught a stall (a GC pause, a swap-in) would otherwise price
# every draft out until probes (priced without it: `Speculator._draft_length`) measure serial steps again.
MAX_SERIAL_OVERHEAD = 0.75


class StepPeriods:
    """What a step that drafts costs beyond its draft rows: the overlap it gives up.

    With the overlap on (a GPU), the host prepares step n + 1 while the device runs step n; a step that drafts
    must first read back the tokens its drafts continue, so its host work adds to its device time. This keeps
    running means of the wall seconds between one decode step's start and the next's, for steps that overlapped
    and for steps that did not (with their draft rows' share of a step, `StepCost.row_cost` x rows), and gives the
    difference as a share of an overlapped step (`serial_overhead`): 0 until both kinds were seen, and where steps
    never overlap (the CPU). Speculation prices it into every step that drafts (`best_draft_length`)."""

    def __init__(self) -> None:
        self.overlapped: float | None = None  # seconds
        self.serial: float | None = None  # seconds
        self.serial_rows: float = 0.0  # the serial steps' draft rows, as a share of a step

    def observe(self, seconds: float, overlapped: bool, rows_share: float) -> None:
        if overlapped:
            self.overlapped = _mean(self.overlapped, seconds)
            return
        self.serial = _mean(self.serial, seconds)
        self.serial_rows = _mean(self.serial_rows, rows_share)

    def serial_overhead(self) -> float:
        """How much longer than an overlapped decode step a step that drafts takes, its draft rows aside, as a
        share of the overlapped step (at most `MAX_SERIAL_OVERHEAD`)."""
        if not self.overlapped or self.serial is None:
            return 0.0
        return min(MAX_SERIAL_OVERHEAD, max(0.0, self.serial / self.overlapped - 1.0 - self.serial_rows))


def _mean(mean: float | None, sample: float) -> float:
    return sample if mean is None else mean + PERIOD_WEIGHT * (sample - mean)
