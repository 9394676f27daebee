"""Checkpoint loading: HF config.json + safetensors (single file and sharded) -> our model, sharded per
rank; every failure says what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fusedserve.models.forward_batch import ForwardBatch, KVCache
from fusedserve.models.layers.weight_source import WeightShapeError
from fusedserve.models.loader import (
    INDEX_FILE,
    CheckpointError,
    checkpoint_files,
    iter_checkpoint,
    load_model,
    load_weights,
)
from fusedserve.models.parallel.collectives import Collectives
from fusedserve.models.parallel.groups import (
    Group,
    ParallelConfig,
    ParallelGroups,
    plan_group_ranks,
    rank_coordinates,
)
from fusedserve.models.registry import UnsupportedArchitecture


def groups_of(tp: int, rank: int) -> ParallelGroups:
    """Rank ``rank``'s groups of a tp-rank engine, without process groups: loading never communicates."""
    config = ParallelConfig(tp)
    mine = {}
    for name, lists in plan_group_ranks(config).items():
        (ranks,) = [g for g in lists if rank in g]
        mine[name] = Group(name=name, rank=ranks.index(rank), ranks=tuple(ranks))
    return ParallelGroups(config=config, coords=rank_coordinates(config, rank), **mine)


def load(model_dir: Path, tp: int = 1, rank: int = 0) -> Any:
    groups = ParallelGroups.single_rank() if tp == 1 else groups_of(tp, rank)
    return load_model(model_dir, groups, Collectives("gloo"))


def prefill_logits(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    block = 16
    kv = KVCache.allocate(model.kv_shapes(), sum(-(-len(p) // block) for p in prompts), block, torch.float32)
    return model(ForwardBatch.prefill(prompts, kv)).logits


@pytest.fixture
def ckpt(tiny_llama: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint, free to break."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "ckpt"))


def edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def rewrite_tensors(model_dir: Path, edit: Any) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


# --- loads and matches ----------------------------------------------------------------------------


def test_single_file_checkpoint_matches_hf(
    tiny_llama: Path, oracles: dict[str, Any], llama_prompts: list[list[int]]
) -> None:
    logits = prefill_logits(load(tiny_llama), llama_prompts)
    assert (logits - oracles["base"].logits).abs().max().item() <= 1e-4


def test_sharded_checkpoint_loads_and_matches(
    tiny_llama: Path, tmp_path: Path, oracles: dict[str, Any], llama_prompts: list[list[int]]
) -> None:
    from transformers import LlamaForCausalLM

    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(str(tiny_llama)).save_pretrained(str(sharded), max_shard_size="200KB")
    files = checkpoint_files(sharded)
    assert len(files) >= 3 and (sharded / INDEX_FILE).is_file()
    assert min(json.loads((sharded / INDEX_FILE).read_text())["weight_map"].values()) == files[0].name
    ours = prefill_logits(load(sharded), llama_prompts)
    assert (ours - oracles["base"].logits).abs().max().item() <= 1e-4
    torch.testing.assert_close(ours, prefill_logits(load(tiny_llama), llama_prompts), rtol=0, atol=0)


class RecordingSource:
    """Wraps a checkpoint tensor and records how much of it was read."""

    def __init__(self, inner: Any, reads: list[tuple[str, str, int, int]]) -> None:
        self._inner, self._reads, self.name = inner, reads, inner.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._inner.shape  # type: ignore[no-any-return]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        t = self._inner.narrow(dim, start, length)
        self._reads.append((self.name, "narrow", t.numel(), _numel(self.shape)))
        return t  # type: ignore[no-any-return]

    def full(self) -> torch.Tensor:
        t = self._inner.full()
        self._reads.append((self.name, "full", t.numel(), _numel(self.shape)))
        return t  # type: ignore[no-any-return]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_reads_only_its_shard_and_the_shards_reassemble(tiny_llama: Path, tp: int) -> None:
    from safetensors.torch import load_file

    from fusedserve.models.llama import LlamaForCausalLM

    full = load_file(str(tiny_llama / "model.safetensors"))
    config = json.loads((tiny_llama / "config.json").read_text())
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(tiny_llama))
    models = []
    for rank in range(tp):
        model = LlamaForCausalLM(hf_config, groups_of(tp, rank), Collectives("gloo"))
        reads: list[tuple[str, str, int, int]] = []
        load_weights(
            model, (RecordingSource(s, reads) for s in iter_checkpoint([tiny_llama / "model.safetensors"]))
        )
        # Only the (replicated, 1-D) norm weights are read whole; every matrix is read as a strict shard.
        assert {name for name, how, _, _ in reads if how == "full"} == {
            n for n in full if n.endswith("norm.weight")
        }
        assert all(got < total for name, how, got, total in reads if how == "narrow"), reads
        models.append(model)

    def cat(param: str, dim: int) -> torch.Tensor:
        return torch.cat([dict(m.named_parameters())[param] for m in models], dim=dim)

    hd, kv = config["head_dim"], config["num_key_value_heads"]
    q_rows = config["num_attention_heads"] * hd // tp
    kv_rows = hd * max(1, kv // tp)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        qkv = [dict(m.named_parameters())[f"layers.{i}.self_attn.qkv_proj.weight"] for m in models]
        torch.testing.assert_close(torch.cat([w[:q_rows] for w in qkv]), full[p + "self_attn.q_proj.weight"])
        for r, w in enumerate(qkv):  # KV heads: split while tp <= kv heads, replicated beyond
            head = r * kv // tp
            for j, name in enumerate(("k_proj", "v_proj")):
                torch.testing.assert_close(
                    w[q_rows + j * kv_rows : q_rows + (j + 1) * kv_rows],
                    full[p + f"self_attn.{name}.weight"][head * hd : head * hd + kv_rows],
                )
        torch.testing.assert_close(
            cat(f"layers.{i}.self_attn.o_proj.weight", 1), full[p + "self_attn.o_proj.weight"]
        )
        gate_up = [dict(m.named_parameters())[f"layers.{i}.mlp.gate_up_proj.weight"].chunk(2) for m in models]
        torch.testing.assert_close(torch.cat([g for g, _ in gate_up]), full[p + "mlp.gate_proj.weight"])
        torch.testing.assert_close(torch.cat([u for _, u in gate_up]), full[p + "mlp.up_proj.weight"])
        torch.testing.assert_close(
            cat(f"layers.{i}.mlp.down_proj.weight", 1), full[p + "mlp.down_proj.weight"]
        )
    vocab = config["vocab_size"]
    for ours, theirs in (
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ):
        table = cat(ours, 0)
        assert table.shape[0] == 256  # vocab 250 padded to a multiple of lcm(64, tp)
        torch.testing.assert_close(table[:vocab], full[theirs])
        assert not table[vocab:].any()


def test_tied_embeddings_share_one_table(llama_variants: dict[str, Path]) -> None:
    from safetensors import safe_open

    with safe_open(str(llama_variants["tied"] / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    model = load(llama_variants["tied"])
    assert model.lm_head.weight is model.embed_tokens.weight


# --- errors -----------------------------------------------------------------------------------------


def test_missing_config_json(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(
        CheckpointError, match=r"no config\.json \(is this a HuggingFace checkpoint directory\?\)"
    ):
        load(ckpt)


def test_config_json_not_json(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load(ckpt)


def test_no_safetensors(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        load(ckpt)


def test_file_named_in_the_index_is_missing(tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(str(tiny_llama)).save_pretrained(str(sharded), max_shard_size="200KB")
    victim = sorted(sharded.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError) as e:
        load(sharded)
    assert str(e.value) == f"{sharded}: files named in {INDEX_FILE} are missing: {victim.name}"


def test_index_not_valid(ckpt: Path) -> None:
    (ckpt / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        load(ckpt)


def test_corrupted_safetensors_header(ckpt: Path) -> None:
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header starts at byte 8
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        load(ckpt)
    assert str(e.value).startswith(f"{ckpt / 'model.safetensors'}: not a readable safetensors file: ")


def test_truncated_safetensors(ckpt: Path) -> None:
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match="model.safetensors: not a readable safetensors file: .*incomplete"
    ):
        load(ckpt)


def test_missing_tensor(ckpt: Path) -> None:
    rewrite_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError) as e:
        load(ckpt)
    assert str(e.value) == (
        "checkpoint lacks 1 tensor(s): layers.1.mlp.up_proj.weight "
        "(part 1 of layers.1.mlp.gate_up_proj.weight)"
    )


def test_missing_plain_tensors(ckpt: Path) -> None:
    def drop(t: dict[str, torch.Tensor]) -> None:
        del t["lm_head.weight"], t["model.norm.weight"]

    rewrite_tensors(ckpt, drop)
    with pytest.raises(CheckpointError) as e:
        load(ckpt)
    assert str(e.value) == "checkpoint lacks 2 tensor(s): lm_head.weight, norm.weight"


def test_unexpected_tensor(ckpt: Path) -> None:
    rewrite_tensors(ckpt, lambda t: t.update({"model.layers.9.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(
        CheckpointError, match=r"checkpoint tensor model\.layers\.9\.mlp\.extra\.weight has no place"
    ):
        load(ckpt)


def test_shape_mismatch_intermediate_size(ckpt: Path) -> None:
    edit_config(ckpt, intermediate_size=96)
    with pytest.raises(CheckpointError) as e:
        load(ckpt)
    msg = str(e.value)
    assert "mlp." in msg and "checkpoint shape (" in msg and "as config.json implies" in msg, msg
    assert "96" in msg


def test_shape_mismatch_hidden_size(ckpt: Path) -> None:
    edit_config(ckpt, hidden_size=32)
    with pytest.raises(CheckpointError) as e:
        load(ckpt)
    assert str(e.value) == "lm_head.weight: checkpoint shard has shape (250, 64), model expects (250, 32)"


def test_shape_mismatch_at_tp2(ckpt: Path) -> None:
    """The same check on a rank's shard: the full dimension is compared, not just the slice."""
    edit_config(ckpt, intermediate_size=64)
    with pytest.raises(
        CheckpointError,
        match=r"mlp\.down_proj\.weight: checkpoint shape \(64, 128\) has no dimension 1 of size 64 ",
    ):
        load(ckpt, tp=2, rank=1)


def test_unsupported_architecture(ckpt: Path) -> None:
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        UnsupportedArchitecture,
        match="architecture 'GPT2LMHeadModel' is not supported; supported: .*LlamaForCausalLM",
    ):
        load(ckpt)


def test_no_architecture(ckpt: Path) -> None:
    edit_config(ckpt, architectures=[])
    with pytest.raises(CheckpointError, match="config.json names no architecture"):
        load(ckpt)


def test_heads_that_do_not_split_are_refused(tiny_llama: Path) -> None:
    with pytest.raises(WeightShapeError, match="num_attention_heads=4 does not split over 3 ranks"):
        load(tiny_llama, tp=3, rank=0)
