"""Where every token sits under DP attention, for one forward (pure).

Each DP group d has ``n_d`` tokens (possibly 0). The residual stream is SCATTERED: rank
r = d*attn_tp + a holds chunk a of DP group d's tokens. The FULL layout concatenates the
chunks of all ranks in rank order, so DP groups appear one after another.

Two paddings, chosen as sglang does (``choose_padding``):
- MAX_LEN: every DP group is padded to L = max_d n_d rounded up to a multiple of attn_tp;
  every chunk has c = L / attn_tp rows; FULL has dp*L rows (padding rows flagged invalid)
  and is built by an all-gather; the combine is an equal-chunk reduce-scatter.
- SUM_LEN: no padding; chunks are uneven (n_d split as evenly as possible); FULL has sum n_d
  rows and is built by an all-reduce of a zero-filled buffer; the combine is a
  reduce-scatter-v.

Example, tp=4, dp=2 (attn_tp=2), n = [3, 1]:
    MAX_LEN: L=4, c=2; chunks rank0 = g0[0:2], rank1 = g0[2:3]+pad, rank2 = g1[0:1]+pad, rank3 = pad
    SUM_LEN: chunk sizes [2, 1, 1, 0]; FULL = g0[0:3] g1[0:1]
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .groups import ParallelConfig


class Padding(enum.Enum):
    MAX_LEN = "max_len"
    SUM_LEN = "sum_len"


def choose_padding(dp_num_tokens: list[int]) -> Padding:
    """MAX_LEN when padding to the max wastes less than half the work (sglang's rule)."""
    total, longest = sum(dp_num_tokens), max(dp_num_tokens)
    return Padding.MAX_LEN if total * 2 > longest * len(dp_num_tokens) else Padding.SUM_LEN


def _split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class DPGeometry:
    padding: Padding
    dp_num_tokens: tuple[int, ...]
    attn_tp: int
    chunk_sizes: tuple[int, ...]  # real rows of each rank's chunk (rank order)
    chunk_rows: tuple[int, ...]  # rows each rank's chunk occupies in FULL (== chunk_sizes for SUM_LEN)

    @property
    def max_chunk(self) -> int:
        return max(self.chunk_rows) if self.chunk_rows else 0

    @property
    def full_rows(self) -> int:
        return sum(self.chunk_rows)

    def chunk_offset(self, rank: int) -> int:
        return sum(self.chunk_rows[:rank])

    def local_sizes(self, dp_rank: int) -> list[int]:
        """Real rows of each chunk of one DP group (attn_tp entries)."""
        a = self.attn_tp
        return list(self.chunk_sizes[dp_rank * a : (dp_rank + 1) * a])

    def valid_full_rows(self) -> list[bool] | None:
        """For MAX_LEN: which FULL rows are real tokens; None when all are (SUM_LEN)."""
        if self.padding is Padding.SUM_LEN:
            return None
        out: list[bool] = []
        for real, rows in zip(self.chunk_sizes, self.chunk_rows):
            out += [True] * real + [False] * (rows - real)
        return out


def dp_geometry(config: ParallelConfig, dp_num_tokens: list[int], padding: Padding | None = None) -> DPGeometry:
    if len(dp_num_tokens) != config.dp or any(n < 0 for n in dp_num_tokens):
        raise ValueError(f"need {config.dp} non-negative DP token counts, got {dp_num_tokens}")
    padding = padding or choose_padding(dp_num_tokens)
    a = config.attn_tp
    sizes: list[int] = []
    rows: list[int] = []
    if padding is Padding.MAX_LEN:
        c = -(-max(dp_num_tokens) // a)
        for n in dp_num_tokens:
            # chunk j of a group holds tokens [j*c, (j+1)*c): real rows are what falls below n
            real = [max(0, min(c, n - j * c)) for j in range(a)]
            sizes += real
            rows += [c] * a
    else:
        for n in dp_num_tokens:
            part = _split(n, a)
            sizes += part
            rows += part
    return DPGeometry(padding, tuple(dp_num_tokens), a, tuple(sizes), tuple(rows))
