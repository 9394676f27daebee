"""Accounting of executed collectives: what ran, where, on which group and path, how many bytes.

The communicator's plan says what *should* run per forward; the ledger records what *did*.
Prometheus counters are fed from ``totals()``; ``verify`` and tests compare ``forward_records()``
with the plan.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from .collective_clock import BOUNDS

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "fused_ar_add_rmsnorm")
PATHS = ("nccl", "gloo", "flashinfer_fused", "reference_fused")


@dataclass(frozen=True)
class CollectiveRecord:
    site: str  # where in the model, e.g. "layers.3.post_attn"
    op: str
    group: str
    path: str
    nbytes: int

    @property
    def key(self) -> tuple[str, str, str]:
        """(site, op, group): what the plan predicts."""
        return (self.site, self.op, self.group)


@dataclass
class TimeHistogram:
    """Sampled collective times: ``counts[i]`` <= ``bounds[i]``; the last count is above every bound."""

    bounds: tuple[float, ...]
    counts: list[int]
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds


@dataclass
class CollectiveLedger:
    """Records every collective a rank runs. Not thread-safe: one per rank."""

    calls: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (op, group, path) -> calls
    bytes: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (op, group, path) -> bytes
    seconds: dict[tuple[str, str, str], TimeHistogram] = field(default_factory=dict)  # sampled times
    _forward: list[CollectiveRecord] = field(default_factory=list)
    forwards: int = 0

    def observe_time(self, key: tuple[str, str, str], seconds: float) -> None:
        h = self.seconds.get(key)
        if h is None:
            h = self.seconds[key] = TimeHistogram(BOUNDS, [0] * (len(BOUNDS) + 1))
        h.observe(seconds)

    def time_snapshot(self) -> dict[tuple[str, str, str], tuple[tuple[float, ...], tuple[int, ...], float]]:
        """(op, group, path) -> (bounds, counts, sum), a copy for exporters."""
        return {k: (h.bounds, tuple(h.counts), h.sum) for k, h in list(self.seconds.items())}

    def record(self, site: str, op: str, group: str, path: str, nbytes: int) -> None:
        key = (op, group, path)
        self.calls[key] += 1
        self.bytes[key] += nbytes
        self._forward.append(CollectiveRecord(site, op, group, path, nbytes))

    def begin_forward(self) -> None:
        self._forward = []
        self.forwards += 1

    def replay(self, records: Iterable[CollectiveRecord]) -> None:
        """Count one more forward whose collectives ran without Python: a CUDA-graph replay runs
        exactly the collectives recorded while that forward was captured."""
        self.begin_forward()
        for r in records:
            self.record(r.site, r.op, r.group, r.path, r.nbytes)

    def forward_records(self) -> list[CollectiveRecord]:
        """Collectives since the last ``begin_forward``, in execution order."""
        return list(self._forward)

    def totals(self) -> list[tuple[str, str, str, int, int]]:
        """(op, group, path, calls, bytes) rows for exporters."""
        return [(op, g, p, n, self.bytes[(op, g, p)]) for (op, g, p), n in sorted(self.calls.items())]
