"""The one step runner: runs forwards of one model on one rank — the target or the EAGLE3 draft.

``StepExecutor.run(step, hidden)`` takes a ``Step`` (plain values, ``step.py``) and returns the
model's ``ModelOutput``: the logits of every sequence's last ``num_logits`` rows, sequence by
sequence, and the per-row hidden states the model returns (the target's EAGLE3 aux states, the
draft's next hidden state). The engine, speculative decoding, every rank of a parallel engine,
``verify`` and every benchmark run forwards through it.

Eager forwards (``forward_batch``): tokens packed one sequence after another, their positions, the
cache slot of every new row, ``logits_indices`` = the last ``num_logits`` rows of each sequence,
a tail mask as the reference attention's full mask; under DP attention the DP groups' token
counts (and their real counts as a device tensor); for a recurrent (Mamba) model the state slots.

CUDA graphs (``capture`` once at start-up; the executor was built ``graph_ready``: graph-safe
kernels, one cache block kept back for padding rows): a step whose sequences all feed the same
number of rows with logits for all of them (decode, a speculative verify, a draft step), or a
draft first pass (each sequence's last row only), runs as a replay at the next captured batch
size (``step_graphs.py``); any other step (prefill, mixed, too large) runs eagerly. Under DP
attention every DP group must replay the same shape, so only the shape the DP leaders agreed on
(``Step.graph_shape``) replays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from ...models.forward_batch import ForwardBatch, KVCache
from ...models.interface import ModelOutput, StepModel
from ...models.layers.attention_layout import AttentionPlanner
from ...models.layers.kernels import Kernels
from ...models.layers.mamba_state import MambaStateCache
from ...models.parallel.ledger import CollectiveLedger
from .gpu_kernel import gpu_kernel
from .host_copy import to_device
from .step import SeqRows, Step
from .step_graphs import FeedFn, FinishFn, GrowFn, LeavesFn, PackedSeq, SampleFn, StaticInputs, StepGraphs
from .step_shape import ShapeKey, StepShape

log = logging.getLogger(__name__)

MoveKV = Callable[[KVCache, torch.Tensor, torch.Tensor], None]  # (cache, src slots, dst slots): ``KVCache.move``

# K/V moves between slots in one Triton launch a group on a GPU (``kv_move_triton``: torch's index_copy_ splits into a
# kernel per layer on a cache past 2**31 elements); False: ``KVCache.move``, the A/B (bench/graph_launch_probe.py
# --set worker.executor.executor.KV_MOVE_ONE_LAUNCH=False).
KV_MOVE_ONE_LAUNCH = True


class StepExecutor:
    """``ledger``: the rank's collective ledger (graph replays count into it); None for a model
    without collectives (the draft). ``dp``: DP-attention groups (0 = none). ``aux_layers``: the
    target layers whose input residual every forward returns (EAGLE3)."""

    def __init__(self, model: StepModel, kv_cache: KVCache, device: torch.device,
                 ledger: CollectiveLedger | None = None, state_cache: MambaStateCache | None = None,
                 reserved_blocks: int = 0, aux_layers: tuple[int, ...] = (), dp: int = 0,
                 graph_ready: bool = False, attention: AttentionPlanner | None = None,
                 kernels: Kernels | None = None) -> None:
        if graph_ready and reserved_blocks < 1:
            raise ValueError("CUDA graphs need a reserved cache block for padding rows")
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.ledger = ledger
        self.state_cache = state_cache
        self.reserved_blocks = reserved_blocks
        self.aux_layers = aux_layers
        self.dp = dp
        self.graph_ready = graph_ready
        self.attention = attention  # the attention backend's planner (FlashInfer); None = it needs none
        self.kernels = kernels  # the model's kernel set (the EAGLE3 draft takes the target's)
        self.graphs: StepGraphs | None = None
        # moves K/V between cache slots (copy_kv, a tree verify's moves): one launch a group on a GPU
        fast = gpu_kernel(device, f"{__package__}.kv_move_triton", "move_kv_triton") if KV_MOVE_ONE_LAUNCH else None
        self.move_kv: MoveKV = fast or KVCache.move

    @property
    def local(self) -> StepExecutor:
        """This rank's executor (the engine's runner protocol: a leader's runner wraps one)."""
        return self

    @property
    def single_rank(self) -> bool:
        """The engine's runner protocol: no other rank needs each forward's token ids on its host."""
        return True

    @property
    def num_blocks(self) -> int:
        """Cache blocks the scheduler may hand out (the padding block excluded)."""
        return self.kv_cache.num_blocks - self.reserved_blocks

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    # --- eager ----------------------------------------------------------------------------------

    def forward_batch(self, step: Step, hidden: torch.Tensor | None = None) -> ForwardBatch:
        """The eager forward batch of a step. hidden: [rows, width] (the draft's input) or None."""
        bs = self.kv_cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for s in step.seqs:
            first_row = len(ids)
            ids += s.token_ids
            positions += s.positions
            slots += s.slots(bs)
            logits_rows += range(first_row + s.rows - s.num_logits, first_row + s.rows)
        dev = self.device
        masks = [None if s.tail_mask is None else _full_mask(s) for s in step.seqs]
        state_slots = [s.state_slot if s.state_slot is not None else -1 for s in step.seqs]
        counts = list(step.dp_num_tokens) if step.dp_num_tokens is not None else None
        return ForwardBatch(
            input_ids=to_device(ids, dev),
            positions=to_device(positions, dev),
            query_lens=[s.rows for s in step.seqs],
            context_lens=[s.context_len for s in step.seqs],
            slot_mapping=to_device(slots, dev),
            block_tables=[list(s.block_table) for s in step.seqs],
            kv_cache=self.kv_cache,
            logits_indices=to_device(logits_rows, dev),
            attn_masks=[None if m is None else m.to(dev) for m in masks] if any(m is not None for m in masks)
            else None,
            state_slots=state_slots if self.state_cache is not None else None,
            state_cache=self.state_cache,
            dp_num_tokens=counts, dp_padding=step.dp_padding,
            dp_real_tokens=None if counts is None else to_device(counts, dev),
            aux_layers=self.aux_layers,
            input_hidden=None if hidden is None else hidden.to(dev),
            attention=self.attention.plan(step.attention_layout()) if self.attention is not None and step.seqs
            else None,
        )

    # --- the one entry point --------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, step: Step, hidden: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
            positions: torch.Tensor | None = None, tail_rows: torch.Tensor | None = None) -> ModelOutput:
        """Logits of every sequence's last ``num_logits`` rows ([step.num_logits, vocab]) and the
        model's per-row hidden states ([step.num_tokens, width] each). ``input_ids``: [step.num_tokens]
        on the device, in place of the step's token ids (a verify of drafts still on the device);
        ``positions`` ([step.num_tokens]) and ``tail_rows`` ([step.num_tokens, tail], every sequence's
        tail mask rows): the same for RoPE positions and tree masks (a draft tree grown on the device),
        at captured shapes only."""
        shape = self.graph_shape(step, 0 if hidden is None else int(hidden.shape[-1]))
        if shape is None and (positions is not None or tail_rows is not None):
            raise ValueError("device-side positions and tail masks need a captured step shape")
        if shape is None:
            batch = self.forward_batch(step, hidden)
            if input_ids is not None:
                batch.input_ids = input_ids.to(batch.input_ids.dtype)
            out: ModelOutput = self.model(batch)
            return out
        return self._replay(shape, step, hidden, input_ids, positions, tail_rows)

    def graph_key(self, step: Step, hidden: int = 0) -> ShapeKey | None:
        """The captured kind of forward this step fits (its shape without the batch), or None."""
        graphs = self.graphs
        if graphs is None or not step.seqs:
            return None
        first = step.seqs[0]
        q, tail = first.rows, first.tail
        if all(s.rows == q and s.num_logits == q and s.tail == tail and (s.tail_mask is None) == (first.tail_mask
                                                                                                   is None)
               for s in step.seqs):
            key: ShapeKey = (q, tail, False, hidden, 0, False)
            if key in graphs.batch_sizes:
                return key
        if all(s.num_logits == 1 and s.tail_mask is None for s in step.seqs):
            return graphs.first_pass_key(max(s.rows for s in step.seqs), hidden)
        return None

    def graph_shape(self, step: Step, hidden: int = 0) -> StepShape | None:
        """The captured shape this step replays at; None = eager. Under DP attention only the
        shape the DP leaders agreed on (``step.graph_shape``)."""
        if self.graphs is None:
            return None
        if self.dp:
            return step.graph_shape
        key = self.graph_key(step, hidden)
        return None if key is None else self.graphs.shape_for(len(step.seqs), key)

    def chainable(self) -> bool:
        """Chained shapes can be captured here: no DP attention (a captured forward's attention reads
        device metadata alone: ``AttentionPlanner.graph_plan``)."""
        return not self.dp

    def chain_shape(self, num_seqs: int, hidden: int, chain: int, sampled: bool = False) -> StepShape | None:
        """The captured chained shape ``run_chain`` replays for ``num_seqs`` sequences, or None."""
        if self.graphs is None or self.dp:
            return None
        return self.graphs.shape_for(num_seqs, (1, 0, False, hidden, chain, sampled))

    @torch.inference_mode()
    def run_chain(self, step: Step, hidden: torch.Tensor, first_ids: torch.Tensor, chain: int,
                  sampling: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """``chain`` forwards of one row per sequence in one replay, each fed the previous one's
        ``feed`` tokens and hidden state (a captured chained shape); the first is fed ``first_ids``
        ([len(step.seqs)], on the device) in place of the step's token ids and ``hidden``
        ([len(step.seqs), width]). ``sampling``: each sequence's temperature [len(step.seqs)] (0: greedy)
        and uniform numbers [len(step.seqs), chain], for a sampled chain (its tokens drawn by ``sample``).
        -> [the tokens fed after each forward [len(step.seqs), chain]] (and for a sampled chain the
        distributions they were drawn from [len(step.seqs), chain, vocab]), or None when no captured
        chained shape fits (the caller runs the forwards one by one)."""
        if not step.seqs or not all(s.rows == 1 and s.num_logits == 1 and s.tail_mask is None for s in step.seqs):
            return None
        shape = self.chain_shape(len(step.seqs), int(hidden.shape[-1]), chain, sampling is not None)
        if shape is None or self.graphs is None:
            return None
        temperatures, uniforms = sampling if sampling is not None else (None, None)
        return self.graphs.run(shape, self._packed(step), hidden, input_ids=first_ids, temperatures=temperatures,
                               uniforms=uniforms)

    def first_chain_shape(self, step: Step, hidden: int, chain: int, sampled: bool = False) -> StepShape | None:
        """The captured first pass + chain ``run_first_chain`` replays for this first pass, or None."""
        if not step.seqs or not all(s.num_logits == 1 and s.tail_mask is None for s in step.seqs):
            return None
        return self.first_chain_at(len(step.seqs), max(s.rows for s in step.seqs), hidden, chain, sampled)

    def first_chain_at(self, num_seqs: int, rows: int, hidden: int, chain: int, sampled: bool = False
                       ) -> StepShape | None:
        """The captured first pass + chain for ``num_seqs`` sequences of at most ``rows`` rows, or None."""
        if self.graphs is None or self.dp:
            return None
        key = self.graphs.first_pass_key(rows, hidden, chain, sampled)
        return None if key is None else self.graphs.shape_for(num_seqs, key)

    @torch.inference_mode()
    def run_first_chain(self, step: Step, hidden: torch.Tensor, chain: int,
                        sampling: tuple[torch.Tensor, torch.Tensor] | None = None,
                        drop: torch.Tensor | None = None, input_ids: torch.Tensor | None = None
                        ) -> list[torch.Tensor] | None:
        """The draft's first pass (``step``: each sequence's bases, its last row the root; ``hidden``: their aux
        rows [step.num_tokens, width]) and ``chain`` steps after it, in one replay (a captured shape with a
        first pass): step 1 is fed the first pass's ``feed`` token (or draw) and its last row's hidden state.
        ``sampling``: each sequence's temperature and uniform numbers [len(step.seqs), 1 + chain].
        -> [the drafts [len(step.seqs), 1 + chain]] (a sampled chain's also the distributions drawn from
        [len(step.seqs), 1 + chain, vocab]), or None when no such shape is captured for the step.
        ``drop`` ([len(step.seqs)], on the device): how many of each sequence's last rows are not real after
        all (``StepGraphs.run``; the step lays out every sequence's most rows); ``input_ids``: the rows' token
        ids on the device, in place of the step's."""
        shape = self.first_chain_shape(step, int(hidden.shape[-1]), chain, sampling is not None)
        if shape is None or self.graphs is None:
            return None
        temperatures, uniforms = sampling if sampling is not None else (None, None)
        return self.graphs.run(shape, self._packed(step), hidden, input_ids=input_ids, temperatures=temperatures,
                               uniforms=uniforms, drop=drop)

    def tree_chain_shape(self, num_seqs: int, hidden: int, chain: int, leaves: int) -> StepShape | None:
        """The captured tree chain ``run_tree_chain`` replays for ``num_seqs`` sequences, or None."""
        if self.graphs is None or self.dp:
            return None
        return self.graphs.shape_for(num_seqs, (leaves, chain * leaves, False, hidden, chain, False))

    def tree_first_at(self, num_seqs: int, rows: int, hidden: int, chain: int, leaves: int) -> StepShape | None:
        """The captured first pass of ``rows`` rows per sequence + a tree's ``chain`` steps of ``leaves`` leaves for
        ``num_seqs`` sequences (replayed on inputs a verify's program stages: ``replay_staged``), or None."""
        if self.graphs is None or self.dp:
            return None
        return self.graphs.shape_for(num_seqs, (rows, chain * leaves, True, hidden, chain, False))

    @torch.inference_mode()
    def run_tree_chain(self, step: Step, hidden: torch.Tensor, first_ids: torch.Tensor, scores: torch.Tensor,
                       chain: int) -> list[torch.Tensor] | None:
        """A draft tree's ``chain`` steps in one replay (a captured tree chain: the program given to
        ``capture`` as ``grow``). ``step``: the first step's layout (every sequence's leaves, causal;
        their masks come from the program); hidden, first_ids, scores: the first leaves' hidden inputs
        [rows, width], tokens and scores [rows], on the device. -> the program's outputs, one row per
        sequence; None when no captured tree chain fits."""
        if not step.seqs:
            return None
        k = step.seqs[0].rows
        if not all(s.rows == k and s.num_logits == k and s.tail_mask is None for s in step.seqs):
            return None
        shape = self.tree_chain_shape(len(step.seqs), int(hidden.shape[-1]), chain, k)
        if shape is None or self.graphs is None:
            return None
        return self.graphs.run(shape, self._packed(step), hidden, input_ids=first_ids, scores=scores)

    def _packed(self, step: Step) -> list[PackedSeq]:
        """A step's sequences as ``StepGraphs.run`` takes them."""
        bs = self.kv_cache.block_size
        return [PackedSeq(s.block_table, s.token_ids, s.positions, s.slots(bs), s.context_len, s.tail_mask)
                for s in step.seqs]

    def _replay(self, shape: StepShape, step: Step, hidden: torch.Tensor | None,
                input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                tail_rows: torch.Tensor | None = None) -> ModelOutput:
        out, _ = self._replay_finished(shape, step, hidden, input_ids, positions, tail_rows)
        return out

    def _replay_finished(self, shape: StepShape, step: Step, hidden: torch.Tensor | None,
                         input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                         tail_rows: torch.Tensor | None = None, later_ids: torch.Tensor | None = None
                         ) -> tuple[ModelOutput, tuple[torch.Tensor, ...]]:
        """A replay -> the model's output and the finish program's extra outputs (``capture``'s ``finish``)."""
        graphs = self.graphs
        assert graphs is not None
        packed = self._packed(step)
        dp_real = list(step.dp_num_tokens) if self.dp and step.dp_num_tokens is not None else []
        logits, *rest = graphs.run(shape, packed, hidden, dp_real, input_ids, positions, tail_rows,
                                   later_ids=later_ids)
        n = len(rest) - graphs.extras.get(shape, 0)
        return ModelOutput(logits, tuple(rest[:n])), tuple(rest[n:])

    def finishes(self, shape: StepShape) -> bool:
        """``shape`` is captured with a finish program's outputs (``run_finished`` replays it)."""
        return self.graphs is not None and bool(self.graphs.extras.get(shape))

    @torch.inference_mode()
    def run_finished(self, step: Step, later_ids: torch.Tensor | None = None, shape: StepShape | None = None,
                     input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                     tail_rows: torch.Tensor | None = None) -> tuple[ModelOutput, tuple[torch.Tensor, ...]] | None:
        """``run`` at a captured shape whose forward has a finish program (``capture``'s ``finish``: the
        speculative verify's) -> the model's output and the program's extra outputs, each at its real rows or
        sequences; None (nothing run) where the step replays no such shape. ``later_ids``: [len(step.seqs),
        rows - 1] on the device, the token ids of every sequence's rows after its first (a verify's drafts; the
        step's own there only size it); ``shape``: the step's ``graph_shape``, where the caller has it;
        ``input_ids``, ``positions``, ``tail_rows``: as ``run``'s (a tree verify's, grown on the device)."""
        shape = shape or self.graph_shape(step)
        if shape is None or not self.finishes(shape):
            return None
        return self._replay_finished(shape, step, None, input_ids, positions, tail_rows, later_ids=later_ids)

    def static_inputs(self, shape: StepShape) -> StaticInputs:
        """A captured shape's static inputs, for another graph's program to stage (``replay_staged``)."""
        assert self.graphs is not None
        return self.graphs.static_inputs(shape)

    @torch.inference_mode()
    def replay_staged(self, shape: StepShape, sampling: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, ...]:
        """A captured shape replayed on the static inputs another graph staged -> its outputs at the padded
        batch (``StepGraphs.replay_staged``; ``sampling``: a sampled chain's temperatures and numbers)."""
        assert self.graphs is not None
        return self.graphs.replay_staged(shape, sampling)

    # --- start-up and cache moves -------------------------------------------------------------

    def capture(self, shapes: Sequence[StepShape], max_blocks: int, feed: FeedFn | None = None,
                grow: GrowFn | None = None, sample: SampleFn | None = None, finish: FinishFn | None = None,
                leaves: LeavesFn | None = None) -> None:
        """Capture the forward at these shapes (once, at start-up); from now on matching steps replay.
        ``feed``: a chained shape's logits -> next tokens; ``sample``: a sampled chain's draw; ``grow``: a
        tree chain's program; ``finish``: a plain forward's program after it (``run_finished``'s extra
        outputs; ``step_graphs.py``); ``leaves``: a tree chain's first leaves picked from its first pass."""
        if not self.graph_ready:
            raise ValueError("this executor was not built for CUDA graphs (graph-safe kernels, a padding block)")
        dtype = next(self.model.parameters()).dtype
        self.graphs = StepGraphs(self.model, self.kv_cache, shapes, max_blocks, dtype, self.ledger,
                                 self.aux_layers, self.dp, use_graphs=self.device.type == "cuda",
                                 attention=self.attention, feed=feed, grow=grow, sample=sample, finish=finish,
                                 leaves=leaves)
        log.info("captured %d step shapes (%s) %s", len(shapes), ", ".join(str(s) for s in sorted(shapes)[:4]),
                 "as CUDA graphs" if self.graphs.use_graphs else "(run eagerly off CUDA)")

    @torch.inference_mode()
    def copy_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of cache slots ``src`` to ``dst`` in every layer (all read before any is
        written), e.g. accepted draft-tree nodes to their sequence positions."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source slots for {len(dst)} destinations")
        if not src:
            return
        both = to_device(list(src) + list(dst), self.device)  # one host-to-device copy
        self.move_kv(self.kv_cache, both[:len(src)], both[len(src):])


def _full_mask(s: SeqRows) -> torch.Tensor:
    """A sequence's tail mask -> over its whole context: [rows, tail] -> [rows, context_len]."""
    full = torch.ones((s.rows, s.context_len), dtype=torch.bool)
    tail = torch.tensor(s.tail_mask, dtype=torch.bool).view(s.rows, s.tail)
    full[:, s.context_len - s.tail:] = tail
    return full
