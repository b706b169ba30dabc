"""SIGUSR1 stack dumps survive a library that takes the signal (service/stackdump.py): on
the H200 Triton's LLVM installed its own SIGUSR1 handler while the workers compiled their
kernels, and the operator's dump never came. Real processes, real signals; a foreign
handler is planted the way a C library would plant it (sigaction, here with libc's
getpid as the handler, which swallows the signal as LLVM's does)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from service import stackdump

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or stackdump.handler_address() is None,
    reason="reads sigaction through libc (Linux)",
)

PLANT = """
import ctypes, os, signal, sys, threading, time
from service import stackdump

def plant():  # a C library's handler for SIGUSR1: libc's getpid, which ignores the signal
    act = stackdump._Sigaction()
    act.sa_handler = ctypes.cast(stackdump._LIBC.getpid, ctypes.c_void_p).value
    assert stackdump._LIBC.sigaction(signal.SIGUSR1, ctypes.byref(act), None) == 0
"""


def run(body: str) -> str:
    """Run `body` after PLANT in a fresh interpreter, from a file (Triton's @jit reads its
    kernels' source); its stderr (asserting it exited 0)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "body.py"
        script.write_text(PLANT + textwrap.dedent(body))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_the_guard_takes_sigusr1_back_and_the_dump_comes() -> None:
    """A handler planted after start-up is replaced by faulthandler's within the guard's
    period, with one warning naming the library; the next SIGUSR1 writes the stacks."""
    err = run("""
        import logging
        logging.basicConfig(level=logging.INFO)
        stackdump.install(guard_seconds=0.05)
        ours = stackdump.handler_address()
        plant()
        assert stackdump.handler_address() != ours
        end = time.monotonic() + 120
        while stackdump.handler_address() != ours:  # the guard's doing, waited for
            assert time.monotonic() < end, "the guard never re-installed faulthandler"
            time.sleep(0.01)
        print("MARK", file=sys.stderr, flush=True)
        # to this thread (the guard's runs too): handled before pthread_kill returns
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
    """)
    assert err.count("SIGUSR1 handler taken by") == 1, err
    assert "libc" in err.split("SIGUSR1 handler taken by")[1].splitlines()[0], err
    after = err.split("MARK", 1)[1]
    assert "most recent call first" in after and "<module>" in after, err


def test_without_the_guard_the_planted_handler_swallows_the_signal() -> None:
    """Why the guard exists: with the planted handler in place SIGUSR1 writes nothing; one
    `ensure` (what the guard runs) puts faulthandler back and says so, and the next
    SIGUSR1 dumps. Single-threaded, so each signal is handled before os.kill returns."""
    err = run("""
        stackdump.install(guard_seconds=0)
        plant()
        os.kill(os.getpid(), signal.SIGUSR1)  # swallowed, as LLVM's handler does
        print("SWALLOWED", file=sys.stderr, flush=True)
        assert stackdump.ensure() is False and stackdump.ensure() is True
        os.kill(os.getpid(), signal.SIGUSR1)
    """)
    before, after = err.split("SWALLOWED", 1)
    assert "most recent call first" not in before, err
    assert "most recent call first" in after and "<module>" in after, err


def test_install_twice_keeps_one_working_handler() -> None:
    """A second `install` in one process (a server started twice in a test) still dumps:
    faulthandler.register alone would leave the SIG_IGN that install passes through."""
    err = run("""
        stackdump.install(guard_seconds=0)
        stackdump.install(guard_seconds=0)
        assert stackdump.ensure() is True
        os.kill(os.getpid(), signal.SIGUSR1)
    """)
    assert "most recent call first" in err and "<module>" in err, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_triton_compile_after_install_leaves_sigusr1_dumping(tmp_path: Path) -> None:
    """The case seen on the H200: a kernel compiled (cold cache) after `install`. Whether
    or not this Triton's LLVM takes SIGUSR1, once the guard has looked, the signal dumps."""
    err = run(f"""
        import logging
        os.environ["TRITON_CACHE_DIR"] = {str(tmp_path)!r}  # cold: LLVM compiles here
        logging.basicConfig(level=logging.INFO)
        import torch, triton, triton.language as tl
        stackdump.install(guard_seconds=0.05)
        ours = stackdump.handler_address()

        @triton.jit
        def _twice(x_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

        x = torch.ones(1000, device="cuda")
        _twice[(4,)](x, 1000, BLOCK=256)
        torch.cuda.synchronize()
        print("after compile:", stackdump.owner(stackdump.handler_address()), file=sys.stderr)
        end = time.monotonic() + 120
        while stackdump.handler_address() != ours:
            assert time.monotonic() < end, "the guard never re-installed faulthandler"
            time.sleep(0.01)
        print("MARK", file=sys.stderr, flush=True)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
    """)
    after = err.split("MARK", 1)[1]
    assert "most recent call first" in after and "<module>" in after, err
