"""What an engine reports about itself: scheduler load, prefix-cache counters and the speculative-decoding counters."""

from __future__ import annotations

from dataclasses import dataclass

from ..spec_decode.stats import SpecDecodeStats
from .scheduler import SchedulerStats


@dataclass(frozen=True)
class EngineStats(SchedulerStats):
    spec: SpecDecodeStats | None = None  # speculative-decoding counters; None without speculation
