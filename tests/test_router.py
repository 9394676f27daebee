"""The router: the least busy ready leader, ties in turn (pure)."""

from __future__ import annotations

import pytest

from fusedserve.worker.ray.router import NoCandidate, Router


def test_least_busy_leader_first_and_ties_in_turn() -> None:
    r = Router()
    assert r.pick(["a", "b", "c"], {"a": 2, "b": 0, "c": 1}) == "b"
    picks = [r.pick(["a", "b"], {}) for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"] and picks[0] != picks[1]
    with pytest.raises(NoCandidate):
        r.pick([], {})
