"""FlashInfer's fused all-reduce + residual add + RMSNorm (GPU), with the reference as fallback.

One TRT-LLM workspace per communicating group (``create_allreduce_fusion_workspace(backend=
"trtllm")``; FlashInfer allocates it with multicast disabled, over CUDA IPC between the ranks of
one node), created at construction — before any CUDA-graph capture — for at most
``max_tokens`` tokens. Every rank votes on the CPU group whether its workspaces are usable; if
any rank could not build one, every rank takes the reference path, so the ranks never diverge.
Keep NVLink multicast off in the environment (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

The kernel computes ``residual_out = all_reduce(x) + residual`` and
``norm_out = rms_norm(residual_out) * weight``, the same as ``ReferenceFusedAllReduceNorm``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..groups import Group, ParallelGroups
from .reference import FusedAllReduceNorm, ReferenceFusedAllReduceNorm

log = logging.getLogger(__name__)

FUSED_GROUPS = ("tp", "attn_tp")  # the groups a fused boundary can owe (see comm_plan.py)


class FlashInferFusedAllReduceNorm:
    path = "flashinfer_fused"

    def __init__(self, workspaces: dict[str, Any], max_tokens: int) -> None:
        from flashinfer.comm import AllReduceFusionPattern, allreduce_fusion

        self._workspaces = workspaces
        self._kernel = allreduce_fusion
        self._pattern = AllReduceFusionPattern.kARResidualRMSNorm
        self.max_tokens = max_tokens

    @staticmethod
    def create(groups: ParallelGroups, hidden: int, dtype: torch.dtype,
               max_tokens: int = 2048) -> FusedAllReduceNorm:
        """The FlashInfer kernel when every rank can run it, else the reference (on all ranks)."""
        workspaces: dict[str, Any] = {}
        reason = ""
        try:
            from flashinfer.comm import create_allreduce_fusion_workspace

            seen: dict[tuple[int, ...], Any] = {}
            for name in FUSED_GROUPS:
                group = groups.by_name(name)
                if group.is_trivial:
                    continue
                if group.ranks not in seen:  # tp and attn_tp are the same ranks without DP attention
                    seen[group.ranks] = create_allreduce_fusion_workspace(
                        backend="trtllm", world_size=group.size, rank=group.rank, max_token_num=max_tokens,
                        hidden_dim=hidden, dtype=dtype, group=group.device_group)
                workspaces[name] = seen[group.ranks]
        except Exception as e:  # any failure: this rank votes no
            reason = f"{type(e).__name__}: {e}"
        ok = _vote(groups.tp, not reason)
        if not ok:
            log.warning("FlashInfer fused all-reduce unavailable (%s); using all-reduce + add + RMSNorm",
                        reason or "another rank could not create its workspace")
            for ws in {id(w): w for w in workspaces.values()}.values():
                try:
                    ws.destroy()
                except Exception:  # pragma: no cover - best effort
                    pass
            return ReferenceFusedAllReduceNorm()
        return FlashInferFusedAllReduceNorm(workspaces, max_tokens)

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: Group
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [num_tokens, hidden], num_tokens <= max_tokens (the plan's gate)
        norm_out = torch.empty_like(x)
        residual_out = torch.empty_like(residual)
        self._kernel(
            input=x.contiguous(), workspace=self._workspaces[group.name], pattern=self._pattern,
            launch_with_pdl=True, residual_out=residual_out, norm_out=norm_out,
            residual_in=residual.contiguous(), rms_gamma=weight, rms_eps=eps,
        )
        return norm_out, residual_out


def _vote(group: Group, mine: bool) -> bool:
    """True only if every rank of the group votes yes (MIN over the CPU group)."""
    if group.is_trivial:
        return mine
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return bool(flag.item())
