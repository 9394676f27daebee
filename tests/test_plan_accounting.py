"""Planned vs executed, forward by forward, through the engine on several gloo ranks (CPU).

Every forward counts its own plan variant as it starts (``CollectiveLedger.begin_forward``), so a run
whose forwards switch variants — DP attention's MAX_LEN (FULL gathered by all-gather) and SUM_LEN
(by all-reduce), the fused plan for at most 2048 tokens and the unfused one above — still has
planned == executed on every rank, and ``/status``'s ``matches_plan`` stays true; one collective
more than planned makes it false. The multi-rank CUDA-graph path runs here too, eagerly off CUDA:
the leader announces the capture, every rank captures the same shapes, replays count as captured.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from fusedserve.worker.engine.sequence import SamplingParams
from fusedserve.worker.parallel.local_ranks import run_on_ranks

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _accounting(ledger: Any) -> dict[str, Any]:
    """A rank's planned and executed calls by (op, group), and what /status says of them."""
    from fusedserve.worker.serving.engine_stats import ledger_snapshot
    from fusedserve.worker.serving.local_engine_client import group_status

    snap = ledger_snapshot(ledger, {})
    executed: Counter[tuple[str, str]] = Counter()
    for (op, group, _path), n in snap.collective_calls.items():
        executed[(op, group)] += n
    return {"planned": dict(snap.collective_planned), "executed": dict(executed), "forwards": snap.forwards,
            "matches_plan": group_status(snap, ready=True)["collectives"]["matches_plan"]}


def _inject_extra_collective(ledger_owner: Any) -> None:
    """One all-reduce no plan asked for (what the reduce-twice bug does), on this rank."""
    groups, collectives = ledger_owner.comm.groups, ledger_owner.comm.collectives
    collectives.all_reduce(torch.zeros(4), groups.tp, "injected")


def _dp_rank(rank: int, world: int, backend: str, model_dir: str, graphs: bool) -> dict[str, Any]:
    """tp=2 dp=2 ep=2: each DP leader serves its own requests (one long, one short, at different times)."""
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.parallel.rank import build_rank, lead_engine, leads

    groups = build_groups(ParallelConfig(2, 2, 2), rank, backend)
    config = EngineConfig(num_blocks=32, max_num_seqs=4, max_batch_tokens=64, skip_tokenizer=True,
                          cuda_graphs=graphs, cuda_graph_batch_sizes=(1, 2, 4))
    built = build_rank(model_dir, config, groups, backend)
    assert leads(groups)  # attn_tp = 1: every rank leads its DP group
    engine, runner = lead_engine(built, model_dir, config)
    prompts = [[5, 9, 17, 3, 44, 8, 100, 7, 7, 1, 20, 21]] if groups.coords.dp_rank == 0 else [[200, 13]]
    for p in prompts:
        engine.add_request(p, GREEDY)
    done, tokens = 0, []
    for i in range(40):  # every step is one round on both DP leaders: the same number of steps on each
        if i == 10 and groups.coords.dp_rank == 1:
            engine.add_request([31, 32, 33, 34, 35, 36], GREEDY)  # arrives while group 0 decodes
        for o in engine.step():
            done += o.finished
            tokens += o.new_token_ids
    out = _accounting(built.model.comm.ledger)
    out["done"], out["tokens"] = done, tokens
    out["graph_rounds"] = runner.rounds.graph_rounds if runner.rounds is not None else 0
    _inject_extra_collective(built.model)
    out["after_injection"] = _accounting(built.model.comm.ledger)["matches_plan"]
    return out


def test_dp_attention_mixing_max_len_and_sum_len_matches_its_plan(tmp_path: Path) -> None:
    """Eager, then with the DP leaders agreeing on graph replays (padded idle groups included)."""
    from fusedserve.tiny import make_tiny_deepseek_v3

    model_dir = str(make_tiny_deepseek_v3(tmp_path / "ds"))
    eager = run_on_ranks(_dp_rank, 2, model_dir, False, backend="gloo", timeout_s=300)
    graphed = run_on_ranks(_dp_rank, 2, model_dir, True, backend="gloo", timeout_s=300)
    assert [r["tokens"] for r in graphed] == [r["tokens"] for r in eager]
    assert all(r["graph_rounds"] > 0 for r in graphed) and all(r["graph_rounds"] == 0 for r in eager)
    for r in eager + graphed:
        assert r["done"] == (1 if r is eager[0] or r is graphed[0] else 2)
        assert r["planned"] == r["executed"] and r["matches_plan"], r
        # Both paddings ran: MAX_LEN gathers FULL with all-gather(tp), SUM_LEN with all-reduce(tp).
        assert r["planned"].get(("all_gather", "tp"), 0) > 0 and r["planned"].get(("all_reduce", "tp"), 0) > 0, r
        assert r["after_injection"] is False


def _tp_rank_built(rank: int, world: int, backend: str, model_dir: str, config: Any) -> tuple[Any, Any]:
    """This rank of a tp=world group (the reference fusion): (built rank, (engine, runner)) on the leader; a
    follower serves the leader's steps until it stops, then (built rank, None)."""
    from fusedserve.models.parallel.groups import ParallelConfig, ParallelGroups, build_groups
    from fusedserve.worker.parallel.rank import build_rank, follower_channel, lead_engine, leads
    from fusedserve.worker.parallel.step_channel import follow

    groups = build_groups(ParallelConfig(world), rank, backend) if world > 1 else ParallelGroups.single_rank()
    built = build_rank(model_dir, config, groups, backend, "reference")
    if not leads(groups):
        follow(built.executor, follower_channel(groups))
        return built, None
    return built, lead_engine(built, model_dir, config)


def _tp2_rank(rank: int, world: int, backend: str, model_dir: str, graphs: bool) -> dict[str, Any]:
    from fusedserve.worker.engine.config import EngineConfig

    # max_batch_tokens above the fusion gate: a 2100-token prefill takes the unfused plan, decode the fused.
    config = EngineConfig(num_blocks=160, max_num_seqs=3, max_batch_tokens=4096, skip_tokenizer=True,
                          cuda_graphs=graphs, cuda_graph_batch_sizes=(1, 2, 4))
    built, lead = _tp_rank_built(rank, world, backend, model_dir, config)
    if lead is None:
        return {"tokens": None, **_accounting(built.model.comm.ledger), "graph_runs": _runs(built.executor)}
    engine, runner = lead
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (1100, 1000)] + [[7, 7, 1]]
    try:
        tokens = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    finally:
        runner.stop()
    return {"tokens": tokens, **_accounting(built.model.comm.ledger), "graph_runs": _runs(built.executor)}


def _runs(executor: Any) -> int:
    return executor.graphs.runs if executor.graphs is not None else 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_tp2_fused_and_unfused_forwards_and_graph_replays_match_the_plan(tmp_path: Path, graphs: bool) -> None:
    from fusedserve.tiny import make_tiny_llama

    model_dir = str(make_tiny_llama(tmp_path / "llama", max_position_embeddings=4096))
    [single] = run_on_ranks(_tp2_rank, 1, model_dir, False, backend="gloo", timeout_s=300)
    ranks = run_on_ranks(_tp2_rank, 2, model_dir, graphs, backend="gloo", timeout_s=300)
    assert ranks[0]["tokens"] == single["tokens"]
    for r in ranks:
        assert r["planned"] == r["executed"] and r["matches_plan"], r
        assert r["planned"].get(("fused_ar_add_rmsnorm", "tp"), 0) > 0  # decode steps: fused
        assert r["planned"].get(("all_reduce", "tp"), 0) > 2 * 4  # the long prefill: unfused, per boundary
        assert (r["graph_runs"] > 0) is graphs  # the follower replays the shapes the leader announced
    assert ranks[0]["forwards"] == ranks[1]["forwards"]


def _tp2_prefill_rank(rank: int, world: int, backend: str, model_dir: str, lengths: tuple[int, ...]
                      ) -> dict[str, Any]:
    """Prompts one at a time, each prefilled alone: at a captured length (``prefill_graph_tokens``) a replay."""
    from fusedserve.worker.engine.config import EngineConfig

    config = EngineConfig(num_blocks=64, max_num_seqs=2, max_batch_tokens=256, skip_tokenizer=True,
                          cuda_graphs=True, cuda_graph_batch_sizes=(1, 2), prefill_graph_tokens=lengths)
    built, lead = _tp_rank_built(rank, world, backend, model_dir, config)
    if lead is None:
        return {"tokens": None, **_accounting(built.model.comm.ledger), "graph_runs": _runs(built.executor)}
    engine, runner = lead
    g = torch.Generator().manual_seed(5)
    try:
        tokens = [engine.generate([torch.randint(0, 250, (n,), generator=g).tolist()], GREEDY)[0].token_ids
                  for n in (5, 12, 40)]  # padded to 8 and 16; 40 fits no length: eager
    finally:
        runner.stop()
    return {"tokens": tokens, **_accounting(built.model.comm.ledger), "graph_runs": _runs(built.executor)}


def test_tp2_prefill_graphs_give_the_eager_tokens_and_match_the_plan(tmp_path: Path) -> None:
    """``prefill_graph_tokens`` on two ranks (given: the default takes them on one rank only): each lone
    prompt's prefill padded to a captured length and replayed on both ranks gives the single rank's eager
    tokens, and every rank executes what it planned."""
    from fusedserve.tiny import make_tiny_llama

    model_dir = str(make_tiny_llama(tmp_path / "llama", max_position_embeddings=4096))
    [single] = run_on_ranks(_tp2_prefill_rank, 1, model_dir, (), backend="gloo", timeout_s=300)
    decode_only = run_on_ranks(_tp2_prefill_rank, 2, model_dir, (), backend="gloo", timeout_s=300)
    ranks = run_on_ranks(_tp2_prefill_rank, 2, model_dir, (8, 16), backend="gloo", timeout_s=300)
    assert ranks[0]["tokens"] == decode_only[0]["tokens"] == single["tokens"]
    for r, d in zip(ranks, decode_only, strict=True):
        assert r["planned"] == r["executed"] and r["matches_plan"], r
        assert r["graph_runs"] == d["graph_runs"] + 2  # the 5- and 12-token prefills replayed, on both ranks
    assert ranks[0]["forwards"] == ranks[1]["forwards"]
