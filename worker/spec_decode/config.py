"""The EAGLE3 speculative-decoding settings (sglang's ``--speculative-*`` meaning), checked once."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


class SpeculativeConfigError(ValueError):
    """A speculative-decoding setting that cannot work; the message says which and why."""


def tree_reach(num_steps: int, topk: int) -> int:
    """Slots past a tree round's root that the next tree, drafted behind its verify, reaches: the next root at most
    ``num_steps + 1`` further, its first pass's bases before it and its draft steps' ``(num_steps - 1) * topk``
    scratch slots after."""
    return num_steps + 1 + (num_steps - 1) * topk


@dataclass(frozen=True)
class SpeculativeConfig:
    """EAGLE3 drafting (sglang's ``--speculative-*`` meaning).

    ``num_steps``: draft depth; ``topk``: branching (1 = a chain); ``num_draft_tokens``: tree
    nodes verified, the root included (a chain verifies ``num_steps + 1``; None = that).
    """

    draft_model: str
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.draft_model:
            raise SpeculativeConfigError("speculative decoding needs a draft model directory (draft_model)")
        for name in ("num_steps", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpeculativeConfigError(f"{name} must be a positive integer, got {value!r}")
        d = self.num_draft_tokens
        if d is not None and not isinstance(d, int):
            raise SpeculativeConfigError(f"num_draft_tokens must be an integer, got {d!r}")
        if self.topk == 1:
            chain = self.num_steps + 1
            if d is not None and d < chain:
                raise SpeculativeConfigError(
                    f"with topk=1 (a chain) every draft is verified: num_draft_tokens must be at least "
                    f"num_steps + 1 = {chain}, got {d}")
            if d is not None and d > chain:
                log.warning("num_draft_tokens %d adjusted to num_steps + 1 = %d: a chain (topk=1) has no more "
                            "nodes", d, chain)
            object.__setattr__(self, "num_draft_tokens", chain)
            return
        if d is None:
            raise SpeculativeConfigError("tree drafting (topk > 1) needs num_draft_tokens, the nodes one verify "
                                         "checks (sglang's default is 8)")
        most = 1 + self.topk + (self.num_steps - 1) * self.topk ** 2
        if not 2 <= d <= most:
            raise SpeculativeConfigError(
                f"num_draft_tokens must be in [2, {most}] for topk={self.topk}, num_steps={self.num_steps} "
                f"(the root plus at most topk + (num_steps - 1) * topk^2 candidates), got {d}")

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def verify_tokens(self) -> int:
        """Tokens one verify feeds per sequence: the root and the drafts."""
        return int(self.num_draft_tokens or self.num_steps + 1)

    @property
    def lookahead_tokens(self) -> int:
        """K/V slots needed beyond the last known token: the verified drafts in the target's
        cache, the nodes of draft steps 1.. in the draft's (same block tables); a chain's also the
        next round's draft steps and verify, run before this round's acceptance is read back
        (``SpecDecoder``: after every draft accepted, the verify's rows reach ``verify_tokens`` slots past
        this verify's, the draft steps num_steps - 1); a tree's also the next round's tree, drafted behind the
        verify before it is read back (``tree_reach``)."""
        ahead = max(self.verify_tokens, self.num_steps - 1) if self.is_chain else 0
        tree = 0 if self.is_chain else tree_reach(self.num_steps, self.topk) - 1
        return max(self.verify_tokens - 1 + ahead, (self.num_steps - 1) * self.topk - 1, tree)

    @property
    def in_flight_reach(self) -> int:
        """Slots past a round's root that the round launched after it (before it is read back) and what that
        round stages may reach: two roots of at most ``num_steps + 1`` tokens each, then the later one's verify
        or draft tree (``SpecDecoder._follow`` reserves the blocks)."""
        return 2 * (self.num_steps + 1) + max(self.verify_tokens, (self.num_steps - 1) * self.topk)
