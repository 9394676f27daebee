"""The group controller's /status document from observations (pure: no Ray)."""

from __future__ import annotations

from fusedserve.worker.ray.runtime_status import (
    ControllerObservation,
    Failure,
    GroupObservation,
    acceptance_length,
    controller_status,
)
from fusedserve.worker.serving.engine_client import MetricsSnapshot


def _rank(rank: int, role: str) -> dict[str, object]:
    return {"rank": rank, "role": role, "node": "127.0.0.1", "pid": 100 + rank, "labels": {"rank": str(rank)}}


def _snapshot(rank: int, executed: int, forwards: int = 3, drafts: int = 0, accepted: int = 0) -> MetricsSnapshot:
    return MetricsSnapshot(labels={"rank": str(rank)}, collective_calls={("all_reduce", "tp", "gloo"): executed},
                           collective_planned={("all_reduce", "tp"): 2 * forwards}, forwards=forwards,
                           spec={"drafts": drafts, "accepted_tokens": accepted} if drafts else {})


def _group(index: int, revision: str, snapshots: tuple[MetricsSnapshot, ...], phase: str = "Ready"
           ) -> GroupObservation:
    return GroupObservation(index, f"fusedserve/default/demo/{index}", "STRICT_PACK", ({"fake_gpu": 1.0},) * 2,
                            phase, revision, (_rank(0, "leader"), _rank(1, "follower")), snapshots)


def test_group_entry_shows_ranks_acceptance_and_plan_vs_execution() -> None:
    ok = (_snapshot(0, 6, drafts=10, accepted=15), _snapshot(1, 6))
    status = controller_status(ControllerObservation("demo", "default", "demo", "rev2", 1, (_group(0, "rev2", ok),)))
    assert status["ready"] and status["ready_replicas"] == 1 and status["last_failure"] is None
    [g] = status["groups"]
    assert g["acceptance_length"] == 2.5 and g["collectives_match_plan"] is True and not g["outdated"]
    leader, follower = g["ranks"]
    assert leader["acceptance_length"] == 2.5 and "labels" not in leader
    assert follower["collectives"]["per_op"] == [{"op": "all_reduce", "group": "tp", "planned": 6, "executed": 6}]
    assert [c["type"] for c in status["conditions"]] == ["Ready"]


def test_a_rank_off_plan_a_failure_and_an_outdated_group_are_visible() -> None:
    off = (_snapshot(0, 6), _snapshot(1, 5))
    failures = (Failure(0, 1.0, "rank 1 died (ActorDiedError: ...)", "RankFailed"),
                Failure(1, 2.0, "needs 2 fake_gpu, 1 free (other groups hold the rest)", "Unschedulable"))
    obs = ControllerObservation("demo", "default", "demo", "rev2", 2, (_group(0, "rev1", off),), failures, restarts=1)
    status = controller_status(obs)
    [g] = status["groups"]
    assert g["collectives_match_plan"] is False and g["outdated"] is True
    assert status["restarts"] == 1 and status["last_failure"]["kind"] == "Unschedulable"
    assert status["updated_replicas"] == 0
    kinds = {c["type"]: c for c in status["conditions"]}
    assert kinds["Ready"]["status"] is False and kinds["Scheduled"]["reason"] == "Unschedulable"
    assert "needs 2 fake_gpu" in kinds["Scheduled"]["message"] and kinds["Progressing"]["status"] is True


def test_acceptance_length_is_none_without_speculation() -> None:
    assert acceptance_length((_snapshot(0, 6),)) is None
    assert acceptance_length((_snapshot(0, 6, drafts=4, accepted=2), _snapshot(2, 6, drafts=4, accepted=6))) == 2.0


def test_the_group_shows_how_its_leader_keeps_the_weights() -> None:
    """/status: the leader's quantization (models/quantization.py) per group and on each rank."""
    from dataclasses import replace

    from fusedserve.models.layers.fp8_block import BlockFP8
    from fusedserve.models.quantization import Quantization

    fp8 = Quantization("auto", BlockFP8(), BlockFP8()).to_json("bfloat16")
    ranks = tuple({**_rank(r, role), "quantization": fp8} for r, role in ((0, "leader"), (1, "follower")))
    group = replace(_group(0, "rev2", (_snapshot(0, 6), _snapshot(1, 6))), ranks=ranks)
    [g] = controller_status(ControllerObservation("demo", "default", "demo", "rev2", 1, (group,)))["groups"]
    assert g["quantization"] == {"requested": "auto", "checkpoint": "fp8", "weight_block_size": [128, 128],
                                 "weights": "fp8", "description": fp8["description"]}
    assert "FP8 weights, Triton block-scaled FP8 GEMMs" in fp8["description"]
    assert g["ranks"][1]["quantization"] == fp8
    plain = controller_status(ControllerObservation("demo", "default", "demo", "rev2", 1, (_group(0, "rev2", ()),)))
    assert plain["groups"][0]["quantization"] is None  # ranks not started yet
