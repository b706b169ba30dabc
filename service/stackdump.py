"""SIGUSR1 → every thread's Python stack on stderr, without stopping the process: how an
operator sees what a wedged server is doing (docs/RELIABILITY.md "Wedged pipeline").

`install` registers faulthandler's C-level handler when a server process starts
(service/app.py `run`) and starts a guard thread that checks every second that the handler
is still faulthandler's: LLVM, inside Triton's compiler, installs its own SIGUSR1 handler
(which swallows the signal) the first time a process compiles a kernel, and only then. A
replaced handler is logged, naming the library that owns it, and faulthandler's
registered again.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import faulthandler
import logging
import signal
import sys
import threading
import time

log = logging.getLogger("grace.stackdump")
SIGNAL = signal.SIGUSR1


class _Sigaction(ctypes.Structure):
    """glibc's `struct sigaction` on Linux (x86-64 and aarch64): the handler, a 1,024-bit
    mask, the flags, the restorer."""

    _fields_ = [
        ("sa_handler", ctypes.c_void_p),
        ("sa_mask", ctypes.c_ubyte * 128),
        ("sa_flags", ctypes.c_int),
        ("sa_restorer", ctypes.c_void_p),
    ]


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


_LIBC: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_ours: list[int | None] = [None]  # faulthandler's handler address, once installed
_lock = threading.Lock()
_guard_started = threading.Event()
GUARD_SECONDS = 1.0


def handler_address(sig: int = SIGNAL) -> int | None:
    """The C-level handler now installed for `sig` (None where it cannot be read)."""
    if _LIBC is None:
        return None
    old = _Sigaction()
    if _LIBC.sigaction(int(sig), None, ctypes.byref(old)) != 0:
        return None
    return old.sa_handler or 0


def owner(address: int) -> str:
    """The shared object (and symbol, where exported) holding `address`."""
    if _LIBC is None or address in (0, 1):  # SIG_DFL, SIG_IGN
        return {0: "SIG_DFL", 1: "SIG_IGN"}.get(address, hex(address))
    info = _DlInfo()
    try:
        dladdr = _LIBC.dladdr
    except AttributeError:
        return hex(address)
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return hex(address)
    name = info.dli_fname.decode(errors="replace")
    return f"{name} ({info.dli_sname.decode(errors='replace')})" if info.dli_sname else name


def _register() -> None:
    faulthandler.unregister(SIGNAL)  # register() alone keeps a stale sigaction in place
    faulthandler.register(SIGNAL, all_threads=True, chain=False)
    _ours[0] = handler_address()


def install(guard_seconds: float = GUARD_SECONDS) -> None:
    """Register faulthandler for SIGUSR1 (all threads, stderr), remember its handler and
    start the guard (once per process; `guard_seconds` 0: no guard). From the main thread
    SIGUSR1 is first set to SIG_IGN, the disposition a re-registration passes through: a
    signal in that instant loses its dump rather than killing the process."""
    if threading.current_thread() is threading.main_thread():
        faulthandler.unregister(SIGNAL)
        signal.signal(SIGNAL, signal.SIG_IGN)
    _register()
    if guard_seconds > 0 and _ours[0] is not None and not _guard_started.is_set():
        _guard_started.set()
        threading.Thread(target=_guard, args=(guard_seconds,), name="grace-stackdump-guard",
                         daemon=True).start()  # fmt: skip


def _guard(seconds: float) -> None:
    while True:  # lives as long as the process (a daemon thread)
        time.sleep(seconds)
        ensure()


def ensure() -> bool:
    """True when SIGUSR1 still reaches faulthandler; otherwise log who took it, register
    faulthandler again and return False. A no-op (True) before `install` or where the
    handler cannot be read."""
    with _lock:
        ours, now = _ours[0], handler_address()
        if ours is None or now is None or now == ours:
            return True
        log.warning("SIGUSR1 handler taken by %s: stack dumps re-installed", owner(now))
        _register()
        return False
