"""Data-parallel attention as a policy over the step channel: every forward is a round.

Under DP attention (``data`` > 1) each DP group schedules its own requests, while the MoE/MLP
layers and the boundaries between blocks run collectives over the whole engine group. So every
forward is a *round* that all ranks enter together:

1. The first rank of each DP group (its *DP leader*, running an ``Engine`` over a
   ``LeaderExecutor`` with these rounds) all-gathers over the DP leaders' CPU group its next
   forward's token count, sequence count and CUDA-graph kind (``StepExecutor.graph_key``):
   ``dp_num_tokens`` is then the same tuple on every rank.
2. If every DP group that has sequences runs the same graphable kind, all of them (the idle ones
   too) replay the graph captured at the batch that holds the largest group
   (``Step.graph_shape``); otherwise each runs its own rows eagerly.
3. A DP leader with nothing to run takes part with an *empty* forward whenever any other DP group
   has tokens; when every count is 0 nobody runs a forward and the idle leaders back off a little
   before the next round.
4. Inside a DP group of attn_tp > 1 ranks the leader announces each forward (with the agreed
   counts and shape) to its followers on the step channel, as for any parallel group.

A DP leader's engine never sleeps on its own (``DPEngine.has_unfinished`` is always true), so the
serving loop keeps calling ``step``, and each ``step`` takes part in at least one round.

Not here yet: EAGLE3 drafting under DP attention (``RuntimeConfig`` refuses it), and balancing
requests by load (the router goes round-robin over the DP leaders).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...models.parallel.groups import Group
from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.outputs import RequestOutput
from ..executor.executor import StepExecutor
from ..executor.step import Step

if TYPE_CHECKING:
    from .step_channel import LeaderExecutor

log = logging.getLogger(__name__)

IDLE_BACKOFF_S = (0.002, 0.005, 0.01, 0.02, 0.05)  # sleeps after consecutive all-idle rounds
_NO_KEY = (-1, -1, -1, -1)


class DPRounds:
    """The DP leaders' agreement, one call per forward (all DP leaders call ``agree`` together)."""

    def __init__(self, leaders: Group) -> None:
        self.leaders = leaders  # on a DP leader (attn_tp rank 0), groups.dp holds every DP leader
        self.rounds = 0
        self.empty_forwards = 0
        self.graph_rounds = 0

    def agree(self, step: Step, executor: StepExecutor) -> Step:
        """This DP group's step with every group's token count and, if all agree, a graph shape."""
        self.rounds += 1
        key = executor.graph_key(step)
        mine = [step.num_tokens, len(step.seqs), *(_NO_KEY if key is None else (key[0], key[1], int(key[2]), key[3]))]
        rows = self._gather(mine)
        counts = tuple(r[0] for r in rows)
        shape = None
        busy = [r for r in rows if r[1] > 0]
        keys = {tuple(r[2:]) for r in busy}
        if executor.graphs is not None and busy and len(keys) == 1 and _NO_KEY not in keys:
            k = next(iter(keys))
            shape = executor.graphs.shape_for(max(r[1] for r in busy), (k[0], k[1], bool(k[2]), k[3], 0, False))
            self.graph_rounds += shape is not None
        return replace(step, dp_num_tokens=counts, graph_shape=shape)

    def _gather(self, mine: list[int]) -> list[list[int]]:
        if self.leaders.is_trivial:
            return [mine]
        t = torch.tensor(mine, dtype=torch.int64)
        out = [torch.zeros_like(t) for _ in range(self.leaders.size)]
        dist.all_gather(out, t, group=self.leaders.cpu_group)
        return [o.tolist() for o in out]


class DPEngine(Engine):
    """An ``Engine`` on a DP leader: every ``step`` takes part in at least one round."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, runner: LeaderExecutor) -> None:
        if runner.rounds is None:
            raise ValueError("a DP engine runs on a LeaderExecutor with DP rounds")
        super().__init__(model_dir, config, runner=runner)
        self.leader = runner
        self.dp_rounds = runner.rounds
        self._idle = 0

    def has_unfinished(self) -> bool:
        return True  # the serving loop must keep stepping: other DP groups may need this one

    def generate(self, *args: object, **kwargs: object) -> list[Any]:
        raise NotImplementedError("a DP-attention engine serves through LocalEngineClient (it never idles)")

    def step(self) -> list[RequestOutput]:
        if super().has_unfinished():
            before = self.dp_rounds.rounds
            outputs = super().step()
            if self.dp_rounds.rounds == before:  # nothing scheduled this step: still take part
                self.leader.idle_round()
            self._idle = 0
            return outputs
        if self.leader.idle_round():
            self._idle = 0
        else:
            time.sleep(IDLE_BACKOFF_S[min(self._idle, len(IDLE_BACKOFF_S) - 1)])
            self._idle += 1
        return []

