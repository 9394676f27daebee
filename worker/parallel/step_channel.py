"""One leader/follower protocol for every parallel engine: the leader announces, the followers follow.

The leader of a group of ranks (rank 0 of the engine group; under DP attention the first rank of
each DP group, whose followers are its attn_tp group) runs the ``Engine``. Before each forward,
K/V copy or graph capture it broadcasts a ``StepMessage`` — a plain value: the forward's
``Step`` (its sequences as lists, a verify's tree as a mask, the DP token counts), the slots to
copy, or the shapes to capture — on the group's CPU (gloo) group; every follower runs the same
thing on its own shard of the weights and of the KV cache, taking part in its collectives. Aux
states and logits are complete on every rank, so drafting and sampling need only the leader. A
STOP message ends the followers' loop. This is the seam the Ray rank actors use: these messages
cross it, never per-step tensors.

A follower that raises exits its loop; the leader's collectives then fail (gloo: the peer closed
the connection) or time out (the process group's timeout), so the leader never waits forever.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...models.interface import ModelOutput
from ...models.parallel.groups import Group
from ..executor.executor import StepExecutor
from ..executor.step import Step
from ..executor.step_shape import StepShape
from .dp_rounds import DPRounds

log = logging.getLogger(__name__)


class StepKind(enum.Enum):
    FORWARD = "forward"
    COPY_KV = "copy_kv"
    CAPTURE = "capture"
    STOP = "stop"


@dataclass(frozen=True)
class StepMessage:
    kind: StepKind
    step: Step | None = None  # FORWARD
    src: tuple[int, ...] = ()  # COPY_KV
    dst: tuple[int, ...] = ()
    shapes: tuple[StepShape, ...] = ()  # CAPTURE
    max_blocks: int = 0


class StepChannel:
    """Broadcasts from the group's first rank over its CPU (gloo) group."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.leader = group.ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.group.rank == 0

    def send(self, message: StepMessage) -> None:
        if not self.group.is_trivial:
            dist.broadcast_object_list([message], src=self.leader, group=self.group.cpu_group)

    def recv(self) -> StepMessage:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group.cpu_group)
        message = box[0]
        if not isinstance(message, StepMessage):
            raise TypeError(f"follower got {type(message).__name__} instead of a step message")
        return message


class LeaderExecutor:
    """A leader's runner: announces every forward, K/V copy and capture, then runs it on its own
    executor (``local``). With DP attention each forward is a round: the DP leaders first agree on
    every group's token count (and on a CUDA-graph shape they all replay at, ``rounds``)."""

    def __init__(self, local: StepExecutor, channel: StepChannel, rounds: DPRounds | None = None) -> None:
        self.local = local
        self.channel = channel
        self.rounds = rounds
        self.in_forward = False  # between announcing a forward and finishing it

    @property
    def single_rank(self) -> bool:
        """No follower: a forward may take its token ids from the device (overlapped engine steps)."""
        return self.channel.group.is_trivial and self.rounds is None

    def run(self, step: Step, hidden: torch.Tensor | None = None, input_ids: torch.Tensor | None = None
            ) -> ModelOutput:
        if hidden is not None:
            raise ValueError("a parallel engine's target forward takes no hidden input")
        if input_ids is not None and not self.single_rank:
            raise ValueError("token ids on the leader's device cannot reach its followers")
        if self.rounds is not None:
            step = self.rounds.agree(step, self.local)
        self.in_forward = True
        self.channel.send(StepMessage(StepKind.FORWARD, step))
        out = self.local.run(step, input_ids=input_ids)
        self.in_forward = False
        return out

    def idle_round(self) -> bool:
        """DP attention: take part in one round with no tokens; returns whether any group ran a forward."""
        if self.rounds is None:
            raise RuntimeError("idle rounds exist only under DP attention")
        step = self.rounds.agree(Step(()), self.local)
        if not any(step.dp_num_tokens or ()) and step.graph_shape is None:
            return False
        self.rounds.empty_forwards += 1
        self.in_forward = True
        self.channel.send(StepMessage(StepKind.FORWARD, step))
        self.local.run(step)
        self.in_forward = False
        return True

    def copy_kv(self, src: list[int], dst: list[int]) -> None:
        self.channel.send(StepMessage(StepKind.COPY_KV, src=tuple(src), dst=tuple(dst)))
        self.local.copy_kv(src, dst)

    def capture(self, shapes: Sequence[StepShape], max_blocks: int) -> None:
        self.channel.send(StepMessage(StepKind.CAPTURE, shapes=tuple(shapes), max_blocks=max_blocks))
        self.local.capture(shapes, max_blocks)

    def stop(self) -> None:
        """End the followers' loop (not while they are inside a forward's collectives)."""
        if not self.in_forward:
            self.channel.send(StepMessage(StepKind.STOP))


def follow(executor: StepExecutor, channel: StepChannel) -> int:
    """A follower's loop: run what the leader announces until it says stop; returns the forwards run."""
    forwards = 0
    while True:
        message = channel.recv()
        if message.kind is StepKind.STOP:
            return forwards
        if message.kind is StepKind.FORWARD and message.step is not None:
            executor.run(message.step)
            forwards += 1
        elif message.kind is StepKind.COPY_KV:
            executor.copy_kv(list(message.src), list(message.dst))
        elif message.kind is StepKind.CAPTURE:
            executor.capture(message.shapes, message.max_blocks)
        else:
            raise RuntimeError(f"follower got a malformed step message {message.kind}")

