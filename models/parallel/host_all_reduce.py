"""The all-reduce of one host's CPU ranks through shared memory (gloo's stays for everything else).

On CPU every tensor-parallel layer sums a few rows over its group; gloo over loopback took 1.7-2.1 ms for one
row of 576 floats at 2 ranks and 2.4-2.7 ms at 3, where a socket round trip takes 23 us
(``bench/collective_latency.py``, bench/results/2026-12-05-collective-latency-cpu.json). vLLM's and SGLang's CPU
backends sum through shared memory for the same reason. Here:

- one segment per group under /dev/shm: a header of 32-bit words (each rank's "arrived" and "done" counters, its
  pid and its process start time) and one slot of ``SLOT_BYTES`` per rank. Rank 0 creates it and names it to the
  others over the group's gloo CPU group; once every rank has mapped it the name is unlinked (nothing is left
  behind whatever happens next). If any rank cannot map it or cannot see every peer's process (another host,
  another container, another PID namespace), every rank of the group keeps gloo: ``connect`` agrees on it.
- one sum, per chunk of at most ``SLOT_BYTES``: wait until every rank is done reading the chunk before (its
  ``done`` counter), copy this rank's chunk into its slot, publish ``arrived``, wait for every rank's
  ``arrived``, sum the slots in rank order (the same expression on every rank: bit-identical results everywhere,
  as replicated activations need), publish ``done``.
- waiting sleeps in the kernel on the peer's counter word (a futex on the shared page): no CPU is burnt while a
  slow rank computes, and the waiter wakes as soon as the counter moves (spinning first was slower in a trial on
  a 2-core host with three ranks: the spinner takes the core the late rank needs). Every ``WAIT_SLICE_S`` a
  waiter checks that the peers it waits for are alive: a rank that died is reported within that slice (gloo
  reports it when its socket closes), and a wait longer than ``timeout_s`` is an error too.

One row of 576 floats: 118-120 us at 2 ranks and 427-433 us at 3 (on 2 cores) against gloo's 1.9-2.2 / 2.7 ms
(bench/results/2026-12-05-host-all-reduce-cpu.json).

Linux on x86-64 (futexes; stores seen by other cores in program order); elsewhere ``connect`` returns None and
the group keeps gloo. Counters are 32-bit and wrap; ranks are never more than one chunk apart, so a wrapped
comparison stays exact.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

SLOT_BYTES = 1 << 20
WAIT_SLICE_S = 0.05
SHM_DIR = "/dev/shm"
# x86-64 only: its stores become visible in program order, which the counters rely on (no fences are issued).
_SYS_FUTEX = {"x86_64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_ALIGN = 64
log = logging.getLogger(__name__)
_MASK = 0xFFFFFFFF


def _reached(counter: int, seq: int) -> bool:
    """Whether a 32-bit counter holds ``seq`` or later (wrapped: the two are less than 2**31 apart)."""
    return (counter - seq) & _MASK < 0x80000000


class HostAllReduceError(RuntimeError):
    """A peer of the shared-memory all-reduce died or did not arrive in time."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None if there is none
    (gone, or a zombie: a rank killed but not yet reaped is dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


@dataclass(frozen=True)
class _Layout:
    world: int
    slot_bytes: int

    @property
    def header_words(self) -> int:
        return 4 * self.world  # arrived, done, pid, start time (low 32 bits)

    @property
    def data_offset(self) -> int:
        return -(-self.header_words * 4 // _ALIGN) * _ALIGN

    @property
    def size(self) -> int:
        return self.data_offset + self.world * self.slot_bytes


class HostAllReduce:
    """Sum over the ranks of one group on one host, in place (``__call__``). Built by ``connect``."""

    path = "shm"

    def __init__(self, fd: int, layout: _Layout, rank: int, name: str, timeout_s: float) -> None:
        import mmap

        self._map = mmap.mmap(fd, layout.size)
        self.layout = layout
        self.rank = rank
        self.name = name
        self.timeout_s = timeout_s
        buf = np.frombuffer(self._map, dtype=np.uint8)
        words = buf[:layout.header_words * 4].view(np.uint32)
        w = layout.world
        self._arrived, self._done = words[:w], words[w:2 * w]
        self._pids, self._starts = words[2 * w:3 * w], words[3 * w:4 * w]
        self._data = torch.from_numpy(buf[layout.data_offset:]).view(w, layout.slot_bytes)
        self._libc = _libc()
        self._seq = 0  # chunks summed so far by this rank (== every rank's, between calls)
        self._peers = [j for j in range(w) if j != rank]

    # -- set-up -----------------------------------------------------------------------------------------------
    @staticmethod
    def connect(rank: int, world: int, cpu_group: Any, name: str = "group",
                timeout_s: float = 1800.0) -> HostAllReduce | None:
        """Collective over ``cpu_group`` (gloo; every rank of the group calls it): the group's shared segment,
        or None on every rank if one of them cannot use it."""
        import torch.distributed as dist

        layout = _Layout(world, SLOT_BYTES)
        usable = _SYS_FUTEX is not None and os.path.isdir(SHM_DIR)
        created = f"{SHM_DIR}/fusedserve-{secrets.token_hex(12)}"
        path: list[str | None] = [created if rank == 0 and usable else None]
        fd = -1
        if rank == 0 and usable:
            try:
                fd = os.open(created, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.posix_fallocate(fd, 0, layout.size)  # pages reserved now: a full /dev/shm fails here, not later
            except OSError:
                usable = False
        dist.broadcast_object_list(path, src=dist.get_global_rank(cpu_group, 0), group=cpu_group)
        if rank != 0 and usable and path[0] is not None:
            try:
                fd = os.open(path[0], os.O_RDWR)
            except OSError:
                usable = False
        me: HostAllReduce | None = None
        if usable and fd >= 0:
            try:
                me = HostAllReduce(fd, layout, rank, name, timeout_s)
                me._pids[rank] = os.getpid()
                me._starts[rank] = (_start_time(os.getpid()) or 0) & _MASK
            except (OSError, ValueError):
                me = None
        # Everyone has mapped it (or failed): unlink, then check the peers' processes are visible from here.
        dist.barrier(group=cpu_group)
        if rank == 0 and path[0] is not None:
            try:
                os.unlink(created)
            except OSError:
                pass
        if fd >= 0:
            os.close(fd)
        ok = torch.tensor([int(me is not None and me._peers_visible())], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
        if not int(ok.item()):
            log.info("group %s: all-reduce over gloo (a rank cannot share this host's memory)", name)
            if me is not None:
                me.close()
            return None
        log.info("group %s: all-reduce through shared memory (%d ranks on this host)", name, world)
        return me

    def _peers_visible(self) -> bool:
        for j in self._peers:
            start = _start_time(int(self._pids[j]))
            if start is None or start & _MASK != int(self._starts[j]):
                return False
        return True

    def close(self) -> None:
        self._data = None  # type: ignore[assignment]
        self._arrived = self._done = self._pids = self._starts = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with the process
            pass

    # -- the sum ------------------------------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group's ranks, in place. x: [*], on the CPU."""
        flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
        raw = flat.view(torch.uint8)
        step = self.layout.slot_bytes  # SLOT_BYTES, a power of two: whole elements of any dtype
        for lo in range(0, raw.numel(), step):
            self._chunk(raw[lo:lo + step], flat.dtype)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def _chunk(self, raw: torch.Tensor, dtype: torch.dtype) -> None:
        seq = self._seq + 1
        n = raw.numel()
        self._wait(self._done, seq - 1)  # every rank has read the chunk before from our slot
        self._data[self.rank, :n].copy_(raw)
        self._publish(self._arrived, seq)
        self._wait(self._arrived, seq)
        slots = self._data[:, :n].view(dtype)
        out = raw.view(dtype)
        torch.add(slots[0], slots[1], out=out)
        for j in range(2, self.layout.world):
            out.add_(slots[j])
        self._publish(self._done, seq)
        self._seq = seq

    def _publish(self, counters: np.ndarray, seq: int) -> None:
        counters[self.rank] = seq & _MASK
        addr = ctypes.c_void_p(counters.ctypes.data + 4 * self.rank)
        self._libc.syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def _wait(self, counters: np.ndarray, seq: int) -> None:
        """Until every peer's counter has reached ``seq`` (wrapped 32-bit comparison)."""
        for j in self._peers:
            if not _reached(int(counters[j]), seq):
                self._wait_peer(counters, j, seq)

    def _wait_peer(self, counters: np.ndarray, j: int, seq: int) -> None:
        addr = ctypes.c_void_p(counters.ctypes.data + 4 * j)
        ts = _Timespec(int(WAIT_SLICE_S), int(WAIT_SLICE_S % 1 * 1e9))
        deadline = time.monotonic() + self.timeout_s
        while True:
            seen = int(counters[j])
            if _reached(seen, seq):
                return
            # Sleeps while the word still holds ``seen``; the peer's publish wakes it (or the slice ends).
            self._libc.syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_uint32(seen), ctypes.byref(ts), None, 0)
            if _reached(int(counters[j]), seq):
                return
            pid = int(self._pids[j])
            start = _start_time(pid)
            if start is None or start & _MASK != int(self._starts[j]):
                raise HostAllReduceError(f"all-reduce over {self.name}: rank {j} (pid {pid}) exited")
            if time.monotonic() > deadline:
                raise HostAllReduceError(f"all-reduce over {self.name}: rank {j} did not arrive in "
                                         f"{self.timeout_s:.0f} s")
