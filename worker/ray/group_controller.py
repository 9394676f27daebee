"""The group controller: a Ray driver that keeps ``replicas`` engine groups serving, and the
``EngineClient`` the HTTP API talks to (``router.py`` picks the least busy leader of the ready groups).

Reconciling (``reconcile_once``, every second on a background thread):

- a Ready group whose rank died or failed is torn down and recreated at the same index (its
  requests in flight already ended with ``EngineDead``: the HTTP layer answers 503, never hangs);
  the failure stays in ``status()``;
- missing groups are created at the lowest free index, extra ones removed;
- groups of an older revision (``apply`` with a changed spec) are rolled one at a time: a new
  group is made ready first, then one outdated group goes; when the surge cannot be placed, the
  outdated group goes first;
- a failed creation (unschedulable placement group, a rank that cannot start) is recorded with
  its reason and retried after a delay.

``start`` re-adopts the groups a previous controller left (named, detached placement groups and
rank actors), then creates what is missing and returns once every group is ready; it raises
``GroupError`` when none can be made ready.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import ray

from ..engine.outputs import RequestOutput
from ..engine.sequence import FinishReason, InvalidRequest, SamplingParams
from ..serving.engine_client import EngineDead, MetricsSnapshot, NoReadyEngine
from ..spec import RuntimeConfig
from .engine_group import (
    EngineGroup,
    GroupError,
    GroupStartFailed,
    GroupUnschedulable,
    find_placement_groups,
    short,
)
from .output_pump import OutputPump
from .placement import ClusterShape, PlacementError, lowest_free_index
from .router import NoCandidate, Router
from .runtime_status import ControllerObservation, Failure, GroupObservation, controller_status

if TYPE_CHECKING:
    from ..engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

RECONCILE_EVERY_S = 1.0
RETRY_UNSCHEDULABLE_S = 5.0
RETRY_START_FAILED_S = (10.0, 30.0, 60.0)
RPC_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 60.0  # a group leaving (rolled, scaled down) first finishes its requests this long


class GroupController:
    def __init__(self, config: RuntimeConfig, cluster: ClusterShape) -> None:
        self.config = config
        self.cluster = cluster
        self.groups: dict[int, EngineGroup] = {}
        self.failures: list[Failure] = []
        self.restarts = 0
        self.creating: dict[int, dict[str, Any]] = {}
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._retry_at = 0.0
        self._start_failures = 0
        self._router = Router()
        self._requests: dict[str, tuple[EngineGroup, Any]] = {}  # request id -> (group, leader) serving it
        # (event loop, leader) -> the leader's output stream read on that loop (touched on that loop only)
        self._pumps: dict[tuple[int, int], OutputPump] = {}
        self._thread: threading.Thread | None = None

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self.adopt()
        while len(self.groups) < self.config.replicas:
            self._create(self._free_index(), raise_errors=True)
        self._thread = threading.Thread(target=self._run, name="fusedserve-groups", daemon=True)
        self._thread.start()

    def adopt(self) -> None:
        """Take over the groups a previous controller of this deployment left running."""
        for index, pg in sorted(find_placement_groups(self.config).items()):
            group = EngineGroup.adopt(self.config, index, pg, self.cluster)
            if group.phase == "Ready":
                with self._lock:
                    self.groups[index] = group
            else:
                group.teardown()

    def apply(self, config: RuntimeConfig) -> None:
        """A new spec: the reconcile loop rolls outdated groups one at a time and scales to ``replicas``."""
        if config.name != self.config.name or config.namespace != self.config.namespace:
            raise ValueError("apply() changes one deployment's spec, not its name or namespace")
        log.info("applying revision %s (was %s), %d replicas", config.revision, self.config.revision, config.replicas)
        self.config = config
        self._retry_at = 0.0
        self._wake.set()

    def shutdown(self) -> None:
        """Stop reconciling; kill every rank actor and remove every placement group of this deployment."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        with self._lock:
            groups, self.groups = list(self.groups.values()), {}
        for g in groups:
            g.teardown()
        try:  # a group that was half-made when we stopped
            for index, pg in find_placement_groups(self.config).items():
                EngineGroup.adopt(self.config, index, pg, self.cluster).teardown()
        except Exception as e:  # noqa: BLE001 (best effort: Ray shuts down next)
            log.warning("cleanup: %s", short(e))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile_once()
            except Exception:
                log.exception("reconcile failed")
            self._wake.wait(RECONCILE_EVERY_S)
            self._wake.clear()

    # --- reconcile --------------------------------------------------------------------------------

    def reconcile_once(self) -> None:
        rc = self.config
        for index, group in self._snapshot():
            problem = group.check()
            if problem is not None and not self._stop.is_set():
                self._fail(index, group, problem)
        if self._stop.is_set() or time.monotonic() < self._retry_at:
            return
        groups = dict(self._snapshot())
        extra = sorted(groups, key=lambda i: (groups[i].revision == rc.revision, -i))[:max(0, len(groups) - rc.replicas)]
        outdated = sorted(i for i, g in groups.items() if g.revision != rc.revision and i not in extra)
        for index in extra:
            self._remove(index)
        if len(groups) < rc.replicas:
            self._create(self._free_index())
        elif outdated:
            self._roll(outdated[0])

    def _free_index(self) -> int:
        with self._lock:
            return lowest_free_index(set(self.groups) | set(self.creating))

    def _roll(self, index: int) -> None:
        """Replace one outdated group: surge first, else (no room for the surge) replace in place."""
        try:
            self._create(self._free_index(), raise_errors=True, record=False)
        except GroupUnschedulable:
            log.info("no room for a surge group: replacing group %d in place", index)
            self._remove(index)
            self._create(index)
            return
        except GroupError:
            return
        self._remove(index)

    def _create(self, index: int, raise_errors: bool = False, record: bool = True) -> None:
        rc = self.config
        with self._lock:
            self.creating[index] = {"index": index, "since": time.time(), "revision": rc.revision}
        try:
            group = EngineGroup.create(rc, index, self.cluster)
        except (GroupError, PlacementError) as e:
            reason = e.reason if isinstance(e, GroupError) else str(e)
            kind = "Unschedulable" if isinstance(e, (GroupUnschedulable, PlacementError)) else "StartFailed"
            if record or kind != "Unschedulable":  # a surge that does not fit is no failure
                self._record(Failure(index, time.time(), reason, kind))
            if isinstance(e, GroupStartFailed):
                self._start_failures += 1
                delay = RETRY_START_FAILED_S[min(self._start_failures, len(RETRY_START_FAILED_S)) - 1]
            else:
                delay = RETRY_UNSCHEDULABLE_S
            self._retry_at = time.monotonic() + delay
            log.warning("engine group %d: %s (retrying in %.0f s)", index, reason, delay)
            if raise_errors:
                if isinstance(e, PlacementError):
                    raise GroupUnschedulable(reason) from e
                raise
            return
        finally:
            with self._lock:
                self.creating.pop(index, None)
        self._start_failures = 0
        with self._lock:
            old = self.groups.get(index)
            self.groups[index] = group
        if old is not None and old is not group:
            old.teardown()

    def _fail(self, index: int, group: EngineGroup, problem: str) -> None:
        log.warning("engine group %d failed (%s); recreating it", index, problem)
        group.phase = "Failed"
        self._record(Failure(index, time.time(), problem, "RankFailed"))
        self.restarts += 1
        with self._lock:
            if self.groups.get(index) is group:
                del self.groups[index]
        group.teardown()
        self._create(index)

    def _remove(self, index: int) -> None:
        """Drain a group (no new requests; those in flight finish), then tear it down."""
        with self._lock:
            group = self.groups.get(index)
            if group is None:
                return
            group.phase = "Draining"
        log.info("removing engine group %d (revision %s)", index, group.revision)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self._in_flight(group) and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.05)
        with self._lock:
            if self.groups.get(index) is group:
                del self.groups[index]
        group.teardown()

    def _in_flight(self, group: EngineGroup) -> int:
        with self._lock:
            return sum(1 for g, _ in self._requests.values() if g is group)

    def _record(self, failure: Failure) -> None:
        with self._lock:
            self.failures = [*self.failures[-49:], failure]

    def _snapshot(self) -> list[tuple[int, EngineGroup]]:
        with self._lock:
            return sorted((i, g) for i, g in self.groups.items() if g.phase == "Ready")

    # --- EngineClient -----------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def max_model_len(self) -> int | None:
        """What the ready groups of the current revision accept (None while none is ready)."""
        ready = [g for _, g in self._snapshot() if g.max_model_len is not None]
        current = [g for g in ready if g.revision == self.config.revision] or ready
        return min((g.max_model_len for g in current if g.max_model_len is not None), default=None)

    def load_tokenizer(self) -> Tokenizer | None:
        """From the checkpoint's tokenizer files here: prompts are tokenised in this process, not by a rank."""
        from ..engine.tokenizer import Tokenizer, TokenizerError

        if self.config.skip_tokenizer:  # model.skipTokenizer: token-id prompts only, text and chat get a 400
            return None
        try:
            return Tokenizer.from_dir(self.config.model_path)
        except TokenizerError as e:
            log.warning("no tokenizer for the API (token-id prompts only): %s", e)
            return None

    def _pick(self) -> tuple[EngineGroup, Any]:
        """The leader the router picks among every ready group's leaders (call with the lock held)."""
        leaders = [(g.index, i) for _, g in self._snapshot() for i in range(len(g.leaders))]
        in_flight: dict[tuple[int, int], int] = {}
        for g, a in self._requests.values():
            key = (g.index, next((i for i, x in enumerate(g.leaders) if x is a), -1))
            in_flight[key] = in_flight.get(key, 0) + 1
        try:
            index, i = self._router.pick(leaders, in_flight)
        except NoCandidate:
            last = f" (last failure: {self.failures[-1].reason})" if self.failures else ""
            raise NoReadyEngine(f"no ready engine groups{last}") from None
        group = self.groups[index]
        return group, group.leaders[i]

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       final_only: bool = False) -> AsyncIterator[RequestOutput]:
        with self._lock:  # picked and counted at once: a draining group sees every request it got
            group, leader = self._pick()
            self._requests[request_id] = (group, leader)
        finished = False
        pump: OutputPump | None = None
        try:
            pump = self._pump(group, leader)
            queue = pump.open(request_id)
            await leader.submit.remote(prompt, asdict(params), request_id, pump.channel, final_only)
            while not finished:
                item = await queue.get()
                if isinstance(item, EngineDead):
                    raise item
                reason = item.get("finish_reason")
                item["finish_reason"] = FinishReason(reason) if reason is not None else None
                out = RequestOutput(**item)
                finished = out.finished
                yield out
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError
                ) as e:
            raise EngineDead(f"engine group {group.index} failed: {short(e)}") from None
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, (InvalidRequest, EngineDead)):
                raise cause from None
            raise EngineDead(f"engine group {group.index}: {short(e)}") from None
        finally:
            if pump is not None:
                pump.close(request_id)
            with self._lock:
                self._requests.pop(request_id, None)
            if not finished:  # the consumer went away, or the group failed
                try:
                    leader.abort.remote(request_id)
                except ray.exceptions.RayError as e:
                    log.debug("abort %s: %s", request_id, short(e))

    def _pump(self, group: EngineGroup, leader: Any) -> OutputPump:
        """The output stream of ``leader`` on the running loop (a new one after the last one ended)."""
        key = (id(asyncio.get_running_loop()), id(leader))
        pump = self._pumps.get(key)
        if pump is None or not pump.alive or pump.leader is not leader:
            pump = self._pumps[key] = OutputPump(leader, group.index, on_end=self._forget_pump)
        return pump

    def _forget_pump(self, pump: OutputPump) -> None:
        key = (id(pump.loop), id(pump.leader))
        if self._pumps.get(key) is pump:
            del self._pumps[key]

    async def abort(self, request_id: str) -> None:
        entry = self._requests.get(request_id)
        if entry is not None:
            try:
                await entry[1].abort.remote(request_id)
            except ray.exceptions.RayError as e:
                log.debug("abort %s: %s", request_id, short(e))

    async def status(self) -> dict[str, Any]:
        rc = self.config
        observed = []
        with self._lock:
            groups = sorted(self.groups.items())
            creating = tuple(dict(c) for c in self.creating.values())
            failures = tuple(self.failures)
        for index, g in groups:
            snapshots: list[MetricsSnapshot] = []
            error = None
            if g.phase == "Ready":
                try:
                    snapshots = await self._group_metrics(g)
                except (asyncio.TimeoutError, ray.exceptions.RayError) as e:
                    error = short(e)
            observed.append(GroupObservation(index, g.name, g.plan.strategy, g.plan.bundles, g.phase, g.revision,
                                             tuple(g.ranks), tuple(snapshots), g.adopted, error))
        return controller_status(ControllerObservation(rc.name, rc.namespace, rc.model_name, rc.revision,
                                                       rc.replicas, tuple(observed), failures, self.restarts,
                                                       creating))

    async def metrics(self) -> list[MetricsSnapshot]:
        out: list[MetricsSnapshot] = []
        for _, g in self._snapshot():
            try:
                out += await self._group_metrics(g)
            except (asyncio.TimeoutError, ray.exceptions.RayError) as e:  # a failing group: the reconcile loop deals with it
                log.debug("metrics of group %d: %s", g.index, short(e))
        return out

    async def _group_metrics(self, g: EngineGroup) -> list[MetricsSnapshot]:
        async def one(actor: Any) -> list[MetricsSnapshot]:
            return list(await actor.metrics.remote())

        per_rank = await asyncio.wait_for(asyncio.gather(*(one(a) for a in g.actors)), RPC_TIMEOUT_S)
        return [s for snapshots in per_rank for s in snapshots]


__all__ = ["GroupController", "GroupError", "GroupUnschedulable"]
