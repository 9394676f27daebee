"""The padded static layout of one captured forward (``step_graphs.py``).

``batch`` sequences of ``tokens`` rows each (``rows = batch * tokens``), causal or with a mask
over each context's last ``tail`` slots (a draft tree), logits of every row or of each
sequence's last row only (``last_only``: a sequence may bring fewer rows than ``tokens``,
padded in front, e.g. the draft's first pass), and, for the EAGLE3 draft, a ``hidden`` input of
that width; ``chain``: that many forwards replayed back to back, each feeding the next on the
device: one row per sequence with its greedy next token and hidden state (the EAGLE3 draft's chain
steps; ``sampled``: its token drawn at the row's temperature with the row's uniform numbers); with
``last_only``, the draft's first pass first (its ``tokens`` rows per sequence), whose last row's draft
and hidden state feed the chain's first step; or ``tokens`` leaves per sequence with a mask over the
last ``tail = chain * tokens`` slots (a draft tree's steps, grown on the device). Examples (chain of 3 drafts, batch padded to 8):

    StepShape(8, 1)                              target decode: one token per sequence
    StepShape(8, 4)                              target verify of a chain (root + 3 drafts, causal)
    StepShape(8, 8, tail=8)                      target verify of an 8-node tree (tree mask)
    StepShape(8, 4, last_only=True, hidden=384)  draft first pass: <= 4 bases, aux states in
    StepShape(8, 1, hidden=128)                  draft step of a chain: its own hidden state in
    StepShape(8, 1, hidden=128, chain=2)         the chain's 2 remaining draft steps, one replay
    StepShape(8, 1, hidden=128, chain=2, sampled=True)  the same, each draft drawn from the draft's q
    StepShape(8, 4, last_only=True, hidden=384, chain=2)  the first pass, its draft and the 2 steps, one replay
    StepShape(8, 4, 24, hidden=128, chain=6)     a tree's 6 draft steps of 4 leaves, one replay
    StepShape(8, 7, 20, last_only=True, hidden=384, chain=5)  the first pass (<= 7 bases), then a tree's 5 steps
                                                 of 4 leaves (20 / 5) grown from its top-4, one replay
"""

from __future__ import annotations

from dataclasses import dataclass

ShapeKey = tuple[int, int, bool, int, int, bool]  # (tokens, tail, last_only, hidden, chain, sampled): no batch


@dataclass(frozen=True, order=True)
class StepShape:
    batch: int  # padded sequences
    tokens: int  # rows per sequence
    tail: int = 0  # mask over each context's last ``tail`` slots; 0 = causal
    last_only: bool = False  # logits of each sequence's last row; fewer rows padded in front
    hidden: int = 0  # width of the hidden-state input (EAGLE3 draft); 0 = none
    chain: int = 0  # forwards chained on the device (one row per sequence each); 0 = one plain forward
    sampled: bool = False  # a chain whose drafts are drawn (temperatures and uniform numbers in), not argmax

    def __post_init__(self) -> None:
        one_row = (self.tokens, self.tail) == (1, 0) or self.last_only and not self.tail
        tree = not self.last_only and self.tokens >= 2 and self.tail == self.chain * self.tokens
        first_tree = self.last_only and self.chain > 0 and self.tail % self.chain == 0 and self.tail >= 2 * self.chain
        if self.chain and (not self.hidden or not (one_row or tree or first_tree)):
            raise ValueError(f"a chained shape feeds a hidden input to one row per sequence (after a first pass: "
                             f"last_only), or to a tree's leaves with a mask over chain * leaves slots (after a "
                             f"first pass: last_only, leaves >= 2): {self}")
        if self.sampled and (not self.chain or self.tail):
            raise ValueError(f"only a chain of one row per sequence draws its drafts: {self}")

    @property
    def rows(self) -> int:
        return self.batch * self.tokens

    @property
    def key(self) -> ShapeKey:
        return (self.tokens, self.tail, self.last_only, self.hidden, self.chain, self.sampled)

    @property
    def has_first_pass(self) -> bool:
        """A chain that starts with the draft's first pass over ``tokens`` rows per sequence."""
        return self.chain > 0 and self.last_only

    @property
    def is_tree_chain(self) -> bool:
        """A draft tree's steps chained in one replay (after a first pass where ``has_first_pass``)."""
        return self.chain > 0 and self.tail > 0

    @property
    def leaves(self) -> int:
        """A tree chain's leaves per sequence and step (``tail / chain``); 1 for a chain of one row each."""
        return self.tail // self.chain if self.is_tree_chain else 1

    @staticmethod
    def of(batch: int, key: ShapeKey) -> StepShape:
        return StepShape(batch, *key)


def prefill_shapes(lengths: list[int], hidden: int = 0) -> list[StepShape]:
    """One sequence's prefill at each of these prompt lengths (``EngineConfig.prefill_graph_tokens``): its rows
    padded in front up to the length, logits of the last row only; ``hidden``: the EAGLE3 draft's aux width (its
    pass over the prompt)."""
    return [StepShape(1, n, last_only=True, hidden=hidden) for n in lengths]
