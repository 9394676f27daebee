"""Reading an in-process ``Engine``'s counters in the shapes ``MetricsSnapshot`` carries.

Kept apart from the client so that what the engine exposes (scheduler stats, the rank's
collective ledger, speculative-decoding stats) is looked up in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...models.parallel.ledger import CollectiveLedger
from ..engine.engine import Engine
from .engine_client import HistogramData, MetricsSnapshot


def ledger_snapshot(ledger: CollectiveLedger, labels: Mapping[str, str]) -> MetricsSnapshot:
    """A rank's collectives over whole forwards (``CollectiveLedger.settled``: a forward still running is
    left out, so executed never runs ahead of planned mid-forward): executed calls and bytes, planned calls
    (each forward's own plan variant), forwards, and sampled times. Safe from any thread; raises
    RuntimeError if the ledger never held still."""
    counts = ledger.settled()
    return MetricsSnapshot(labels=dict(labels), collective_calls=counts.calls, collective_bytes=counts.bytes,
                           collective_planned=counts.planned, forwards=counts.forwards,
                           collective_seconds=collective_seconds(ledger))


def spec_snapshot(engine: Engine) -> dict[str, Any]:
    """Speculative-decoding counters (``MetricsSnapshot.spec``); empty without speculation.

    Read from ``engine.stats().spec`` (an object or a dict): drafts, draft_tokens,
    accepted_tokens, accepted_per_position (list) and accepted_per_step (counts per number of
    accepted tokens, as a list or a {k: count} map); vLLM's ``num_*`` names are accepted too.
    """
    spec = getattr(engine.stats(), "spec", None)
    if spec is None:
        return {}
    per_step = _counts(_field(spec, "accepted_per_step", "num_accepted_per_step", default=()))
    return {
        "drafts": int(_field(spec, "drafts", "num_drafts")),
        "draft_tokens": int(_field(spec, "draft_tokens", "num_draft_tokens")),
        "accepted_tokens": int(_field(spec, "accepted_tokens", "num_accepted_tokens")),
        "per_position": [int(n) for n in _field(spec, "accepted_per_position", "num_accepted_tokens_per_pos",
                                                "per_position", default=())],
        "accepted_per_step": HistogramData(
            bounds=tuple(float(k) for k in range(len(per_step))),
            counts=(*per_step, 0),
            sum=float(sum(k * n for k, n in enumerate(per_step))),
        ),
    }


_MISSING = object()


def _field(obj: Any, *names: str, default: Any = _MISSING) -> Any:
    for name in names:
        value = obj.get(name, _MISSING) if isinstance(obj, dict) else getattr(obj, name, _MISSING)
        if value is not _MISSING:
            return value
    if default is _MISSING:
        raise AttributeError(f"speculative stats have none of {names}")
    return default


def _counts(samples: Any) -> list[int]:
    """counts[k] = verify steps that accepted k tokens, from a {k: count} map or such a list."""
    if isinstance(samples, dict):
        size = max(samples, default=-1) + 1
        return [int(samples.get(k, 0)) for k in range(size)]
    return [int(n) for n in samples]


def collective_seconds(ledger: Any) -> dict[tuple[str, str, str], HistogramData]:
    """A rank's sampled collective times (``CollectiveLedger.time_snapshot``) as exporter histograms."""
    return {key: HistogramData(bounds, counts, total)
            for key, (bounds, counts, total) in ledger.time_snapshot().items()}
