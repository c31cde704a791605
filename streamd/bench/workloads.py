"""Synthetic request-length workloads for the memory benchmark, after the paper's Fig. 11.

It owns the length distributions: right-skewed log-normals whose means, after clipping to the model's
context (prompts to 1024 tokens, prompt + output to 2048, as the paper's OPT setup), equal the
datasets' published means. Everything is seeded; request i is the same in every simulated system.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy itself is imported on first draw (passed around as `np`)
    import numpy
    from numpy.typing import NDArray

MAX_PROMPT_LEN = 1024
MAX_SEQ_LEN = 2048
_FIT_SAMPLES = 100_000
_CHUNK = 4096


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    input_mean: float
    output_mean: float
    input_sigma: float
    output_sigma: float


WORKLOADS: dict[str, Workload] = {
    # Fig. 11a: ShareGPT, input mean 161.31, output mean 337.99, long right tails.
    "sharegpt": Workload("sharegpt", 161.31, 337.99, 1.0, 1.0),
    # Fig. 11b: Alpaca, input mean 19.31, output mean 58.45, concentrated.
    "alpaca": Workload("alpaca", 19.31, 58.45, 0.6, 0.9),
    # Long prompts with a heavy tail (documents, chat histories): most requests short, a few near the cap.
    "longtail": Workload("longtail", 400.0, 200.0, 1.6, 1.6),
}


def _clipped_lognormal(
    np: ModuleType, z: NDArray[numpy.float64], mu: float, sigma: float, cap: int | NDArray[numpy.int64]
) -> NDArray[numpy.int64]:
    return np.clip(np.rint(np.exp(mu + sigma * z)), 1, cap).astype(np.int64)


def _fit_mu(
    np: ModuleType, z: NDArray[numpy.float64], sigma: float, target_mean: float, cap: int | NDArray[numpy.int64]
) -> float:
    """mu such that the clipped sample's mean is the target (bisection; the mean grows with mu)."""
    lo, hi = -5.0, 12.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _clipped_lognormal(np, z, mid, sigma, cap).mean() < target_mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(slots=True)
class RequestStream:
    """An endless, seeded sequence of (prompt_len, output_len) drawn in chunks on demand."""

    workload: Workload
    seed: int
    _prompts: list[int] = field(default_factory=list)
    _outputs: list[int] = field(default_factory=list)
    _mu: tuple[float, float] | None = None

    def __getitem__(self, index: int) -> tuple[int, int]:
        while index >= len(self._prompts):
            self._draw_chunk(len(self._prompts) // _CHUNK)
        return self._prompts[index], self._outputs[index]

    def _fit(self, np: ModuleType) -> tuple[float, float]:
        if self._mu is None:
            rng = np.random.default_rng([self.seed, 0])
            zi, zo = rng.standard_normal(_FIT_SAMPLES), rng.standard_normal(_FIT_SAMPLES)
            w = self.workload
            mu_in = _fit_mu(np, zi, w.input_sigma, w.input_mean, MAX_PROMPT_LEN)
            prompts = _clipped_lognormal(np, zi, mu_in, w.input_sigma, MAX_PROMPT_LEN)
            mu_out = _fit_mu(np, zo, w.output_sigma, w.output_mean, MAX_SEQ_LEN - prompts)
            self._mu = (mu_in, mu_out)
        return self._mu

    def _draw_chunk(self, chunk: int) -> None:
        import numpy as np

        mu_in, mu_out = self._fit(np)
        rng = np.random.default_rng([self.seed, 1 + chunk])
        w = self.workload
        prompts = _clipped_lognormal(np, rng.standard_normal(_CHUNK), mu_in, w.input_sigma, MAX_PROMPT_LEN)
        outputs = _clipped_lognormal(np, rng.standard_normal(_CHUNK), mu_out, w.output_sigma, MAX_SEQ_LEN - prompts)
        self._prompts.extend(prompts.tolist())
        self._outputs.extend(outputs.tolist())


@dataclass(slots=True)
class TokenWorkload:
    """Token-id prompts and the output length of each (the throughput benchmarks' request lists)."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)
