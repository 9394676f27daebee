"""What a chain's verify computes on the device right behind its forward, inside its CUDA graph.

For a captured chain verify (``b`` sequences of ``q = num_steps + 1`` rows: each root and its drafts,
``StepShape(b, q)``), after the target's forward (``StepGraphs``'s ``finish`` program):

- ``aux`` [rows, 3H]: the aux states of every row, side by side (what the draft's first pass reads);
- ``verdict`` [b, 2q]: per sequence its ``q - 1`` drafts (the verify's own input ids), the target's argmax of
  its ``q`` rows (raw logits) and how many drafts the greedy rule accepts (up to the first that differs
  from the argmax before it) — the one tensor a greedy round reads back, one contiguous slice for the real
  sequences;
- staged: the draft's greedy first pass + chain for the same ``b`` (``Drafter.first_chain_staged``)
  gets its inputs written here, as ``Drafter.chain_after`` would pack and copy them for the next round's chain
  drafted ahead: bases = the verify's rows (slots, causal index, context, block tables as the verify's, RoPE
  one further), base ``j`` reading the argmax of row ``j`` (a greedy row's accepted drafts equal the argmax
  before them, then comes the argmax), their aux states, and ``q - 1 -`` accepted rows dropped per sequence
  (none for padding sequences: those whose last row writes the pad slot). The host then only replays it
  (``StepExecutor.replay_staged``).

The same function runs eagerly off CUDA (``StepGraphs``' eager replays), so the CPU tests check it
against the host's acceptance. A tree's verify (``tail``) gets nothing here (``tree_verify_program.py``). On a GPU everything after the
argmax is one Triton launch (``verify_stage_triton.py``; checked against these torch ops in Triton's
interpreter), where the torch ops were some twenty kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from ...models.interface import ModelOutput
from ..executor.gpu_kernel import gpu_kernel
from ..executor.step_graphs import StaticInputs
from ..executor.step_shape import StepShape

ArgmaxFn = Callable[[torch.Tensor], torch.Tensor]  # logits [rows, vocab] -> [rows] int64
Staged = Callable[[int], StaticInputs | None]  # padded batch -> the draft's first chain inputs to stage, or None
# (argmax, the verify's static inputs, its aux states, batch, q, the draft's inputs to stage or None) ->
# (aux, verdict), or None where it does not take these inputs (``verify_stage_triton``)
StageKernel = Callable[[torch.Tensor, StaticInputs, tuple[torch.Tensor, ...], int, int, StaticInputs | None],
                       tuple[torch.Tensor, torch.Tensor] | None]


class VerifyProgram:
    """``argmax``: the sampler's (graph-safe); ``staged``: the draft's first chain inputs for a padded batch;
    ``stage_kernel``: all of the program after the argmax in one launch (GPU), else the torch ops below."""

    def __init__(self, argmax: ArgmaxFn, staged: Staged, stage_kernel: StageKernel | None = None) -> None:
        self.argmax = argmax
        self.staged = staged
        self.stage_kernel = stage_kernel

    def __call__(self, shape: StepShape, inputs: StaticInputs, out: ModelOutput) -> tuple[torch.Tensor, ...]:
        if shape.tail or shape.tokens < 2 or shape.last_only:  # a tree's verify, a decode step, a prefill
            return ()
        b, q = shape.batch, shape.tokens
        argmax = self.argmax(out.logits)  # [rows]
        if self.stage_kernel is not None:
            done = self.stage_kernel(argmax, inputs, out.hidden, b, q, self.staged(b))
            if done is not None:
                return done
        aux = torch.cat(out.hidden, dim=-1)
        targets = argmax.view(b, q)
        drafts = inputs.ids.view(b, q)[:, 1:]
        counts = (drafts == targets[:, :-1]).long().cumprod(dim=1).sum(dim=1)
        verdict = torch.cat([drafts, targets, counts[:, None]], dim=1)
        draft = self.staged(b)
        if draft is not None and draft.hidden is not None and draft.drop is not None:
            rows = b * q
            real = inputs.slots.view(b, q)[:, -1] != inputs.pad_slot
            draft.ids[:rows].copy_(argmax)
            draft.positions[:rows].copy_(inputs.positions + 1)
            draft.slots[:rows].copy_(inputs.slots)
            draft.index[:rows].copy_(inputs.index)
            draft.context_lens.copy_(inputs.context_lens)
            draft.tables.copy_(inputs.tables)
            draft.hidden[:rows].copy_(aux)
            draft.drop.copy_(torch.where(real, q - 1 - counts, torch.zeros_like(counts)))
        if inputs.block_size:
            stage_next_verify(inputs, targets, counts, b, q)
        return aux, verdict


# (the verify's static inputs, counts [n], greedy counts [n], tokens [n, q], next drafts [n, >= q - 1], n, q):
#   ``restage_sampled`` or its one-launch GPU kernel
RestageFn = Callable[[StaticInputs, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int], None]


def restage_sampled(inputs: StaticInputs, counts: torch.Tensor, greedy_counts: torch.Tensor, tokens: torch.Tensor,
                    next_drafts: torch.Tensor, n: int, q: int) -> None:
    """The next verify of a round with sampled requests, launched before that round is read back: the inputs
    ``stage_next_verify`` wrote from the greedy rule's ``greedy_counts`` [n] moved, for the first ``n`` sequences,
    to the device's outcome — each one's rows ``counts - greedy_counts`` further (positions, causal index,
    context), its root the token after its accepted drafts (``tokens`` [n, q]: the accepted drafts, then the
    token emitted after them), the slots through its block table again — and its drafts' rows
    ``next_drafts[:, :q - 1]`` (the chain drafted behind it). The plain reference of ``restage_triton``."""
    shift = counts - greedy_counts
    positions, index = inputs.positions.view(-1, q)[:n], inputs.index.view(-1, q)[:n]
    positions.add_(shift[:, None])
    index.add_(shift[:, None])
    inputs.context_lens[:n].add_(shift)
    ids = inputs.ids.view(-1, q)[:n]
    ids[:, 0].copy_(tokens.gather(1, counts[:, None])[:, 0])
    ids[:, 1:].copy_(next_drafts[:, :q - 1])
    inputs.slots.view(-1, q)[:n].copy_(table_slots(inputs, index))


def restage_fn(device: torch.device | str) -> RestageFn:
    """``restage_triton`` where the hardware runs it (CUDA with Triton), else ``restage_sampled``; chosen once."""
    return cast(RestageFn, gpu_kernel(device, f"{__package__}.verify_stage_triton", "restage_triton") or restage_sampled)


def stage_next_verify(inputs: StaticInputs, targets: torch.Tensor, counts: torch.Tensor, b: int, q: int) -> None:
    """The verify's own static inputs for the round after it, written over this round's (which its forward has
    read): each real sequence's root = the token emitted after its accepted drafts (``targets[count]``), its rows
    ``count + 1`` positions, causal indices and context further on, their slots through its block table (the
    host replays that only where the table reaches them: ``SpecDecoder``'s pipelined rounds); its drafts' rows
    are the next chain's, copied in by the host. Padding sequences stay padding."""
    real = inputs.slots.view(b, q)[:, -1] != inputs.pad_slot
    shift = torch.where(real, counts + 1, torch.zeros_like(counts))
    ids = inputs.ids.view(b, q)
    ids[:, 0].copy_(torch.where(real, targets.gather(1, counts[:, None])[:, 0], ids[:, 0]))
    inputs.positions.view(b, q).add_(shift[:, None])
    index = inputs.index.view(b, q)
    index.add_(shift[:, None])
    inputs.context_lens[:b].add_(shift)
    inputs.slots.view(b, q).copy_(torch.where(real[:, None], table_slots(inputs, index), inputs.slots.view(b, q)))


def table_slots(inputs: StaticInputs, index: torch.Tensor) -> torch.Tensor:
    """The cache slots of causal indices ``index`` [n, q] through the first ``n`` sequences' block tables (a column
    past the table clamped: the host replays such inputs only where its table reaches them)."""
    bs = inputs.block_size
    column = (index // bs).clamp(max=inputs.tables.shape[1] - 1)
    return inputs.tables[:index.shape[0]].gather(1, column) * bs + index % bs


# The program after the argmax as one launch on a GPU (checked against the torch ops in Triton's interpreter, and
# on the H200 by test_greedy_rounds_staged_by_the_verify_equal_the_host_op_rounds with it on). There SmolLM2's
# 8-row chain verify graph took 793 us of GPU time with it against 806-809 without (same lease:
# bench/results/2026-12-05-spec-defaults-ab-smollm2-h200.json; the A/B: bench/graph_launch_probe.py --set
# worker.spec_decode.verify_program.ONE_LAUNCH=False).
ONE_LAUNCH = True


def verify_stage_kernel(device: torch.device) -> StageKernel | None:
    """The program's one-launch kernel where the hardware runs it (CUDA with Triton), else None (torch ops)."""
    if not ONE_LAUNCH:
        return None
    return cast("StageKernel | None", gpu_kernel(device, f"{__package__}.verify_stage_triton", "verify_stage_triton"))
