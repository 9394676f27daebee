"""Accounting of executed collectives: what ran, where, on which group and path, how many bytes.

The communicator's plan says what *should* run per forward; the ledger records what *did*.
Prometheus counters are fed from ``totals()``; ``verify`` and tests compare ``forward_records()``
with the plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

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
class CollectiveLedger:
    """Records every collective a rank runs. Not thread-safe: one per rank."""

    calls: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (op, group, path) -> calls
    bytes: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (op, group, path) -> bytes
    _forward: list[CollectiveRecord] = field(default_factory=list)
    forwards: int = 0

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
