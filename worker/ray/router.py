"""Which engine group leader serves the next request (pure: no Ray, no clock).

The least busy leader (fewest requests in flight through this controller), ties taken in turn, so
an idle group is never skipped for a busy one and equal groups share the load round-robin. Under
DP attention every DP group's leader is a candidate of its own.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

L = TypeVar("L", bound=Hashable)


class NoCandidate(LookupError):
    """No ready leader to route to."""


class Router:
    def __init__(self) -> None:
        self._turn = 0

    def pick(self, leaders: Sequence[L], in_flight: dict[L, int]) -> L:
        """One of ``leaders`` (in a stable order) with the fewest requests in flight."""
        if not leaders:
            raise NoCandidate("no ready engine group leader")
        least = min(in_flight.get(x, 0) for x in leaders)
        tied = [x for x in leaders if in_flight.get(x, 0) == least]
        self._turn += 1
        return tied[self._turn % len(tied)]
