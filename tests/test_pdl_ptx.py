"""PDL's rule, read in the code Triton emits for Hopper (no GPU needed: Triton compiles for sm_90 here).

``models/layers/pdl.py``: a kernel launched with programmatic dependent launch may start while the kernel
before it still runs, so it must wait (``griddepcontrol.wait``) before it reads anything another kernel
wrote and before it writes anything. The GPU tests check results under PDL; this test checks the order
itself, in the PTX of every PDL kernel of the project at a representative shape: the wait is there, no
global store comes before it, and no global load (nor asynchronous copy) either — except in the decode
GEMV, the one-tile decode GEMM and the draft's input kernel, which read their (first) weight tile or norm
weights (weights: written by no kernel) before the wait, as they must to overlap the kernel before. With PDL off,
no ``griddepcontrol`` instruction is emitted at all. A compiler that hoisted a load above the wait, or
a kernel edited to read before it, fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `bench.*` importable under a bare `pytest` too
    sys.path.insert(0, str(ROOT))

from bench import hopper_ptx as bench_ptx  # noqa: E402
from fusedserve.models.layers import (  # noqa: E402
    argmax_triton,
    attention_splits_triton,
    decode_attention_triton,
    draft_input_triton,
    embedding_triton,
    fp8_block_gemv_triton,
    kv_write_triton,
    linear_triton,
    mla_absorb_triton,
    prefill_attention_triton,
    rms_norm_triton,
    rope_triton,
    router_triton,
    silu_mul_triton,
)
from fusedserve.worker.engine import sample_triton  # noqa: E402
from fusedserve.worker.executor import chain_layout_triton  # noqa: E402
from fusedserve.worker.spec_decode import chain_accept_triton, tree_stage_triton, verify_stage_triton  # noqa: E402

# Triton 3.9 warns, once, that its FP-fusion default will change; nothing here depends on it
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION:UserWarning")
LOADS = ("ld.global", "cp.async.cg", "cp.async.ca", "cp.async.bulk")

DECODE_POINTERS = {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "bt_ptr": "*i32",
                   "ctx_ptr": "*i32", "slot_ptr": "*i64", "cnt_ptr": "*i32", "index_ptr": "*i64",
                   "qstart_ptr": "*i32", "tail_ptr": "*i8"}
# name -> (kernel, compile-time constants, argument types other than bf16 pointers / i32 / fp32 eps and scale)
KERNELS: dict[str, tuple[Any, dict[str, Any], dict[str, str]]] = {
    "add_rms_norm": (rms_norm_triton._rms_norm_kernel, {"HAS_RESIDUAL": True, "BLOCK": 4096}, {}),
    "argmax_chunks": (argmax_triton._chunk_argmax_kernel, {"BLOCK": 4096}, {"val_ptr": "*fp32", "idx_ptr": "*i64"}),
    "argmax_rows": (argmax_triton._rows_argmax_kernel, {"C_PAD": 32, "HAS_TABLE": True},
                    {"val_ptr": "*fp32", "idx_ptr": "*i64", "out_ptr": "*i64", "table_ptr": "*i64"}),
    "argmax_to_row": (argmax_triton._row_argmax_to_kernel, {"BLOCK": 16384}, {"out_ptr": "*i64", "table_ptr": "*i64"}),
    "draft_input": (draft_input_triton._draft_input_kernel, {"BLOCK": 1024}, {"ids_ptr": "*i64"}),
    "embedding": (embedding_triton._embedding_kernel, {"BLOCK": 1024}, {"ids_ptr": "*i64"}),
    "verify_stage": (verify_stage_triton._verify_stage_kernel,
                     {"Q": 8, "Q_PAD": 8, "PARTS": 3, "BLOCK_H": 1024, "BLOCK_W": 512, "STAGE": True, "NEXT": True},
                     {name: "*i64" for name in ("argmax_ptr", "ids_ptr", "pos_ptr", "slots_ptr", "index_ptr", "ctx_ptr",
                                                "tables_ptr", "verdict_ptr", "d_ids_ptr", "d_pos_ptr", "d_slots_ptr",
                                                "d_index_ptr", "d_ctx_ptr", "d_tables_ptr", "d_drop_ptr")}),
    # a tree verify's program (SmolLM2's tree-s6-k4-t16: 16 nodes, depth 6)
    "tree_stage": (tree_stage_triton._tree_stage_kernel,
                   {"N": 16, "N_PAD": 16, "DEPTH": 6, "MOVES": 6, "D_PAD": 8, "PARTS": 3, "BLOCK_H": 1024,
                    "BLOCK_W": 512, "STAGE": True, "NEXT": True},
                   {name: "*i64" for name in ("argmax_ptr", "ids_ptr", "pos_ptr", "slots_ptr", "index_ptr", "ctx_ptr",
                                              "tables_ptr", "tail_ptr", "verdict_ptr", "moves_ptr", "d_ids_ptr",
                                              "d_pos_ptr", "d_slots_ptr", "d_index_ptr", "d_ctx_ptr", "d_tables_ptr",
                                              "d_drop_ptr")}),
    "rope": (rope_triton._rope_kernel, {"Q_HEADS": 32, "HALF": 64}, {"pos_ptr": "*i64", "inv_ptr": "*fp32"}),
    "silu_mul": (silu_mul_triton._silu_mul_kernel, {"BLOCK": 1024}, {}),
    # MLA's absorbed products from kv_b's block-FP8 weight (DeepSeek-V3: 128 x 128 blocks, nope = v = 128, 4 rows):
    # the first e4m3 tile and its scales before the wait
    "mla_absorb_q": (mla_absorb_triton._absorb_q_kernel, {"NOPE": 128, "NOPE_PAD": 128, "BLOCK_R": 64, "BN": 128,
                                                          "BK": 128, "BLOCK_M": 4}, {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}),
    "mla_absorb_v": (mla_absorb_triton._absorb_v_kernel, {"BLOCK_J": 32, "BLOCK_R": 128, "BN": 128, "BK": 128,
                                                          "BLOCK_M": 4}, {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}),
    # the one-row block-FP8 GEMV (DeepSeek-V3's 128 x 128 blocks, e4m3 read as int32 words): its first weight step
    # before the wait
    "fp8_gemv": (fp8_block_gemv_triton._fp8_gemv_kernel,
                 {"GROUP_N": 128, "GROUP_K": 128, "BLOCK_N": 8, "BLOCK_K": 1024, "EVEN_K": True, "HAS_BIAS": True,
                  "NATIVE": True}, {"w_ptr": "*i32", "s_ptr": "*fp32"}),
    # the MoE router's fp32 logits (DeepSeek-V3's fp32 gate, 4 bf16 rows): its first gate tile before the wait
    "router_logits": (router_triton._logits_kernel, {"BLOCK_M": 4, "BLOCK_E": 2, "BLOCK_K": 2048, "EVEN_K": True},
                      {"w_ptr": "*fp32", "y_ptr": "*fp32"}),
    "kv_write": (kv_write_triton._write_kv_kernel,
                 {"K_WIDTH": 1024, "V_WIDTH": 1024, "K_PAD": 1024, "V_PAD": 1024, "HAS_V": True}, {"slot_ptr": "*i64"}),
    "decode_attention": (decode_attention_triton._decode_kernel,
                         {"HEADS": 32, "GROUP": 4, "BLOCK_H": 4, "HEAD_BLOCKS": 1, "H_PAD": 16, "DA": 128, "DA_PAD": 128,
                          "DB": 0, "DB_PAD": 16, "VDIM": 128, "VDIM_PAD": 128, "V_IN_K": False, "PAGE": 16,
                          "BLOCK_N": 32, "SPLITS": 4, "COMBINE": False, "DOT_FP32": False, "PREFETCH": False,
                          "ROWS": False, "SPLIT_TILES": 1, "R_PAD": 1, "COMBINE_LOADS": 4}, DECODE_POINTERS),
    "decode_attention_read_ahead": (decode_attention_triton._decode_kernel,
                                    {"HEADS": 32, "GROUP": 4, "BLOCK_H": 4, "HEAD_BLOCKS": 1, "H_PAD": 16, "DA": 128,
                                     "DA_PAD": 128, "DB": 0, "DB_PAD": 16, "VDIM": 128, "VDIM_PAD": 128,
                                     "V_IN_K": False, "PAGE": 16, "BLOCK_N": 32, "SPLITS": 32, "COMBINE": True,
                                     "DOT_FP32": False, "PREFETCH": True, "ROWS": False, "SPLIT_TILES": 1, "R_PAD": 1, "COMBINE_LOADS": 4}, DECODE_POINTERS),
    "decode_attention_rows": (decode_attention_triton._decode_kernel,  # SmolLM2's chain-7 verify: 8 rows x 3 heads
                              {"HEADS": 9, "GROUP": 3, "BLOCK_H": 3, "HEAD_BLOCKS": 1, "H_PAD": 32, "DA": 64,
                               "DA_PAD": 64, "DB": 0, "DB_PAD": 16, "VDIM": 64, "VDIM_PAD": 64, "V_IN_K": False,
                               "PAGE": 16, "BLOCK_N": 32, "SPLITS": 32, "COMBINE": True, "DOT_FP32": False,
                               "PREFETCH": True, "ROWS": True, "SPLIT_TILES": 1, "R_PAD": 8, "COMBINE_LOADS": 4}, DECODE_POINTERS),
    # SmolLM2's tree verify (tree-s6-k4-t16): 16 rows x 3 heads, the tree's tail mask over the last 16 indices
    "decode_attention_rows_tree": (decode_attention_triton._decode_kernel,
                                   {"HEADS": 9, "GROUP": 3, "BLOCK_H": 3, "HEAD_BLOCKS": 1, "H_PAD": 64, "DA": 64,
                                    "DA_PAD": 64, "DB": 0, "DB_PAD": 16, "VDIM": 64, "VDIM_PAD": 64, "V_IN_K": False,
                                    "PAGE": 16, "BLOCK_N": 32, "SPLITS": 32, "COMBINE": True, "DOT_FP32": False,
                                    "PREFETCH": True, "ROWS": True, "SPLIT_TILES": 1, "R_PAD": 16, "COMBINE_LOADS": 4,
                                    "TAIL": 16}, DECODE_POINTERS),
    "decode_attention_combine": (decode_attention_triton._decode_kernel,
                                 {"HEADS": 32, "GROUP": 4, "BLOCK_H": 4, "HEAD_BLOCKS": 1, "H_PAD": 16, "DA": 128,
                                  "DA_PAD": 128, "DB": 0, "DB_PAD": 16, "VDIM": 128, "VDIM_PAD": 128, "V_IN_K": False,
                                  "PAGE": 16, "BLOCK_N": 32, "SPLITS": 4, "COMBINE": True, "DOT_FP32": False,
                                  "PREFETCH": False, "ROWS": False, "SPLIT_TILES": 1, "R_PAD": 1, "COMBINE_LOADS": 4}, DECODE_POINTERS),
    "combine": (attention_splits_triton._combine_kernel, {"SPLITS_PAD": 32, "VDIM": 128, "VDIM_PAD": 128},
                {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32"}),
    "decode_gemm": (linear_triton._decode_gemm_kernel,
                    {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 128, "EVEN_K": True, "SPLIT_K": 1, "HAS_BIAS": False, "DOT_FP32": False,
                     "EPILOGUE": linear_triton.EPILOGUE_PLAIN, "HEAD_DIM": 2, "ONE_TILE": False,
                     "PREFETCH_LINES": 0, "LINE": 64},
                    {}),
    # a small model's width (K 576 in one masked tile of 1024): the weights read before the wait, as the GEMV's
    "decode_gemm_one_tile": (linear_triton._decode_gemm_kernel,
                             {"BLOCK_N": 16, "BLOCK_M": 16, "BLOCK_K": 1024, "EVEN_K": False, "SPLIT_K": 1, "HAS_BIAS": False,
                              "DOT_FP32": False, "EPILOGUE": linear_triton.EPILOGUE_ROPE, "HEAD_DIM": 64,
                              "ONE_TILE": True, "PREFETCH_LINES": 0, "LINE": 64},
                             {"pos_ptr": "*i64", "inv_ptr": "*fp32"}),
    # the same tile as 8 + 1 slices of 64 in two batched dots (``ONE_TILE_SLICES``): the weights still before the
    # wait, its dependents released after its dots (``linear_triton.late_release``), as launched
    "decode_gemm_one_tile_sliced": (linear_triton._decode_gemm_kernel,
                                    {"BLOCK_N": 16, "BLOCK_M": 16, "BLOCK_K": 1024, "EVEN_K": False, "SPLIT_K": 1, "HAS_BIAS": False,
                                     "DOT_FP32": False, "EPILOGUE": linear_triton.EPILOGUE_ROPE, "HEAD_DIM": 64,
                                     "ONE_TILE": True, "PREFETCH_LINES": 0, "LINE": 64, "SLICES": 8,
                                     "TAIL_SLICES": 1, "SLICE_K": 64, "LATE_RELEASE": True},
                                    {"pos_ptr": "*i64", "inv_ptr": "*fp32"}),
    "decode_gemm_split_k": (linear_triton._decode_gemm_kernel,
                            {"BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_K": 128, "EVEN_K": True, "SPLIT_K": 2, "HAS_BIAS": True,
                             "DOT_FP32": False, "EPILOGUE": linear_triton.EPILOGUE_PLAIN, "HEAD_DIM": 2,
                             "ONE_TILE": False, "PREFETCH_LINES": 0, "LINE": 64},
                            {"ws_ptr": "*fp32", "cnt_ptr": "*i32"}),
    "decode_gemm_rope": (linear_triton._decode_gemm_kernel,
                         {"BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_K": 128, "EVEN_K": True, "SPLIT_K": 1, "HAS_BIAS": True,
                          "DOT_FP32": False, "EPILOGUE": linear_triton.EPILOGUE_ROPE, "HEAD_DIM": 128,
                          "ONE_TILE": False, "PREFETCH_LINES": 0, "LINE": 64},
                         {"pos_ptr": "*i64", "inv_ptr": "*fp32"}),
    # a small model's width at 8 rows (SmolLM2's qkv, K 576: 9 lines of 64 bf16 a row), its weight slice asked
    # of L2 before the wait (``L2_PREFETCH_K_MAX``): a prefetch, not a load
    "decode_gemm_l2_prefetch": (linear_triton._decode_gemm_kernel,
                                {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 64, "EVEN_K": True, "SPLIT_K": 1, "HAS_BIAS": False,
                                 "DOT_FP32": False, "EPILOGUE": linear_triton.EPILOGUE_ROPE, "HEAD_DIM": 64,
                                 "ONE_TILE": False, "PREFETCH_LINES": 16, "LINE": 64},
                                {"pos_ptr": "*i64", "inv_ptr": "*fp32"}),
    "decode_gemm_silu": (linear_triton._decode_gemm_kernel,
                         {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "EVEN_K": True, "SPLIT_K": 1, "HAS_BIAS": False,
                          "DOT_FP32": False, "EPILOGUE": linear_triton.EPILOGUE_SILU, "HEAD_DIM": 2,
                          "ONE_TILE": False, "PREFETCH_LINES": 0, "LINE": 64},
                         {}),
    # a chain verify's split launch (new K/V stored and read from k / v, splits combined in the kernel), and a
    # prompt's unsplit one (the K/V stored before it): GQA 9 / 3, head dim 64 (SmolLM2)
    **{name: (prefill_attention_triton._prefill_kernel,
              {"TAIL": 0, "GROUP": 3, "BLOCK_H": 3, "HEAD_BLOCKS": 1, "BLOCK_Q": 10, "BLOCK_Q_PAD": 16, "ROWS": 32,
               "DA": 64, "DA_PAD": 64, "DB": 0, "DB_PAD": 16, "VDIM": 64, "VDIM_PAD": 64, "V_IN_K": False, "PAGE": 16,
               "BLOCK_N": 64, "SPLIT": split, "NEW_KV": split, "COMBINE": split, "SPLITS_PAD": 32, "HEADS": 9,
               "DOT_FP32": False},
              {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "bt_ptr": "*i32",
               "qstart_ptr": "*i32", "index_ptr": "*i64", "ctx_ptr": "*i32", "tail_ptr": "*i64", "slot_ptr": "*i64",
               "cnt_ptr": "*i32", "qk_scale": "fp32"})
       for name, split in (("prefill_attention_split", True), ("prefill_attention", False))},
    "prefill_attention_split_stores": (prefill_attention_triton._prefill_kernel,
                                       {"TAIL": 0, "GROUP": 3, "BLOCK_H": 3, "HEAD_BLOCKS": 1, "BLOCK_Q": 10,
                                        "BLOCK_Q_PAD": 16, "ROWS": 32, "DA": 64, "DA_PAD": 64, "DB": 0, "DB_PAD": 16,
                                        "VDIM": 64, "VDIM_PAD": 64, "V_IN_K": False, "PAGE": 16, "BLOCK_N": 64,
                                        "SPLIT": True, "NEW_KV": True, "COMBINE": False, "SPLITS_PAD": 32,
                                        "HEADS": 9, "DOT_FP32": False},
                                       {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                                        "bt_ptr": "*i32", "qstart_ptr": "*i32", "index_ptr": "*i64",
                                        "ctx_ptr": "*i32", "tail_ptr": "*i64", "slot_ptr": "*i64", "cnt_ptr": "*i32",
                                        "qk_scale": "fp32"}),
    "gemv": (linear_triton._gemv_kernel,
             {"BLOCK_N": 4, "BLOCK_K": 2048, "EVEN_K": True, "HAS_BIAS": False,
              "EPILOGUE": linear_triton.EPILOGUE_PLAIN, "HEAD_DIM": 2}, {}),
    "gemv_rope": (linear_triton._gemv_kernel,
                  {"BLOCK_N": 4, "BLOCK_K": 1024, "EVEN_K": False, "HAS_BIAS": False,
                   "EPILOGUE": linear_triton.EPILOGUE_ROPE, "HEAD_DIM": 64}, {"pos_ptr": "*i64", "inv_ptr": "*fp32"}),
    "gemv_silu": (linear_triton._gemv_kernel,
                  {"BLOCK_N": 4, "BLOCK_K": 2048, "EVEN_K": True, "HAS_BIAS": False,
                   "EPILOGUE": linear_triton.EPILOGUE_SILU, "HEAD_DIM": 2}, {}),
    # a chain's first pass layout and its steps' (SmolLM2's draft: 8 rows, 1 728-wide aux states, 6 steps)
    "first_pass_layout": (chain_layout_triton._first_pass_kernel,
                          {"Q": 8, "Q_PAD": 8, "CHAIN": 6, "CHAIN_PAD": 8, "H": 1728, "BLOCK_H": 1024, "PAGE": 16},
                          {**{name: "*i64" for name in ("ids_ptr", "pos_ptr", "slots_ptr", "index_ptr", "ctx_ptr",
                                                        "drop_ptr", "tables_ptr", "o_ids_ptr", "o_pos_ptr",
                                                        "o_slots_ptr", "o_index_ptr", "o_ctx_ptr", "s_pos_ptr",
                                                        "s_index_ptr", "s_ctx_ptr", "s_slots_ptr")},
                           "pad_slot": "i64"}),
    # the same before a tree's steps (SmolLM2's tree-s6-k4-t16: 7 rows, 5 steps of 4 leaves)
    "first_pass_tree_layout": (chain_layout_triton._first_pass_kernel,
                               {"Q": 7, "Q_PAD": 8, "CHAIN": 5, "CHAIN_PAD": 8, "H": 1728, "BLOCK_H": 1024, "PAGE": 16,
                                "LEAVES": 4, "L_PAD": 4},
                               {**{name: "*i64" for name in ("ids_ptr", "pos_ptr", "slots_ptr", "index_ptr", "ctx_ptr",
                                                             "drop_ptr", "tables_ptr", "o_ids_ptr", "o_pos_ptr",
                                                             "o_slots_ptr", "o_index_ptr", "o_ctx_ptr", "s_pos_ptr",
                                                             "s_index_ptr", "s_ctx_ptr", "s_slots_ptr")},
                                "pad_slot": "i64"}),
    # the draw at a temperature: each chunk's statistics, then each chunk's q and the draw (a draft's table)
    "sample_chunk_stats": (sample_triton._chunk_stats_kernel, {"CHUNK": 1024},
                           {"temp_ptr": "*fp32", "stats_ptr": "*fp32"}),
    "sample_chunk_draw": (sample_triton._chunk_draw_kernel,
                          {"CHUNK": 1024, "C_PAD": 64, "HAS_TABLE": True, "WRITE_Q": True},
                          {"temp_ptr": "*fp32", "u_ptr": "*fp64", "stats_ptr": "*fp32", "table_ptr": "*i64",
                           "tok_ptr": "*i64", "q_ptr": "*fp32"}),
    # the rejection rule for sampled chains: a program a row, the chain's last row program testing its drafts
    "chain_rule": (chain_accept_triton._rule_kernel, {"K_PAD": 8, "K1_PAD": 8, "BLOCK": 4096},
                   {"first_ptr": "*i64", "temp_ptr": "*fp32", "d_ptr": "*i64", "q_ptr": "*fp32", "u_ptr": "*fp64",
                    "m_ptr": "*fp32", "s_ptr": "*fp32", "cnt_ptr": "*i32", "count_ptr": "*i64", "tok_ptr": "*i64",
                    "rows_ptr": "*i64"}),
}
READS_BEFORE_WAIT = {"gemv", "gemv_rope", "gemv_silu", "decode_gemm_one_tile", "decode_gemm_one_tile_sliced",
                     "draft_input", "router_logits", "mla_absorb_q", "mla_absorb_v", "fp8_gemv"}  # their (first) weight tile; the norm weights


def hopper_ptx(fn: Any, constexprs: dict[str, Any], types: dict[str, str], num_warps: int = 4) -> list[str]:
    """The kernel's PTX for sm_90 (``bench/hopper_ptx.py``); skipped where this Triton cannot compile for it."""
    try:
        return bench_ptx.hopper_ptx(fn, constexprs, types, num_warps)
    except (RuntimeError, FileNotFoundError) as e:  # no ptxas with this Triton: the GPU tests still cover PDL
        pytest.skip(f"Triton cannot compile for sm_90 here: {e}")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_pdl_kernel_waits_before_it_touches_what_other_kernels_write(name: str) -> None:
    fn, constexprs, types = KERNELS[name]
    ptx = hopper_ptx(fn, {**constexprs, "PDL": True}, types)
    waits = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    assert waits, f"{name}: no griddepcontrol.wait under PDL"
    loads = [i for i, line in enumerate(ptx) if any(op in line for op in LOADS)]
    stores = [i for i, line in enumerate(ptx) if "st.global" in line or "atom.global" in line or "red.global" in line]
    assert stores and loads, f"{name}: no global loads / stores found (the PTX check would be vacuous)"
    assert stores[0] > waits[0], f"{name}: a global store before griddepcontrol.wait"
    if name in READS_BEFORE_WAIT:
        assert loads[0] < waits[0], f"{name}: the weight tile is not read before the wait (no overlap)"
        assert loads[-1] > waits[0], f"{name}: every load before the wait (x too)"
    else:
        assert loads[0] > waits[0], f"{name}: a global load before griddepcontrol.wait:\n{ptx[loads[0]]}"


def test_small_decode_gemm_asks_l2_for_its_weights_before_the_wait() -> None:
    """``L2_PREFETCH_K_MAX``: one prefetch a line of the program's weight slice (16 lines a row: the 9 of K 576
    padded, the padding lines repeating the first), all of them before griddepcontrol.wait, no load there."""
    fn, constexprs, types = KERNELS["decode_gemm_l2_prefetch"]
    ptx = hopper_ptx(fn, {**constexprs, "PDL": True}, types)
    wait = next(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
    prefetches = [i for i, line in enumerate(ptx) if "prefetch.global.L2" in line]
    assert prefetches and prefetches[-1] < wait
    assert len(prefetches) * 128 >= 64 * 16  # a [64 rows, 16 lines] slice over 4 warps: 8 a thread at least


@pytest.mark.parametrize("name", ["add_rms_norm", "decode_gemm", "decode_gemm_split_k", "gemv"])
def test_pdl_off_emits_no_grid_dependency_control(name: str) -> None:
    fn, constexprs, types = KERNELS[name]
    assert not any("griddepcontrol" in line for line in hopper_ptx(fn, {**constexprs, "PDL": False}, types))


def test_sliced_one_tile_chains_fewer_mmas_than_the_whole_tile() -> None:
    """The one-tile GEMM at SmolLM2's K 576 (8 + 1 slices of 64, ``ONE_TILE_SLICES``) issues 20-24 MMAs a warp (4
    warps; Triton 3.9 / 3.6) against the whole masked tile's 64: the chain a warp runs after the PDL wait, under
    half as long."""
    def mmas(name: str) -> int:
        fn, constexprs, types = KERNELS[name]
        return bench_ptx.mma_counts(hopper_ptx(fn, {**constexprs, "PDL": True}, types))["mma_sync"]

    sliced, whole = mmas("decode_gemm_one_tile_sliced"), mmas("decode_gemm_one_tile")
    assert 0 < 2 * sliced < whole, (sliced, whole)


def _release_wait_last_mma(name: str, **changes: Any) -> tuple[int, int, int]:
    """PTX line numbers of the kernel's first launch_dependents, first wait and last MMA instruction (PDL on; a
    wgmma's last is its wait_group)."""
    fn, constexprs, types = KERNELS[name]
    ptx = hopper_ptx(fn, {**constexprs, **changes, "PDL": True}, types)
    release = next(i for i, line in enumerate(ptx) if "griddepcontrol.launch_dependents" in line)
    wait = next(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
    return release, wait, max(i for i, line in enumerate(ptx) if "mma.sync" in line or "wgmma." in line)


def test_late_release_lets_the_next_kernel_launch_only_after_the_sums() -> None:
    """``LATE_RELEASE`` (always for the sliced one tile, ``linear_triton.late_release``): launch_dependents after the
    kernel's last MMA; without it before its wait, as the other kernels here (the whole tile, the K loop)."""
    release, wait, last_mma = _release_wait_last_mma("decode_gemm_one_tile_sliced")
    assert wait < last_mma < release
    release, wait, last_mma = _release_wait_last_mma("decode_gemm", LATE_RELEASE=True)
    assert wait < last_mma < release
    for name in ("decode_gemm", "decode_gemm_one_tile"):
        release, wait, _ = _release_wait_last_mma(name)
        assert release < wait, name
    assert linear_triton.late_release(8, 3) and not linear_triton.late_release(8, 0)


def test_fp8_gemv_holds_its_step_in_registers() -> None:
    """The one-row block-FP8 GEMV at its launch for DeepSeek-V3's o_proj (K 16 384, 128 x 128 blocks): the weight
    words, their conversion and the sums fit the registers, nothing spilled to local memory (ptxas for sm_90a)."""
    gemv = fp8_block_gemv_triton
    bk = gemv.block_k(16384)
    constexprs = {"GROUP_N": 128, "GROUP_K": 128, "BLOCK_N": gemv.BLOCK_N, "BLOCK_K": bk, "EVEN_K": True,
                  "HAS_BIAS": False, "NATIVE": True, "PDL": True}
    ptx = hopper_ptx(gemv._fp8_gemv_kernel, constexprs, {"w_ptr": "*i32", "s_ptr": "*fp32"},
                     gemv.warps(gemv.BLOCK_N, bk))
    try:
        use = bench_ptx.register_use(ptx)
    except (RuntimeError, FileNotFoundError) as e:  # no ptxas beside this Triton
        pytest.skip(f"ptxas cannot account for sm_90 here: {e}")
    assert use["spill_stores"] == 0 and use["spill_loads"] == 0, use
