"""Nemotron-H against transformers' NemotronHForCausalLM (fp32, torch path on CPU).

One schedule of forwards covers prefill from zero, chunked prefill (a sequence continuing
with several tokens), decode (one token per sequence, batched) and mixed batches; the logits
of every token must equal HF's logits of the whole sequence (max abs diff <= 1e-4), so
"prefill N, then decode k" equals "prefill N+k". On gloo ranks every forward's executed
collectives must equal the plan on every rank. Several configurations share one spawn per
world size. Sequences are spread over DP groups round-robin, so DP-attention cases (dp > 1)
only need adding to ``CASES`` once the communicator supports them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fusedserve.models.forward_batch import ForwardBatch, KVCache
from fusedserve.models.layers.mamba_state import MambaStateCache
from fusedserve.models.nemotron_h import NemotronHForCausalLM, layer_pattern
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
# Ids at vocab shard edges (250 padded to 256: 63/64, 127/128, 191/192, 249 at tp=4).
SEQS: list[list[int]] = [
    [0, 63, 64, 127, 128, 191, 192, 249, 5, 3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 2, 64, 33, 83, 27],
    [17, 11, 249, 7],
    [100, 37, 3, 141, 59, 26, 200, 58, 97, 93, 12, 9],
]
# Tokens each sequence runs per forward (chunk_size is 8): sequence 0 prefills 17 (three chunks),
# continues with 5 (chunked prefill), then decodes; 1 decodes from its first token; 2 prefills 9.
# Under dp=2 (sequence s on DP group s % 2), forward 3 leaves DP group 1 without tokens.
SCHEDULE: list[dict[int, int]] = [{0: 17, 1: 1, 2: 9}, {0: 5, 1: 1, 2: 1}, {0: 1, 1: 1}, {0: 1, 2: 1},
                                  {1: 1, 2: 1}]
REPLAY = Schedule(SEQS, SCHEDULE, BLOCK, BLOCKS_PER_SEQ)
# (tp, dp, ep, fusion) per world size; one spawn each.
CASES: dict[int, list[tuple[int, int, int, str]]] = {
    2: [(2, 1, 1, "off"), (2, 1, 1, "reference"), (2, 1, 2, "off"), (2, 1, 2, "reference")],
    4: [(4, 1, 1, "off"), (4, 1, 1, "reference"), (4, 2, 1, "off"), (4, 4, 4, "off"), (4, 4, 4, "reference"),
        (4, 2, 2, "off"), (4, 2, 2, "reference")],
}




@pytest.fixture(scope="module")
def tiny_nemotron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fusedserve.tiny import make_tiny_nemotron_h

    return make_tiny_nemotron_h(tmp_path_factory.mktemp("tiny-nemotron-h") / "model")


@pytest.fixture(scope="module")
def hf_model(tiny_nemotron: Path) -> Any:
    from transformers import NemotronHForCausalLM as HF

    return HF.from_pretrained(str(tiny_nemotron), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_logits(hf_model: Any) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf_model(torch.tensor([seq[:n]])).logits[0].float() for seq, n in zip(SEQS, REPLAY.done_tokens())]






def _rank_main(rank: int, world: int, backend: str, model_dir: str,
               cases: list[tuple[int, int, int, str]]) -> list[dict[str, Any]]:
    from fusedserve.models.loader import load_model
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.fusion.selection import FusionMode, fused_kernel
    from fusedserve.models.parallel.groups import build_groups

    results = []
    for tp, dp, ep, fusion in cases:
        groups = build_groups(ParallelConfig(tp, dp, ep), rank, backend)
        collectives = Collectives(backend, fused=fused_kernel(FusionMode(fusion), groups, 0, torch.float32))
        model = load_model(model_dir, groups, collectives)
        logits, mismatches = REPLAY.run(model, dp, groups.coords.dp_rank)
        lead = groups.coords.attn_tp_rank == 0  # one rank per DP group reports logits
        results.append({"case": (tp, dp, ep, fusion), "logits": logits if lead else {},
                        "mismatches": mismatches})
    return results




def test_tp1_prefill_chunked_prefill_and_decode_equal_hf(tiny_nemotron: Path, hf_logits: list[torch.Tensor]) -> None:
    from fusedserve.models.loader import load_model
    from fusedserve.models.parallel.collectives import Collectives

    model = load_model(tiny_nemotron, ParallelGroups.single_rank(), Collectives("gloo"))
    logits, mismatches = REPLAY.run(model, dp=1, dp_rank=0)
    assert not mismatches
    check_logits(logits, hf_logits, "tp1", ATOL)
    # The same tokens in one prefill per sequence give the same logits (state cache = recompute).
    kv = KVCache.allocate(model.kv_shapes(), 16, BLOCK, torch.float32)
    full = ForwardBatch.prefill([seq[:n] for seq, n in zip(SEQS, REPLAY.done_tokens())], kv)
    full.state_slots, full.state_cache = [0, 1, 2], MambaStateCache.allocate(model.state_shapes(), 3, torch.float32)
    torch.testing.assert_close(torch.cat([logits[s] for s in range(len(SEQS))]), model(full).logits, atol=1e-5, rtol=0)


def test_fused_expert_checkpoint_layout_loads(hf_model: Any, hf_logits: list[torch.Tensor],
                                              tmp_path: Path) -> None:
    """transformers' in-memory layout ("model." prefix, [E, ...] expert tensors) loads too."""
    from fusedserve.models.loader import load_model
    from fusedserve.models.parallel.collectives import Collectives

    hf_model.save_pretrained(str(tmp_path), save_original_format=False)
    model = load_model(tmp_path, ParallelGroups.single_rank(), Collectives("gloo"))
    kv = KVCache.allocate(model.kv_shapes(), BLOCKS_PER_SEQ, BLOCK, torch.float32)
    n = REPLAY.done_tokens()[0]
    batch = ForwardBatch.prefill([SEQS[0][:n]], kv)
    batch.state_slots, batch.state_cache = [0], MambaStateCache.allocate(model.state_shapes(), 1, torch.float32)
    check_logits({0: model(batch).logits}, hf_logits, "fused expert layout", ATOL)


@pytest.mark.parametrize("world", sorted(CASES))
def test_ranks_equal_hf_and_run_the_plan(world: int, tiny_nemotron: Path, hf_logits: list[torch.Tensor]) -> None:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    per_rank = run_on_ranks(_rank_main, world, str(tiny_nemotron), CASES[world], backend="gloo")
    for c, case in enumerate(CASES[world]):
        mismatches = [f"rank {r}: {m}" for r, res in enumerate(per_rank) for m in res[c]["mismatches"]]
        assert not mismatches, f"{case}: " + "; ".join(mismatches)
        logits: dict[int, torch.Tensor] = {}
        for res in per_rank:
            logits.update(res[c]["logits"])
        assert sorted(logits) == list(range(len(SEQS)))
        check_logits(logits, hf_logits, f"tp={case[0]} dp={case[1]} ep={case[2]} fusion={case[3]}", ATOL)




def test_pattern_blocks_and_cache_shapes(tiny_nemotron: Path) -> None:
    from fusedserve.models.loader import load_config
    from fusedserve.models.parallel.collectives import Collectives

    config = load_config(tiny_nemotron)
    assert layer_pattern(config) == "M*-EME"
    legacy = type("Legacy", (), {"hybrid_override_pattern": "ME*-"})()
    assert layer_pattern(legacy) == "ME*-"
    blocks = NemotronHForCausalLM.blocks(config)
    assert blocks[0] == BlockSpec("layers.0.mixer", Layout.ATTN_TP_FULL, "attn_tp")
    assert blocks[1] == BlockSpec("layers.1.mixer", Layout.ATTN_TP_FULL, "attn_tp")
    assert blocks[2] == BlockSpec("layers.2.mixer", Layout.FULL, "tp")
    assert blocks[3] == BlockSpec("layers.3.mixer", Layout.FULL, "tp")
    # Built (not loaded) on rank 1 of tp=2: no process group is needed to construct it.
    model = NemotronHForCausalLM(config, unconnected_groups(ParallelConfig(2), 1), Collectives("gloo"),
                                 device="meta")
    assert model.kv_shapes() == {1: (1, 16)}  # 2 KV heads over 2 ranks
    shapes = model.state_shapes()
    assert sorted(shapes) == [0, 4]
    # 4 of 8 heads x 8, 2 of 4 groups x state 16: conv x+B+C = 32 + 64 channels
    assert shapes[0].conv == (96, 3) and shapes[0].ssm == (4, 8, 16)
