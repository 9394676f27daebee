"""A parallel engine on one torch.distributed group: rank 0 leads, the other ranks follow.

The leader runs the whole ``Engine`` (scheduler, sampler, detokenizer, EAGLE3 draft). Before
each target forward it broadcasts the step's *description* — the ``ScheduledBatch``, plain
lists, including a verify's draft tree as parent indices — on the TP group's CPU group
(``broadcast_object_list``); every follower rebuilds the ``ForwardBatch`` with its own
``ModelRunner`` (its shard of the weights and of the KV cache) and runs the same forward,
taking part in its collectives. K/V copies after a tree verify are announced the same way.
Aux states and logits are complete on every rank, so the draft and sampling need only the
leader. A stop message ends the followers' loop; the leader sends it however it leaves.

A follower that raises exits its process; the leader's collectives then fail (gloo: the peer
closed the connection) or time out (the process group's timeout, which ``run_on_ranks`` sets),
so the leader never waits forever. This is the seam the Ray rank actors use: the leader's
messages are what crosses it, never per-step tensors.

    def rank_main(rank, world, backend):
        return run_engine_group(rank, world, backend, "model/", EngineConfig(num_blocks=64),
                                lambda engine: engine.generate(["def f("]), fusion=True)

    run_on_ranks(rank_main, 2)  # -> [completions, None]
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..models.forward_batch import KVCache
from ..models.parallel.collectives import Collectives
from ..models.parallel.groups import Group, ParallelConfig, ParallelGroups, build_groups
from .engine import DTYPES, Engine, EngineConfig
from .model_runner import ModelRunner
from .scheduler import ScheduledBatch

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class StepMessage:
    """What the leader tells the followers: run a forward, copy K/V slots, or stop."""

    kind: str  # "forward" | "copy_kv" | "stop"
    batch: ScheduledBatch | None = None
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()


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


class LeaderRunner(ModelRunner):
    """Rank 0's runner: announces every target forward and K/V copy, then runs it itself."""

    def __init__(self, runner: ModelRunner, channel: StepChannel) -> None:
        super().__init__(runner.model, runner.kv_cache, runner.device)
        self.state_cache = runner.state_cache
        self.channel = channel
        self.in_forward = False  # between announcing a forward and finishing it

    def forward(self, batch: ScheduledBatch, attn_masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        if attn_masks is not None:
            raise ValueError("a parallel engine's forward takes its masks from the batch (tree_parents), "
                             "not as tensors")
        self.in_forward = True
        self.channel.send(StepMessage("forward", batch))
        logits = super().forward(batch)
        self.in_forward = False
        return logits

    def copy_kv(self, src: list[int], dst: list[int]) -> None:
        self.channel.send(StepMessage("copy_kv", src=tuple(src), dst=tuple(dst)))
        super().copy_kv(src, dst)


def follow(runner: ModelRunner, channel: StepChannel) -> int:
    """A follower's loop: run what the leader announces until it says stop; returns the forwards run."""
    forwards = 0
    while True:
        message = channel.recv()
        if message.kind == "stop":
            return forwards
        if message.kind == "forward" and message.batch is not None:
            runner.forward(message.batch)
            forwards += 1
        elif message.kind == "copy_kv":
            runner.copy_kv(list(message.src), list(message.dst))
        else:
            raise RuntimeError(f"follower got an unknown step message {message.kind!r}")


def agree_num_blocks(runner: ModelRunner, group: Group) -> None:
    """Every rank keeps the smallest KV cache any rank could allocate (block tables are shared)."""
    if group.is_trivial:
        return
    n = torch.tensor([runner.kv_cache.num_blocks], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group.cpu_group)
    agreed = int(n.item())
    if agreed != runner.kv_cache.num_blocks:
        old = runner.kv_cache
        shapes = {i: (k.shape[1], k.shape[2], old.v[i].shape[2]) for i, k in old.k.items()}
        first = next(iter(old.k.values()))
        runner.kv_cache = KVCache.allocate(shapes, agreed, old.block_size, first.dtype, first.device)


def load_rank_runner(model_dir: str | Path, config: EngineConfig, groups: ParallelGroups, backend: str,
                     fusion: bool, kernel: str = "reference") -> ModelRunner:
    """This rank's model shard and KV cache. ``kernel``: the fused AR + add + RMSNorm when ``fusion``
    ("reference", or "flashinfer" on GPUs)."""
    fused = None
    if fusion and kernel != "reference":
        from ..models.loader import load_config
        from ..models.parallel.fused_allreduce_norm import make_fused_allreduce_norm

        fused = make_fused_allreduce_norm(kernel, groups, load_config(model_dir).hidden_size, DTYPES[config.dtype])
    runner = ModelRunner.load(model_dir, config.block_size, config.num_blocks, config.kv_memory_fraction,
                              config.max_num_seqs, DTYPES[config.dtype], config.device, groups=groups,
                              collectives=Collectives("nccl" if backend == "nccl" else "gloo", fused=fused),
                              fusion=fusion)
    agree_num_blocks(runner, groups.tp)
    return runner


def run_engine_group(rank: int, world: int, backend: str, model_dir: str | Path, config: EngineConfig,
                     lead: Callable[[Engine], T], fusion: bool = False, kernel: str = "reference") -> T | None:
    """Run one rank of a tp=``world`` engine (torch.distributed already initialised, e.g. by
    ``run_on_ranks``): the leader builds the ``Engine`` and returns ``lead(engine)``; followers
    serve its forwards and return None."""
    groups = build_groups(ParallelConfig(world), rank, backend) if world > 1 else ParallelGroups.single_rank()
    runner = load_rank_runner(model_dir, config, groups, backend, fusion, kernel)
    channel = StepChannel(groups.tp)
    if not channel.is_leader:
        forwards = follow(runner, channel)
        log.info("rank %d: leader stopped after %d forwards", rank, forwards)
        return None
    leader = LeaderRunner(runner, channel)
    try:
        return lead(Engine(model_dir, config, runner=leader))
    finally:
        if not leader.in_forward:  # else the followers are inside that forward's collectives
            channel.send(StepMessage("stop"))
