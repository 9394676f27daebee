"""Building one rank, the one recipe: used by the Ray rank actor, ``verify``, tests and every benchmark.

``build_rank(model_dir, config, groups, backend, fusion)`` loads this rank's shard of the model with
the kernels, fusion, quantization and CUDA-graph readiness decided once (``executor/kernel_set.py``,
``models/parallel/fusion/selection.py``, ``models/quantization.py``), sizes the KV cache (the smallest any rank of the group
could allocate: block tables are shared) and returns the rank's ``StepExecutor``.
``run_engine_group`` runs a whole engine group on ranks already joined in torch.distributed (e.g.
by ``run_on_ranks``): the leader builds the ``Engine`` over a ``LeaderExecutor``, followers follow.

    def rank_main(rank, world, backend):
        return run_engine_group(rank, world, backend, "model/", EngineConfig(num_blocks=64),
                                lambda engine: engine.generate(["def f("]), fusion="reference")

    run_on_ranks(rank_main, 2)  # -> [completions, None]
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ...models.forward_batch import KVCache
from ...models.interface import CausalLM
from ...models.layers.mamba_state import MambaStateCache
from ...models.loader import architecture_of, checkpoint_quantization, load_config, load_model
from ...models.parallel.collectives import Collectives
from ...models.parallel.fusion.selection import (
    FusionMode,
    device_capability,
    flashinfer_importable,
    fused_kernel,
    fusion_mode,
    mode_of,
)
from ...models.parallel.groups import Group, ParallelConfig, ParallelGroups, build_groups
from ...models.quantization import Quantization, choose_quantization
from ...models.random_init import random_model
from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..executor.executor import StepExecutor
from ..executor.kernel_set import KernelChoice, kernel_choice, libraries
from ..executor.kv_cache import CPU_KV_BLOCKS, KVCacheSizeError, available_memory, blocks_for
from ..spec_decode.draft_model import draft_aux_layers
from .dp_rounds import DPEngine, DPRounds
from .step_channel import LeaderExecutor, StepChannel, follow

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Rank:
    groups: ParallelGroups
    model: CausalLM
    executor: StepExecutor
    fusion: FusionMode  # what this rank really runs (FlashInfer may have fallen back on every rank)
    kernels: KernelChoice
    quantization: Quantization  # how the checkpoint's weights are kept (block FP8 or plain)


def agree_min(value: int, group: Group) -> int:
    """The smallest ``value`` over the group's ranks (its CPU group)."""
    if group.is_trivial:
        return value
    n = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(n.item())


def build_rank(model_dir: str | Path, config: EngineConfig, groups: ParallelGroups | None = None,
               backend: str | None = None, fusion: str = "off", aux_layers: tuple[int, ...] | None = None,
               **model_kwargs: Any) -> Rank:
    """This rank's model shard, KV cache and executor. ``fusion``: what the spec or CLI asks for
    (``fusion/selection.py``: auto | on | off | reference | flashinfer); ``aux_layers``: the layers whose
    input residual every forward returns (default: what ``config.speculative``'s draft reads; set
    without a draft, e.g. to train one); ``model_kwargs`` go to the model class (benchmarks only)."""
    groups = groups or ParallelGroups.single_rank()
    device = torch.device(config.device)
    cuda = device.type == "cuda"
    backend = backend or ("nccl" if cuda else "gloo")
    dtype = config.torch_dtype
    model_config = load_config(model_dir)
    par = groups.config
    mode = fusion_mode(fusion, par.tp, par.dp_attention, device_capability(device), cuda and flashinfer_importable())
    kernel = fused_kernel(mode, groups, int(model_config.hidden_size), dtype)
    collectives = Collectives("nccl" if backend == "nccl" else "gloo", fused=kernel)
    choice = kernel_choice(device, config.cuda_graphs, model_config, dtype, libraries() if cuda else frozenset(),
                           config.kernels)
    kernels = choice.kernel_set()
    dummy = config.load_format == "dummy"
    quant = choose_quantization(config.quantization, checkpoint_quantization(model_config),
                                architecture_of(model_config), device_capability(device), dummy)
    if dummy:  # random weights as the checkpoint config.json describes would hold them (FP8: kept or dequantized)
        fp8 = {"fp8": quant.fp8} if quant.fp8 is not None else {}
        model: CausalLM = random_model(model_config, groups, collectives, dtype, device, config.seed or 0,
                                       dequantized=quant.checkpoint if quant.dequantize else None, kernels=kernels,
                                       **fp8, **model_kwargs)
    else:
        model = load_model(model_dir, groups, collectives, dtype, device, kernels, quant, **model_kwargs)
    model.eval()
    state_shapes = model.state_shapes()
    num_blocks = config.num_blocks
    if num_blocks is None:
        num_blocks = blocks_for(model.kv_shapes(), state_shapes, config.block_size, dtype, config.max_num_seqs,
                                config.kv_memory_fraction, available_memory(device))
        if device.type == "cpu":
            num_blocks = min(num_blocks, CPU_KV_BLOCKS)
    num_blocks = agree_min(num_blocks, groups.tp)  # block tables are shared by every rank
    if num_blocks < 1:
        raise KVCacheSizeError(f"the KV cache holds no block of {config.block_size} tokens")
    reserved = 1 if choice.graphs else 0
    cache = KVCache.allocate(model.kv_shapes(), num_blocks + reserved, config.block_size, dtype, device)
    state_cache = MambaStateCache.allocate(state_shapes, config.max_num_seqs, dtype, device) if state_shapes \
        else None
    aux = aux_layers if aux_layers is not None else \
        draft_aux_layers(config.speculative, model_config) if config.speculative is not None else ()
    attention = None
    if kernels.planner is not None:
        dims = model.attention_dims()
        attention = kernels.planner(dims.num_qo_heads, dims.num_kv_heads, dims.head_dim, dims.scale, cache)
    executor = StepExecutor(model, cache, device, collectives.ledger, state_cache, reserved, aux,
                            dp=par.dp if par.dp_attention else 0, graph_ready=choice.graphs, attention=attention,
                            kernels=kernels)
    log.info("rank %d: %s, %d KV blocks of %d, fusion %s, kernels %s%s, quantization %s", groups.coords.rank,
             type(model).__name__, num_blocks, config.block_size, mode_of(kernel).value, choice.kernels,
             ", CUDA graphs" if choice.graphs else "", quant.describe(config.dtype, choice.kernels))
    return Rank(groups, model, executor, mode_of(kernel), choice, quant)


def lead_engine(rank: Rank, model_dir: str | Path, config: EngineConfig) -> tuple[Engine, LeaderExecutor]:
    """The leader's engine over its step channel (with DP rounds under DP attention)."""
    groups = rank.groups
    if groups.config.dp_attention:
        runner = LeaderExecutor(rank.executor, StepChannel(groups.attn_tp), DPRounds(groups.dp))
        return DPEngine(model_dir, config, runner), runner
    runner = LeaderExecutor(rank.executor, StepChannel(groups.tp))
    return Engine(model_dir, config, runner=runner), runner


def follower_channel(groups: ParallelGroups) -> StepChannel:
    return StepChannel(groups.attn_tp if groups.config.dp_attention else groups.tp)


def leads(groups: ParallelGroups) -> bool:
    return follower_channel(groups).is_leader


def run_engine_group(rank: int, world: int, backend: str, model_dir: str | Path, config: EngineConfig,
                     lead: Callable[[Engine], T], fusion: str = "off", dp: int = 1, ep: int = 1,
                     **model_kwargs: Any) -> T | None:
    """Run one rank of a ``world``-rank engine (torch.distributed already initialised): the leader
    returns ``lead(engine)``; followers serve its forwards and return None. ``model_kwargs``: the
    model class's benchmark-only alternatives (as ``build_rank``)."""
    groups = build_groups(ParallelConfig(world, dp, ep), rank, backend) if world > 1 else ParallelGroups.single_rank()
    built = build_rank(model_dir, config, groups, backend, fusion, **model_kwargs)
    if not leads(groups):
        forwards = follow(built.executor, follower_channel(groups))
        log.info("rank %d: leader stopped after %d forwards", rank, forwards)
        return None
    engine, runner = lead_engine(built, model_dir, config)
    try:
        return lead(engine)
    finally:
        runner.stop()
