"""One forward's attention layout as host values, for backends that plan before the forward runs.

Sequence i brings ``qo_lens[i]`` new rows that are the last rows of its ``kv_lens[i]`` cached
tokens (K/V through ``block_tables[i]``); attention is causal, or — where ``tail_masks[i]`` is
given, row-major [rows, tail] — that mask replaces the causal rule over the context's last
``tail`` slots (every slot before them stays visible): a speculative tree.

A backend with a planner (``AttentionPlanner``, e.g. FlashInfer's) turns an eager forward's layout into
its ``ForwardBatch.attention`` once per forward; the attention of every layer then runs with that plan.
A captured forward carries the planner's ``graph_plan``, whose kernels read the replay's device
metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..forward_batch import KVCache

# What the FlashInfer wrappers take here (attention_flashinfer.py): the prebuilt modules' head dims.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def flashinfer_supports(head_dim: int, dtype: torch.dtype) -> bool:
    return head_dim in SUPPORTED_HEAD_DIMS and dtype in SUPPORTED_DTYPES


@dataclass(frozen=True)
class AttentionLayout:
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    tail_masks: tuple[tuple[bool, ...] | None, ...] | None = None  # per sequence; None = all causal

    @property
    def is_decode(self) -> bool:
        """One causal row per sequence."""
        return all(q == 1 for q in self.qo_lens) and not self.has_masks

    @property
    def has_masks(self) -> bool:
        return self.tail_masks is not None and any(m is not None for m in self.tail_masks)

    def full_mask(self, i: int) -> list[bool]:
        """Sequence i's mask over its whole context, row-major [qo_len, kv_len] (True = may attend)."""
        q, kv = self.qo_lens[i], self.kv_lens[i]
        tail = None if self.tail_masks is None else self.tail_masks[i]
        if tail is None:
            return [c <= kv - q + r for r in range(q) for c in range(kv)]
        width = len(tail) // q
        return [c < kv - width or tail[r * width + c - (kv - width)] for r in range(q) for c in range(kv)]


@dataclass(frozen=True)
class AttentionDims:
    """A model's attention on this rank, as a planner needs it (one set for every layer)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class AttentionPlanner(Protocol):
    """Plans a backend's attention for a forward (host side, outside CUDA graphs)."""

    def plan(self, layout: AttentionLayout) -> Any:
        """An eager forward's plan (goes into ``ForwardBatch.attention``)."""
        ...

    def graph_plan(self) -> Any:
        """The plan every captured forward carries (its ``ForwardBatch.attention``): its kernels read the
        replay's device metadata alone, so nothing is planned on the host before a replay and a replay
        may advance context lengths on the device (chained forwards)."""
        ...


class PlannerFactory(Protocol):
    """Makes a model's planner for one KV cache: heads and dims on this rank, the softmax scale."""

    def __call__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kv_cache: KVCache) -> AttentionPlanner: ...
