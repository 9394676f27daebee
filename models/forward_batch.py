"""What one forward needs besides the weights: tokens, positions, and where their KV goes.

Sequences are packed one after another (``query_lens`` tokens each). Each sequence's KV lives
in fixed-size blocks of a paged cache; ``block_tables[i]`` lists sequence i's blocks and
``slot_mapping`` says where each new token's K/V is written.

``PagedAttentionMetadata`` is the same layout as device tensors of static shape, for attention
that must not read Python lists (CUDA graphs replay without running Python).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .parallel.dp_geometry import Padding


class KVShape(NamedTuple):
    """One attention layer's cache on this rank: ``kv_heads`` heads of K (``k_dim``) and V (``v_dim``).

    ``v_in_k``: only K is stored and V is its first ``v_dim`` columns, a view (MLA's latent cache:
    K = [normed latent | rope key], V = the latent). ``kv_shapes()`` may also give the short forms
    (kv_heads, head_dim) and (kv_heads, k_dim, v_dim): ``of`` reads all three.
    """

    kv_heads: int
    k_dim: int
    v_dim: int
    v_in_k: bool = False

    @staticmethod
    def of(shape: tuple[int, ...]) -> KVShape:
        if isinstance(shape, KVShape):
            return shape
        if len(shape) == 2:
            return KVShape(shape[0], shape[1], shape[1])
        if len(shape) == 3:
            return KVShape(shape[0], shape[1], shape[2])
        raise ValueError(f"a KV shape is (kv_heads, dim), (kv_heads, k_dim, v_dim) or a KVShape, not {shape}")

    @property
    def elements_per_token(self) -> int:
        """Cache elements one token takes (K, and V unless it is in K)."""
        return self.kv_heads * (self.k_dim + (0 if self.v_in_k else self.v_dim))


@dataclass
class KVCache:
    """Paged K/V storage of every attention layer: [num_blocks * block_size, kv_heads, head_dim].

    A layer in ``v_in_k`` stores K only: its ``v`` tensor is a view of K's first v_dim columns (the
    attention backends write K alone there and may read V out of the K rows they load).
    ``allocate`` puts the K and V tensors of one shape in one ``groups`` tensor [tensors, slots, ...],
    each layer's a view of it, so that moving slots (``StepExecutor.copy_kv``) is one gather per group
    instead of one per layer and tensor.
    """

    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    block_size: int
    num_blocks: int
    v_in_k: frozenset[int] = frozenset()
    groups: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def allocate(layer_shapes: dict[int, tuple[int, ...]], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> KVCache:
        """layer_shapes: layer id -> a ``KVShape`` (or one of its short forms) on this rank."""
        slots = num_blocks * block_size
        owned: list[tuple[str, int, tuple[int, int]]] = []  # (k or v, layer, (heads, dim)) of each owning tensor
        shared: set[int] = set()
        for i, raw in layer_shapes.items():
            shape = KVShape.of(raw)
            owned.append(("k", i, (shape.kv_heads, shape.k_dim)))
            if shape.v_in_k:
                if shape.v_dim > shape.k_dim:
                    raise ValueError(f"layer {i}: V of {shape.v_dim} cannot be the first columns of K of {shape.k_dim}")
                shared.add(i)
            else:
                owned.append(("v", i, (shape.kv_heads, shape.v_dim)))
        tensors: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}}
        groups = []
        for dims in dict.fromkeys(d for _, _, d in owned):
            members = [(kind, i) for kind, i, d in owned if d == dims]
            group = torch.zeros(len(members), slots, *dims, dtype=dtype, device=device)
            groups.append(group)
            for j, (kind, i) in enumerate(members):
                tensors[kind][i] = group[j]
        k = {i: tensors["k"][i] for i in layer_shapes}
        v = {i: k[i][..., : KVShape.of(layer_shapes[i]).v_dim] if i in shared else tensors["v"][i] for i in layer_shapes}
        return KVCache(k=k, v=v, block_size=block_size, num_blocks=num_blocks, v_in_k=frozenset(shared),
                       groups=tuple(groups))

    def stored(self) -> list[torch.Tensor]:
        """Every tensor that owns cache memory (each layer's K, and its V unless that is a view of K)."""
        return [*self.k.values(), *(t for i, t in self.v.items() if i not in self.v_in_k)]

    def grouped(self) -> list[torch.Tensor]:
        """The owning tensors as [tensors, slots, ...] stacks: ``groups``, or each layer's alone (a cache
        built from separate tensors)."""
        return list(self.groups) or [t[None] for t in self.stored()]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The K/V of slots ``src`` copied to slots ``dst`` in every layer, on the device (one gather and one scatter per
        group of same-shaped layers); every source is read before any destination is written."""
        for group in self.grouped():
            KVCache.move_group(group, src, dst)

    @staticmethod
    def move_group(group: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``move`` in one group ([tensors, slots, ...]): a gather of every source, then a scatter."""
        group.index_copy_(1, dst, group.index_select(1, src))  # not group[:, d] = ...: its indexing costs the host 2x

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over every layer (what a decode step reads per context token)."""
        return sum(t[0].numel() * t.element_size() for t in self.stored())


@dataclass
class PagedAttentionMetadata:
    """The batch's paged layout as device tensors: read on the device only (CUDA-graph safe).

    Example, block size 4: sequence 0 has 5 tokens cached in blocks [7, 2] and decodes one
    more; sequence 1 prefills 3 tokens into block [5]::

        block_tables = [[7, 2], [5, 0]]   # [B, max_blocks] int32, rows padded with block 0
        context_lens = [6, 3]             # [B] int32, cached tokens after this step
        token_seq    = [0, 1, 1, 1]       # [T] sequence of each new token
        token_index  = [5, 0, 1, 2]       # [T] each new token's index in its context (causal limit)
        query_start  = [0, 1, 4]          # [B+1] int32, sequence i's new tokens are rows
                                          #   query_start[i]..query_start[i+1]-1
        max_query_len = 3                 # static: 1 means a decode batch (token i is sequence i)

    ``tail_mask`` ([T, L] bool, optional) replaces the causal rule over the last L cache indices
    of each token's sequence (a speculative tree: a node sees its ancestors and itself there);
    every index before those L stays visible. None = causal.
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    token_seq: torch.Tensor
    token_index: torch.Tensor
    query_start: torch.Tensor
    max_query_len: int
    tail_mask: torch.Tensor | None = None

    @staticmethod
    def from_lists(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                   device: torch.device | str | None = None, max_blocks: int | None = None
                   ) -> PagedAttentionMetadata:
        width = max_blocks if max_blocks is not None else max((len(t) for t in block_tables), default=0)
        width = max(width, 1)
        tables = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t[:width], dtype=torch.int32)
        seq = [i for i, q in enumerate(query_lens) for _ in range(q)]
        index = [c - q + j for q, c in zip(query_lens, context_lens) for j in range(q)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return PagedAttentionMetadata(
            block_tables=tables.to(device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            token_seq=torch.tensor(seq, dtype=torch.long, device=device),
            token_index=torch.tensor(index, dtype=torch.long, device=device),
            query_start=torch.tensor(starts, dtype=torch.int32, device=device),
            max_query_len=max(query_lens, default=0),
        )

    @staticmethod
    def decode(block_tables: torch.Tensor, context_lens: torch.Tensor) -> PagedAttentionMetadata:
        """One new token per sequence, computed on the device (capturable).
        block_tables: [B, max_blocks] int32; context_lens: [B] int32"""
        b = block_tables.shape[0]
        return PagedAttentionMetadata(
            block_tables=block_tables,
            context_lens=context_lens,
            token_seq=torch.arange(b, device=block_tables.device),
            token_index=context_lens.long() - 1,
            query_start=torch.arange(b + 1, dtype=torch.int32, device=block_tables.device),
            max_query_len=1,
        )


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    query_lens: list[int]  # new tokens per sequence
    context_lens: list[int]  # tokens in the cache per sequence after this step (incl. the new ones)
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_tables: list[list[int]]
    kv_cache: KVCache | None
    logits_indices: torch.Tensor | None = None  # rows that get logits; None = every row
    # Optional per-sequence [query_len, context_len] boolean masks (True = may attend), e.g. a
    # speculative tree; None = causal.
    attn_masks: list[torch.Tensor | None] | None = None
    # Per-sequence recurrent-state slots (Mamba layers) and their storage; None without such layers.
    state_slots: list[int] | None = None
    state_cache: Any = None
    # DP attention: tokens of every DP group this forward (this batch is this rank's DP group's);
    # the padding mode (None = chosen per forward, as sglang does); the real tokens of each DP group
    # as a [dp] device tensor when dp_num_tokens are padded counts (a CUDA-graph replay), else None.
    dp_num_tokens: list[int] | None = None
    dp_padding: Padding | None = None
    dp_real_tokens: torch.Tensor | None = None
    # EAGLE3: target layers whose complete input residual stream the forward returns (ModelOutput.hidden).
    aux_layers: tuple[int, ...] = ()
    # The EAGLE3 draft's per-row hidden input: [T, 3*H_target] (aux states) or [T, H] (its own).
    input_hidden: torch.Tensor | None = None
    extras: dict[str, object] = field(default_factory=dict)
    # The paged layout as device tensors; None = built from the lists above on first use.
    paged: PagedAttentionMetadata | None = None
    # The attention backend's plan for this forward (e.g. FlashInfer wrappers planned for it); None =
    # the backend needs none.
    attention: Any = None

    def paged_metadata(self) -> PagedAttentionMetadata:
        """``paged``, built from the Python lists (one host-to-device copy) when not given."""
        if self.paged is None:
            self.paged = PagedAttentionMetadata.from_lists(self.query_lens, self.context_lens, self.block_tables,
                                                           self.input_ids.device)
        return self.paged

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @staticmethod
    def prefill(prompts: list[list[int]], kv_cache: KVCache, device: torch.device | str | None = None,
                all_logits: bool = True) -> ForwardBatch:
        """Fresh sequences laid out in consecutive blocks of ``kv_cache``."""
        bs = kv_cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        next_block = 0
        for p in prompts:
            nblocks = -(-len(p) // bs)
            table = list(range(next_block, next_block + nblocks))
            next_block += nblocks
            if next_block > kv_cache.num_blocks:
                raise ValueError(f"KV cache of {kv_cache.num_blocks} blocks is too small for these prompts")
            ids += p
            positions += range(len(p))
            slots += [table[i // bs] * bs + i % bs for i in range(len(p))]
            tables.append(table)
        lens = [len(p) for p in prompts]
        last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))], device=device)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            query_lens=lens,
            context_lens=list(lens),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=tables,
            kv_cache=kv_cache,
            logits_indices=None if all_logits else last,
        )
