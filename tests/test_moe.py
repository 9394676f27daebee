"""MoE layer: routers against brute force, the MoE against a plain loop over tokens, and the
EP x moe_tp split (every rank's partial summed = the whole MoE) without processes.

The plain references here share no code with ``models/layers/{router,experts,moe}.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from fusedserve.models.layers.experts import FUSED, RoutedExperts, parse_expert_name
from fusedserve.models.layers.moe import MoE, expert_stacked_params
from fusedserve.models.layers.router import RouterConfig, TopKRouter, select_experts
from fusedserve.models.layers.weight_source import TensorSource
from fusedserve.models.parallel.groups import (
    ParallelConfig,
    ParallelGroups,
    unconnected_groups,
)

# --- routers against brute force ------------------------------------------------------------

def brute_route(logits: list[float], cfg: RouterConfig, bias: list[float] | None) -> dict[int, float]:
    """One token: {expert: weight}, by sorting python floats."""
    e = len(logits)
    if cfg.scoring == "sigmoid":
        scores = [1 / (1 + math.exp(-x)) for x in logits]
        choice = [s + (bias[i] if bias else 0.0) for i, s in enumerate(scores)]
    else:
        m = max(logits)
        z = sum(math.exp(x - m) for x in logits)
        scores = [math.exp(x - m) / z for x in logits]
        choice = list(scores)
    candidates = list(range(e))
    if cfg.topk_method != "greedy":
        size = e // cfg.n_group
        groups = [list(range(g * size, (g + 1) * size)) for g in range(cfg.n_group)]

        def group_score(g: list[int]) -> float:
            best = sorted((choice[i] for i in g), reverse=True)
            return sum(best[:2]) if cfg.scoring == "sigmoid" else best[0]

        kept = sorted(groups, key=group_score, reverse=True)[: cfg.topk_group]
        candidates = sorted(i for g in kept for i in g)
    chosen = sorted(candidates, key=lambda i: choice[i], reverse=True)[: cfg.top_k]
    w = {i: scores[i] for i in chosen}
    if cfg.norm_topk_prob:
        total = sum(w.values())
        w = {i: v / total for i, v in w.items()}
    return {i: v * cfg.routed_scaling_factor for i, v in w.items()}


def as_dicts(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.tolist())) for w, i in zip(weights, ids)]


ROUTERS = {
    "v3_grouped": RouterConfig(16, 3, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=2.5),
    "v3_one_group": RouterConfig(8, 2, "sigmoid", "noaux_tc", n_group=1, topk_group=1, norm_topk_prob=False,
                                 routed_scaling_factor=1.5),
    "v2_greedy": RouterConfig(12, 4, "softmax", "greedy", routed_scaling_factor=16.0, norm_topk_prob=False),
    "v2_group_limited": RouterConfig(12, 3, "softmax", "group_limited_greedy", n_group=4, topk_group=2,
                                     norm_topk_prob=True),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_router_matches_brute_force(name: str) -> None:
    cfg = ROUTERS[name]
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, cfg.num_experts, generator=g, dtype=torch.float64).float() * 2
    bias = (torch.rand(cfg.num_experts, generator=g) - 0.5) if cfg.has_correction_bias else None
    weights, ids = select_experts(logits, cfg, bias)
    assert weights.dtype == torch.float32 and ids.shape == (64, cfg.top_k)
    for t, got in enumerate(as_dicts(weights, ids)):
        want = brute_route(logits[t].tolist(), cfg, None if bias is None else bias.tolist())
        assert sorted(got) == sorted(want), f"token {t}: experts {sorted(got)} vs {sorted(want)}"
        for i in want:
            assert abs(got[i] - want[i]) < 1e-5


def test_group_limit_changes_the_choice() -> None:
    """The best experts overall sit in one group, but the second-best group wins on its top-2 sum."""
    cfg = RouterConfig(8, 2, "sigmoid", "noaux_tc", n_group=4, topk_group=1, norm_topk_prob=True)
    logits = torch.tensor([[4.0, -9.0, 3.0, 2.9, -9.0, -9.0, -9.0, -9.0]])
    _, ids = select_experts(logits, cfg, torch.zeros(8))
    assert sorted(ids[0].tolist()) == [2, 3]  # group 1 (3.0 + 2.9) beats group 0 (4.0 + -9.0)
    flat = RouterConfig(8, 2, "sigmoid", "noaux_tc", n_group=1, topk_group=1)
    assert sorted(select_experts(logits, flat, torch.zeros(8))[1][0].tolist()) == [0, 2]


def test_correction_bias_changes_choice_not_weights() -> None:
    cfg = RouterConfig(8, 2, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                       routed_scaling_factor=2.0)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 8, generator=g)
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 wins every token's choice...
    weights, ids = select_experts(logits, cfg, bias)
    assert (ids == 5).any(dim=-1).all()
    # ...but its weight is its unbiased sigmoid score, normalised with the other winner's.
    scores = logits.sigmoid()
    want = scores.gather(1, ids)
    want = want / want.sum(-1, keepdim=True) * 2.0
    torch.testing.assert_close(weights, want)
    _, unbiased_ids = select_experts(logits, cfg, torch.zeros(8))
    assert not torch.equal(ids.sort(-1).values, unbiased_ids.sort(-1).values)


def test_a_folded_shared_expert_takes_the_last_slot_with_weight_one() -> None:
    """``shared_experts``: every token also routes to expert E (the shared one, ``moe.py``), unscaled; the
    routed choice and its weights stay what they were."""
    from dataclasses import replace

    cfg = ROUTERS["v3_grouped"]
    logits = torch.randn(6, cfg.num_experts, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(cfg.num_experts, generator=torch.Generator().manual_seed(5)) * 0.2
    w, ids = select_experts(logits, cfg, bias)
    w1, ids1 = select_experts(logits, replace(cfg, shared_experts=1), bias)
    assert ids1.shape == (6, cfg.top_k + 1) and replace(cfg, shared_experts=1).slots == cfg.top_k + 1
    assert torch.equal(ids1[:, :-1], ids) and torch.equal(w1[:, :-1], w)
    assert (ids1[:, -1] == cfg.num_experts).all() and (w1[:, -1] == 1).all()


def test_router_config_validation() -> None:
    with pytest.raises(ValueError, match="does not go with"):
        RouterConfig(8, 2, "softmax", "noaux_tc")
    with pytest.raises(ValueError, match="cannot hold"):
        RouterConfig(8, 5, "sigmoid", "noaux_tc", n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="do not fit"):
        RouterConfig(8, 2, "sigmoid", "noaux_tc", n_group=3, topk_group=1)


def test_router_is_fp32_for_bf16_inputs() -> None:
    cfg = ROUTERS["v3_grouped"]
    router = TopKRouter(16, cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(5, 16)
    w32, i32 = router(x)
    w16, _ = router(x.bfloat16())
    assert router.weight.dtype == torch.float32 and w16.dtype == torch.float32
    assert w32.shape == (5, 3) and i32.dtype == torch.int64


# --- the MoE against a plain loop over tokens ------------------------------------------------

H, I_EXPERT, I_SHARED, E, LATENT = 32, 16, 24, 8, 12


def random_moe_weights(gated: bool, latent: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-style per-expert tensors of one MoE layer (prefix "mlp.")."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    d = LATENT if latent else H
    w = {"mlp.gate.weight": r(E, H, std=0.5), "mlp.gate.e_score_correction_bias": r(E, std=0.2)}
    for e in range(E):
        if gated:
            w[f"mlp.experts.{e}.gate_proj.weight"] = r(I_EXPERT, d)
        w[f"mlp.experts.{e}.up_proj.weight"] = r(I_EXPERT, d)
        w[f"mlp.experts.{e}.down_proj.weight"] = r(d, I_EXPERT)
    if gated:
        w["mlp.shared_experts.gate_proj.weight"] = r(I_SHARED, H)
    w["mlp.shared_experts.up_proj.weight"] = r(I_SHARED, H)
    w["mlp.shared_experts.down_proj.weight"] = r(H, I_SHARED)
    if latent:  # Nemotron-H with mlp_bias: latent projections and the shared expert have biases
        w["mlp.shared_experts.up_proj.bias"], w["mlp.shared_experts.down_proj.bias"] = r(I_SHARED), r(H)
        w["mlp.fc1_latent_proj.weight"], w["mlp.fc1_latent_proj.bias"] = r(LATENT, H), r(LATENT)
        w["mlp.fc2_latent_proj.weight"], w["mlp.fc2_latent_proj.bias"] = r(H, LATENT), r(H)
    return w


def fused_layout(w: dict[str, torch.Tensor], gated: bool) -> dict[str, torch.Tensor]:
    """The same weights as transformers keeps them in memory: [E, ...] expert tensors."""
    out = {k: v for k, v in w.items() if parse_expert_name(k) is None}
    up = [torch.cat([w[f"mlp.experts.{e}.gate_proj.weight"], w[f"mlp.experts.{e}.up_proj.weight"]])
          if gated else w[f"mlp.experts.{e}.up_proj.weight"] for e in range(E)]
    out["mlp.experts.gate_up_proj" if gated else "mlp.experts.up_proj"] = torch.stack(up)
    out["mlp.experts.down_proj"] = torch.stack([w[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    return out


def plain_moe(x: torch.Tensor, w: dict[str, torch.Tensor], cfg: RouterConfig, gated: bool, latent: bool,
              valid: list[bool] | None = None) -> torch.Tensor:
    """Token by token, expert by expert."""
    act = torch.nn.functional.silu if gated else (lambda t: torch.relu(t) ** 2)
    out = torch.zeros_like(x)
    bias = w["mlp.gate.e_score_correction_bias"].tolist()
    for t in range(x.shape[0]):
        if valid is not None and not valid[t]:
            continue
        xt = x[t]
        route = brute_route((w["mlp.gate.weight"] @ xt).tolist(), cfg, bias)
        h = w["mlp.fc1_latent_proj.weight"] @ xt + w["mlp.fc1_latent_proj.bias"] if latent else xt
        routed = torch.zeros_like(h)
        for e, weight in route.items():
            up = w[f"mlp.experts.{e}.up_proj.weight"] @ h
            inner = act(w[f"mlp.experts.{e}.gate_proj.weight"] @ h) * up if gated else act(up)
            routed += weight * (w[f"mlp.experts.{e}.down_proj.weight"] @ inner)
        if latent:
            routed = w["mlp.fc2_latent_proj.weight"] @ routed + w["mlp.fc2_latent_proj.bias"]
        up = w["mlp.shared_experts.up_proj.weight"] @ xt + w.get("mlp.shared_experts.up_proj.bias", 0.0)
        inner = act(w["mlp.shared_experts.gate_proj.weight"] @ xt) * up if gated else act(up)
        down = w["mlp.shared_experts.down_proj.weight"] @ inner + w.get("mlp.shared_experts.down_proj.bias", 0.0)
        out[t] = routed + down
    return out


KINDS = {  # name -> (gated, latent, router)
    "deepseek": (True, False, RouterConfig(E, 2, "sigmoid", "noaux_tc", n_group=4, topk_group=2,
                                           norm_topk_prob=True, routed_scaling_factor=2.5)),
    "nemotron_latent": (False, True, RouterConfig(E, 3, "sigmoid", "noaux_tc", n_group=2, topk_group=1,
                                                  norm_topk_prob=True, routed_scaling_factor=1.5)),
}


def build_moe(kind: str, groups: ParallelGroups) -> MoE:
    gated, latent, cfg = KINDS[kind]
    return MoE(H, I_EXPERT, cfg, groups, gated=gated, activation="silu" if gated else "relu2",
               shared_intermediate=I_SHARED, latent_size=LATENT if latent else None, latent_bias=latent,
               shared_bias=latent)


def load_moe(moe: MoE, weights: dict[str, torch.Tensor]) -> set[tuple[str, object]]:
    """A minimal loader: HF names -> our parameters (as a model's checkpoint_name_to_param does)."""
    root = torch.nn.ModuleDict({"mlp": moe})
    params = dict(root.named_parameters())
    loaded: set[tuple[str, object]] = set()
    for name, tensor in weights.items():
        expert = parse_expert_name(name)
        shard: Any = None
        pname = name
        if expert is not None:
            experts = root.get_submodule(expert.module)
            assert isinstance(experts, RoutedExperts)
            target = experts.checkpoint_target(expert)
            if target is None:
                continue
            pname, shard = f"{expert.module}.{target[0]}", target[1]
        elif "shared_experts" in name and moe.experts.gated and "down_proj" not in name:
            shard = 0 if ".gate_proj." in name else 1
            pname = name.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.", ".gate_up_proj.")
        owner = root.get_submodule(pname.rsplit(".", 1)[0])
        loader: Any = getattr(owner, "weight_loader", None)
        if loader is None:
            params[pname].data.copy_(tensor)
            filled = None
        else:
            filled = loader(params[pname], TensorSource(name, tensor), shard)
        loaded.update((pname[len("mlp."):], s) for s in (filled if filled is not None else [shard]))
    missing = {n for n in dict(moe.named_parameters())} - {p for p, _ in loaded}
    assert not missing, f"not loaded: {missing}"
    return loaded


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_moe_equals_plain_loop_over_tokens(kind: str) -> None:
    gated, latent, cfg = KINDS[kind]
    w = random_moe_weights(gated, latent)
    moe = build_moe(kind, ParallelGroups.single_rank())
    load_moe(moe, w)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(1))
    out = moe(x)
    assert out.group == "tp"
    torch.testing.assert_close(out.partial, plain_moe(x, w, cfg, gated, latent), atol=1e-5, rtol=1e-5)


def test_padding_rows_never_route_and_get_zero() -> None:
    gated, latent, cfg = KINDS["deepseek"]
    w = random_moe_weights(gated, latent)
    moe = build_moe("deepseek", ParallelGroups.single_rank())
    load_moe(moe, w)
    seen: list[torch.Tensor] = []
    moe.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone()))
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(2))
    valid = torch.tensor([True, False, True, True, False, True])
    out = moe(x, valid).partial
    assert (seen[0][~valid] == -1).all() and (seen[0][valid] >= 0).all()
    assert (out[~valid] == 0).all()
    torch.testing.assert_close(out, plain_moe(x, w, cfg, gated, latent, valid.tolist()), atol=1e-5, rtol=1e-5)


# --- EP x moe_tp: the sum over all tp ranks of their partials is the whole MoE ----------------

@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_rank_partials_sum_to_the_whole_moe(kind: str, layout: str, tp: int, ep: int) -> None:
    gated, latent, _ = KINDS[kind]
    w = random_moe_weights(gated, latent, seed=tp * 10 + ep)
    if layout == "fused":
        w = fused_layout(w, gated)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(4))
    whole = build_moe(kind, ParallelGroups.single_rank())
    load_moe(whole, w)
    total = torch.zeros(9, H)
    for rank in range(tp):
        groups = unconnected_groups(ParallelConfig(tp, 1, ep), rank)
        moe = build_moe(kind, groups)
        loaded = load_moe(moe, w)
        # Exactly this rank's experts: E/ep of them, global ids from moe_ep_rank * E/ep.
        experts = moe.experts
        assert experts.num_local == E // ep and experts.first == groups.coords.moe_ep_rank * (E // ep)
        expected = {(f"experts.{p}", s) for ours, _, s in expert_stacked_params(experts)
                    for p in [ours.split(".")[-1]]}
        assert expected <= loaded
        total += moe(x).partial
    torch.testing.assert_close(total, whole(x).partial, atol=1e-5, rtol=1e-5)


def test_other_ranks_experts_are_skipped_by_name() -> None:
    groups = unconnected_groups(ParallelConfig(4, 1, 2), 2)  # moe_ep rank 1: experts 4..7, moe_tp rank 0
    experts = RoutedExperts(E, H, I_EXPERT, groups.moe_ep, groups.moe_tp)
    assert experts.checkpoint_target(parse_expert_name("layers.1.mlp.experts.3.gate_proj.weight")) is None
    assert experts.checkpoint_target(parse_expert_name("layers.1.mlp.experts.4.up_proj.weight")) == (
        "gate_up_proj", ("up_proj", 4))
    assert experts.checkpoint_target(parse_expert_name("layers.1.mlp.experts.down_proj")) == ("down_proj", FUSED)
    assert parse_expert_name("layers.1.mlp.shared_experts.gate_proj.weight") is None
    assert parse_expert_name("layers.1.mlp.gate.weight") is None
