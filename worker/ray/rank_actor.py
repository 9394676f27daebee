"""One rank of an engine group, as a Ray actor (``ray.remote(RankActor)``, made by ``engine_group``).

Every rank initialises torch.distributed (NCCL on a GPU, gloo on CPU; rendezvous at the address
rank 0 picked), builds the parallel groups and its shard of the model and KV cache, with the
all-reduce + RMSNorm fusion chosen once from ``spec.communication`` (``parallel/rank.py``'s
``build_rank``). Then it takes one of two roles:

- a *leader* runs an ``Engine`` behind a ``LocalEngineClient`` and serves requests by Ray calls
  (``generate`` is an async generator: one Ray stream per request; Ray calls carry requests and
  outputs, never per-step tensors). Without DP attention rank 0 is the only leader and announces
  each forward to the others (``parallel/step_channel.py``); with DP attention the first rank of
  every DP group leads its own engine and the leaders step in rounds (``parallel/dp_rounds.py``).
- a *follower* runs the forwards its leader announces, in a thread.

``ping`` says why a rank cannot serve (None when healthy); ``metrics`` returns every rank's
``MetricsSnapshot`` (a follower's carries its collectives only).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from ...models.parallel.groups import ParallelConfig, rank_coordinates
from .. import startup_gc
from ..serving.engine_client import MetricsSnapshot
from ..spec import RuntimeConfig

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT = timedelta(seconds=120)


class RankStartError(RuntimeError):
    """A rank could not start (checkpoint, rendezvous, KV cache); the message says which rank and why."""


def parallel_config(rc: RuntimeConfig) -> ParallelConfig:
    return ParallelConfig(rc.tensor, rc.data, rc.expert)


def rank_labels(rc: RuntimeConfig, group_index: int, rank: int) -> dict[str, str]:
    c = rank_coordinates(parallel_config(rc), rank)
    return {"deployment": rc.name, "namespace": rc.namespace, "engine_group": str(group_index),
            "rank": str(rank), "tp_rank": str(c.tp_rank), "dp_rank": str(c.dp_rank), "ep_rank": str(c.moe_ep_rank)}


def is_leader(rc: RuntimeConfig, rank: int) -> bool:
    """Leaders run an engine: rank 0, or with DP attention the first rank of every DP group."""
    return rank % rc.attn_tp == 0 if rc.dp_attention else rank == 0


def leader_ranks(rc: RuntimeConfig) -> list[int]:
    return [r for r in range(rc.ranks) if is_leader(rc, r)]


def engine_config(rc: RuntimeConfig, device: str) -> Any:
    """The frozen ``EngineConfig`` of one rank."""
    from ..engine.config import EngineConfig
    from ..spec_decode.config import SpeculativeConfig

    cuda = device.startswith("cuda")
    s = rc.speculative
    return EngineConfig(
        block_size=rc.block_size, kv_memory_fraction=rc.kv_cache_fraction,
        max_num_seqs=rc.max_sequences, max_batch_tokens=rc.max_batch_tokens, max_model_len=rc.max_model_len,
        dtype=rc.dtype_on(cuda), quantization=rc.quantization, device=device, load_format=rc.load_format,
        skip_tokenizer=rc.skip_tokenizer, enable_prefix_caching=rc.prefix_caching,
        speculative=None if s is None else SpeculativeConfig(s.draft_model, s.num_steps, s.top_k, s.num_draft_tokens))


def _own_gpu() -> int:
    """The GPU Ray gave this actor, as a device index (every GPU of the node is visible to it)."""
    import ray

    ids = ray.get_gpu_ids()
    if len(ids) != 1:
        raise RankStartError(f"a GPU rank needs exactly one GPU, Ray gave it {ids}")
    return int(ids[0])


class RankActor:
    def __init__(self, config: RuntimeConfig, group_index: int, rank: int, gpu: bool = False) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.rc = config
        self.gpu = gpu  # this rank holds one GPU of its bundle
        self.group_index = group_index
        self.rank = rank
        self.labels = rank_labels(config, group_index, rank)
        self.leader = is_leader(config, rank)
        self.client: Any = None  # LocalEngineClient on a leader
        self.ledger: Any = None  # this rank's CollectiveLedger once loaded
        self.kernel = "off"
        self.quantization: dict[str, Any] | None = None  # models/quantization.py's choice, once loaded
        self.error: str | None = None
        self.ready = False
        self._follower: threading.Thread | None = None
        self._last_snapshot: MetricsSnapshot | None = None
        self._channels: dict[str, Any] = {}  # name -> OutputChannel (serving, on a leader)

    # --- start ------------------------------------------------------------------------------------

    def address(self) -> tuple[str, int]:
        """Where the group may rendezvous (asked of rank 0): this node's address and a free port (the controller
        makes the ``init_method``: ``EngineGroup._rendezvous``)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, int(s.getsockname()[1])

    async def start(self, master: str | None) -> dict[str, Any]:
        """Join the group, load the shard, take up the role; returns ``info()``."""
        try:
            with startup_gc.paused():  # torch, transformers and the model: long-lived objects (startup_gc.py)
                await asyncio.to_thread(self._start, master)
        except Exception as e:
            self.error = f"rank {self.rank}: {type(e).__name__}: {e}"
            log.exception("rank %d failed to start", self.rank)
            raise RankStartError(self.error) from e
        self.ready = True
        return await self.info()

    def _start(self, master: str | None) -> None:
        import torch
        import torch.distributed as dist

        from ...models.parallel.groups import ParallelGroups, build_groups
        from ..parallel.rank import build_rank, follower_channel, lead_engine, leads
        from ..parallel.step_channel import follow
        from ..serving.local_engine_client import LocalEngineClient

        rc = self.rc
        cuda = self.gpu
        device = f"cuda:{_own_gpu()}" if cuda else "cpu"
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(device)
        if rc.ranks > 1:
            if master is None:
                raise RankStartError("a group of several ranks needs its rendezvous (init_method)")
            dist.init_process_group(backend, init_method=master, rank=self.rank, world_size=rc.ranks,
                                    timeout=RENDEZVOUS_TIMEOUT)
            groups = build_groups(parallel_config(rc), self.rank, backend)
        else:
            groups = ParallelGroups.single_rank()
        config = engine_config(rc, device)
        rank = build_rank(rc.model_path, config, groups, backend, rc.all_reduce_fusion)
        self.kernel = rank.fusion.value
        self.quantization = rank.quantization.to_json(config.dtype, rank.kernels.kernels)
        self.ledger = rank.executor.ledger
        log.info("rank %d/%d of group %d loaded (%s, fusion %s)", self.rank, rc.ranks, self.group_index,
                 backend, self.kernel)
        if not leads(groups):
            channel = follower_channel(groups)
            self._follow(lambda: follow(rank.executor, channel))
            return
        engine, _runner = lead_engine(rank, rc.model_path, config)
        self.client = LocalEngineClient(engine, self.labels, model_name=rc.model_name)

    def _follow(self, loop: Any) -> None:
        def run() -> None:
            try:
                forwards = loop()
                self.error = f"rank {self.rank}: the leader stopped the group after {forwards} forwards"
            except Exception as e:  # the leader's collectives fail too; say it here as well
                self.error = f"rank {self.rank}: follower failed: {type(e).__name__}: {e}"
                log.exception("rank %d follower stopped", self.rank)

        self._follower = threading.Thread(target=run, name=f"fusedserve-follower-{self.rank}", daemon=True)
        self._follower.start()

    # --- health and introspection -----------------------------------------------------------------

    async def ping(self) -> str | None:
        """None while this rank can serve, else why not."""
        if self.error is not None:
            return self.error
        if self.client is not None:
            try:
                status = await asyncio.wait_for(self.client.status(), 10)
            except asyncio.TimeoutError:
                return None  # a long step, not a failure
            if not status.get("ready", False):
                return f"rank {self.rank}: {status.get('error') or 'the engine is not ready'}"
        return None

    async def info(self) -> dict[str, Any]:
        import ray

        return {"rank": self.rank, "role": "leader" if self.leader else "follower", "labels": self.labels,
                "node": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "actor_id": ray.get_runtime_context().get_actor_id(), "revision": self.rc.revision,
                "fusion": self.kernel, "quantization": self.quantization, "ready": self.ready, "error": self.error,
                "max_model_len": int(self.client.max_model_len) if self.client is not None else None}

    async def metrics(self) -> list[MetricsSnapshot]:
        if self.client is not None:
            return list(await self.client.metrics())
        return [self._ledger_snapshot()] if self.ledger is not None else []

    def _ledger_snapshot(self) -> MetricsSnapshot:
        """A follower's collectives over whole forwards (its ledger is written by the follower thread;
        ``ledger_snapshot`` copies it between two updates)."""
        from ..serving.engine_stats import ledger_snapshot

        if self.ledger is None:
            return MetricsSnapshot(labels=dict(self.labels))
        try:
            self._last_snapshot = ledger_snapshot(self.ledger, self.labels)
        except RuntimeError as e:  # never quiet: the last one again (an empty one would read as a counter reset)
            log.warning("rank %d: collectives not read this time: %s", self.rank, e)
        return self._last_snapshot or MetricsSnapshot(labels=dict(self.labels))

    # --- serving (leaders) ------------------------------------------------------------------------

    def max_model_len(self) -> int:
        return int(self.client.max_model_len)

    async def submit(self, prompt: str | list[int], params: dict[str, Any], request_id: str, channel: str,
                     final_only: bool = False) -> None:
        """Start a request whose outputs go to ``channel``'s stream (``outputs``); raises ``InvalidRequest``.
        ``final_only``: its one output when it ends (``EngineClient.generate``)."""
        from ..engine.sequence import SamplingParams

        await self.client.submit(prompt, SamplingParams(**params), request_id, self._channel(channel), final_only)

    async def outputs(self, channel: str) -> AsyncIterator[list[dict[str, Any]]]:
        """One consumer's stream (a Ray streaming call, ``num_returns="streaming"``): the outputs of every
        request submitted on ``channel``, one item per wake-up with all that was delivered meanwhile —
        an engine step's outputs travel as one Ray object, not one per request. An engine failure is
        the last item (``{"engine_dead": reason}``); a consumer that goes away aborts its requests."""
        from ..serving.engine_client import EngineDead

        ch = self._channel(channel)
        try:
            while True:
                batch: list[dict[str, Any]] = []
                for item in await ch.next_batch():
                    if isinstance(item, EngineDead):
                        yield batch + [{"engine_dead": str(item)}]
                        return
                    batch.append(asdict(item))
                yield batch
        finally:
            if self._channels.pop(channel, None) is ch:
                self.client.close_channel(ch)

    def _channel(self, name: str) -> Any:
        """The named output channel (made by whichever comes first: a submit or the stream)."""
        ch = self._channels.get(name)
        if ch is None:
            ch = self._channels[name] = self.client.open_channel()
        return ch

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    async def status(self) -> dict[str, Any]:
        return dict(await self.client.status())
