"""DeepSeek-V3 / Kimi-K2 against transformers' DeepseekV3ForCausalLM (fp32).

One schedule of forwards covers prefill, chunked prefill and batched decode through the paged
MLA cache; every token's logits must equal HF's logits of the whole sequence (max abs diff
<= 1e-4). On gloo ranks, every forward's executed collectives must equal the plan on every
rank. Several checkpoints x (tp, dp, ep, fusion) share one spawn per world size. Sequences are
spread over DP groups round-robin, so DP-attention cases only need adding to ``CASES``.

Checkpoint variants (all with non-zero ``e_score_correction_bias``):
- base: q_lora, n_group 4 / topk_group 2, interleaved rope, per-expert tensors;
- kimi: Kimi-K2 layout: n_group 1, YaRN (factor, mscale = mscale_all_dim = 1, beta 1/1),
  routed_scaling_factor 2.827, 3 experts per token;
- lite: q_lora_rank None (plain q_proj), rotate-half rope, YaRN with mscale != mscale_all_dim
  (cos/sin attention factor and softmax mscale² both != 1), every layer MoE, 2 shared experts,
  transformers' fused expert tensors (``save_original_format=False``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fusedserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from fusedserve.models.forward_batch import KVShape
from fusedserve.models.layers.moe import MoE
from fusedserve.models.parallel.comm_plan import BlockSpec
from fusedserve.models.parallel.groups import (
    ParallelConfig,
    ParallelGroups,
    unconnected_groups,
)
from fusedserve.models.parallel.layouts import Layout
from tests.schedule_replay import Schedule, check_logits

ATOL = 1e-4
BLOCK = 4
BLOCKS_PER_SEQ = 8
SEQS: list[list[int]] = [
    [0, 63, 64, 127, 128, 191, 192, 249, 5, 3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 2, 64, 33, 83, 27],
    [17, 11, 249, 7],
    [100, 37, 3, 141, 59, 26, 200, 58, 97, 93, 12, 9],
]
# Tokens each sequence runs per forward: sequence 0 prefills 17, continues with 5 (chunked
# prefill), then decodes; 1 decodes from its first token; 2 prefills 9. Under dp=2 (sequence s
# on DP group s % 2), forward 3 leaves DP group 1 without tokens.
SCHEDULE: list[dict[int, int]] = [{0: 17, 1: 1, 2: 9}, {0: 5, 1: 1, 2: 1}, {0: 1, 1: 1}, {0: 1, 2: 1},
                                  {1: 1, 2: 1}]
REPLAY = Schedule(SEQS, SCHEDULE, BLOCK, BLOCKS_PER_SEQ)
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "kimi": {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 3, "routed_scaling_factor": 2.827,
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "mscale": 1.0,
                                 "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0,
                                 "original_max_position_embeddings": 32}},
    "lite": {"q_lora_rank": None, "rope_interleave": False, "first_k_dense_replace": 0, "n_shared_experts": 2,
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9,
                                 "mscale_all_dim": 0.7, "original_max_position_embeddings": 64},
             "save_original_format": False},
}
# (variant, tp, dp, ep, fusion[, kernel set]) per world size; one spawn each. The "torch" kernel set runs the
# fused MoE, into which a single shared expert folds without ep (moe.py): its tp slices are the experts' too.
CASES: dict[int, list[tuple[Any, ...]]] = {
    2: [("base", 2, 1, 1, "off"), ("base", 2, 1, 1, "reference"), ("base", 2, 1, 2, "off"),
        ("base", 2, 1, 2, "reference"), ("kimi", 2, 1, 2, "reference"), ("lite", 2, 1, 2, "off"),
        ("base", 2, 1, 1, "reference", "torch")],
    4: [("base", 4, 1, 1, "off"), ("base", 4, 1, 1, "reference"), ("base", 4, 1, 4, "off"),
        ("base", 4, 1, 4, "reference"), ("base", 4, 1, 2, "reference"), ("lite", 4, 1, 4, "reference"),
        # DP attention (one DP group has no tokens in some forwards of the schedule)
        ("base", 4, 2, 1, "off"), ("base", 4, 4, 4, "off"), ("base", 4, 4, 4, "reference"),
        ("base", 4, 2, 2, "off"), ("base", 4, 2, 2, "reference"), ("lite", 4, 2, 2, "off"),
        ("base", 4, 2, 1, "off", "torch")],
}






@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fusedserve.tiny import make_tiny_deepseek_v3

    root = tmp_path_factory.mktemp("tiny-deepseek-v3")
    return {name: make_tiny_deepseek_v3(root / name, seed=i, **kw) for i, (name, kw) in enumerate(VARIANTS.items())}


@pytest.fixture(scope="module")
def hf_logits(checkpoints: dict[str, Path]) -> dict[str, list[torch.Tensor]]:
    from transformers import DeepseekV3ForCausalLM as HF

    out = {}
    for name, path in checkpoints.items():
        hf = HF.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            out[name] = [hf(torch.tensor([seq[:n]])).logits[0].float() for seq, n in zip(SEQS, REPLAY.done_tokens())]
    return out






def _rank_main(rank: int, world: int, backend: str, model_dirs: dict[str, str],
               cases: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.loader import load_model
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.fusion.selection import FusionMode, fused_kernel
    from fusedserve.models.parallel.groups import build_groups

    results = []
    for variant, tp, dp, ep, fusion, *kernel_set in cases:
        groups = build_groups(ParallelConfig(tp, dp, ep), rank, backend)
        collectives = Collectives(backend, fused=fused_kernel(FusionMode(fusion), groups, 0, torch.float32))
        model = load_model(model_dirs[variant], groups, collectives, kernels=Kernels.named(*kernel_set or ["reference"]))
        logits, mismatches = REPLAY.run(model, dp, groups.coords.dp_rank)
        lead = groups.coords.attn_tp_rank == 0  # one rank per DP group reports logits
        folded = [isinstance(layer.mlp, MoE) and layer.mlp.shared_experts is None for layer in model.layers]
        results.append({"logits": logits if lead else {}, "mismatches": mismatches, "folded": folded})
    return results




def _load_tp1(path: Path) -> DeepseekV3ForCausalLM:
    from fusedserve.models.loader import load_model
    from fusedserve.models.parallel.collectives import Collectives

    model = load_model(path, ParallelGroups.single_rank(), Collectives("gloo"))
    assert isinstance(model, DeepseekV3ForCausalLM)
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp1_prefill_chunked_prefill_and_decode_equal_hf(variant: str, checkpoints: dict[str, Path],
                                                         hf_logits: dict[str, list[torch.Tensor]]) -> None:
    model = _load_tp1(checkpoints[variant])
    logits, mismatches = REPLAY.run(model, dp=1, dp_rank=0)
    assert not mismatches
    check_logits(logits, hf_logits[variant], f"tp1 {variant}", ATOL)


@pytest.mark.parametrize("world", sorted(CASES))
def test_ranks_equal_hf_and_run_the_plan(world: int, checkpoints: dict[str, Path],
                                         hf_logits: dict[str, list[torch.Tensor]]) -> None:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    dirs = {name: str(path) for name, path in checkpoints.items()}
    per_rank = run_on_ranks(_rank_main, world, dirs, CASES[world], backend="gloo")
    for c, (variant, tp, dp, ep, fusion, *kernel_set) in enumerate(CASES[world]):
        what = f"{variant} tp={tp} dp={dp} ep={ep} fusion={fusion} kernels={kernel_set or ['reference']}"
        mismatches = [f"rank {r}: {m}" for r, res in enumerate(per_rank) for m in res[c]["mismatches"]]
        assert not mismatches, f"{what}: " + "; ".join(mismatches)
        # the shared expert folds exactly where the fused MoE runs without ep (base: one shared expert)
        assert all(any(res[c]["folded"]) == (kernel_set == ["torch"] and ep == 1) for res in per_rank), what
        logits: dict[int, torch.Tensor] = {}
        for res in per_rank:
            logits.update(res[c]["logits"])
        assert sorted(logits) == list(range(len(SEQS)))
        check_logits(logits, hf_logits[variant], what, ATOL)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp1_fused_moe_folds_one_shared_expert_and_equals_hf(variant: str, checkpoints: dict[str, Path],
                                                             hf_logits: dict[str, list[torch.Tensor]]) -> None:
    """The torch kernel set (the fused MoE's capturable twin): a single shared expert (base, kimi) is one more
    expert of the fused computation, loaded from the checkpoint's shared_experts tensors; two (lite) stay apart."""
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.loader import load_model
    from fusedserve.models.parallel.collectives import Collectives

    model = load_model(checkpoints[variant], ParallelGroups.single_rank(), Collectives("gloo"),
                       kernels=Kernels.torch_native())
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    folded = variant != "lite"
    assert moes and all((m.shared_experts is None) == folded for m in moes)
    e = model.config.n_routed_experts
    assert all(m.experts.gate_up_proj.shape[0] == e + folded and m.gate.cfg.slots == m.gate.cfg.top_k + folded
               for m in moes)
    if folded:
        assert model.checkpoint_name_to_param("model.layers.1.mlp.shared_experts.up_proj.weight") == (
            "layers.1.mlp.experts.gate_up_proj", ("up_proj", e))
        assert model.checkpoint_name_to_param("model.layers.1.mlp.shared_experts.down_proj.weight") == (
            "layers.1.mlp.experts.down_proj", ("down_proj", e))
    logits, mismatches = REPLAY.run(model, dp=1, dp_rank=0)
    assert not mismatches
    check_logits(logits, hf_logits[variant], f"tp1 {variant} torch kernels", ATOL)


def test_a_folded_shared_expert_missing_from_the_checkpoint_is_named(checkpoints: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.loader import CheckpointError, load_model
    from fusedserve.models.parallel.collectives import Collectives

    src = checkpoints["base"]
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
            continue
        tensors = {k: v for k, v in load_file(f).items() if "layers.2.mlp.shared_experts.gate_proj" not in k}
        save_file(tensors, tmp_path / f.name, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.shared_experts\.gate_proj\.weight"):
        load_model(tmp_path, ParallelGroups.single_rank(), Collectives("gloo"), kernels=Kernels.torch_native())


def test_the_correction_bias_is_not_hidden(checkpoints: dict[str, Path],
                                           hf_logits: dict[str, list[torch.Tensor]]) -> None:
    """Negative control: without the checkpoint's e_score_correction_bias the logits move well
    past the tolerance, so the parity tests above do check routing."""
    model = _load_tp1(checkpoints["base"])
    for layer in model.layers:
        if isinstance(layer.mlp, MoE) and layer.mlp.gate.e_score_correction_bias is not None:
            layer.mlp.gate.e_score_correction_bias.zero_()
    logits, _ = REPLAY.run(model, dp=1, dp_rank=0)
    worst = max(float((logits[s] - hf_logits["base"][s]).abs().max()) for s in logits)
    assert worst > 10 * ATOL


def test_blocks_layers_and_cache_shapes(checkpoints: dict[str, Path]) -> None:
    from fusedserve.models.loader import load_config
    from fusedserve.models.parallel.collectives import Collectives

    config = load_config(checkpoints["base"])
    blocks = DeepseekV3ForCausalLM.blocks(config)
    assert len(blocks) == 2 * config.num_hidden_layers
    assert blocks[0] == BlockSpec("layers.0.attn", Layout.ATTN_TP_FULL, "attn_tp")
    assert blocks[3] == BlockSpec("layers.1.mlp", Layout.FULL, "tp")
    # Built (not loaded) on rank 3 of tp=4, ep=2: no process group is needed to construct it.
    model = DeepseekV3ForCausalLM(config, unconnected_groups(ParallelConfig(4, 1, 2), 3), Collectives("gloo"),
                                  device="meta")
    assert not isinstance(model.layers[0].mlp, MoE) and isinstance(model.layers[1].mlp, MoE)
    # The latent cache, whatever the heads per rank: one KV head of [latent 32 | rope 8], V = the latent
    assert model.kv_shapes() == {i: KVShape(1, 40, 32, v_in_k=True) for i in range(3)}
    experts = model.layers[2].mlp.experts
    assert (experts.first, experts.num_local, experts.inter_local) == (4, 4, 16)


def test_ep_sharded_loading_reads_only_local_experts(checkpoints: dict[str, Path]) -> None:
    """rank 1 of tp=2 ep=2 holds experts 4..7: the other experts' tensors are never read, and
    the MTP-free checkpoint loads completely (the loader checks every local expert)."""
    from fusedserve.models.loader import checkpoint_files, iter_checkpoint, load_config, load_weights
    from fusedserve.models.parallel.collectives import Collectives

    path = checkpoints["base"]
    config = load_config(path)
    model = DeepseekV3ForCausalLM(config, unconnected_groups(ParallelConfig(2, 1, 2), 1), Collectives("gloo"))
    read: list[str] = []

    class Spy:
        def __init__(self, inner: Any) -> None:
            self._inner, self.name = inner, inner.name

        @property
        def shape(self) -> tuple[int, ...]:
            return self._inner.shape  # type: ignore[no-any-return]

        def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
            read.append(self.name)
            return self._inner.narrow(dim, start, length)  # type: ignore[no-any-return]

        def full(self) -> torch.Tensor:
            read.append(self.name)
            return self._inner.full()  # type: ignore[no-any-return]

    load_weights(model, (Spy(s) for s in iter_checkpoint(checkpoint_files(path))))
    expert_reads = {int(n.split(".")[5]) for n in read if ".mlp.experts." in n}
    assert expert_reads == {4, 5, 6, 7}
    # An MTP layer's tensors (index >= num_hidden_layers) are not ours to load.
    assert model.checkpoint_name_to_param("model.layers.3.mlp.experts.0.up_proj.weight") is None
    assert model.checkpoint_name_to_param("model.layers.1.mlp.experts.1.up_proj.weight") is None
    assert model.checkpoint_name_to_param("model.layers.1.mlp.experts.5.up_proj.weight") == (
        "layers.1.mlp.experts.gate_up_proj", ("up_proj", 5))
    assert model.checkpoint_name_to_param("model.layers.1.mlp.shared_experts.up_proj.weight") == (
        "layers.1.mlp.shared_experts.gate_up_proj.weight", 1)


def test_missing_local_expert_is_reported(checkpoints: dict[str, Path]) -> None:
    from fusedserve.models.loader import (
        CheckpointError,
        checkpoint_files,
        iter_checkpoint,
        load_config,
        load_weights,
    )
    from fusedserve.models.parallel.collectives import Collectives

    path = checkpoints["base"]
    model = DeepseekV3ForCausalLM(load_config(path), unconnected_groups(ParallelConfig(2, 1, 2), 0),
                                  Collectives("gloo"))
    dropped = "model.layers.2.mlp.experts.3.down_proj.weight"
    sources = (s for s in iter_checkpoint(checkpoint_files(path)) if s.name != dropped)
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.3\.down_proj\.weight"):
        load_weights(model, sources)


def test_kimi_k2_config_json_loads(checkpoints: dict[str, Path], hf_logits: dict[str, list[torch.Tensor]],
                                   tmp_path: Path) -> None:
    """A config.json as Kimi-K2 ships it (model_type "kimi_k2" with remote code, legacy
    rope_scaling/rope_theta, scoring_func/topk_method keys) loads as DeepseekV3 and gives the
    same logits as the deepseek_v3-typed copy of the same weights gives in HF."""
    import json
    import shutil

    src = checkpoints["kimi"]
    shutil.copytree(src, tmp_path / "kimi-k2")
    config = json.loads((src / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config.update(model_type="kimi_k2", rope_scaling=rope, scoring_func="sigmoid", topk_method="noaux_tc",
                  auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (tmp_path / "kimi-k2" / "config.json").write_text(json.dumps(config))
    model = _load_tp1(tmp_path / "kimi-k2")
    logits, _ = REPLAY.run(model, dp=1, dp_rank=0)
    check_logits(logits, hf_logits["kimi"], "kimi_k2 config.json", ATOL)
