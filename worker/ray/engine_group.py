"""One engine group on Ray: its placement group and rank actors (the effects; the plan is ``placement``).

``EngineGroup.create`` reserves the named, detached placement group, waits for it (an infeasible
or long-pending group fails with the reason: ``GroupUnschedulable``), starts one detached, named
``RankActor`` per rank in its bundle, rendezvouses them at rank 0's address and waits until every
rank is loaded (``GroupStartFailed`` otherwise, with the placement group removed again). Where rank 0's node
address is loopback (the embedded Ray of ``fusedserve run``: every rank on this host) they rendezvous in a
file instead (``dist.FileStore``, in a directory only this user reads, removed at teardown): torch's TCP store
listens on every interface whatever address it is given.
``EngineGroup.adopt`` finds a group a previous controller left running. ``check`` pings every rank;
``teardown`` kills the actors and removes the placement group.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from ..spec import RuntimeConfig
from .placement import (
    LOOPBACK_HOSTS,
    RAY_NAMESPACE,
    ClusterShape,
    PlacementPlan,
    explain_unschedulable,
    plan_group,
    rank_actor_name,
)
from .rank_actor import leader_ranks

log = logging.getLogger(__name__)

SCHEDULE_TIMEOUT_S = 30.0  # a feasible placement group still pending after this is reported
START_TIMEOUT_S = 300.0
PING_TIMEOUT_S = 10.0
REPING_TIMEOUT_S = PING_TIMEOUT_S + 2  # the second look, once a rank reported a problem: longer than a busy rank's own status wait


class GroupError(RuntimeError):
    """An engine group could not be made ready; ``reason`` is what status shows."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GroupUnschedulable(GroupError):
    """Ray cannot place the group (now or ever); retried after a delay."""


class GroupStartFailed(GroupError):
    """A rank failed to start (checkpoint, rendezvous, memory); retried after a longer delay."""


def short(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    cause = getattr(e, "cause", None)  # RayTaskError: the remote exception
    if cause is not None and cause is not e:
        return short(cause)
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]


@dataclass
class EngineGroup:
    index: int
    plan: PlacementPlan
    revision: str
    pg: Any = None
    actors: list[Any] = field(default_factory=list)
    leaders: list[Any] = field(default_factory=list)  # actors that serve requests
    ranks: list[dict[str, Any]] = field(default_factory=list)  # RankActor.info() of each rank
    phase: str = "Pending"  # Pending, Starting, Ready, Failed, Terminating
    created_at: float = 0.0
    adopted: bool = False
    rendezvous_dir: str | None = None  # the file store's directory (ranks on a loopback node), removed at teardown

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def max_model_len(self) -> int | None:
        """What the group's engines accept (their leaders report it)."""
        lens = [int(r["max_model_len"]) for r in self.ranks if r.get("max_model_len")]
        return min(lens) if lens else None

    # --- create / adopt ---------------------------------------------------------------------------

    @classmethod
    def create(cls, rc: RuntimeConfig, index: int, cluster: ClusterShape,
               schedule_timeout_s: float = SCHEDULE_TIMEOUT_S) -> EngineGroup:
        from ray.util import placement_group

        plan = plan_group(rc.namespace, rc.name, index, rc.ranks, cluster, rc.attn_tp)
        group = cls(index, plan, rc.revision, created_at=time.time())
        group.pg = placement_group(list(plan.bundles), strategy=plan.strategy, name=plan.name,
                                   lifetime=plan.lifetime)
        try:
            group._wait_scheduled(schedule_timeout_s)
            group.phase = "Starting"
            group._start_actors(rc, cluster)
        except BaseException:
            group.teardown()
            raise
        group.phase = "Ready"
        log.info("engine group %s ready: %d ranks, revision %s", plan.name, plan.ranks, rc.revision)
        return group

    def _wait_scheduled(self, timeout_s: float) -> None:
        import ray

        deadline = time.monotonic() + timeout_s
        while True:
            ready, _ = ray.wait([self.pg.ready()], timeout=0.5)
            if ready:
                return
            state = _scheduling_state(self.pg)
            if state == "INFEASIBLE" or time.monotonic() > deadline:
                nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
                why = explain_unschedulable(self.plan, nodes, ray.available_resources())
                raise GroupUnschedulable(f"placement group {self.name} cannot be scheduled: {why}")

    def _start_actors(self, rc: RuntimeConfig, cluster: ClusterShape) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .rank_actor import RankActor

        actor_cls = ray.remote(RankActor)
        # On GPUs every rank sees all of its node's GPUs and picks its own (ray.get_gpu_ids()): CUDA IPC
        # (FlashInfer's fused all-reduce workspace) maps peer memory only on visible devices, as vLLM
        # found. NVLink multicast stays off (TESTING.md).
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "NCCL_NVLS_ENABLE": "0",
               "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"} if cluster.gpus else {}
        for rank, bundle in enumerate(self.plan.bundles):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
            self.actors.append(actor_cls.options(
                name=rank_actor_name(self.name, rank), namespace=RAY_NAMESPACE, lifetime="detached",
                num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                max_restarts=0, max_concurrency=256, scheduling_strategy=strategy,
                runtime_env={"env_vars": env} if env else None,
            ).remote(rc, self.index, rank, cluster.gpus))
        self.leaders = [self.actors[r] for r in leader_ranks(rc)]
        try:
            master = None
            if rc.ranks > 1:
                master = self._rendezvous(ray.get(self.actors[0].address.remote(), timeout=START_TIMEOUT_S))
            self.ranks = ray.get([a.start.remote(master) for a in self.actors], timeout=START_TIMEOUT_S)
        except Exception as e:
            raise GroupStartFailed(f"engine group {self.name} failed to start: {_first_rank_error(self, short(e))}") from e

    def _rendezvous(self, address: tuple[str, int]) -> str:
        """The ranks' ``init_method`` from rank 0's node address and free port: a file store on a loopback node
        (made here: the controller runs there too), else TCP."""
        host, port = address
        if host not in LOOPBACK_HOSTS:
            return f"tcp://{host}:{port}"
        self.rendezvous_dir = tempfile.mkdtemp(prefix="fusedserve-rendezvous-")  # mode 0700
        return f"file://{self.rendezvous_dir}/store"

    @classmethod
    def adopt(cls, rc: RuntimeConfig, index: int, pg: Any, cluster: ClusterShape) -> EngineGroup:
        """A group a previous controller left: ready if every rank answers, else Failed (torn down
        by the caller). Its revision is the ranks' (it may be outdated: the caller rolls it)."""
        import ray

        plan = plan_group(rc.namespace, rc.name, index, pg.bundle_count, cluster)
        group = cls(index, plan, revision="", pg=pg, phase="Failed", created_at=time.time(), adopted=True)
        try:
            group.actors = [ray.get_actor(rank_actor_name(plan.name, r), namespace=RAY_NAMESPACE)
                            for r in range(plan.ranks)]
            group.ranks = ray.get([a.info.remote() for a in group.actors], timeout=PING_TIMEOUT_S)
        except (ValueError, ray.exceptions.RayError) as e:  # ValueError: no such actor
            log.warning("cannot adopt %s: %s", plan.name, short(e))
            return group
        revisions = {r["revision"] for r in group.ranks}
        if len(revisions) == 1 and all(r["ready"] and not r["error"] for r in group.ranks):
            group.revision = revisions.pop()
            group.leaders = [group.actors[r["rank"]] for r in group.ranks if r["role"] == "leader"]
            group.phase = "Ready"
            log.info("adopted engine group %s (revision %s)", plan.name, group.revision)
        return group

    # --- health / teardown ------------------------------------------------------------------------

    def check(self) -> str | None:
        """None while every rank can serve, else the first problem."""
        import ray

        try:
            answers = ray.get([a.ping.remote() for a in self.actors], timeout=PING_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            return None  # busy ranks (a long step on a loaded host); a dead one raises instead
        except ray.exceptions.RayError as e:
            return _first_rank_error(self, short(e))
        problem = next((a for a in answers if a), None)
        # Each rank answers when it gets to it: a peer may have answered "fine" just before it was
        # killed, and the survivor after its collective failed. Ask again before naming a rank.
        return None if problem is None else _first_rank_error(self, str(problem))

    def teardown(self) -> None:
        import ray
        from ray.util import remove_placement_group

        self.phase = "Terminating"
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except (ValueError, ray.exceptions.RayError) as e:  # already gone
                log.debug("kill %s: %s", self.name, e)
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except (ValueError, ray.exceptions.RayError) as e:
                log.debug("remove %s: %s", self.name, e)
        self.pg = None
        if self.rendezvous_dir is not None:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
            self.rendezvous_dir = None


def _scheduling_state(pg: Any) -> str:
    from ray.util import placement_group_table

    try:
        return str(placement_group_table(pg).get("stats", {}).get("scheduling_state", ""))
    except Exception:  # noqa: BLE001 (an optional hint: the caller waits on anyway)
        return ""


def _first_rank_error(group: EngineGroup, first: str) -> str:
    """Which rank failed, every rank asked again: a rank that died; else one that stopped answering
    while a peer reports a problem (its process is gone, Ray not yet sure); else a live rank's own
    error rather than its peers' transport errors (a survivor's collective fails when its peer dies,
    in words gloo and NCCL vary); else ``first``, what the first look saw."""
    import ray

    pings = [actor.ping.remote() for actor in group.actors]
    problems: list[str] = []
    silent: list[int] = []
    for rank, ping in enumerate(pings):
        try:
            problem = ray.get(ping, timeout=REPING_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            silent.append(rank)
            continue
        except ray.exceptions.RayError as dead:
            return f"rank {rank} died ({short(dead)})"
        if problem:
            problems.append(str(problem))
    reported = problems or [first]
    if silent:
        return f"rank {silent[0]} stopped answering; {reported[0]}"
    own = [p for p in reported if "Connection" not in p and "closed" not in p]
    return (own or reported)[0]


def find_placement_groups(rc: RuntimeConfig) -> dict[int, Any]:
    """This deployment's placement groups that still exist, by group index."""
    from ray.util import get_placement_group, placement_group_table

    from .placement import parse_group_index

    out: dict[int, Any] = {}
    for entry in placement_group_table().values():
        name = str(entry.get("name", ""))
        index = parse_group_index(name, rc.namespace, rc.name)
        if index is not None and entry.get("state") != "REMOVED":
            out[index] = get_placement_group(name)
    return out
