"""Mamba2 mixer: the chunked scan against the plain recurrence, the mixer against HF's
NemotronHMamba2Mixer (torch path), decode and chunked prefill against one long prefill, and
the head/group sharding (each rank's partial sums to the one-rank output; no collectives)."""

from __future__ import annotations

import pytest
import torch

from fusedserve.models.forward_batch import ForwardBatch
from fusedserve.models.layers.mamba2 import Mamba2Config, Mamba2Mixer
from fusedserve.models.layers.mamba2_sharding import Mamba2Sharding
from fusedserve.models.layers.mamba_state import MambaStateCache
from fusedserve.models.layers.ssd_scan import ssd_chunk_scan, ssm_scan_reference
from fusedserve.models.layers.weight_source import TensorSource, WeightShapeError
from fusedserve.models.parallel.groups import Group

HIDDEN, HEADS, HEAD_DIM, STATE, KERNEL, CHUNK = 32, 8, 4, 16, 4, 8


@pytest.mark.parametrize("length,groups", [(1, 2), (7, 1), (8, 2), (21, 4), (40, 8)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_scan_equals_recurrence(length: int, groups: int, with_state: bool) -> None:
    g = torch.Generator().manual_seed(length * 10 + groups)
    x = torch.randn(length, HEADS, HEAD_DIM, generator=g)
    dt = torch.rand(length, HEADS, generator=g) * 0.5 + 0.01
    A = -torch.rand(HEADS, generator=g) * 4 - 0.1
    B = torch.randn(length, groups, STATE, generator=g)
    C = torch.randn(length, groups, STATE, generator=g)
    s0 = torch.randn(HEADS, HEAD_DIM, STATE, generator=g) if with_state else None
    y, final = ssd_chunk_scan(x, dt, A, B, C, CHUNK, s0)
    y_ref, final_ref = ssm_scan_reference(x, dt, A, B, C, s0)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_ref, atol=1e-5, rtol=1e-5)


def _hf_mixer(n_groups: int, seed: int = 0):  # type: ignore[no-untyped-def]
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    torch.manual_seed(seed)
    cfg = NemotronHConfig(vocab_size=64, hidden_size=HIDDEN, layers_block_type=["linear_attention"],
                          mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM, n_groups=n_groups,
                          ssm_state_size=STATE, conv_kernel=KERNEL, chunk_size=CHUNK, time_step_min=0.05)
    hf = NemotronHMamba2Mixer(cfg, layer_idx=0).eval()
    with torch.no_grad():  # random everything, so that a mis-sliced parameter shows
        hf.A_log.copy_(torch.log(torch.rand(HEADS) * 6 + 0.5))
        hf.D.uniform_(0.5, 1.5)
        hf.dt_bias.uniform_(-4.0, 0.5)  # some softplus values fall under time_step_min: clamp exercised
        hf.norm.weight.uniform_(0.5, 1.5)
    return cfg, hf


def _ours(cfg, hf, group: Group) -> Mamba2Mixer:  # type: ignore[no-untyped-def]
    mc = Mamba2Config(hidden=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, n_groups=cfg.n_groups, state_size=STATE,
                      conv_kernel=KERNEL, chunk_size=CHUNK, time_step_limit=hf.time_step_limit,
                      norm_eps=cfg.layer_norm_epsilon)
    mixer = Mamba2Mixer(0, mc, group)
    params = dict(mixer.named_parameters())
    for name, value in hf.state_dict().items():
        owner = mixer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else mixer
        owner.weight_loader(params[name], TensorSource(name, value))  # type: ignore[operator]
    return mixer


def _batch(lens: list[int], ctx: list[int], slots: list[int], cache: MambaStateCache) -> ForwardBatch:
    n = sum(lens)
    return ForwardBatch(input_ids=torch.zeros(n, dtype=torch.long), positions=torch.zeros(n, dtype=torch.long),
                        query_lens=lens, context_lens=ctx, slot_mapping=torch.zeros(n, dtype=torch.long),
                        block_tables=[[] for _ in lens], kv_cache=None, state_slots=slots, state_cache=cache)


def _cache(mixer: Mamba2Mixer, slots: int = 4) -> MambaStateCache:
    return MambaStateCache.allocate({0: mixer.state_shape()}, slots, torch.float32)


@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_prefill_equals_hf_and_packing_keeps_sequences_apart(n_groups: int) -> None:
    cfg, hf = _hf_mixer(n_groups)
    ours = _ours(cfg, hf, Group.single("attn_tp"))
    lens = [20, 1, 9]
    seqs = [torch.randn(n, HIDDEN) for n in lens]
    with torch.no_grad():
        expected = torch.cat([hf(s[None])[0] for s in seqs])
    cache = _cache(ours)
    cache.ssm[0].fill_(3.0)  # stale contents of reused slots must not leak into fresh sequences
    cache.conv[0].fill_(3.0)
    got = ours(torch.cat(seqs), _batch(lens, lens, [2, 0, 3], cache)).partial
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_decode_and_chunked_prefill_continue_the_state() -> None:
    cfg, hf = _hf_mixer(2, seed=1)
    ours = _ours(cfg, hf, Group.single("attn_tp"))
    a, b = torch.randn(23, HIDDEN), torch.randn(14, HIDDEN)
    with torch.no_grad():
        want_a, want_b = hf(a[None])[0], hf(b[None])[0]
    cache = _cache(ours)
    # step 1: prefill a[:10] and b[:3] (b's slot is 1, a's is 3)
    out = [ours(torch.cat([a[:10], b[:3]]), _batch([10, 3], [10, 3], [3, 1], cache)).partial]
    # step 2: chunked prefill of a[10:19] (continues), b decodes one token
    out.append(ours(torch.cat([a[10:19], b[3:4]]), _batch([9, 1], [19, 4], [3, 1], cache)).partial)
    got_a, got_b = [out[0][:10], out[1][:9]], [out[0][10:], out[1][9:]]
    # steps 3..: both decode
    for t in range(4):
        o = ours(torch.stack([a[19 + t], b[4 + t]]), _batch([1, 1], [20 + t, 5 + t], [3, 1], cache)).partial
        got_a.append(o[:1])
        got_b.append(o[1:])
    torch.testing.assert_close(torch.cat(got_a), want_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(got_b), want_b[:8], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size,n_groups", [(2, 2), (2, 4), (4, 4)])
def test_sharded_partials_sum_to_one_rank(size: int, n_groups: int) -> None:
    cfg, hf = _hf_mixer(n_groups, seed=2)
    lens = [13, 1]
    x = torch.randn(sum(lens), HIDDEN)
    with torch.no_grad():
        expected = torch.cat([hf(x[None, :13])[0], hf(x[None, 13:])[0]])
    total = torch.zeros_like(expected)
    for rank in range(size):
        group = Group(name="attn_tp", rank=rank, ranks=tuple(range(size)))
        mixer = _ours(cfg, hf, group)
        out = mixer(x, _batch(lens, lens, [0, 1], _cache(mixer)))
        assert out.group == "attn_tp"
        total += out.partial
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_sharding_segments_split_or_replicate_groups() -> None:
    # 8 heads x 4, 2 groups of state 16, over 4 ranks: each group replicated on 2 ranks.
    s = Mamba2Sharding(num_heads=8, head_dim=4, n_groups=2, state_size=16, size=4, rank=1)
    assert (s.heads, s.head_start, s.groups, s.group_start) == (2, 2, 1, 0)
    inner = 32
    assert s.in_proj_segments() == [(8, 8), (inner + 8, 8), (2 * inner, 16), (2 * inner + 32, 16),
                                     (2 * inner + 64 + 2, 2)]
    s3 = Mamba2Sharding(8, 4, 2, 16, 4, 3)
    assert s3.group_start == 1 and s3.conv_segments()[1] == (inner + 16, 16)
    # Split: every checkpoint row lands on exactly one rank.
    rows = sorted(r for k in range(2) for a, n in Mamba2Sharding(8, 4, 4, 16, 2, k).in_proj_segments()
                  for r in range(a, a + n))
    assert rows == list(range(2 * inner + 2 * 64 + 8))
    with pytest.raises(WeightShapeError):
        Mamba2Sharding(8, 4, 3, 16, 2, 0)


def test_norm_groups_spanning_ranks_are_refused() -> None:
    cfg, hf = _hf_mixer(2)
    with pytest.raises(WeightShapeError, match="norm"):
        _ours(cfg, hf, Group(name="attn_tp", rank=0, ranks=(0, 1, 2, 3)))
