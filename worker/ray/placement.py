"""Engine group -> Ray placement group (pure: no Ray import, no I/O).

One bundle per rank: ``{"GPU": 1, "CPU": 1}`` on GPUs; locally ``{"CPU": 0.25, "fake_gpu": 1}``
(Ray cannot fake ``GPU``, so a custom resource counts the pretend accelerators). A group that
fits one node is STRICT_PACK: every rank on one node, which the fused all-reduce's IPC workspace
and NVLink need, and a tensor-parallel group never straddles nodes. Larger groups will be whole-
node slices (``node_slices``: STRICT_SPREAD over slices, each slice STRICT_PACK); until then they
are refused with a ``PlacementError``.

Names are ``fusedserve/<namespace>/<name>/<group-index>`` and the placement groups are
detached, so a restarted controller finds (re-adopts) its groups by name. A replacement group
takes the lowest free index; rank actors are named ``<group name>/rank<r>``.

    plan = plan_group("default", "tiny-code", 0, ranks=2, cluster=ClusterShape.local())
    plan.bundles == ({"CPU": 0.25, "fake_gpu": 1.0},) * 2 and plan.strategy == "STRICT_PACK"
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

LOCAL_GPU_RESOURCE = "fake_gpu"
LOCAL_CPU_PER_RANK = 0.25  # a CPU rank mostly waits on gloo; 4 ranks fit a 1-CPU budget
GPU_CPU_PER_RANK = 1.0
NAME_PREFIX = "fusedserve"
RAY_NAMESPACE = "fusedserve"  # of the named, detached rank actors
# Addresses of this host alone (the embedded Ray's node address, the default HTTP listen address).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class PlacementError(ValueError):
    """An engine group that this cluster's shape cannot hold; the message says why (permanent)."""


@dataclass(frozen=True)
class ClusterShape:
    """What the planner needs to know of the cluster: which resource counts accelerators and
    how many one node has."""

    accelerator: str  # "GPU" or LOCAL_GPU_RESOURCE
    gpus_per_node: int

    @staticmethod
    def local(fake_gpus: int = 8) -> ClusterShape:
        return ClusterShape(LOCAL_GPU_RESOURCE, fake_gpus)

    @property
    def gpus(self) -> bool:
        return self.accelerator == "GPU"


@dataclass(frozen=True)
class PlacementPlan:
    name: str
    bundles: tuple[dict[str, float], ...]  # bundle i holds rank i
    strategy: str  # "STRICT_PACK" (one node); whole-node slices later
    slices: tuple[tuple[int, ...], ...]  # ranks sharing a node, in node order
    lifetime: str = "detached"

    @property
    def ranks(self) -> int:
        return len(self.bundles)

    def needs(self) -> dict[str, float]:
        """Total resources of the bundles."""
        out: dict[str, float] = {}
        for b in self.bundles:
            for k, v in b.items():
                out[k] = out.get(k, 0.0) + v
        return out


def group_prefix(namespace: str, deployment: str) -> str:
    return f"{NAME_PREFIX}/{namespace}/{deployment}/"


def group_name(namespace: str, deployment: str, index: int) -> str:
    return f"{group_prefix(namespace, deployment)}{index}"


def parse_group_index(name: str, namespace: str, deployment: str) -> int | None:
    """The group index of one of this deployment's placement group names, else None."""
    prefix = group_prefix(namespace, deployment)
    rest = name[len(prefix):] if name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


def rank_actor_name(group: str, rank: int) -> str:
    return f"{group}/rank{rank}"


def lowest_free_index(used: Iterable[int]) -> int:
    taken = set(used)
    return next(i for i in range(len(taken) + 1) if i not in taken)


def node_slices(ranks: int, gpus_per_node: int, attn_tp: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Ranks grouped into whole nodes: [0..g-1], [g..2g-1], ... A group that fits one node is one
    slice. A larger one must be whole nodes, and each attention-TP group (``attn_tp`` consecutive
    ranks; default: the whole group) must stay inside a node: the fused all-reduce's workspace is
    intra-node IPC. DP/EP collectives may cross nodes."""
    if gpus_per_node < 1:
        raise PlacementError(f"nodes of {gpus_per_node} GPUs hold no rank")
    if ranks <= gpus_per_node:
        return (tuple(range(ranks)),)
    if ranks % gpus_per_node:
        raise PlacementError(f"an engine group of {ranks} ranks larger than a node must be a whole number of "
                             f"{gpus_per_node}-GPU nodes")
    inner = ranks if attn_tp is None else attn_tp
    if gpus_per_node % inner:
        raise PlacementError(f"attention tensor-parallel groups of {inner} ranks would straddle "
                             f"{gpus_per_node}-GPU nodes")
    return tuple(tuple(range(s, s + gpus_per_node)) for s in range(0, ranks, gpus_per_node))


def rank_bundle(cluster: ClusterShape) -> dict[str, float]:
    if cluster.gpus:
        return {"GPU": 1.0, "CPU": GPU_CPU_PER_RANK}
    return {"CPU": LOCAL_CPU_PER_RANK, cluster.accelerator: 1.0}


def plan_group(namespace: str, deployment: str, index: int, ranks: int, cluster: ClusterShape,
               attn_tp: int | None = None) -> PlacementPlan:
    """The placement group of engine group ``index``: one bundle per rank, one node."""
    if ranks < 1:
        raise PlacementError(f"an engine group needs at least one rank, got {ranks}")
    if cluster.gpus_per_node < 1:  # e.g. `--ray-address` of a cluster started with plain `ray start`
        raise PlacementError(
            "no node of the Ray cluster has " + ("GPUs" if cluster.gpus else
                                                 f"the {cluster.accelerator!r} resource that CPU ranks take")
            + f": start GPU nodes with `ray start --num-gpus N`, CPU nodes with `ray start --resources "
            f"'{{\"{LOCAL_GPU_RESOURCE}\": N}}'` (N: the ranks a node holds)")
    slices = node_slices(ranks, cluster.gpus_per_node, attn_tp)
    if len(slices) > 1:
        raise PlacementError(
            f"an engine group of {ranks} ranks does not fit one node of {cluster.gpus_per_node} "
            f"{cluster.accelerator}s; groups larger than a node come later (whole-node slices)")
    bundle = rank_bundle(cluster)
    return PlacementPlan(group_name(namespace, deployment, index), tuple(dict(bundle) for _ in range(ranks)),
                         "STRICT_PACK", slices)


def explain_unschedulable(plan: PlacementPlan, nodes: Iterable[Mapping[str, float]],
                          available: Mapping[str, float]) -> str:
    """Why a placement group stays pending: ``nodes`` are the alive nodes' total resources,
    ``available`` the cluster's free resources now."""
    need = plan.needs()
    nodes = list(nodes)
    total: dict[str, float] = {}
    for n in nodes:
        for k, v in n.items():
            total[k] = total.get(k, 0.0) + v
    short = [f"needs {need[k]:g} {k}, cluster has {total.get(k, 0.0):g}" for k in sorted(need)
             if total.get(k, 0.0) < need[k]]
    if short:
        return "; ".join(short)
    if plan.strategy == "STRICT_PACK":
        per_node = [k for k in sorted(need) if max((n.get(k, 0.0) for n in nodes), default=0.0) < need[k]]
        if per_node:
            k = per_node[0]
            biggest = max(n.get(k, 0.0) for n in nodes)
            return f"needs {need[k]:g} {k} on one node (STRICT_PACK), the largest node has {biggest:g}"
    busy = [f"needs {need[k]:g} {k}, {available.get(k, 0.0):g} free (other groups hold the rest)"
            for k in sorted(need) if available.get(k, 0.0) < need[k]]
    return "; ".join(busy) or f"{plan.strategy} found no node with {plan.ranks} free bundles"
