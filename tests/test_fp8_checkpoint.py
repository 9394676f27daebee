"""Block-FP8 checkpoints (the DeepSeek-V3 / Kimi-K2 release format) against HF transformers (fp32, CPU).

The tests write tiny random DeepSeek-V3s in that format (``fusedserve.tiny.make_tiny_deepseek_v3_fp8``:
e4m3 weights, ``weight_scale_inv`` per block, config.json's ``quantization_config``), with the block
scaled down to the tiny shapes:

- b8: 8 x 8 blocks, every weight whole blocks: the oracle is transformers' own fine-grained FP8
  support (it dequantizes on CPU);
- b16: 16 x 16 blocks, kv_a_proj_with_mqa's 40 rows end in a partial block (as DeepSeek-V3's 576 rows
  of 128): transformers cannot dequantize it, the oracle is HF on the checkpoint written dequantized;
  at tp=4 q_b_proj's 24-row shards cut a block: FP8 refused with the reason, ``none`` serves it;
- fused: transformers' fused expert tensors with ``<name>_scale_inv``, q_lora None, every layer MoE.

Every rank runs the product's path (``build_rank`` + one prefill ``Step`` through the executor, as
``fusedserve verify``): FP8 weights kept (``quantization: fp8``, the dequantizing reference GEMMs on
CPU) or dequantized at load (``none``); logits within 1e-4 of the oracle and every rank's collectives
equal to the plan, at tp 1/2/4 with EP and DP attention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fusedserve.models.layers.fp8_block import (
    BlockFP8,
    QuantizationConfigError,
    dequantize_weight,
    quantize_activation,
    quantize_weight,
)
from fusedserve.models.parallel.groups import ParallelConfig, unconnected_groups
from fusedserve.verify import VerifyOptions, default_prompts

pytest.importorskip("accelerate")  # transformers' FP8 loading needs it (a dev dependency)

ATOL = 1e-4
VARIANTS: dict[str, dict[str, Any]] = {
    "b8": {"block": (8, 8)},
    "b16": {"block": (16, 16), "seed": 1},
    "fused": {"block": (8, 8), "seed": 2, "save_original_format": False, "q_lora_rank": None,
              "first_k_dense_replace": 0},
}
ORACLE = {"b8": "hf", "b16": "hf-dequantized", "fused": "hf-dequantized"}
# (variant, tp, dp, ep, quantization, fusion) per world size; one spawn each.
CASES: dict[int, list[tuple[str, int, int, int, str, str]]] = {
    2: [("b8", 2, 1, 1, "fp8", "off"), ("b8", 2, 1, 2, "fp8", "reference"), ("b16", 2, 1, 2, "fp8", "off"),
        ("fused", 2, 1, 2, "fp8", "off"), ("b16", 2, 1, 1, "none", "reference")],
    4: [("b8", 4, 1, 1, "fp8", "reference"), ("b8", 4, 1, 4, "fp8", "off"), ("b8", 4, 2, 2, "fp8", "off"),
        ("b8", 4, 4, 4, "fp8", "off"), ("fused", 4, 1, 4, "fp8", "reference"), ("b16", 4, 1, 1, "none", "off"),
        ("b16", 4, 2, 2, "none", "off")],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fusedserve.tiny import make_tiny_deepseek_v3_fp8

    root = tmp_path_factory.mktemp("tiny-deepseek-v3-fp8")
    return {name: make_tiny_deepseek_v3_fp8(root / name, **kw) for name, kw in VARIANTS.items()}


def _prompts(path: Path) -> list[list[int]]:
    import json

    return default_prompts(json.loads((path / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def oracle_logits(checkpoints: dict[str, Path]) -> dict[str, torch.Tensor]:
    from fusedserve.verify import _oracle_logits

    return {name: _oracle_logits(VerifyOptions(str(path), oracle=ORACLE[name]), _prompts(path))
            for name, path in checkpoints.items()}


# --- the format ----------------------------------------------------------------------------------


def test_the_release_quantization_config_is_read_and_others_are_refused() -> None:
    release = {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                       "weight_block_size": [128, 128]}}
    assert BlockFP8.from_hf(release) == BlockFP8(128, 128)
    assert BlockFP8.from_hf({"vocab_size": 3}) is None
    for bad, why in [({"quant_method": "awq"}, "quant_method 'awq'"),
                     ({"fmt": "e5m2"}, "fmt 'e5m2'"), ({"activation_scheme": "static"}, "activation_scheme"),
                     ({"weight_block_size": None}, "per-tensor FP8"), ({"scale_fmt": "ue8m0"}, "scale_fmt")]:
        with pytest.raises(QuantizationConfigError, match=why):
            BlockFP8.from_hf({"quantization_config": {**release["quantization_config"], **bad}})


def test_kimi_k2_remote_code_config_keeps_its_quantization_config(tmp_path: Path) -> None:
    """Kimi-K2's config.json (model_type kimi_k2, remote code) loads as DeepSeek-V3 with its FP8 format."""
    import json

    from fusedserve.models.loader import checkpoint_quantization, load_config
    from fusedserve.tiny import DEEPSEEK_V3_DEFAULTS

    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps({
        **DEEPSEEK_V3_DEFAULTS, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "quantization_config": quant}))
    assert checkpoint_quantization(load_config(tmp_path)) == BlockFP8(128, 128)


def test_dequantization_equals_transformers_and_handles_partial_blocks() -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(0)
    fmt = BlockFP8(16, 32)
    w = torch.randn(3, 64, 96, generator=g)  # experts x whole blocks: transformers can read it
    q, s = quantize_weight(w, fmt)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 4, 3)
    ours = dequantize_weight(q, s, fmt)
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)
    assert torch.equal(ours, theirs)
    assert float((ours - w).abs().max() / w.abs().max()) < 0.07  # e4m3: 3 mantissa bits
    partial = torch.randn(40, 70, generator=g)  # 2.5 x 2.2 blocks: scales [3, 3]
    q, s = quantize_weight(partial, fmt)
    assert s.shape == (3, 3)
    assert torch.equal(dequantize_weight(q, s, fmt)[32:, 64:], q[32:, 64:].float() * s[2, 2])
    x = torch.randn(5, 70, generator=g)
    _, xs = quantize_activation(x, 32)
    assert xs.shape == (5, 3) and torch.allclose(xs[:, 2], x[:, 64:].abs().amax(1) / 448)


def test_a_dequantized_source_reads_any_shard() -> None:
    from fusedserve.models.layers.weight_source import DequantizedSource, TensorSource

    fmt = BlockFP8(16, 16)
    q, s = quantize_weight(torch.randn(2, 40, 56, generator=torch.Generator().manual_seed(1)), fmt)
    src = DequantizedSource(TensorSource("w", q), TensorSource("w_scale_inv", s), fmt)
    full = dequantize_weight(q, s, fmt)
    assert torch.equal(src.full(), full)
    for dim, start, length in [(1, 10, 20), (2, 24, 32), (1, 32, 8), (0, 1, 1), (-1, 0, 56)]:
        assert torch.equal(src.narrow(dim, start, length), full.narrow(dim, start, length)), (dim, start, length)
    with pytest.raises(ValueError, match="block grid"):
        DequantizedSource(TensorSource("w", q), TensorSource("w_scale_inv", s[:, :2]), fmt)


def test_quantization_choice() -> None:
    from fusedserve.models.quantization import QuantizationError, choose_quantization

    fp8, ds = BlockFP8(128, 128), "DeepseekV3ForCausalLM"
    hopper, ampere = (9, 0), (8, 0)
    assert choose_quantization("auto", fp8, ds, hopper).weights == "fp8"
    assert choose_quantization("auto", fp8, ds, None).weights == "dequantized"  # CPU
    assert choose_quantization("auto", fp8, ds, ampere).weights == "dequantized"
    assert choose_quantization("auto", fp8, "LlamaForCausalLM", hopper).weights == "dequantized"
    assert choose_quantization("auto", None, ds, hopper).weights == "unquantized"
    assert choose_quantization("none", fp8, ds, hopper).weights == "dequantized"
    assert choose_quantization("fp8", fp8, ds, None).fp8 == fp8  # CPU: the reference GEMMs (tests)
    assert choose_quantization("fp8", None, ds, hopper, dummy=True).fp8 == BlockFP8(128, 128)
    for args, why in [(("fp8", None, ds, hopper), "needs a block-FP8 checkpoint"),
                      (("fp8", fp8, "LlamaForCausalLM", hopper), "has no block-FP8 layers"),
                      (("fp8", fp8, ds, ampere), "compute capability 8.0"), (("int4", fp8, ds, None), "one of")]:
        with pytest.raises(QuantizationError, match=why):
            choose_quantization(*args)  # type: ignore[arg-type]


# --- loading -------------------------------------------------------------------------------------




def test_shards_that_cut_a_block_are_refused_with_the_reason(checkpoints: dict[str, Path]) -> None:
    """sglang's and vLLM's rule: a TP shard of an FP8 weight must be whole blocks (its scales split
    with it); replicated weights may end in a partial block (kv_a_proj_with_mqa's 40 rows of 16)."""
    from fusedserve.models.deepseek_v3 import DeepseekV3ForCausalLM
    from fusedserve.models.layers.weight_source import WeightShapeError
    from fusedserve.models.loader import load_config
    from fusedserve.models.parallel.collectives import Collectives

    config = load_config(checkpoints["b16"])
    fmt = BlockFP8(16, 16)

    def build(tp: int, ep: int) -> DeepseekV3ForCausalLM:
        return DeepseekV3ForCausalLM(config, unconnected_groups(ParallelConfig(tp, 1, ep), 0), Collectives("gloo"),
                                     device="meta", fp8=fmt)

    model = build(2, 1)  # 48-row q_b shards, experts' 16-row intermediate slices: whole blocks
    # kv_a_proj_with_mqa's 40 rows end in a partial block after q_a_proj's 48 in their merged matmul: 3 + 3 scale rows
    assert model.layers[0].self_attn.fused_qkv_a_proj_with_mqa.weight_scale_inv.shape == (6, 4)
    assert model.layers[1].mlp.experts.down_proj_scale_inv.shape == (8, 4, 1)
    with pytest.raises(WeightShapeError, match=r"layers\.0\.self_attn: q_b_proj: output rows 96: a shard of 24 per "
                                               r"rank over 4 ranks is not a multiple of the FP8 block's 16"):
        build(4, 4)
    # attention and the shared experts (2 x 32 rows) fit at tp=4; the routed experts' 8-row slices do not
    config.num_attention_heads, config.first_k_dense_replace, config.n_shared_experts = 8, 0, 2
    with pytest.raises(WeightShapeError, match=r"layers\.0\.mlp: expert intermediate rows 32: a shard of 8 per "
                                               r"rank over 4 ranks .* quantization: none"):
        build(4, 1)
    assert build(4, 4).layers[0].mlp.experts.inter_local == 32  # ep=4: experts whole on their rank


def test_a_split_that_cuts_a_block_is_refused_before_any_rank_starts(checkpoints: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """verify and `fusedserve run` (quantization fp8) refuse b16 at tp=4 from the meta build, with the
    layer's message; dequantized (none) it splits."""
    from fusedserve.models.loader import load_config
    from fusedserve.models.parallel.groups import ParallelConfig
    from fusedserve.models.split_check import SplitError, check_split
    from fusedserve.verify import VerifyError, prepare
    from fusedserve.worker.ray.launcher import load_runtime_config
    from fusedserve.worker.spec import SpecError

    path, cut = checkpoints["b16"], r"q_b_proj: output rows 96: a shard of 24 per rank over 4 ranks"
    with pytest.raises(SplitError, match=cut):
        check_split(load_config(path), ParallelConfig(4), BlockFP8(16, 16))
    with pytest.raises(VerifyError, match=cut):
        prepare(VerifyOptions(str(path), tp=4, quantization="fp8"))
    prepare(VerifyOptions(str(path), tp=4, quantization="none"))
    manifest = tmp_path / "b16.yaml"
    for quant in ("fp8", "none"):
        manifest.write_text("apiVersion: fusedserve.io/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: b16}\n"
                            f"spec:\n  model: {{path: {path}, quantization: {quant}}}\n  parallelism: {{tensor: 4}}\n")
        if quant == "fp8":
            with pytest.raises(SpecError, match="spec.parallelism: .*" + cut):
                load_runtime_config(str(manifest))
        else:
            assert load_runtime_config(str(manifest)).quantization == "none"


def test_format_mismatches_are_named(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """An FP8 layer given a plain weight, or a plain model given an FP8 weight without scales, says so."""
    import json
    import shutil

    from fusedserve.models.loader import CheckpointError, load_model
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.groups import ParallelGroups
    from fusedserve.models.quantization import Quantization
    from fusedserve.tiny import make_tiny_deepseek_v3

    plain = make_tiny_deepseek_v3(tmp_path / "plain")
    with pytest.raises(CheckpointError, match=r"_proj\.weight: checkpoint tensor is torch\.float32, "
                                              r"model expects torch\.float8_e4m3fn"):
        load_model(plain, ParallelGroups.single_rank(), Collectives("gloo"),
                   quantization=Quantization("fp8", BlockFP8(8, 8), BlockFP8(8, 8)))
    bare = tmp_path / "no-config"
    shutil.copytree(checkpoints["b8"], bare)
    config = json.loads((bare / "config.json").read_text())
    del config["quantization_config"]
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="float8_e4m3fn.*weight_scale_inv"):
        load_model(bare, ParallelGroups.single_rank(), Collectives("gloo"))


def test_ep_rank_reads_only_its_experts_and_their_scales(checkpoints: dict[str, Path]) -> None:
    from fusedserve.models.deepseek_v3 import DeepseekV3ForCausalLM
    from fusedserve.models.loader import load_config
    from fusedserve.models.parallel.collectives import Collectives

    model = DeepseekV3ForCausalLM(load_config(checkpoints["b8"]), unconnected_groups(ParallelConfig(2, 1, 2), 1),
                                  Collectives("gloo"), device="meta", fp8=BlockFP8(8, 8))
    assert model.checkpoint_name_to_param("model.layers.1.mlp.experts.1.up_proj.weight_scale_inv") is None
    assert model.checkpoint_name_to_param("model.layers.1.mlp.experts.5.up_proj.weight_scale_inv") == (
        "layers.1.mlp.experts.gate_up_proj_scale_inv", ("up_proj", 5))
    assert model.checkpoint_name_to_param("model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv") == (
        "layers.1.mlp.shared_experts.gate_up_proj.weight_scale_inv", 1)


# --- against the oracle --------------------------------------------------------------------------


def _check(opts: VerifyOptions, results: list[dict[str, Any]], prompts: list[list[int]],
           oracle: torch.Tensor, atol: float = ATOL) -> None:
    from fusedserve.verify import _assemble_logits, ranks_collectives

    what = f"{opts.model.rsplit('/', 1)[-1]} tp={opts.tp} dp={opts.dp} ep={opts.ep} {opts.quantization}"
    ok, _sites, mismatches, _paths = ranks_collectives(results)
    assert ok, f"{what}: " + "; ".join(mismatches)
    diff = float((_assemble_logits(results, prompts, opts.dp) - oracle).abs().max())
    assert diff <= atol, f"{what}: max |logit diff| {diff:.2e} > {atol}"
    want = "FP8 weights" if opts.quantization == "fp8" else "dequantized to"
    assert want in results[0]["quantization"], results[0]["quantization"]


def _tp1(opts: VerifyOptions, prompts: list[list[int]], kernels: str | None = None) -> dict[str, Any]:
    """verify's rank, on one rank in this process (``kernels``: another kernel set than verify's)."""
    from dataclasses import replace

    from fusedserve.verify import _engine_config, _prefill_step
    from fusedserve.worker.parallel.rank import build_rank

    config = _engine_config(opts, prompts, torch.device("cpu"))
    built = build_rank(opts.model, replace(config, kernels=kernels) if kernels else config)
    if kernels == "torch":  # the fused FP8 MoE: the single shared expert is its last expert, with its scales
        moe = built.model.layers[-1].mlp
        assert moe.shared_experts is None and moe.experts.gate_up_proj_scale_inv.shape[0] == moe.experts.num_experts + 1
    out = built.executor.run(_prefill_step(prompts))
    ledger = built.model.comm.ledger
    return {"dp_rank": 0, "logits": out.logits.float(), "planned": ledger.forward_plan(),
            "executed": [r.key for r in ledger.forward_records()], "paths": dict(ledger.calls),
            "quantization": built.quantization.describe(opts.dtype, built.kernels.kernels)}


def test_tp1_fp8_and_dequantized_equal_the_oracle(checkpoints: dict[str, Path],
                                                   oracle_logits: dict[str, torch.Tensor]) -> None:
    for name, path in checkpoints.items():
        prompts = _prompts(path)
        for quant in ("fp8", "none"):
            opts = VerifyOptions(str(path), quantization=quant)
            _check(opts, [_tp1(opts, prompts)], prompts, oracle_logits[name])


def test_tp1_fused_fp8_moe_with_the_shared_expert_folded_equals_the_oracle(
        checkpoints: dict[str, Path], oracle_logits: dict[str, torch.Tensor]) -> None:
    for name in ("b8", "fused"):  # per-expert and fused expert tensors; one shared expert each
        path = checkpoints[name]
        prompts = _prompts(path)
        opts = VerifyOptions(str(path), quantization="fp8")
        _check(opts, [_tp1(opts, prompts, kernels="torch")], prompts, oracle_logits[name])


def _ranks_main(rank: int, world: int, backend: str, cases: list[tuple[VerifyOptions, list[list[int]]]]
                ) -> list[dict[str, Any]]:
    from fusedserve.verify import _rank_main

    return [_rank_main(rank, world, backend, opts, prompts) for opts, prompts in cases]


@pytest.mark.parametrize("world", sorted(CASES))
def test_ranks_equal_the_oracle_and_run_the_plan(world: int, checkpoints: dict[str, Path],
                                                 oracle_logits: dict[str, torch.Tensor]) -> None:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    cases = [(VerifyOptions(str(checkpoints[v]), tp=tp, dp=dp, ep=ep, quantization=q, fusion=f),
              _prompts(checkpoints[v])) for v, tp, dp, ep, q, f in CASES[world]]
    per_rank = run_on_ranks(_ranks_main, world, cases, backend="gloo", timeout_s=600)
    for c, (variant, *_rest) in enumerate(CASES[world]):
        opts, prompts = cases[c]
        _check(opts, [r[c] for r in per_rank], prompts, oracle_logits[variant])


def test_float16_fp8_checkpoint(checkpoints: dict[str, Path], oracle_logits: dict[str, torch.Tensor]) -> None:
    """dtype float16 (the spec takes it now): FP8 weights with float16 activations and norms."""
    path = checkpoints["b8"]
    prompts = _prompts(path)
    opts = VerifyOptions(str(path), dtype="float16", quantization="fp8")
    result = _tp1(opts, prompts)
    assert result["logits"].dtype == torch.float32  # reported as float32; computed in float16
    _check(opts, [result], prompts, oracle_logits["b8"], atol=5e-2)
    # Every row but one within 2e-2: in float16 one prompt token's top expert groups (0.343 vs 0.342 in
    # fp32) swap in the second MoE layer — a routing near-tie, not attention error (its rows are within
    # 8e-4); the absorbed MLA's two extra float16 roundings move that gap by 0.003.
    from fusedserve.verify import _assemble_logits

    rows = (_assemble_logits([result], prompts, opts.dp) - oracle_logits["b8"]).abs().amax(dim=-1)
    assert float(rows.sort().values[-2]) <= 2e-2, rows


def test_dummy_fp8_weights_at_config_shapes(tmp_path: Path) -> None:
    """load_format dummy + quantization fp8 draws block-FP8 weights from config.json alone (benchmarks);
    each block's largest value maps to 448."""
    import json

    from fusedserve.tiny import DEEPSEEK_V3_DEFAULTS
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.parallel.rank import build_rank

    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [8, 8]}
    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_V3_DEFAULTS, "model_type": "deepseek_v3",
                                                      "architectures": ["DeepseekV3ForCausalLM"],
                                                      "quantization_config": quant}))
    built = build_rank(tmp_path, EngineConfig(num_blocks=4, load_format="dummy", quantization="fp8", seed=0))
    experts = built.model.layers[1].mlp.experts  # type: ignore[attr-defined]
    assert built.quantization.weights == "fp8" and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    amax = experts.gate_up_proj[0].float().view(8, 8, 8, 8).abs().amax(dim=(1, 3))
    assert torch.equal(amax, torch.full_like(amax, 448.0))
    # quantization none: the same weights, dequantized (what a benchmark compares the FP8 model with)
    plain = build_rank(tmp_path, EngineConfig(num_blocks=4, load_format="dummy", quantization="none", seed=0))
    twin = plain.model.layers[1].mlp.experts  # type: ignore[attr-defined]
    assert plain.quantization.weights == "dequantized"
    assert torch.equal(twin.gate_up_proj, dequantize_weight(experts.gate_up_proj, experts.gate_up_proj_scale_inv,
                                                            BlockFP8(8, 8)))
    for layer in built.model.layers:  # type: ignore[attr-defined]
        # MLA keeps kv_b's block-FP8 weight for its absorbed products' FP8 kernels (mla_absorb_triton.py), the
        # weight whose dequantized halves are W_UK / W_UV; the dequantized twin has none
        attn, pack = layer.self_attn, layer.self_attn.kv_b_fp8
        assert pack is not None and pack.weight is attn.kv_b_proj.weight and pack.fmt == BlockFP8(8, 8)
        halves = dequantize_weight(pack.weight, pack.scale_inv, pack.fmt, attn.w_uk.dtype).view(
            attn.heads, pack.nope + pack.v, -1)
        assert torch.equal(halves[:, :pack.nope], attn.w_uk) and torch.equal(halves[:, pack.nope:], attn.w_uv)
    assert all(layer.self_attn.kv_b_fp8 is None for layer in plain.model.layers)  # type: ignore[attr-defined]
    from fusedserve.verify import _prefill_step

    prompts = [[5, 9, 200, 3], [17]]
    got, want = (b.executor.run(_prefill_step(prompts)).logits for b in (built, plain))
    assert float((got - want).abs().max()) < 1e-5


def test_verify_runs_fp8_checkpoints_and_names_the_oracle_to_use(checkpoints: dict[str, Path]) -> None:
    """`fusedserve verify --quantization fp8 --oracle hf-dequantized` on the partial-block checkpoint
    passes; the plain `hf` oracle, which transformers cannot run on it, says what to use instead."""
    from fusedserve.verify import VerifyError, _oracle_logits, run_verify

    path = str(checkpoints["b16"])
    report = run_verify(VerifyOptions(path, tp=2, ep=2, quantization="fp8", oracle="hf-dequantized"))
    assert report.ok, report.to_text()
    assert "quantization: fp8 e4m3, 16x16 weight blocks" in report.to_text()
    with pytest.raises(VerifyError, match="try --oracle hf-dequantized"):
        _oracle_logits(VerifyOptions(path, oracle="hf"), _prompts(checkpoints["b16"]))


def test_fp8_slice_benchmark_runs_at_tiny_scale(tmp_path: Path) -> None:
    """bench/fp8_slice.py's CPU dry run (the H200 run is bench/gpu_fp8.sh): a complete record, and the
    logits compared with the bf16 build run on the FP8 build's routing (every forced route used) and with the
    FP8 build's own w8a8 reference."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "slice.json"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "bench/fp8_slice.py", "--tiny", "--skip-gemms", "--prefill", "64",
                           "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["complete"] and {"date", "machine", "command"} <= record.keys()
    logits = record["summary"]["logits"]
    for what in ("decode", "prefill"):
        assert logits[what]["rel_l2_same_routing"] <= logits["tolerance_rel_l2"], logits
        # its w8a8 reference quantizes the activations, which this CPU build (dequantizing, torch set) does not:
        # a small nonzero difference says the reference really ran in its place
        assert 0 < logits[what]["rel_l2_vs_w8a8_reference"] < 0.05, logits
    assert record["summary"]["floor"] == record["summary"]["depth"] == {}  # from the kernel profiles, taken on a GPU only (tests/test_fp8_slice_bound.py)
