"""Test helper: a schedule of forwards over several sequences (prefill from zero, chunked prefill, batched
decode, mixed batches) replayed through a model's own forward on a paged KV cache (and a Mamba state cache where
the model has Mamba layers), each sequence's logits of all its tokens in order, and each forward's executed
collectives against the plan. Sequences are spread over DP groups round-robin (sequence s on group s % dp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fusedserve.models.forward_batch import ForwardBatch, KVCache
from fusedserve.models.layers.mamba_state import MambaStateCache


@dataclass(frozen=True)
class Schedule:
    seqs: list[list[int]]  # each sequence's token ids
    steps: list[dict[int, int]]  # per forward: sequence -> how many of its next tokens it runs
    block: int  # KV block size
    blocks_per_seq: int

    def done_tokens(self) -> list[int]:
        """How many tokens of each sequence the whole schedule runs."""
        return [sum(step.get(s, 0) for step in self.steps) for s in range(len(self.seqs))]

    def batch(self, step: dict[int, int], done: list[int], mine: list[int], kv: KVCache, dp: int,
              state: MambaStateCache | None = None) -> tuple[ForwardBatch, list[tuple[int, int]]]:
        """The forward of this DP group's sequences ``mine`` (``done``: tokens each has run); returns it and
        its (sequence, tokens) rows."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        clens: list[int] = []
        tables: list[list[int]] = []
        rows: list[tuple[int, int]] = []
        for s in mine:
            n = step.get(s, 0)
            if not n:
                continue
            table = list(range(s * self.blocks_per_seq, (s + 1) * self.blocks_per_seq))
            span = range(done[s], done[s] + n)
            ids += self.seqs[s][span.start : span.stop]
            pos += span
            slots += [table[p // self.block] * self.block + p % self.block for p in span]
            qlens.append(n)
            clens.append(span.stop)
            tables.append(table)
            rows.append((s, n))
        dp_tokens = [sum(step.get(s, 0) for s in range(d, len(self.seqs), dp)) for d in range(dp)]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long), positions=torch.tensor(pos, dtype=torch.long),
            query_lens=qlens, context_lens=clens, slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=tables, kv_cache=kv, dp_num_tokens=dp_tokens if dp > 1 else None,
            state_slots=[s for s, _ in rows] if state is not None else None, state_cache=state,
        )
        return batch, rows

    def run(self, model: Any, dp: int, dp_rank: int) -> tuple[dict[int, torch.Tensor], list[str]]:
        """Every forward for this DP group's sequences: each sequence's logits (all its tokens, in order) and,
        per forward, any difference between the collectives this rank executed and the plan."""
        kv = KVCache.allocate(model.kv_shapes(), len(self.seqs) * self.blocks_per_seq, self.block, torch.float32)
        shapes = model.state_shapes()
        state = MambaStateCache.allocate(shapes, len(self.seqs), torch.float32) if shapes else None
        mine = list(range(dp_rank, len(self.seqs), dp))
        done = [0] * len(self.seqs)
        out: dict[int, list[torch.Tensor]] = {s: [] for s in mine}
        mismatches: list[str] = []
        for i, step in enumerate(self.steps):
            batch, rows = self.batch(step, done, mine, kv, dp, state)
            logits = model(batch).logits
            executed = [r.key for r in model.comm.ledger.forward_records()]
            planned = model.comm.ledger.forward_plan()
            if executed != planned:
                mismatches.append(f"forward {i}: executed {executed} planned {planned}")
            start = 0
            for s, n in rows:
                out[s].append(logits[start : start + n])
                start += n
                done[s] += n
        return {s: torch.cat(parts) for s, parts in out.items()}, mismatches


def check_logits(logits: dict[int, torch.Tensor], hf: list[torch.Tensor], what: str, atol: float) -> float:
    """Every sequence's logits equal HF's of the whole sequence within ``atol``; returns the largest difference."""
    worst = 0.0
    for s, got in logits.items():
        assert got.shape == hf[s].shape, f"{what}: sequence {s} logits {tuple(got.shape)} vs {tuple(hf[s].shape)}"
        worst = max(worst, float((got - hf[s]).abs().max()))
    assert worst <= atol, f"{what}: max abs diff {worst:.2e} > {atol}"
    return worst
