"""An engine group with data-parallel attention: every DP group schedules its own requests.

Under DP attention (``data`` > 1) the attention of each DP group runs on its own tokens, while
the MoE/MLP layers and the boundaries between blocks run collectives over the whole engine
group. So every forward is a *round* that all ranks enter together:

1. The first rank of each DP group (its *DP leader*, which runs an ``Engine`` with its own
   scheduler and requests) all-gathers the token count of its next forward over the DP leaders'
   CPU group: ``dp_num_tokens``, the same list on every rank.
2. A DP leader with nothing to run takes part with an *empty* forward (0 tokens) whenever any
   other DP group has tokens; when every count is 0 nobody runs a forward and the idle leaders
   back off a little before the next round.
3. Inside a DP group of ``attn_tp`` > 1 ranks the leader broadcasts each forward's batch
   description and ``dp_num_tokens`` on the attn_tp CPU group, as ``distributed_runner`` does
   for a plain tensor-parallel group; the followers rebuild the batch and run the same forward.

A DP leader's engine never sleeps on its own: ``DPEngine.has_unfinished`` is always true, so the
serving loop (``LocalEngineClient``) keeps calling ``step``, and each ``step`` takes part in
exactly one round or more (one per target forward), never zero.

Not here yet: EAGLE3 drafting under DP attention (``RuntimeConfig`` refuses it), and balancing
requests by load (the group controller routes round-robin over the DP leaders).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..models.parallel.groups import Group, ParallelGroups
from .engine import Engine, EngineConfig
from .model_runner import ModelRunner
from .request_output import RequestOutput
from .scheduler import ScheduledBatch

log = logging.getLogger(__name__)

IDLE_BACKOFF_S = (0.002, 0.005, 0.01, 0.02, 0.05)  # sleeps after consecutive all-idle rounds


@dataclass(frozen=True)
class DPStep:
    """What a DP leader tells its attn_tp followers: run a forward, copy K/V slots, or stop."""

    kind: str  # "forward" | "copy_kv" | "stop"
    batch: ScheduledBatch | None = None
    dp_num_tokens: tuple[int, ...] = ()
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()


def _broadcast(group: Group, message: DPStep | None) -> DPStep:
    box: list[Any] = [message]
    dist.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
    if not isinstance(box[0], DPStep):
        raise TypeError(f"DP follower got {type(box[0]).__name__} instead of a DP step")
    return box[0]


def _forward(runner: ModelRunner, batch: ScheduledBatch, dp_num_tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        fb = runner.prepare(batch)
        fb.dp_num_tokens = dp_num_tokens
        logits: torch.Tensor = runner.model(fb)
    return logits


class DPLeaderRunner(ModelRunner):
    """A DP leader's runner: each forward is a round (token counts agreed by all DP leaders)."""

    def __init__(self, runner: ModelRunner, groups: ParallelGroups) -> None:
        super().__init__(runner.model, runner.kv_cache, runner.device)
        self.state_cache = runner.state_cache
        self.leaders = groups.dp  # on a DP leader (attn_tp rank 0) this group holds every DP leader
        self.local = groups.attn_tp
        self.rounds = 0
        self.empty_forwards = 0

    def agree(self, num_tokens: int) -> list[int]:
        """Every DP group's token count for this round (all DP leaders call this together)."""
        self.rounds += 1
        if self.leaders.is_trivial:
            return [num_tokens]
        mine = torch.tensor([num_tokens], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.leaders.size)]
        dist.all_gather(out, mine, group=self.leaders.cpu_group)
        return [int(t.item()) for t in out]

    def forward(self, batch: ScheduledBatch, attn_masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        if attn_masks is not None:
            raise ValueError("a DP-attention engine takes its masks from the batch, not as tensors")
        counts = self.agree(batch.num_tokens)
        return self._run(batch, counts)

    def _run(self, batch: ScheduledBatch, counts: list[int]) -> torch.Tensor:
        if not self.local.is_trivial:
            _broadcast(self.local, DPStep("forward", batch, tuple(counts)))
        return _forward(self, batch, counts)

    def idle_round(self) -> bool:
        """Take part in one round with no tokens; returns whether any DP group ran a forward."""
        counts = self.agree(0)
        if not any(counts):
            return False
        self.empty_forwards += 1
        self._run(ScheduledBatch([]), counts)
        return True

    def copy_kv(self, src: list[int], dst: list[int]) -> None:
        if not self.local.is_trivial:
            _broadcast(self.local, DPStep("copy_kv", src=tuple(src), dst=tuple(dst)))
        super().copy_kv(src, dst)

    def stop_followers(self) -> None:
        if not self.local.is_trivial:
            _broadcast(self.local, DPStep("stop"))


class DPEngine(Engine):
    """An ``Engine`` on a DP leader: every ``step`` takes part in at least one round."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, runner: DPLeaderRunner) -> None:
        super().__init__(model_dir, config, runner=runner)
        self.dp_runner = runner
        self._idle = 0

    def has_unfinished(self) -> bool:
        return True  # the serving loop must keep stepping: other DP groups may need this one

    def generate(self, *args: object, **kwargs: object) -> list[Any]:
        raise NotImplementedError("a DP-attention engine serves through LocalEngineClient (it never idles)")

    def step(self) -> list[RequestOutput]:
        if super().has_unfinished():
            before = self.dp_runner.rounds
            outputs = super().step()
            if self.dp_runner.rounds == before:  # nothing scheduled this step: still take part
                self.dp_runner.idle_round()
            self._idle = 0
            return outputs
        if self.dp_runner.idle_round():
            self._idle = 0
        else:
            time.sleep(IDLE_BACKOFF_S[min(self._idle, len(IDLE_BACKOFF_S) - 1)])
            self._idle += 1
        return []


def dp_follow(runner: ModelRunner, group: Group) -> int:
    """An attn_tp follower's loop under DP attention; returns the forwards run."""
    forwards = 0
    while True:
        message = _broadcast(group, None)
        if message.kind == "stop":
            return forwards
        if message.kind == "forward" and message.batch is not None:
            _forward(runner, message.batch, list(message.dp_num_tokens))
            forwards += 1
        elif message.kind == "copy_kv":
            runner.copy_kv(list(message.src), list(message.dst))
        else:
            raise RuntimeError(f"DP follower got an unknown step {message.kind!r}")
