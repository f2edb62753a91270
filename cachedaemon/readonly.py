"""A write into the read-only weight pool says what happened before the process dies.

Attached tensors are views of chunks mapped PROT_READ: a write into one (`copy_`, `add_`,
an init that runs again) is stopped by the kernel with SIGSEGV, which on its own ends the
process without a word. `guard` registers a pool's address ranges and, once per process,
installs a SIGSEGV handler that, when the faulting address lies in one of them, writes to
stderr which tensor was written and how to get a private copy, then gives the signal back
to the handler that was there before (Python's faulthandler: a traceback; or the default:
the process still dies of SIGSEGV, as it must, with the weights of every engine intact).

Linux only (the layout of `struct sigaction` and `siginfo_t` of glibc and musl on 64-bit).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from typing import Any

_SA_SIGINFO = 4
_SI_ADDR_OFFSET = 16  # si_signo, si_errno, si_code, padding, then the union's si_addr

HOW = (
    "attached tensors are read-only views of the weight pool that every engine shares. "
    "For weights you can change, attach a private copy: attach_model(model, socket, "
    "copy=True) for all of them, copy=['name', ...] for some, or tensor.clone() first."
)


class _SigAction(ctypes.Structure):
    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * (128 // ctypes.sizeof(ctypes.c_ulong))),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


_HANDLER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

_lock = threading.Lock()
# (sorted starts, (start, end, name) in that order): replaced whole, never mutated, so the
# handler always reads one consistent snapshot
_table: tuple[list[int], list[tuple[int, int, str]]] = ([], [])
_previous = _SigAction()
_handler: object = None  # the ctypes callback, kept alive for the life of the process
_sigaction: Any = None  # libc's sigaction, looked up once, before any fault


def name_at(addr: int) -> str | None:
    """The pool tensor whose bytes hold `addr` in this process, or None."""
    starts, spans = _table
    i = bisect.bisect_right(starts, addr) - 1
    if i >= 0 and addr < spans[i][1]:
        return spans[i][2]
    return None


def message(name: str, addr: int) -> str:
    return (
        f"holdfast: SIGSEGV: a write into the read-only weight pool, tensor {name!r} "
        f"at {addr:#x}; {HOW}\n"
    )


def _on_segv(signum: int, info: int | None, context: int | None) -> None:
    """The SIGSEGV handler: name the tensor if the address is the pool's, then restore the
    previous handler; the faulting write runs again and meets that one."""
    try:
        addr = ctypes.c_void_p.from_address(info + _SI_ADDR_OFFSET).value if info else None
        name = name_at(addr) if addr is not None else None
        if name is not None and addr is not None:
            os.write(2, message(name, addr).encode())
    finally:  # whatever happened above, the next fault must not come back here
        if _sigaction is not None:
            _sigaction(signal.SIGSEGV, ctypes.byref(_previous), None)


def _install() -> None:
    global _handler, _sigaction
    if _handler is not None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    handler = _HANDLER_TYPE(_on_segv)
    action = _SigAction()
    action.handler = ctypes.cast(handler, ctypes.c_void_p).value
    action.flags = _SA_SIGINFO  # on the faulting thread's own stack: Python code runs here
    if libc.sigaction(signal.SIGSEGV, ctypes.byref(action), ctypes.byref(_previous)) != 0:
        raise OSError(ctypes.get_errno(), "sigaction(SIGSEGV) failed")
    _handler, _sigaction = handler, libc.sigaction


def guard(spans: list[tuple[int, int, str]]) -> None:
    """Register (address, nbytes, tensor name) of read-only host memory; install the
    handler the first time."""
    global _table
    with _lock:
        _install()
        merged = sorted([*_table[1], *((a, a + n, name) for a, n, name in spans if n > 0)])
        _table = ([s for s, _, _ in merged], merged)
