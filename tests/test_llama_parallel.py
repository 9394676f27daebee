"""Our Llama on tp = 1, 2, 4 gloo ranks against HF transformers' LlamaForCausalLM (the oracle).

One spawn per world size loads every variant of conftest.LLAMA_VARIANTS twice (fusion off and
reference) and returns logits, plans, executed collectives and aux captures from every rank; the
tests below only read those results. fp32, max abs diff <= 1e-4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fusedserve.models.forward_batch import ForwardBatch, KVCache
from fusedserve.models.layers.rotary import rope_inv_freq, rope_parameters
from fusedserve.models.parallel.comm_plan import FUSION_MAX_TOKENS, plan_table

TOLERANCE = 1e-4
VARIANTS = ("base", "tied", "bias", "kv1", "llama3")
FUSIONS = ("off", "reference")
WORLDS = (1, 2, 4)
CAPTURE_LAYERS = [1, 2, 3]
# More tokens than the fusion gate allows (9 sequences, 2049 tokens): a fused model must select
# its unfused plan variant.
LONG_LENGTHS = [228] * 8 + [FUSION_MAX_TOKENS + 1 - 228 * 8]

# The 4-layer plan (LLAMA_DEFAULTS), the same for tp=2 and tp=4: which collective, which group, where.
TABLE_OFF = [
    "layers.0.attn.in: all_reduce(tp)",
    "layers.0.mlp.in: all_reduce(attn_tp)",
    "layers.1.attn.in: all_reduce(tp)",
    "layers.1.mlp.in: all_reduce(attn_tp)",
    "layers.2.attn.in: all_reduce(tp)",
    "layers.2.mlp.in: all_reduce(attn_tp)",
    "layers.3.attn.in: all_reduce(tp)",
    "layers.3.mlp.in: all_reduce(attn_tp)",
    "final.in: all_reduce(tp)",
    "lm_head: all_gather(tp)",
]
TABLE_FUSED = [
    "layers.0.attn.in: all_reduce(tp)",
    "layers.0.mlp.in: fused_ar_add_rmsnorm(attn_tp)",
    "layers.1.attn.in: fused_ar_add_rmsnorm(tp)",
    "layers.1.mlp.in: fused_ar_add_rmsnorm(attn_tp)",
    "layers.2.attn.in: fused_ar_add_rmsnorm(tp)",
    "layers.2.mlp.in: fused_ar_add_rmsnorm(attn_tp)",
    "layers.3.attn.in: fused_ar_add_rmsnorm(tp)",
    "layers.3.mlp.in: fused_ar_add_rmsnorm(attn_tp)",
    "final.in: all_reduce(tp)",
    "lm_head: all_gather(tp)",
]


def expected_table(world: int, fusion: str) -> list[str]:
    if world == 1:
        return []
    return TABLE_FUSED if fusion == "reference" else TABLE_OFF


def prefill_logits(model: Any, prompts: list[list[int]], aux_layers: tuple[int, ...] = ()) -> Any:
    """The model's output (logits and the aux states of ``aux_layers``) on a prefill of ``prompts``."""
    block = 16
    kv = KVCache.allocate(model.kv_shapes(), sum(-(-len(p) // block) for p in prompts), block, torch.float32)
    batch = ForwardBatch.prefill(prompts, kv)
    batch.aux_layers = aux_layers
    return model(batch)


def prefill_then_decode_logits(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill all but each prompt's last token (a 1-token prompt prefills nothing), then decode the last
    token of every prompt in one batch against the paged KV cache: [len(prompts), vocab]."""
    block = 16
    tables, next_block = [], 0
    for p in prompts:
        tables.append(list(range(next_block, next_block - (-len(p) // block))))
        next_block = tables[-1][-1] + 1
    kv = KVCache.allocate(model.kv_shapes(), next_block, block, torch.float32)

    def slot(i: int, pos: int) -> int:
        return tables[i][pos // block] * block + pos % block

    def batch(spans: list[range]) -> ForwardBatch:
        return ForwardBatch(
            input_ids=torch.tensor([prompts[i][pos] for i, s in enumerate(spans) for pos in s]),
            positions=torch.tensor([pos for s in spans for pos in s]),
            query_lens=[len(s) for s in spans],
            context_lens=[s.stop for s in spans],
            slot_mapping=torch.tensor([slot(i, pos) for i, s in enumerate(spans) for pos in s]),
            block_tables=tables,
            kv_cache=kv,
        )

    model(batch([range(len(p) - 1) for p in prompts]))
    return model(batch([range(len(p) - 1, len(p)) for p in prompts])).logits


def _forward_result(model: Any, collectives: Any, logits: torch.Tensor) -> dict[str, Any]:
    planned = collectives.ledger.forward_plan()  # what the last forward planned, as it started
    return {
        "logits": logits,
        "fused_variant": any(op == "fused_ar_add_rmsnorm" for _site, op, _group in planned),
        "planned": planned,
        "table": plan_table(planned),
        "unfused_planned": model.comm.plan.unfused.expected(),
        "records": [(r.site, r.op, r.group, r.path) for r in collectives.ledger.forward_records()],
    }


def _parity_rank(
    rank: int,
    world: int,
    backend: str,
    variants: dict[str, str],
    prompts: list[list[int]],
    long_prompts: list[list[int]],
) -> dict[Any, Any]:
    """Every variant x fusion mode on this rank; runs in a spawned process (module-level for pickling)."""
    from fusedserve.models.loader import load_model
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.fusion.selection import FusionMode, fused_kernel
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups

    torch.set_num_threads(1)
    groups = build_groups(ParallelConfig(tp=world), rank, backend)
    out: dict[Any, Any] = {}
    for name, path in variants.items():
        for fusion in FUSIONS:
            collectives = Collectives(backend, fused=fused_kernel(FusionMode(fusion), groups, 64, torch.float32))
            model = load_model(path, groups, collectives)
            fwd = prefill_logits(model, prompts, tuple(CAPTURE_LAYERS))
            res = _forward_result(model, collectives, fwd.logits)
            res["captured"] = list(fwd.hidden)
            res["kv_head_start"] = model.layers[0].self_attn.qkv_proj.kv_head_start
            res["kv_shapes"] = model.kv_shapes()
            out[(name, fusion)] = res
            if name == "base":
                out[(name, fusion, "long")] = _forward_result(
                    model, collectives, prefill_logits(model, long_prompts).logits
                )
                decode = prefill_then_decode_logits(model, prompts)
                out[(name, fusion, "decode")] = _forward_result(model, collectives, decode)
    return out


@pytest.fixture(scope="module", params=WORLDS, ids=[f"tp{w}" for w in WORLDS])
def parity(
    request: pytest.FixtureRequest, llama_variants: dict[str, Path], llama_prompts: list[list[int]]
) -> tuple[int, list[dict[Any, Any]]]:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    world: int = request.param
    g = torch.Generator().manual_seed(7)
    long_prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in LONG_LENGTHS]
    variants = {name: str(llama_variants[name]) for name in VARIANTS}
    return world, run_on_ranks(_parity_rank, world, variants, llama_prompts, long_prompts, backend="gloo")


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_hf(
    parity: tuple[int, list[dict[Any, Any]]], oracles: dict[str, Any], variant: str, fusion: str
) -> None:
    world, results = parity
    oracle = oracles[variant].logits
    for rank, res in enumerate(results):
        logits = res[(variant, fusion)]["logits"]
        assert logits.shape == oracle.shape
        diff = (logits - oracle).abs().max().item()
        assert diff <= TOLERANCE, f"tp={world} rank {rank}: max |diff| {diff:.3e}"


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_executed_collectives_equal_the_plan_on_every_rank(
    parity: tuple[int, list[dict[Any, Any]]], variant: str, fusion: str
) -> None:
    world, results = parity
    planned = results[0][(variant, fusion)]["planned"]
    assert results[0][(variant, fusion)]["table"] == expected_table(world, fusion)
    for rank, res in enumerate(results):
        r = res[(variant, fusion)]
        assert r["planned"] == planned, f"rank {rank} planned differently"
        assert r["fused_variant"] is (fusion == "reference" and world > 1)
        assert [rec[:3] for rec in r["records"]] == planned, f"tp={world} rank {rank}"
        # The path says what ran: the host's shared memory for sums, gloo for the other collectives, the CPU
        # reference for fused ones.
        assert {rec[3] for rec in r["records"] if rec[1] == "fused_ar_add_rmsnorm"} <= {"reference_fused"}
        assert {rec[3] for rec in r["records"] if rec[1] == "all_reduce"} <= {"shm"}
        assert {rec[3] for rec in r["records"] if rec[1] not in ("all_reduce", "fused_ar_add_rmsnorm")} <= {"gloo"}


def test_capture_reads_the_complete_residual_stream(
    parity: tuple[int, list[dict[Any, Any]]], oracles: dict[str, Any]
) -> None:
    """DESIGN bug 1: an aux capture before layer i is layer i-1's complete output (pre-norm), never a
    rank's partial sum, also when the MLP all-reduce is deferred into layer i's fused input norm."""
    world, results = parity
    for fusion in FUSIONS:
        for rank, res in enumerate(results):
            captured = res[("base", fusion)]["captured"]
            assert len(captured) == len(CAPTURE_LAYERS)
            for layer, got in zip(CAPTURE_LAYERS, captured):
                want = oracles["base"].hidden_states[layer]
                diff = (got - want).abs().max().item()
                assert diff <= TOLERANCE, f"tp={world} {fusion} rank {rank} layer {layer}: {diff:.3e}"
                torch.testing.assert_close(
                    got, results[0][("base", fusion)]["captured"][CAPTURE_LAYERS.index(layer)], rtol=0, atol=0
                )


def test_kv_heads_split_or_replicated(parity: tuple[int, list[dict[Any, Any]]]) -> None:
    """base has 2 KV heads (split at tp=2, replicated on pairs at tp=4); kv1 has one, on every rank."""
    world, results = parity
    starts = {v: [res[(v, "off")]["kv_head_start"] for res in results] for v in ("base", "kv1")}
    expected = {
        1: {"base": [0], "kv1": [0]},
        2: {"base": [0, 1], "kv1": [0, 0]},
        4: {"base": [0, 0, 1, 1], "kv1": [0, 0, 0, 0]},
    }
    assert starts == expected[world]
    base_heads = 2 // world if world <= 2 else 1
    assert all(
        res[("base", "off")]["kv_shapes"] == {i: (base_heads, 16) for i in range(4)} for res in results
    )
    assert all(res[("kv1", "off")]["kv_shapes"] == {i: (1, 8) for i in range(4)} for res in results)


def test_reference_fusion_defers_the_mlp_all_reduce_into_the_next_layer(
    parity: tuple[int, list[dict[Any, Any]]], oracles: dict[str, Any]
) -> None:
    world, results = parity
    fused_records = [
        ("layers.0.attn.in", "all_reduce", "tp", "shm"),  # the embedding's sum (no residual yet)
        ("layers.0.mlp.in", "fused_ar_add_rmsnorm", "attn_tp", "reference_fused"),
        ("layers.1.attn.in", "fused_ar_add_rmsnorm", "tp", "reference_fused"),  # layer 0's MLP sum
        ("layers.1.mlp.in", "fused_ar_add_rmsnorm", "attn_tp", "reference_fused"),
        ("layers.2.attn.in", "fused_ar_add_rmsnorm", "tp", "reference_fused"),
        ("layers.2.mlp.in", "fused_ar_add_rmsnorm", "attn_tp", "reference_fused"),
        ("layers.3.attn.in", "fused_ar_add_rmsnorm", "tp", "reference_fused"),
        ("layers.3.mlp.in", "fused_ar_add_rmsnorm", "attn_tp", "reference_fused"),
        ("final.in", "all_reduce", "tp", "shm"),  # the last MLP's sum: the final norm never fuses
        ("lm_head", "all_gather", "tp", "gloo"),
    ]
    unfused_records = [
        (site, "all_reduce", group, "shm") if op == "fused_ar_add_rmsnorm" else (site, op, group, path)
        for site, op, group, path in fused_records
    ]
    if world == 1:  # no collectives at all: nothing to defer
        fused_records = unfused_records = []
    for rank, res in enumerate(results):
        fused, off = res[("base", "reference")], res[("base", "off")]
        assert fused["fused_variant"] is (world > 1) and off["fused_variant"] is False
        assert fused["records"] == fused_records, f"rank {rank}"
        assert off["records"] == unfused_records, f"rank {rank}"
        # No plain all-reduce completes an MLP's sum between layers: it is deferred.
        assert not [
            r
            for r in fused["records"]
            if r[1] == "all_reduce" and r[0].startswith("layers.") and r[0] != "layers.0.attn.in"
        ]
        assert (fused["logits"] - oracles["base"].logits).abs().max().item() <= TOLERANCE
        assert (fused["logits"] - off["logits"]).abs().max().item() <= 1e-5


def test_more_tokens_than_the_fusion_gate_runs_the_unfused_plan(
    parity: tuple[int, list[dict[Any, Any]]],
) -> None:
    world, results = parity
    for rank, res in enumerate(results):
        fused, off = res[("base", "reference", "long")], res[("base", "off", "long")]
        assert fused["logits"].shape == (FUSION_MAX_TOKENS + 1, 250)
        assert fused["fused_variant"] is False
        assert fused["table"] == expected_table(world, "off")
        assert [r[:3] for r in fused["records"]] == fused["planned"] == fused["unfused_planned"]
        assert not [r for r in fused["records"] if r[1] == "fused_ar_add_rmsnorm"]
        torch.testing.assert_close(fused["logits"], off["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_decode_after_prefill_matches_hf(
    parity: tuple[int, list[dict[Any, Any]]],
    oracles: dict[str, Any],
    llama_prompts: list[list[int]],
    fusion: str,
) -> None:
    """The KV cache path: each prompt's last token decoded against its prefilled context."""
    world, results = parity
    last = torch.tensor([sum(len(p) for p in llama_prompts[: i + 1]) - 1 for i in range(len(llama_prompts))])
    want = oracles["base"].logits[last]
    for rank, res in enumerate(results):
        decode = res[("base", fusion, "decode")]
        assert decode["logits"].shape == want.shape
        diff = (decode["logits"] - want).abs().max().item()
        assert diff <= TOLERANCE, f"tp={world} rank {rank}: max |diff| {diff:.3e}"
        assert decode["table"] == expected_table(world, fusion)  # 4 tokens: inside the fusion gate
        assert [r[:3] for r in decode["records"]] == decode["planned"]


# --- in-process (tp=1) ---------------------------------------------------------------------------


def test_a_block_returning_a_reduced_tensor_is_a_plan_violation(
    tiny_llama: Path, llama_prompts: list[list[int]]
) -> None:
    """A block that reduces its own output (and hands the communicator a plain tensor) is caught at the
    next boundary, before anything could be reduced twice."""
    from fusedserve.models.loader import load_model
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.communicator import PlanViolation
    from fusedserve.models.parallel.groups import ParallelGroups

    model = load_model(tiny_llama, ParallelGroups.single_rank(), Collectives("gloo"))
    mlp = model.layers[1].mlp
    honest = mlp.forward
    mlp.forward = lambda x: honest(x).partial  # "already reduced"
    with pytest.raises(
        PlanViolation,
        match="layers.2.attn.in: expected a sum owed to group 'tp', got an already-reduced Tensor",
    ):
        prefill_logits(model, llama_prompts)
    mlp.forward = lambda x: type(honest(x))(honest(x).partial, "moe_ep")
    with pytest.raises(
        PlanViolation, match="layers.2.attn.in: incoming sum is owed to 'moe_ep', plan says 'tp'"
    ):
        prefill_logits(model, llama_prompts)


def test_matmul_epilogue_ops_replace_the_separate_ones_where_chosen(
    llama_variants: dict[str, Path], llama_prompts: list[list[int]]
) -> None:
    """A kernel set's qkv-projection-with-RoPE and gate/up-with-SiLU ops (``Kernels.qkv_rope`` / ``gate_up_act``)
    replace the matmul + RoPE and matmul + activation of every layer when given (here torch compositions of the
    references: the same logits to the bit, prefill and decode); a rotation over part of a head keeps the
    separate ops."""
    import dataclasses

    import torch.nn.functional as F

    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.layers.mlp import silu_and_mul
    from fusedserve.models.layers.rotary import RotaryEmbedding, rope_reference
    from fusedserve.models.layers.self_attention import SelfAttention
    from fusedserve.models.loader import load_model
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.groups import Group, ParallelGroups

    calls: list[str] = []

    def qkv_rope(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, positions: torch.Tensor,
                 inv_freq: torch.Tensor, q_size: int, kv_size: int) -> tuple[torch.Tensor, ...]:
        calls.append("qkv_rope")
        q, k, v = F.linear(x, w, b).split([q_size, kv_size, kv_size], dim=-1)
        n, d = x.shape[0], 2 * inv_freq.shape[0]
        q, k = rope_reference(positions, q.view(n, -1, d), k.view(n, -1, d), inv_freq)
        return q.reshape(n, q_size), k.reshape(n, kv_size), v

    def gate_up_act(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append("gate_up_act")
        return silu_and_mul(F.linear(x, w, b))

    fused = dataclasses.replace(Kernels.reference(), qkv_rope=qkv_rope, gate_up_act=gate_up_act)
    for variant in ("bias", "llama3"):
        logits = {}
        for name, kernels in (("reference", Kernels.reference()), ("fused", fused)):
            model = load_model(llama_variants[variant], ParallelGroups.single_rank(), Collectives("gloo"),
                               kernels=kernels)
            logits[name] = (prefill_logits(model, llama_prompts).logits,
                            prefill_then_decode_logits(model, llama_prompts))
        layers = len(model.layers)
        assert calls.count("qkv_rope") == calls.count("gate_up_act") == 3 * layers  # prefill; prefill, decode
        calls.clear()
        for got, want in zip(logits["fused"], logits["reference"], strict=True):
            assert torch.equal(got, want), variant
    partial = SelfAttention(0, 64, 2, 1, 32, Group.single("tp"), RotaryEmbedding(16, 10000.0), qkv_rope=qkv_rope)
    assert partial.qkv_rope is None and partial.project == partial._project


def test_llama3_rope_frequencies_match_hf(llama_variants: dict[str, Path]) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(str(llama_variants["llama3"]))
    theta, scaling = rope_parameters(config)
    assert theta == 500000.0 and scaling is not None and scaling["rope_type"] == "llama3"
    ours = rope_inv_freq(16, theta, scaling)
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert attention_factor == 1.0
    plain = rope_inv_freq(16, theta, None)
    # All three bands occur: kept (high frequency), divided by the factor (low), smoothed (between).
    assert (ours == plain).any() and torch.isclose(ours, plain / 8).any()
    assert ((ours != plain) & ~torch.isclose(ours, plain / 8)).any()


def test_rope_parameters_of_a_transformers4_style_config() -> None:
    from types import SimpleNamespace

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    old = SimpleNamespace(rope_theta=500000.0, rope_scaling=scaling)
    new = SimpleNamespace(rope_parameters={**scaling, "rope_theta": 500000.0})
    assert rope_parameters(old) == (500000.0, scaling)
    theta, params = rope_parameters(new)
    assert theta == 500000.0
    torch.testing.assert_close(rope_inv_freq(16, *rope_parameters(old)), rope_inv_freq(16, theta, params))
    assert rope_parameters(SimpleNamespace()) == (10000.0, None)
