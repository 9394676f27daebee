"""Collectives over a ``Group``, each counted in the rank's ledger.

A size-1 group makes every call a no-op (not counted: the plan has no step there either).
Every call names its ``site`` so the ledger can be compared with the communication plan.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .collective_clock import CollectiveClock, clock_for
from .fusion.reference import FusedAllReduceNorm
from .groups import Group
from .ledger import CollectiveLedger

# torch >= 2.13 names these *_single; older releases (GPU images) only have *_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Collectives:
    """The collectives one rank runs. ``device_path`` is "nccl" or "gloo" (a CPU group's all-reduce runs "shm"
    where its ranks share a host: ``Group.all_reduce_``).

    Every call is counted in the ledger; its time is sampled by ``clock`` (collective_clock.py).
    """

    def __init__(
        self,
        device_path: str,
        ledger: CollectiveLedger | None = None,
        fused: FusedAllReduceNorm | None = None,
        clock: CollectiveClock | None = None,
    ) -> None:
        self.device_path = device_path
        self.ledger = ledger if ledger is not None else CollectiveLedger()
        # The fused all-reduce + add + RMSNorm of this rank (``fusion/selection.py``); None = no fusion,
        # and a model built on these collectives plans none.
        self.fused = fused
        self.clock = clock if clock is not None else clock_for(device_path)

    def _timed(self, key: tuple[str, str, str], run: Any) -> Any:
        token = self.clock.start(key)
        out = run()
        self.clock.stop(key, token, self.ledger.observe_time)
        return out

    def all_reduce(self, x: torch.Tensor, group: Group, site: str) -> torch.Tensor:
        """Sum over the group, in place on ``x`` (the caller owns it). x: [*]"""
        if group.is_trivial:
            return x
        path = group.all_reduce_path(self.device_path)
        self.ledger.record(site, "all_reduce", group.name, path, _nbytes(x))
        self._timed(("all_reduce", group.name, path), lambda: group.all_reduce_(x))
        return x

    def all_gather(self, x: torch.Tensor, group: Group, site: str, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (equal shapes). x: [n, *] -> [size*n, *]"""
        if group.is_trivial:
            return x
        self.ledger.record(site, "all_gather", group.name, self.device_path, _nbytes(x) * group.size)
        x = x.contiguous()
        out = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._timed(("all_gather", group.name, self.device_path),
                    lambda: _all_gather(out, x, group=group.device_group))
        if dim in (0, -x.dim()):
            return out
        return torch.cat(out.chunk(group.size, dim=0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, group: Group, site: str) -> torch.Tensor:
        """Sum over the group and keep this rank's equal chunk of dim 0. x: [size*n, *] -> [n, *]"""
        if group.is_trivial:
            return x
        if x.shape[0] % group.size:
            raise ValueError(f"reduce_scatter of {x.shape[0]} rows over {group.size} ranks at {site}")
        self.ledger.record(site, "reduce_scatter", group.name, self.device_path, _nbytes(x))
        x = x.contiguous()
        out = torch.empty((x.shape[0] // group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._timed(("reduce_scatter", group.name, self.device_path),
                    lambda: _reduce_scatter(out, x, group=group.device_group))
        return out

    def all_to_all(
        self,
        x: torch.Tensor,
        group: Group,
        site: str,
        input_splits: list[int] | None = None,
        output_splits: list[int] | None = None,
    ) -> torch.Tensor:
        """Exchange rows; uneven splits allowed. x: [sum(input_splits), *] -> [sum(output_splits), *]"""
        if group.is_trivial:
            return x
        self.ledger.record(site, "all_to_all", group.name, self.device_path, _nbytes(x))
        rows = sum(output_splits) if output_splits is not None else x.shape[0]
        out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        xc = x.contiguous()
        self._timed(("all_to_all", group.name, self.device_path),
                    lambda: dist.all_to_all_single(out, xc, output_splits, input_splits, group=group.device_group))
        return out

    def broadcast(self, x: torch.Tensor, group: Group, site: str, src_rank: int = 0) -> torch.Tensor:
        """Copy the group-rank ``src_rank``'s ``x`` to every rank, in place."""
        if group.is_trivial:
            return x
        self.ledger.record(site, "broadcast", group.name, self.device_path, _nbytes(x))
        self._timed(("broadcast", group.name, self.device_path),
                    lambda: dist.broadcast(x, src=group.ranks[src_rank], group=group.device_group))
        return x

    def fused_allreduce_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        group: Group,
        site: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(all_reduce(x) + residual), all_reduce(x) + residual). x, residual: [n, hidden]

        The returned residual is a fresh tensor on every path.
        """
        fused = self.fused
        if fused is None:
            raise RuntimeError(f"{site}: a fused boundary on collectives built without a fused kernel")
        self.ledger.record(site, "fused_ar_add_rmsnorm", group.name, fused.path, _nbytes(x))
        out: tuple[torch.Tensor, torch.Tensor] = self._timed(
            ("fused_ar_add_rmsnorm", group.name, fused.path), lambda: fused(x, residual, weight, eps, group))
        return out
