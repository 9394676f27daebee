"""One rank of an engine group, as a Ray actor.

Every rank initialises torch.distributed (NCCL on GPUs, gloo on CPU; rendezvous at the leader's
address), loads its shard and its KV cache. Rank 0 runs the ``Engine`` behind a
``LocalEngineClient`` and serves requests by Ray calls (a streaming generator per request:
Ray calls carry requests and outputs, never per-step tensors); the other ranks follow the
leader's step messages on the CPU group (``distributed_runner``).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import asdict
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)


def engine_config_for(spec: dict[str, Any], device: str) -> Any:
    """The frozen engine config of one rank from the manifest's spec (a JSON dict)."""
    from .engine import EngineConfig
    from .speculative import SpeculativeConfig

    serving, model = spec.get("serving", {}), spec["model"]
    dtype = model.get("dtype", "auto")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    spec_cfg = None
    if spec.get("speculative"):
        s = spec["speculative"]
        spec_cfg = SpeculativeConfig(draft_model=s["draftModel"], num_steps=s.get("numSteps", 3),
                                     topk=s.get("topK", 1), num_draft_tokens=s.get("numDraftTokens"))
    return EngineConfig(
        block_size=serving.get("blockSize", 16),
        num_blocks=None if device.startswith("cuda") else 512,
        kv_memory_fraction=serving.get("kvCacheFraction", 0.9),
        max_num_seqs=serving.get("maxSequences", 64),
        max_batch_tokens=serving.get("maxBatchTokens", 2048),
        max_model_len=serving.get("maxModelLen"),
        dtype=dtype, device=device, speculative=spec_cfg)


def fusion_for(spec: dict[str, Any], device: str) -> tuple[bool, str]:
    """(fusion in the plan, kernel): off -> none; on -> FlashInfer on CUDA, the reference on CPU;
    auto -> FlashInfer on CUDA when it imports, else none."""
    mode = spec.get("communication", {}).get("allReduceFusion", "auto")
    tp = spec.get("parallelism", {}).get("tensor", 1)
    if mode == "off" or tp == 1:
        return False, "off"
    if not device.startswith("cuda"):
        return (True, "reference") if mode == "on" else (False, "off")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return (True, "reference") if mode == "on" else (False, "off")
    return True, "flashinfer"


class RankActor:
    """Wrapped with ``ray.remote`` by the group controller."""

    def __init__(self, spec: dict[str, Any], labels: dict[str, str], rank: int, world: int,
                 model_name: str) -> None:
        self.spec, self.labels, self.rank, self.world = spec, labels, rank, world
        self.model_name = model_name
        self.client: Any = None
        self._follower: threading.Thread | None = None
        self.error: str | None = None

    def address(self) -> tuple[str, int]:
        """Where rank 0 rendezvouses (called on the leader)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, int(s.getsockname()[1])

    def start(self, master: tuple[str, int] | None) -> bool:
        import torch
        import torch.distributed as dist

        from ..models.parallel.fused_allreduce_norm import make_fused_allreduce_norm
        from ..models.parallel.groups import ParallelConfig, ParallelGroups, build_groups
        from .distributed_runner import LeaderRunner, StepChannel, follow, load_rank_runner
        from .engine import Engine
        from .local_engine_client import LocalEngineClient

        cuda = torch.cuda.is_available()
        device = "cuda:0" if cuda else "cpu"  # Ray gives each GPU actor its own visible device
        backend = "nccl" if cuda else "gloo"
        par = self.spec.get("parallelism", {})
        config = ParallelConfig(par.get("tensor", 1), par.get("data", 1), par.get("expert", 1))
        if self.world > 1:
            assert master is not None
            dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}", rank=self.rank,
                                    world_size=self.world, timeout=timedelta(seconds=120))
            groups = build_groups(config, self.rank, backend)
        else:
            torch.set_num_threads(max(1, torch.get_num_threads()))
            groups = ParallelGroups.single_rank()
        engine_config = engine_config_for(self.spec, device)
        fusion, kernel = fusion_for(self.spec, device)
        model_dir = self.spec["model"]["path"]
        runner = load_rank_runner(model_dir, engine_config, groups, backend, fusion)
        if kernel == "flashinfer":
            from ..models.loader import load_config
            from .engine import DTYPES

            runner.model.comm.collectives.fused = make_fused_allreduce_norm(
                "flashinfer", groups, load_config(model_dir).hidden_size, DTYPES[engine_config.dtype])
        channel = StepChannel(groups.tp)
        if not channel.is_leader:
            self._follower = threading.Thread(target=self._follow, args=(follow, runner, channel), daemon=True)
            self._follower.start()
            return True
        engine = Engine(model_dir, engine_config, runner=LeaderRunner(runner, channel) if self.world > 1 else runner)
        self.client = LocalEngineClient(engine, self.labels, model_name=self.model_name)
        return True

    def _follow(self, follow: Any, runner: Any, channel: Any) -> None:
        try:
            follow(runner, channel)
        except Exception as e:  # the leader sees its collectives fail; report here too
            self.error = f"{type(e).__name__}: {e}"
            log.exception("rank %d follower stopped", self.rank)

    def ping(self) -> str | None:
        """None while healthy, else why not."""
        if self.client is not None and getattr(self.client, "_dead", None):
            return str(self.client._dead)
        return self.error

    def info(self) -> dict[str, Any]:
        import os

        import ray

        return {"rank": self.rank, "node": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "actor_id": ray.get_runtime_context().get_actor_id()}

    # --- leader only ----------------------------------------------------------------------------

    def max_model_len(self) -> int:
        return int(self.client.max_model_len)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return str(self.client.apply_chat_template(messages))

    async def generate(self, prompt: str | list[int], params: dict[str, Any], request_id: str
                       ) -> AsyncIterator[dict[str, Any]]:
        from .sequence import SamplingParams

        async for out in self.client.generate(prompt, SamplingParams(**params), request_id):
            yield asdict(out)

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    async def status(self) -> dict[str, Any]:
        return dict(await self.client.status())

    async def metrics(self) -> list[Any]:
        return list(await self.client.metrics())
