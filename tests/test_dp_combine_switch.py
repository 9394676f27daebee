"""The benchmark-only DP combine switch (``plan_communication(..., dp_combine="all_reduce")``).

Under DP attention + EP the plan completes every sum owed to tp with ONE reduce-scatter. The
benchmark alternative (bench/dp_ep_combine.py) all-reduces the FULL sum and takes this rank's
chunk instead. On 2 gloo ranks (tp=2, dp=2, ep=2), both paddings, both MoE architectures:
the alternative gives the same logits as the default, each runs exactly its own plan
(planned == executed), and the ledger shows all_reduce(tp) exactly where the default shows
reduce_scatter(tp). The default plan is unchanged by the keyword's existence.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fusedserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from fusedserve.models.parallel.comm_plan import BoundaryKind, plan_communication
from fusedserve.models.parallel.groups import ParallelConfig

PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7, 7, 1, 240, 13], [200]]


def test_default_plan_is_unchanged_and_the_switch_only_swaps_the_tp_combine() -> None:
    blocks = DeepseekV3ForCausalLM.blocks(SimpleNamespace(num_hidden_layers=3))
    for tp, dp, ep in [(2, 2, 2), (4, 2, 2), (4, 4, 4), (8, 8, 8)]:
        cfg = ParallelConfig(tp, dp, ep)
        default = plan_communication(cfg, blocks, fusion=False)
        assert default == plan_communication(cfg, blocks, fusion=False, dp_combine="reduce_scatter")
        alt = plan_communication(cfg, blocks, fusion=False, dp_combine="all_reduce")
        assert alt.dp_combine == "all_reduce" and default.dp_combine == "reduce_scatter"
        for d, a in ((default.unfused, alt.unfused), (default.sum_len, alt.sum_len)):
            assert d is not None and a is not None
            for bd, ba in zip(d.boundaries, a.boundaries, strict=True):
                if bd.owed == "tp" and bd.kind is BoundaryKind.DP_SCATTER_ADD_NORM_GATHER:
                    assert ba.kind is BoundaryKind.DP_ALL_REDUCE_SLICE_ADD_NORM_GATHER
                    assert bd.steps[0].op == "reduce_scatter" and ba.steps[0].op == "all_reduce"
                    assert ba.steps[0].group == "tp" and ba.steps[0].purpose == "complete"
                    assert bd.steps[1:] == ba.steps[1:]  # the gather is the same
                else:
                    assert bd == ba  # attention (attn_tp) combines and the first boundary keep their RS
    # Without DP attention the keyword changes nothing.
    cfg = ParallelConfig(2, 1, 2)
    assert plan_communication(cfg, blocks, True) == plan_communication(cfg, blocks, True, dp_combine="all_reduce")
    with pytest.raises(ValueError):
        plan_communication(cfg, blocks, True, dp_combine="twice")


def _rank(rank: int, world: int, backend: str, model_dirs: dict[str, str]) -> dict[str, Any]:
    from fusedserve.models.parallel.dp_geometry import Padding
    from fusedserve.models.parallel.groups import build_groups
    from fusedserve.verify import _prefill_step
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.parallel.rank import build_rank

    cfg = ParallelConfig(2, 2, 2)
    groups = build_groups(cfg, rank, backend)
    out: dict[str, Any] = {}
    mine = PROMPTS[groups.coords.dp_rank :: cfg.dp]
    dp_num_tokens = tuple(sum(map(len, PROMPTS[d :: cfg.dp])) for d in range(cfg.dp))
    config = EngineConfig(num_blocks=16, max_num_seqs=4, skip_tokenizer=True)
    for arch, model_dir in model_dirs.items():
        # The benchmark-only plan is a model built with it: no spec, config or CLI reaches dp_combine.
        ranks = {name: build_rank(model_dir, config, groups, backend, dp_combine=name)
                 for name in ("reduce_scatter", "all_reduce")}
        for padding in Padding:
            for name, built in ranks.items():
                logits = built.executor.run(_prefill_step(mine, dp_num_tokens, padding)).logits
                ledger = built.model.comm.ledger
                out[(arch, padding.value, name)] = {
                    "logits": logits.clone(),
                    "planned": ledger.forward_plan(),
                    "executed": [r.key for r in ledger.forward_records()],
                }
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from fusedserve.tiny import make_tiny_deepseek_v3, make_tiny_nemotron_h

    root: Path = tmp_path_factory.mktemp("dp-combine")
    return {"deepseek_v3": str(make_tiny_deepseek_v3(root / "ds")),
            "nemotron_h": str(make_tiny_nemotron_h(root / "nh"))}


def test_all_reduce_combine_gives_the_same_logits_and_runs_its_own_plan(model_dirs: dict[str, str]) -> None:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    ranks = run_on_ranks(_rank, 2, model_dirs, backend="gloo", timeout_s=300)
    for res in ranks:
        for arch in model_dirs:
            for padding in ("max_len", "sum_len"):
                rs, ar = res[(arch, padding, "reduce_scatter")], res[(arch, padding, "all_reduce")]
                what = f"{arch} {padding}"
                for run in (rs, ar):
                    assert run["executed"] == run["planned"], what  # planned == executed, both ways
                torch.testing.assert_close(ar["logits"], rs["logits"], atol=1e-5, rtol=0, msg=what)
                assert len(rs["executed"]) == len(ar["executed"]), what
                swapped = [(a, b) for a, b in zip(rs["executed"], ar["executed"]) if a != b]
                assert swapped, f"{what}: no tp combine to swap"
                for (site_r, op_r, g_r), (site_a, op_a, g_a) in swapped:
                    assert (site_r, g_r) == (site_a, g_a) == (site_r, "tp"), what
                    assert (op_r, op_a) == ("reduce_scatter", "all_reduce"), what
                assert not any(op == "reduce_scatter" and g == "tp" for _s, op, g in ar["executed"]), what
                # One tp combine per block that owes tp (MoE / dense MLP / Nemotron's MLP-like blocks).
                assert sum(op == "reduce_scatter" and g == "tp" for _s, op, g in rs["executed"]) == len(swapped)
