"""Accounting of collectives: what each forward planned, what ran, where, on which path, how many bytes.

The communicator's plan says what *should* run; at the start of every forward the communicator
hands the ledger that forward's own plan variant (``begin_forward``), so ``planned`` counts what
was planned forward by forward, and ``calls`` what was executed. Prometheus counters are fed from
both (``fusedserve_collective_planned_calls_total`` and ``fusedserve_collective_calls_total``);
``verify`` and tests compare ``forward_records()`` with ``forward_plan()``.

A CUDA graph executes without Python: while a forward is captured (``capture()``) nothing is
counted; each replay adds the captured forward's plan and records again (``replay``).

Exporters read a ledger from another thread than the rank's (a follower's actor thread while the rank
steps): ``settled()`` copies it consistently and leaves out a forward still running, so what is
exported is always whole forwards and executed never runs ahead of planned by a partly counted one.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from .collective_clock import BOUNDS

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "fused_ar_add_rmsnorm")
PATHS = ("nccl", "gloo", "shm", "flashinfer_fused", "reference_fused")


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


PlannedRow = tuple[str, str, str]  # (site, op, group), as ``ForwardPlan.expected()`` lists them
SETTLE_ATTEMPTS = 1000


@dataclass(frozen=True)
class SettledCounts:
    """A ledger's counters over whole forwards only (``CollectiveLedger.settled``)."""

    calls: dict[tuple[str, str, str], int]
    bytes: dict[tuple[str, str, str], int]
    planned: dict[tuple[str, str], int]
    forwards: int


@dataclass
class CapturedForward:
    """One forward as a CUDA graph captured it: its plan and the collectives it recorded."""

    planned: list[PlannedRow] = field(default_factory=list)
    records: list[CollectiveRecord] = field(default_factory=list)


@dataclass
class CollectiveLedger:
    """Records every collective a rank plans and runs. Written by one thread (the rank's)."""

    calls: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (op, group, path) -> calls
    bytes: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (op, group, path) -> bytes
    planned: Counter[tuple[str, str]] = field(default_factory=Counter)  # (op, group) -> planned calls
    seconds: dict[tuple[str, str, str], TimeHistogram] = field(default_factory=dict)  # sampled times
    _forward: list[CollectiveRecord] = field(default_factory=list)
    _forward_plan: list[PlannedRow] = field(default_factory=list)
    _capturing: CapturedForward | None = None
    forwards: int = 0
    # Odd while the rank's thread is updating the counters (a sequence lock for readers on other threads).
    _writes: int = 0

    def observe_time(self, key: tuple[str, str, str], seconds: float) -> None:
        h = self.seconds.get(key)
        if h is None:
            h = self.seconds[key] = TimeHistogram(BOUNDS, [0] * (len(BOUNDS) + 1))
        h.observe(seconds)

    def time_snapshot(self) -> dict[tuple[str, str, str], tuple[tuple[float, ...], tuple[int, ...], float]]:
        """(op, group, path) -> (bounds, counts, sum), a copy for exporters."""
        return {k: (h.bounds, tuple(h.counts), h.sum) for k, h in list(self.seconds.items())}

    def record(self, site: str, op: str, group: str, path: str, nbytes: int) -> None:
        rec = CollectiveRecord(site, op, group, path, nbytes)
        if self._capturing is not None:
            self._capturing.records.append(rec)
            return
        key = (op, group, path)
        self._writes += 1
        self.calls[key] += 1
        self.bytes[key] += nbytes
        self._forward.append(rec)
        self._writes += 1

    def begin_forward(self, planned: Iterable[PlannedRow] = ()) -> None:
        """A forward starts; ``planned``: its plan variant's collectives (``ForwardPlan.expected()``)."""
        rows = list(planned)
        if self._capturing is not None:
            self._capturing.planned, self._capturing.records = rows, []
            return
        self._writes += 1
        self._forward = []
        self._forward_plan = rows
        self.planned.update((op, group) for _site, op, group in rows)
        self.forwards += 1
        self._writes += 1

    @contextmanager
    def capture(self) -> Iterator[CapturedForward]:
        """Count nothing while a forward is being captured; the yielded value holds what it planned
        and recorded (for ``replay``)."""
        if self._capturing is not None:
            raise RuntimeError("a capture is already in progress on this ledger")
        captured = CapturedForward()
        self._capturing = captured
        try:
            yield captured
        finally:
            self._capturing = None

    def replay(self, captured: CapturedForward) -> None:
        """Count one more forward whose collectives ran without Python: a CUDA-graph replay runs
        exactly what that forward planned and recorded while it was captured."""
        self.begin_forward(captured.planned)
        for r in captured.records:
            self.record(r.site, r.op, r.group, r.path, r.nbytes)

    def forward_records(self) -> list[CollectiveRecord]:
        """Collectives since the last ``begin_forward``, in execution order."""
        return list(self._forward)

    def forward_plan(self) -> list[PlannedRow]:
        """What the last forward planned, in order (compare with ``forward_records()``'s keys)."""
        return list(self._forward_plan)

    def settled(self) -> SettledCounts:
        """Calls, bytes, planned calls and forwards up to the last whole forward, safe to call from any thread.

        The counters are copied between two updates of the rank's thread (retried while one is under way). A
        forward that has run fewer collectives than its plan so far is still running: it is left out whole
        (its plan, the collectives it ran, its count), so executed and planned compare forward by forward. One
        that has run all its plan, or more, counts at once (an extra collective shows); one that ended short of
        its plan shows from the next forward on. Raises RuntimeError if no quiet moment came.
        """
        for _ in range(SETTLE_ATTEMPTS):
            start = self._writes
            if start % 2 == 0:
                try:
                    calls, nbytes, planned = Counter(self.calls), Counter(self.bytes), Counter(self.planned)
                    forwards, current, plan = self.forwards, list(self._forward), list(self._forward_plan)
                except RuntimeError:  # a dict grew during the copy
                    continue
                if self._writes == start:
                    break
            time.sleep(0)  # let the writer finish its update
        else:
            raise RuntimeError(f"the ledger never held still over {SETTLE_ATTEMPTS} attempts")
        if len(current) < len(plan):
            for r in current:
                calls[(r.op, r.group, r.path)] -= 1
                nbytes[(r.op, r.group, r.path)] -= r.nbytes
            planned.subtract((op, group) for _site, op, group in plan)
            forwards -= 1
        calls, planned = +calls, +planned  # without the series of a first forward left out
        return SettledCounts(dict(calls), {k: nbytes[k] for k in calls}, dict(planned), forwards)

    def totals(self) -> list[tuple[str, str, str, int, int]]:
        """(op, group, path, calls, bytes) rows for exporters."""
        return [(op, g, p, n, self.bytes[(op, g, p)]) for (op, g, p), n in sorted(self.calls.items())]
