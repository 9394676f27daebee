"""A ledger read from another thread while its rank runs forwards (what a follower's metrics do).

The rank's thread counts each forward's plan as it starts and each collective as it runs; an exporter on
another thread must never see a forward half counted (executed behind or ahead of planned), nor a copy torn
between two updates. ``CollectiveLedger.settled()`` gives whole forwards only.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from fusedserve.models.parallel.ledger import CollectiveLedger

PLAN = [("layers.0.attn.in", "all_gather", "tp"), *[(f"layers.{i}.mlp.out", "fused_ar_add_rmsnorm", "tp")
                                                     for i in range(6)], ("lm_head", "all_reduce", "tp")]


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Thread switches every microsecond, so reads land inside the writer's updates."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _forward(ledger: CollectiveLedger, extra: bool = False) -> None:
    ledger.begin_forward(PLAN)
    for site, op, group in PLAN:
        ledger.record(site, op, group, "gloo", 1024)
        if extra and op == "all_reduce":
            ledger.record(site, op, group, "gloo", 1024)


def _per_op(calls: dict[tuple[str, str, str], int]) -> Counter[tuple[str, str]]:
    out: Counter[tuple[str, str]] = Counter()
    for (op, group, _path), n in calls.items():
        out[(op, group)] += n
    return out


def test_settled_counts_are_whole_forwards_while_the_rank_runs(fast_switching: None) -> None:
    ledger = CollectiveLedger()
    stop = threading.Event()

    def rank() -> None:
        while not stop.is_set():
            _forward(ledger)

    writer = threading.Thread(target=rank)
    writer.start()
    seen, torn, last = 0, 0, 0
    try:
        while seen < 2000:
            raw_calls, raw_planned = dict(ledger.calls), dict(ledger.planned)
            torn += _per_op(raw_calls) != Counter(raw_planned)  # what a plain copy sees
            counts = ledger.settled()
            assert _per_op(counts.calls) == Counter(counts.planned)
            assert counts.planned.get(("fused_ar_add_rmsnorm", "tp"), 0) == 6 * counts.forwards
            assert all(counts.bytes[k] == 1024 * n for k, n in counts.calls.items())
            assert counts.forwards >= last  # monotonic: a counter, never a reset
            last = counts.forwards
            seen += 1
    finally:
        stop.set()
        writer.join()
    assert last > 0
    assert torn > 0  # the plain copies were caught mid-forward: the test exercised the race


def test_an_extra_collective_counts_as_soon_as_the_forward_ran_its_plan() -> None:
    ledger = CollectiveLedger()
    _forward(ledger)
    _forward(ledger, extra=True)
    counts = ledger.settled()
    assert counts.forwards == 2
    assert _per_op(counts.calls)[("all_reduce", "tp")] == 3 and counts.planned[("all_reduce", "tp")] == 2


def test_a_forward_still_running_is_left_out_whole() -> None:
    ledger = CollectiveLedger()
    _forward(ledger)
    ledger.begin_forward(PLAN)
    ledger.record(*PLAN[0], "gloo", 1024)
    counts = ledger.settled()
    assert counts.forwards == 1 and counts.planned[("all_gather", "tp")] == 1
    assert counts.calls[("all_gather", "tp", "gloo")] == 1 and counts.bytes[("all_gather", "tp", "gloo")] == 1024
    first = CollectiveLedger()
    first.begin_forward(PLAN)
    assert first.settled().calls == {} and first.settled().planned == {} and first.settled().forwards == 0
