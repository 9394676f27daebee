"""What the HTTP API needs from an engine, wherever the engine runs.

``LocalEngineClient`` (an in-process engine driven by a background thread) and the Ray group
controller's client (requests routed to a group leader actor) both implement this; the HTTP
server and the metrics exporter only see the protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..engine.outputs import RequestOutput
from ..engine.sequence import SamplingParams

if TYPE_CHECKING:
    from ..engine.tokenizer import Tokenizer

# The labels every exported series carries (values may be ""); nothing per request.
# "engine_group" is the engine group index; "group" is reserved for the parallel group of a
# collective (tp, attn_tp, dp, moe_ep, moe_tp), as the communication metrics name it.
SNAPSHOT_LABELS = ("deployment", "namespace", "engine_group", "rank", "tp_rank", "dp_rank", "ep_rank")


@dataclass(frozen=True)
class HistogramData:
    """A histogram kept by an engine: ``counts[i]`` observations <= ``bounds[i]`` (and above the
    previous bound); ``counts[-1]`` (one more than ``bounds``) those above every bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float


@dataclass(frozen=True)
class MetricsSnapshot:
    """Cumulative counters and current gauges of one rank (or one group), for exporters.

    labels: deployment, namespace, group, rank, tp_rank, dp_rank, ep_rank (strings).
    """

    labels: dict[str, str]
    # (op, group, path) -> calls / bytes, from the rank's CollectiveLedger
    collective_calls: dict[tuple[str, str, str], int] = field(default_factory=dict)
    collective_bytes: dict[tuple[str, str, str], int] = field(default_factory=dict)
    # (op, group) -> planned calls, summed forward by forward over each forward's own plan variant
    collective_planned: dict[tuple[str, str], int] = field(default_factory=dict)
    forwards: int = 0
    # (op, group, path) -> sampled durations of collectives, when the rank times them
    collective_seconds: dict[tuple[str, str, str], HistogramData] = field(default_factory=dict)
    # Empty without speculation. Keys: drafts, draft_tokens, accepted_tokens (ints), per_position
    # (list: accepted drafts at position i), accepted_per_step (HistogramData).
    spec: dict[str, Any] = field(default_factory=dict)
    # running, waiting (ints), kv_usage (0..1), preemptions, prompt_tokens, generation_tokens (ints),
    # prefix_caching (bool), prefix_cache_queries, prefix_cache_hits (tokens, ints),
    # finished (dict finish reason -> requests)
    serving: dict[str, Any] = field(default_factory=dict)


class EngineClient(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int | None:
        """The longest sequence (prompt + output) the engines accept; None while none is ready."""
        ...

    def load_tokenizer(self) -> Tokenizer | None:
        """A tokenizer of the served checkpoint for the HTTP layer's own threads (a fresh instance:
        the engine's is the engine thread's); None when the engine takes token ids only."""
        ...

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                 final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one has ``finished`` set. ``final_only`` (a response that
        is not streamed: vLLM's ``FINAL_ONLY``): one output when the request ends, every step's tokens,
        text and logprobs merged into it — nothing crosses a thread or process boundary per step. Raises
        ``InvalidRequest`` before the first output for a request the engine refuses,
        ``NoReadyEngine`` when nothing can take it now, and ``EngineDead`` when the engine (or a
        rank of its group) failed mid-request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def status(self) -> dict[str, Any]:
        """JSON-serialisable state; ``ready`` (bool) says whether requests can be served now."""
        ...

    async def metrics(self) -> list[MetricsSnapshot]: ...


class EngineDead(RuntimeError):
    """The engine serving a request is gone (a rank died); the request cannot finish. The message is
    for the log (it may hold Ray's reports, node ids): clients get a generic answer with an error id."""


class NoReadyEngine(EngineDead):
    """No engine can take a request now (``replicas: 0``, every group starting or failed): retry later."""
