"""Run one function on N local ranks (processes) with torch.distributed initialised.

gloo on CPU, NCCL on CUDA (one GPU per rank); rendezvous through a file store in the run's temp directory:
no port to pick (one picked, released and bound again by rank 0 later could be taken in between by any other
process's socket) and no store server listening on every interface, as torch's TCP store's does. A rank that
raises ends the whole run (the other ranks are terminated) and the error comes back to the
caller with the rank's traceback. Results travel by value through files in a temp directory. No rank runs
the function before every rank's connections are up (a barrier on the store): gloo's connect can return on
one rank while a peer is still connecting, and a rank that returned at once and left cut that peer off.

A rank process ends with ``os._exit`` once its result or error is written: it never runs
interpreter finalization, during which Python 3.11 ends a daemon thread that wants the GIL with
``pthread_exit``. A thread still inside a collective (an engine's, an HTTP server's) that came
back at that moment unwound through C++ frames that cannot unwind and the rank aborted
("terminate called without an active exception", SIGABRT; tests/test_local_ranks.py). A native
crash prints every thread's stack (faulthandler).

Rank processes are forked from a ``forkserver`` that has imported torch and transformers' config
classes once (``FORKSERVER_PRELOAD``; the first call starts it, later calls of the process reuse it):
a spawned rank re-imported them every time, seconds of CPU per rank. The forkserver runs no threads
of its own and never touches CUDA, so a rank forked from it starts as a fresh interpreter would. Each
rank first takes the caller's environment, working directory and ``sys.path`` as they are at the call
(a spawned rank inherited them; the forkserver holds those of its own start), and only then unpickles
the function and its arguments. Only what the preloaded modules read from the environment while
being imported comes from the forkserver's start (the first call's environment).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ...models.parallel.host_all_reduce import HostAllReduceError

# Imported once by the forkserver the ranks are forked from: what every rank imports (a rank's loader reads
# config.json with transformers' AutoConfig). None of them initialises CUDA (each rank does, after the fork).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "transformers.models.auto.configuration_auto", __name__]


class RankFailed(RuntimeError):
    pass


def _caller_state() -> dict[str, Any]:
    """What a spawned rank inherited from its caller: environment, working directory, import path."""
    return {"env": dict(os.environ), "cwd": os.getcwd(), "sys_path": list(sys.path)}


def _take_caller_state(state: dict[str, Any]) -> None:
    os.environ.clear()
    os.environ.update(state["env"])
    os.chdir(state["cwd"])
    sys.path[:] = state["sys_path"]


def _entry(rank: int, world: int, backend: str, state: dict[str, Any], payload: bytes,
           out_dir: str, timeout_s: float) -> None:
    faulthandler.enable(all_threads=True)
    error = Path(out_dir) / f"rank{rank}.err"
    code = 1
    try:
        _take_caller_state(state)
        fn, args = pickle.loads(payload)  # after sys.path: the function's module may only be found through it
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(str(Path(out_dir) / "rendezvous"), world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        # Every rank's connections are up before any rank runs (and may leave): gloo's connect can return on one
        # rank while its peer still reads the handshake, and a rank that finished and exited then closed the
        # socket under it ("Connection closed by peer" in connectFullMesh).
        store.set(f"connected/{rank}", "1")
        store.wait([f"connected/{r}" for r in range(world)], timedelta(seconds=timeout_s))
        try:
            out = fn(rank, world, backend, *args)
            torch.save(out, Path(out_dir) / f"rank{rank}.pt")
            code = 0
        except BaseException as e:  # noqa: BLE001 (KeyboardInterrupt too: a rank stopped by a signal failed)
            # written before the group goes: a peer that then fails on the closed connection finds it
            _write_error(error, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 (the rendezvous or the teardown failed)
        if not error.exists():
            _write_error(error, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter finalization (the module docstring says why)


def _write_error(path: Path, text: str) -> None:
    """A rank's error file, whole or not at all: written aside and renamed, so the parent, which reads the error
    files as soon as the first rank exits (and then stops the others), never reads one half written."""
    aside = path.with_name(path.name + ".part")
    aside.write_text(text)
    os.replace(aside, path)


def run_on_ranks(fn: Callable[..., Any], world: int, *args: Any, backend: str | None = None,
                 timeout_s: float = 120.0) -> list[Any]:
    """fn(rank, world, backend, *args) on every rank; returns the values in rank order."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if backend == "nccl":  # no NVLink multicast: FlashInfer takes its multicast-free IPC workspace
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    payload = pickle.dumps((fn, args))
    mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="fusedserve-ranks-") as out_dir:
        try:
            mp.start_processes(_entry, args=(world, backend, _caller_state(), payload, out_dir,
                                             timeout_s), nprocs=world, join=True, start_method="forkserver")
        except mp.ProcessRaisedException as e:
            raise RankFailed(_root_cause(Path(out_dir)) or str(e).strip().splitlines()[-1]) from e
        except mp.ProcessExitedException as e:
            cause = _root_cause(Path(out_dir))
            if cause is not None and not e.signal_name:
                raise RankFailed(cause) from e
            raise RankFailed(f"a rank exited unexpectedly: {e}" + (f" (first error: {cause})" if cause else "")) from e
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


# A rank that fails makes its peers fail too, with transport errors, or with the host all-reduce's error (raised
# only for a peer that exited or never arrived); report the rank whose error is not one of those.
_PEER_FAILURE = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out", "timed out",
                 f"{HostAllReduceError.__name__}: ")


def _root_cause(out_dir: Path) -> str | None:
    errors = sorted(out_dir.glob("rank*.err"))
    firsts = [(f.stem, lines[0]) for f in errors if (lines := f.read_text().splitlines())]
    for rank, line in firsts:
        if not any(marker in line for marker in _PEER_FAILURE):
            return f"{rank}: {line}"
    return f"{firsts[0][0]}: {firsts[0][1]}" if firsts else None
