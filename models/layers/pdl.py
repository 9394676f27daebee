"""Programmatic dependent launch (PDL) for the project's Triton kernels (Hopper and later).

A kernel launched with PDL may start while the kernel before it in the stream is still finishing: its
programs first let their own dependents launch (``griddepcontrol.launch_dependents``), may read what no
earlier kernel writes (a matmul's weights), then wait (``griddepcontrol.wait``) until the kernel before
has completed and its writes are visible, and only then read activations or write anything. In a decode
step's chain of short kernels this overlaps each kernel's ramp with its predecessor's tail; on an H200 an
emulated Llama-3-8B batch-1 step of Triton GEMVs and small kernels went from 3.76 to 3.50 ms with it,
bit for bit the same result (bench/pdl_gemv_probe.py, bench/results/2026-12-03-pdl-gemv-probe-h200.json).

Rules every kernel here keeps, so that "the kernel before has completed" means "every earlier kernel
has": each one launched with PDL calls ``pdl_wait`` in every program, before its first read of anything
another kernel writes and before its first write. Kernels of other libraries (cuBLAS, FlashInfer, torch)
launch as usual and wait for everything before them.

Decided once per process (``pdl_launch``): on a CUDA GPU of compute capability 9.0 or later with a Triton
that has grid dependency control, unless ``FUSEDSERVE_PDL=0``; the Triton interpreter (CPU tests) never.
Kernels take the decision as a compile-time constant (``PDL``), so the instructions are not even emitted
where it is off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # a Triton without grid dependency control: PDL stays off
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel in the stream launch (it still waits for this one before reading our output)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the kernel before this one has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_open(PDL: tl.constexpr):
    """``pdl_release`` then ``pdl_wait``: the first statement of a kernel with nothing to prefetch."""
    pdl_release(PDL)
    pdl_wait(PDL)


@functools.cache
def pdl_enabled() -> bool:
    if not HAVE_GDC or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("FUSEDSERVE_PDL") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def pdl_launch() -> dict[str, bool]:
    """The keyword arguments a launch of a PDL-aware kernel takes: its ``PDL`` constant, and Triton's
    ``launch_pdl`` where it is on."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled() else {"PDL": False}
