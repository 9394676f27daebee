"""Log-probabilities a request asked for (``SamplingParams.logprobs`` / ``prompt_logprobs``).

Of the model's raw distribution: ``log_softmax`` of the logits as the model returned them
(float32), before penalties, bias, grammar masks, temperature, min-p, top-k and top-p (vLLM's
default ``logprobs_mode="raw_logprobs"``). The same under speculation: a verified token's row
is the target's logits at its position, which equal the plain forward's up to float rounding.

``TokenLogprob`` is a NamedTuple so that it crosses process boundaries (Ray, ``asdict``) as is. This
module imports torch only where it computes: the API process reads ``TokenLogprob`` through
``engine_client`` and ``api_error``, and `fusedserve run` refuses a bad manifest before torch loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # the ``n`` most likely (token id, logprob), best first


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """Each row's chosen token. logits: [k, vocab] raw; tokens: k ids -> k TokenLogprob"""
    if not tokens:
        return []
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(tokens, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(top_n, dim=-1) if top_n > 0 else (lp[:, :0], ids[:, None][:, :0])
    top = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
    return [TokenLogprob(t, v, r, tp) for t, v, r, tp in zip(tokens, chosen.tolist(), ranks.tolist(), top)]
