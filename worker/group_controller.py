"""The group controller: a Ray driver that keeps ``spec.replicas`` engine groups alive and
routes requests to them (it implements ``EngineClient`` for the HTTP server).

Each group is a named, detached placement group (``placement.py``) with one ``RankActor`` per
rank. A monitor thread pings every rank; when one dies or reports a failure, the whole group is
torn down (its requests in flight end with ``EngineDead``, never a hang) and recreated, and the
failure stays visible in ``status()``. ``apply`` with a changed spec rolls the groups one at a
time (a new group is ready before the old one goes).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .engine_client import EngineDead, MetricsSnapshot
from .placement import PlacementError, PlacementPlan, explain_unschedulable, plan_group
from .request_output import RequestOutput
from .sequence import FinishReason, InvalidRequest, SamplingParams

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
SCHEDULE_TIMEOUT_S = 30.0
PING_EVERY_S = 1.0


class GroupUnschedulable(RuntimeError):
    pass


@dataclass
class EngineGroup:
    index: int
    revision: int
    plan: PlacementPlan
    pg: Any = None
    actors: list[Any] = field(default_factory=list)
    phase: str = "Pending"  # Pending, Starting, Ready, Failed
    ranks: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = 0.0

    @property
    def leader(self) -> Any:
        return self.actors[0]


class GroupController:
    def __init__(self, manifest: Any, gpus: bool, gpus_per_node: int = 8) -> None:
        self.manifest = manifest
        self.gpus = gpus
        self.gpus_per_node = gpus_per_node
        self.revision = 1
        self.groups: dict[int, EngineGroup] = {}
        self.failures: list[dict[str, Any]] = []
        self.restarts = 0
        self._lock = threading.RLock()
        self._rr = itertools.count()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    # --- reconcile --------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return str(self.manifest.metadata.name)

    @property
    def namespace(self) -> str:
        return str(self.manifest.metadata.namespace)

    @property
    def model_name(self) -> str:
        return str(self.manifest.spec.model.name or self.name)

    def start(self) -> None:
        """Create every group (blocking until ready), then watch them."""
        for i in range(self.manifest.spec.replicas):
            self._replace(i, reason=None)
        self._monitor = threading.Thread(target=self._watch, name="fusedserve-groups", daemon=True)
        self._monitor.start()

    def apply(self, manifest: Any) -> None:
        """A changed spec: roll groups one at a time; replicas scale up or down."""
        with self._lock:
            old = self.manifest
            self.manifest = manifest
            if manifest.spec.model_dump() != old.spec.model_dump():
                self.revision += 1
        for i in range(manifest.spec.replicas):
            g = self.groups.get(i)
            if g is None or g.revision != self.revision:
                self._replace(i, reason=None)
        for i in sorted(self.groups):
            if i >= manifest.spec.replicas:
                self._teardown(self.groups.pop(i))

    def shutdown(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        for g in list(self.groups.values()):
            self._teardown(g)
        self.groups.clear()

    def _spec_dict(self) -> dict[str, Any]:
        return dict(self.manifest.spec.model_dump(by_alias=True, mode="json"))

    def _replace(self, index: int, reason: str | None) -> None:
        new = self._create(index)
        with self._lock:
            old = self.groups.get(index)
            self.groups[index] = new
        if old is not None:
            self._teardown(old)

    def _create(self, index: int) -> EngineGroup:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .rank_actor import RankActor

        spec = self.manifest.spec
        tp = spec.parallelism.tensor
        plan = plan_group(self.namespace, self.name, index, tp, self.gpus, self.gpus_per_node)
        group = EngineGroup(index=index, revision=self.revision, plan=plan, phase="Pending", started_at=time.time())
        name = f"{plan.name}/r{self.revision}-{int(time.time() * 1000) % 10**9}"
        group.pg = placement_group(list(plan.bundles), strategy=plan.strategy, name=name, lifetime=plan.lifetime)
        ready, _ = ray.wait([group.pg.ready()], timeout=SCHEDULE_TIMEOUT_S)
        if not ready:
            why = explain_unschedulable(plan, ray.cluster_resources())
            remove_placement_group(group.pg)
            raise GroupUnschedulable(f"placement group {plan.name} cannot be scheduled: {why}")
        group.phase = "Starting"
        actor_cls = ray.remote(RankActor)
        spec_dict = self._spec_dict()
        for rank in range(tp):
            labels = {"deployment": self.name, "namespace": self.namespace, "engine_group": str(index), "rank": str(rank),
                      "tp_rank": str(rank), "dp_rank": str(rank // (tp // spec.parallelism.data)),
                      "ep_rank": str(rank // (tp // spec.parallelism.expert))}
            resources = {k: v for k, v in plan.bundles[rank].items() if k not in ("CPU", "GPU")}
            opts: dict[str, Any] = dict(
                num_cpus=0, num_gpus=plan.bundles[rank].get("GPU", 0), resources=resources, max_restarts=0,
                max_concurrency=64,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group.pg, placement_group_bundle_index=rank))
            group.actors.append(actor_cls.options(**opts).remote(spec_dict, labels, rank, tp, self.model_name))
        master = ray.get(group.leader.address.remote()) if tp > 1 else None
        try:
            ray.get([a.start.remote(master) for a in group.actors], timeout=READY_TIMEOUT_S)
            group.ranks = ray.get([a.info.remote() for a in group.actors], timeout=30)
        except Exception as e:
            self._teardown(group)
            raise RuntimeError(f"engine group {index} failed to start: {_short(e)}") from e
        group.phase = "Ready"
        log.info("engine group %d ready (%d ranks, revision %d)", index, tp, self.revision)
        return group

    def _teardown(self, group: EngineGroup) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        group.phase = "Failed" if group.phase != "Ready" else "Terminating"
        for a in group.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        if group.pg is not None:
            try:
                remove_placement_group(group.pg)
            except Exception:
                pass

    def _watch(self) -> None:
        import ray

        while not self._stop.wait(PING_EVERY_S):
            for index, group in list(self.groups.items()):
                if group.phase != "Ready":
                    continue
                problem = None
                try:
                    answers = ray.get([a.ping.remote() for a in group.actors], timeout=10)
                    problem = next((f"rank {r}: {a}" for r, a in enumerate(answers) if a), None)
                except Exception as e:
                    problem = _short(e)
                if problem is None or self._stop.is_set():
                    continue
                with self._lock:
                    group.phase = "Failed"
                    self.failures.append({"group": index, "time": time.time(), "reason": problem})
                    self.restarts += 1
                log.warning("engine group %d failed (%s); recreating it", index, problem)
                self._teardown(group)
                try:
                    self._replace(index, reason=problem)
                except Exception as e:
                    self.failures.append({"group": index, "time": time.time(), "reason": f"recreate: {_short(e)}"})

    # --- EngineClient -----------------------------------------------------------------------------

    def _ready_groups(self) -> list[EngineGroup]:
        with self._lock:
            return [g for _, g in sorted(self.groups.items()) if g.phase == "Ready"]

    def _pick(self) -> EngineGroup:
        ready = self._ready_groups()
        if not ready:
            raise EngineDead("no engine group is ready")
        return ready[next(self._rr) % len(ready)]

    @property
    def max_model_len(self) -> int:
        import ray

        return int(ray.get(self._pick().leader.max_model_len.remote()))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        import ray

        try:
            return str(ray.get(self._pick().leader.apply_chat_template.remote(messages)))
        except ray.exceptions.RayTaskError as e:
            raise _unwrap(e) from None

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str):  # type: ignore[no-untyped-def]
        import ray

        group = self._pick()
        stream = group.leader.generate.options(num_returns="streaming").remote(prompt, asdict(params), request_id)
        try:
            async for ref in stream:
                d = await ref
                reason = d.get("finish_reason")
                d["finish_reason"] = FinishReason(reason) if reason is not None else None
                yield RequestOutput(**d)
        except ray.exceptions.RayTaskError as e:
            raise _unwrap(e) from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
            raise EngineDead(f"engine group {group.index} failed: {_short(e)}") from None

    async def abort(self, request_id: str) -> None:
        for g in self._ready_groups():
            try:
                await g.leader.abort.remote(request_id)
            except Exception:
                pass

    async def status(self) -> dict[str, Any]:
        groups = []
        for index, g in sorted(self.groups.items()):
            entry: dict[str, Any] = {"index": index, "phase": g.phase, "revision": g.revision,
                                     "placement_group": g.plan.name, "strategy": g.plan.strategy,
                                     "bundles": list(g.plan.bundles), "ranks": g.ranks}
            if g.phase == "Ready":
                try:
                    leader = await asyncio.wait_for(_await(g.leader.status.remote()), 10)
                    entry.update({k: v for k, v in leader.items() if k not in ("groups",)})
                    entry["engine"] = leader.get("groups", [])
                except Exception as e:
                    entry["error"] = _short(e)
            groups.append(entry)
        ready = sum(1 for g in groups if g["phase"] == "Ready")
        return {"deployment": self.name, "namespace": self.namespace, "model": self.model_name,
                "ready": ready > 0, "replicas": self.manifest.spec.replicas, "ready_replicas": ready,
                "revision": self.revision, "restarts": self.restarts, "failures": self.failures[-10:],
                "groups": groups}

    async def metrics(self) -> list[MetricsSnapshot]:
        out: list[MetricsSnapshot] = []
        for g in self._ready_groups():
            try:
                out += await asyncio.wait_for(_await(g.leader.metrics.remote()), 10)
            except Exception:
                continue
        return out


async def _await(ref: Any) -> Any:
    return await ref


def _unwrap(e: Any) -> Exception:
    cause = getattr(e, "cause", None)
    if isinstance(cause, (InvalidRequest, EngineDead)):
        return cause
    if isinstance(cause, Exception):
        return cause
    return EngineDead(_short(e))


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


__all__ = ["GroupController", "GroupUnschedulable", "PlacementError"]
