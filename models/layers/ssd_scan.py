"""The Mamba2 selective state-space scan (SSD): chunked form for prefill, one step for decode.

For each head h the state S_h [head_dim, state] evolves per token t as

    S_h <- exp(dt[t, h] * A[h]) * S_h + dt[t, h] * x[t, h, :, None] * B[t, g(h), None, :]
    y[t, h] = S_h @ C[t, g(h)]

where g(h) = h // (heads / groups) is the B/C group of head h. ``dt`` here is already
discretised (softplus(dt + dt_bias), clamped); ``A`` is negative (-exp(A_log)). The D skip
and the gate belong to the mixer, not to the scan.

``ssd_chunk_scan`` computes the same thing a chunk at a time (quadratic inside a chunk,
the recurrence only between chunks) as in the Mamba2 paper's minimal SSD; ``ssm_step`` is
the single-token recurrence used for decode; ``ssm_scan_reference`` is the plain per-token
loop both are checked against. Everything runs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def heads_of_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Give every head its group's B or C. t: [..., groups, state] -> [..., heads, state]"""
    groups = t.shape[-2]
    return t.repeat_interleave(num_heads // groups, dim=-2)


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = x[..., j+1] + ... + x[..., i] for i >= j, -inf above the diagonal.

    x: [..., T] -> [..., T, T]. Built from masked cumulative sums (no differences of large
    cumulative sums), so exp(out) is an exact-enough decay matrix.
    """
    T = x.shape[-1]
    x = x[..., None].expand(*x.shape, T)
    below = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=-1)
    out = torch.cumsum(x.masked_fill(~below, 0.0), dim=-2)
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=0)
    return out.masked_fill(~keep, float("-inf"))


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the scan, a chunk at a time.

    x: [L, heads, head_dim]; dt: [L, heads]; A: [heads]; B, C: [L, groups, state];
    initial_state: [heads, head_dim, state] or None (zeros)
    -> y: [L, heads, head_dim], final_state: [heads, head_dim, state] (float32)
    """
    L, H, P = x.shape
    N = B.shape[-1]
    x, dt, A = x.float(), dt.float(), A.float()
    B, C = heads_of_groups(B.float(), H), heads_of_groups(C.float(), H)
    pad = (-L) % chunk_size
    # Padded steps have dt = 0: no decay and no input, so they leave the state alone.
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))
    Adt = F.pad(A * dt, (0, 0, 0, pad))
    B = F.pad(B, (0, 0, 0, 0, 0, pad))
    C = F.pad(C, (0, 0, 0, 0, 0, pad))
    nc = (L + pad) // chunk_size
    # c = chunk, l/s = position in a chunk, h = head, p = head_dim, n = state
    xdt = xdt.view(nc, chunk_size, H, P)
    B = B.view(nc, chunk_size, H, N)
    C = C.view(nc, chunk_size, H, N)
    Adt = Adt.view(nc, chunk_size, H).permute(2, 0, 1)  # [h, c, l]
    A_cum = torch.cumsum(Adt, dim=-1)  # [h, c, l]

    # 1. Inside each chunk: y[l] = sum_{s<=l} (C[l].B[s]) exp(A_cum[l]-A_cum[s]) xdt[s]
    decay = torch.exp(segment_sum(Adt))  # [h, c, l, s]
    scores = torch.einsum("clhn,cshn->hcls", C, B) * decay
    y_diag = torch.einsum("hcls,cshp->clhp", scores, xdt)

    # 2. State each chunk adds by its end: sum_l exp(A_cum[last]-A_cum[l]) B[l] xdt[l]
    to_end = torch.exp(A_cum[..., -1:] - A_cum)  # [h, c, l]
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", B, to_end, xdt)

    # 3. Recurrence between chunks: the state entering each chunk (and the final one).
    start = torch.zeros((1, H, P, N), dtype=x.dtype, device=x.device) if initial_state is None \
        else initial_state.float().reshape(1, H, P, N)
    chunk_states = torch.cat([start, chunk_states], dim=0)  # [c+1, h, p, n]
    chunk_decay = torch.exp(segment_sum(F.pad(A_cum[..., -1], (1, 0))))  # [h, c+1 (to), c+1 (from)]
    entering = torch.einsum("hzc,chpn->zhpn", chunk_decay, chunk_states)
    states, final_state = entering[:-1], entering[-1]

    # 4. Contribution of the entering state to every position of its chunk.
    y_off = torch.einsum("clhn,chpn,hcl->clhp", C, states, torch.exp(A_cum))
    y = (y_diag + y_off).reshape(nc * chunk_size, H, P)[:L]
    return y, final_state


def ssm_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> torch.Tensor:
    """One token of each of S sequences; updates ``state`` in place.

    state: [S, heads, head_dim, state_size] (float32); x: [S, heads, head_dim]; dt: [S, heads];
    A: [heads]; B, C: [S, groups, state_size] -> y: [S, heads, head_dim] (float32)
    """
    H = x.shape[1]
    dt = dt.float()
    Bh, Ch = heads_of_groups(B.float(), H), heads_of_groups(C.float(), H)
    decay = torch.exp(dt * A.float())[..., None, None]  # [S, h, 1, 1]
    inflow = (dt[..., None] * x.float())[..., None] * Bh[:, :, None, :]  # [S, h, p, n]
    new = state.float() * decay + inflow
    state.copy_(new.to(state.dtype))
    return torch.einsum("shpn,shn->shp", new, Ch)


def ssm_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain per-token recurrence, same contract as ``ssd_chunk_scan`` (for tests)."""
    L, H, P = x.shape
    state = torch.zeros((1, H, P, B.shape[-1]), dtype=torch.float32, device=x.device)
    if initial_state is not None:
        state[0] = initial_state.float()
    ys = [ssm_step(state, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1])[0] for t in range(L)]
    y = torch.stack(ys) if ys else x.new_zeros((0, H, P), dtype=torch.float32)
    return y, state[0]
