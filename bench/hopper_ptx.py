"""What a Triton kernel becomes on Hopper, without a GPU: the PTX Triton emits for sm_90 and ptxas's account of it.

    .venv/bin/python bench/hopper_ptx.py --out bench/results/<date>-hopper-ptx-one-tile-cpu.json

For each decode-GEMM cut in ``CUTS`` (``models/layers/linear_triton._decode_gemm_kernel`` at up to 16 rows over a
small model's K) it reports the MMA instructions one warp issues (``mma.sync``: in a one-tile cut they form one
dependent chain per warp; ``wgmma``: asynchronous warpgroup MMAs), the registers a thread uses and the bytes it
spills to local memory (``ptxas -v`` with Triton's own ptxas). A screen before device time, not a timing: a cut that
spills or chains many MMAs is a suspect, one that does neither still has to win on the GPU.
``tests/test_pdl_ptx.py`` compiles its kernels through ``hopper_ptx`` here.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.append(str(Path(__file__).resolve().parents[1]))

HOPPER = GPUTarget("cuda", 90, 32)


def hopper_ptx(fn: Any, constexprs: dict[str, Any], types: dict[str, str], num_warps: int = 4,
               num_stages: int = 3) -> list[str]:
    """The kernel's PTX for sm_90 at these constants (a constant left out takes the kernel's default; pointers
    bf16 unless ``types`` says otherwise, 16-byte aligned as the launches pass them; other arguments i32, fp32
    for ``eps`` / ``scale``). Every integer argument the kernel specialises on (not in its ``do_not_specialize``)
    is known divisible by 16, as a launch with such values (strides and widths of 576, 4096 ...) compiles it: only
    then can Triton vectorise the loads and pipeline them through shared memory (``cp.async``), so registers,
    spills and load order are the GPU's. RuntimeError / FileNotFoundError where this Triton cannot compile for
    sm_90."""
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty}, **constexprs}
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:  # compiled as a runtime i32 it would be another kernel (a branch on it is not folded away)
        raise ValueError(f"{fn.__name__}: no value for the compile-time constants {', '.join(missing)}")
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        elif name.endswith("_ptr"):
            sig[name] = "*bf16"
        else:
            sig[name] = "fp32" if name in ("eps", "scale") else "i32"
    unspecialised = {p.name for p in fn.params if p.do_not_specialize}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if sig[n].startswith("*") or (sig[n] == "i32" and n not in unspecialised)}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=aligned), target=HOPPER,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    ptx: list[str] = compiled.asm["ptx"].splitlines()
    return ptx


def mma_counts(ptx: list[str]) -> dict[str, int]:
    """MMA instructions in the PTX (one thread's, so one warp's): synchronous and warpgroup ones."""
    text = "\n".join(ptx)
    return {"mma_sync": len(re.findall(r"\bmma\.sync\b", text)), "wgmma": len(re.findall(r"\bwgmma\.mma_async\b", text))}


def _ptxas() -> str:
    """Triton's newest bundled ptxas (the one that reads the PTX version it emits)."""
    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (folder / name).exists():
            return str(folder / name)
    raise FileNotFoundError(f"no ptxas under {folder}")


def register_use(ptx: list[str]) -> dict[str, int]:
    """ptxas -v for sm_90a: registers a thread, bytes of spill stores and loads."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write("\n".join(ptx))
    try:
        out = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    registers = re.search(r"Used (\d+) registers", out)
    stores = re.search(r"(\d+) bytes spill stores", out)
    loads = re.search(r"(\d+) bytes spill loads", out)
    if registers is None or stores is None or loads is None:
        raise RuntimeError(f"ptxas -v said nothing of registers / spills:\n{out}")
    return {"registers": int(registers.group(1)), "spill_stores": int(stores.group(1)),
            "spill_loads": int(loads.group(1))}


# (label, K, block_n, block_k, stages, warps, sliced as (slice_k) or 0): the one-tile GEMM over SmolLM2's widths as
# the engine takes it today (the whole tile in one dot, K masked to a power of two, 1 stage) and as slices in batched
# dots (``ONE_TILE_SLICES``), beside the K loop's cut (64-wide steps, 6 stages) the engine takes at K 576.
CUTS = (("K loop 64 x 64, 6 stages", 576, 64, 64, 6, 4, 0),
        ("one tile 16 x 1024 (576)", 576, 16, 1024, 1, 4, 0),
        ("one tile 32 x 1024 (576)", 576, 32, 1024, 1, 4, 0),
        ("sliced 16: 8+1 x 64 (576)", 576, 16, 1024, 1, 4, 64),
        ("sliced 16: 8+1 x 64 (576)", 576, 16, 1024, 1, 8, 64),
        ("sliced 32: 8+1 x 64 (576)", 576, 32, 1024, 1, 8, 64),
        ("one tile 16 x 2048 (1536)", 1536, 16, 2048, 1, 4, 0),
        ("one tile 16 x 2048 (1536)", 1536, 16, 2048, 1, 8, 0),
        ("sliced 16: 16+8 x 64 (1536)", 1536, 16, 2048, 1, 8, 64),
        ("sliced 16: 16+16 x 64 (1728)", 1728, 16, 2048, 1, 8, 64))


def one_cut(k: int, block_n: int, block_k: int, stages: int, warps: int, slice_k: int) -> dict[str, Any]:
    from fusedserve.models.layers import linear_triton as lt

    slices, tail = lt.one_tile_slices(k, slice_k) if slice_k else (0, 1)
    one_tile = block_k >= k
    constexprs = {"BLOCK_N": block_n, "BLOCK_M": 16, "BLOCK_K": block_k, "SPLIT_K": 1, "EVEN_K": k % block_k == 0,
                  "HAS_BIAS": False, "DOT_FP32": False, "EPILOGUE": lt.EPILOGUE_PLAIN, "HEAD_DIM": 2,
                  "ONE_TILE": one_tile, "PREFETCH_LINES": 0 if one_tile else 16, "LINE": 64, "PDL": True,
                  "SLICES": slices, "TAIL_SLICES": tail, "SLICE_K": slice_k or 64,
                  "LATE_RELEASE": lt.late_release(8, slices)}  # as launched at the verify's 8 rows
    ptx = hopper_ptx(lt._decode_gemm_kernel, constexprs, {}, warps, stages)
    return {**mma_counts(ptx), **register_use(ptx)}


def main() -> None:
    from bench.common import record_header, write_record

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON record to write")
    args = ap.parse_args()
    rows = []
    for label, k, block_n, block_k, stages, warps, slice_k in CUTS:
        row = {"cut": label, "K": k, "block_n": block_n, "block_k": block_k, "stages": stages, "warps": warps,
               "slice_k": slice_k, **one_cut(k, block_n, block_k, stages, warps, slice_k)}
        rows.append(row)
        print(f"{label:32s} {warps} warps: mma.sync {row['mma_sync']:3d}  wgmma {row['wgmma']}  "
              f"registers {row['registers']:3d}  spills {row['spill_stores']} B")
    if args.out:
        record = {**record_header(), "target": "sm_90a (compiled here, no GPU)", "ptxas": _ptxas(), "cuts": rows,
                  "note": "one warp's MMA instructions, a thread's registers and spill bytes; not a timing"}
        print(write_record(record, args.out))


if __name__ == "__main__":
    main()
