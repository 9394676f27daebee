"""What a tree's verify computes on the device right behind its forward, inside its CUDA graph: a greedy tree
round's acceptance, the K/V moves it needs and the next round's inputs, so that round can be launched before
this one is read back (``SpecDecoder``'s tree rounds in flight).

For a captured tree verify (``b`` sequences of ``n`` nodes each, the root first, with its ancestor masks as the
tail mask: ``StepShape(b, n, n)``), after the target's forward (``StepGraphs``' ``finish`` program):

- ``aux`` [rows, 3H]: every row's aux states side by side;
- ``verdict`` [b, 3n + 1]: per sequence the verified tree's tokens (the verify's own input ids) and parents (read
  off its masks), the target's argmax of every row (raw logits) and how many nodes the greedy rule accepts
  (``device_tree.accept_greedy_on_device``: ``draft_tree.accept_greedy``'s rule) — what a greedy round reads back;
- ``moves`` [b, 2 * min(depth, n - 1)]: per sequence the cache slots its accepted nodes' K/V go from and to (node at depth d
  from its verify slot to the root's slot + d; past the count, and for padding sequences, a slot to itself), for
  the caller to apply to the target's cache once the round is its (``apply_moves``): a verify replayed for a
  round read one by one leaves the moves to the host's relocation, which a request's sampled path may need;
- staged: the draft's first pass + tree chain for the same ``b`` (``Drafter.first_tree_staged``): its
  ``depth + 1`` rows per sequence laid out as if every level were accepted, the root's row and the accepted
  nodes' aux states (``accepted_node_rows``: gathered as a prefix) reading the tokens gained (the accepted
  nodes', then the target's choice after them), at the slots and RoPE positions after the root, and the rows
  past the count dropped (``drop``); padding sequences keep padding rows;
- the verify's own inputs for the round after it (``verify_program.stage_next_verify``): each real sequence's root
  the token emitted after its accepted nodes, its rows, slots and context moved on by count + 1 (the next tree's
  tokens, RoPE positions — the root's plus each node's depth — and masks are the host's to copy in from the tree
  the staged draft grows).

The same function runs eagerly off CUDA (``StepGraphs``' eager replays), so the CPU tests check it against the
host's acceptance and relocation. On a GPU everything after the argmax is one Triton launch (``tree_stage_triton``;
checked against these torch ops in Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from ...models.forward_batch import KVCache
from ...models.interface import ModelOutput
from ..executor.executor import MoveKV
from ..executor.gpu_kernel import gpu_kernel
from ..executor.step_graphs import StaticInputs
from ..executor.step_shape import StepShape
from .device_tree import accept_greedy_on_device, accepted_moves, accepted_node_rows, parents_from_mask
from .verify_program import ArgmaxFn, Staged, stage_next_verify, table_slots

# (argmax [rows], the verify's static inputs, its aux states, batch, nodes, depth, the draft's inputs to stage or
# None) -> (aux, verdict, moves), or None where it does not take these inputs (``tree_stage_triton``)
TreeStageKernel = Callable[[torch.Tensor, StaticInputs, tuple[torch.Tensor, ...], int, int, int, StaticInputs | None],
                           tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]


class TreeVerifyProgram:
    """``argmax``: the sampler's (graph-safe); ``staged``: the draft's first pass + tree chain inputs for a padded
    batch (None where not captured at it); ``depth``: the draft's steps (the deepest node); ``stage_kernel``: all of
    the program after the argmax in one launch (GPU), else the torch ops below."""

    def __init__(self, argmax: ArgmaxFn, staged: Staged, depth: int, stage_kernel: TreeStageKernel | None = None
                 ) -> None:
        self.argmax = argmax
        self.staged = staged
        self.depth = depth
        self.stage_kernel = stage_kernel

    def __call__(self, shape: StepShape, inputs: StaticInputs, out: ModelOutput) -> tuple[torch.Tensor, ...]:
        if not shape.tail or shape.tail != shape.tokens or shape.chain or inputs.tail is None:
            return ()  # not a tree's verify
        b, n, depth = shape.batch, shape.tokens, self.depth
        dev = inputs.ids.device
        flat = self.argmax(out.logits)
        if self.stage_kernel is not None:
            done = self.stage_kernel(flat, inputs, out.hidden, b, n, depth, self.staged(b))
            if done is not None:
                return done
        argmax = flat.view(b, n)
        ids = inputs.ids.view(b, n)
        parents = parents_from_mask(inputs.tail.view(b, n, n) != 0)
        acc = accept_greedy_on_device(ids, parents, argmax, depth)
        aux = torch.cat(out.hidden, dim=-1)
        verdict = torch.cat([ids, parents, argmax, acc.count[:, None]], dim=1)
        slots = inputs.slots.view(b, n)
        real = slots[:, -1] != inputs.pad_slot
        moved = min(depth, n - 1)  # the deepest node of a tree of n
        moves = accepted_moves(slots, torch.where(real[:, None], acc.path[:, :moved], -1))
        draft = self.staged(b)
        if draft is not None and draft.hidden is not None and draft.drop is not None and inputs.block_size:
            q = depth + 1
            rows = b * q
            root_index = inputs.index.view(b, n)[:, :1]
            index = root_index + torch.arange(q, device=dev)  # [b, q]: the root's slot and the ones after it
            pad = root_index.expand(b, q)  # a padding sequence's rows: its root's index (in range)
            draft.ids[:rows].copy_(acc.tokens.reshape(-1))
            draft.positions[:rows].copy_((inputs.positions.view(b, n)[:, :1] + 1 + torch.arange(q, device=dev)).view(-1))
            draft.index[:rows].copy_(torch.where(real[:, None], index, pad).view(-1))
            draft.slots[:rows].copy_(torch.where(real[:, None], table_slots(inputs, index), inputs.pad_slot).view(-1))
            draft.context_lens[:b].copy_(torch.where(real, root_index[:, 0] + q, inputs.context_lens[:b]))
            draft.tables.copy_(inputs.tables)
            at = (torch.arange(b, device=dev)[:, None] * n + accepted_node_rows(acc.path)).view(-1)
            draft.hidden[:rows].copy_(aux.index_select(0, at))
            draft.drop[:b].copy_(torch.where(real, depth - acc.count, torch.zeros_like(acc.count)))
        if inputs.block_size:
            stage_next_verify(inputs, acc.tokens, acc.count, b, n)
        return aux, verdict, moves


# The program after the argmax as one launch on a GPU, where the torch ops are some 120 kernels at depth 6. Not yet
# timed on a GPU (the A/B: bench/graph_launch_probe.py --set worker.spec_decode.tree_verify_program.ONE_LAUNCH=False).
ONE_LAUNCH = True


def tree_stage_kernel(device: torch.device) -> TreeStageKernel | None:
    """The program's one-launch kernel where the hardware runs it (CUDA with Triton), else None (torch ops)."""
    if not ONE_LAUNCH:
        return None
    return cast("TreeStageKernel | None", gpu_kernel(device, f"{__package__}.tree_stage_triton", "tree_stage_triton"))


def apply_moves(cache: KVCache, moves: torch.Tensor, move: MoveKV = KVCache.move) -> None:
    """A tree verify's ``moves`` [b, 2 * depth] (sources, then destinations) applied to the cache on the device by
    ``move`` (``KVCache.move`` or the executor's ``move_kv``: every source read before any destination is
    written)."""
    depth = moves.shape[1] // 2
    move(cache, moves[:, :depth].reshape(-1), moves[:, depth:].reshape(-1))
