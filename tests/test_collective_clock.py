"""Collective times: the host clock times every gloo call into the ledger's histogram."""

from __future__ import annotations

import pytest

from fusedserve.models.parallel.collective_clock import BOUNDS, HostClock, clock_for
from fusedserve.models.parallel.ledger import CollectiveLedger
from fusedserve.worker.serving.engine_stats import collective_seconds


def test_host_clock_observes_into_buckets() -> None:
    ledger = CollectiveLedger()
    clock = HostClock()
    key = ("all_reduce", "tp", "gloo")
    for _ in range(3):
        clock.stop(key, clock.start(key), ledger.observe_time)
    ledger.observe_time(key, 2e-5)  # between the first and second bound
    ledger.observe_time(key, 5.0)  # above every bound
    [(k, h)] = collective_seconds(ledger).items()
    assert k == key and h.bounds == BOUNDS and sum(h.counts) == 5
    assert h.counts[1] >= 1 and h.counts[-1] == 1 and h.sum >= 5.0


@pytest.mark.parametrize(("path", "kind"), [("gloo", "HostClock"), ("nccl", "CudaEventClock")])
def test_clock_is_chosen_by_device_path(path: str, kind: str) -> None:
    if path == "nccl":
        pytest.importorskip("torch")
    assert type(clock_for(path)).__name__ == kind
