"""How the worker's child processes (engine, tensor-parallel ranks, data-parallel replicas) live and die.

Stop signals are the server's alone. systemd stops a service with SIGTERM to every process of its
cgroup, Ctrl-C sends SIGINT to the whole foreground group, supervisors `kill -- -PGID`: the
children get the signal too, and one that died of it would fail every request in flight while the
server drains. So every child ignores SIGTERM and SIGINT and keeps them blocked in every thread
(`guard`, the first call of its entry point) and exits only when the server tells it to (Shutdown
over the pipe; rank 0 broadcasts stop to the other ranks), when the server kills it (SIGKILL), or
when the server is gone.

Why blocked as well as ignored: native code may install its own handler at any time, bypassing
Python's `signal` module. On the GPU machine an engine that had compiled Triton kernels was seen
catching SIGHUP, SIGINT, SIGQUIT, SIGUSR1/2, SIGTERM, SIGXCPU, SIGXFSZ and SIGSYS (the set LLVM's
handlers cover; they clean up and re-raise, so the process dies), and an engine compiles kernels
while it serves (a new prefill shape, a decode size captured after startup). A blocked signal is
never delivered to a handler, whoever installed it: it stays pending, harmless, until the process
exits. Threads inherit the mask of the thread that creates them, and the child's first thread has
it from birth (below), so every thread has it. `still_guarded` (when startup is over) says so if a
library replaced the disposition and ignores the signals again, so that the programs the child
runs (compilers) inherit SIG_IGN.

The window before the entry point: a "spawn" child starts a fresh interpreter and unpickles its
arguments (which imports torch) before its target runs; a signal then would still kill it. So
`start` blocks SIGTERM and SIGINT in the spawning thread around `Process.start()`: the mask is
inherited across fork and exec, the signals stay pending in the child, and `guard` sets SIG_IGN,
which discards them.

The server's death, even by SIGKILL, ends every child within a second:
- Linux: PR_SET_PDEATHSIG(SIGKILL), armed by `guard`. The kernel kills the child when its parent
  goes; it needs no GIL, so it works while the child is deep in a native call or still loading.
  The kernel's "parent" is the *thread* that spawned the child, so it is armed only for children
  spawned from the main thread (all of the worker's are); one spawned from another thread would be
  killed when that thread ends.
- Everywhere: a daemon thread checks every 0.5 s that the parent is still the original process
  (`os.getppid()` turns to a reaper when it dies) and `os._exit(1)`s otherwise: the fallback off
  Linux, and a second line if PDEATHSIG was not armed.

multiprocessing's exit hook terminates daemonic children with SIGTERM (now ignored) and then joins
them without a timeout; the hook registered here runs before it and SIGKILLs any child started by
`start` that is still alive, so the server's exit can never hang on one.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.util  # registers multiprocessing's exit hook first, so ours runs before it
import os
import signal
import sys
import threading
import time
import weakref

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1

_started: weakref.WeakSet = weakref.WeakSet()


def start(proc: multiprocessing.process.BaseProcess) -> None:
    """`proc.start()` with the stop signals blocked in this thread, so the child starts with them
    blocked (see the module docstring); signals that arrive meanwhile reach this process after."""
    from multiprocessing import resource_tracker

    # The first spawn also starts multiprocessing's resource tracker, which unblocks these very
    # signals after starting itself: start it first, so our mask holds for the child.
    resource_tracker.ensure_running()
    proc._tokenspeed_pdeathsig = threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    _started.add(proc)


def guard() -> None:
    """In a child, first thing: ignore the stop signals, and die with the parent. A no-op outside a
    multiprocessing child (an entry point called in-process, e.g. by a test)."""
    parent = multiprocessing.parent_process()
    if parent is None or threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # also discards one pending while blocked
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # and kept blocked (module docstring)
    parent_pid = parent.pid
    if sys.platform.startswith("linux") and getattr(multiprocessing.current_process(), "_tokenspeed_pdeathsig", False):
        _arm_pdeathsig()
    if os.getppid() != parent_pid:  # it died before PDEATHSIG was armed
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()


def still_guarded() -> None:
    """In a child, when its startup is over (before it says it is ready): the stop signals ignored
    and blocked again if anything it loaded undid `guard` (a Python library installing a handler,
    seen by `signal.getsignal`; native code installing one, seen only in the kernel's masks, on
    Linux); says which signal and what had replaced it. A no-op where `guard` is."""
    parent = multiprocessing.parent_process()
    if parent is None or threading.current_thread() is not threading.main_thread():
        return
    ignored = kernel_ignored()
    for sig in STOP_SIGNALS:
        handler = signal.getsignal(sig)
        if handler != signal.SIG_IGN:
            logger.warning("%s was no longer ignored after startup (its handler: %r): ignored again",
                           signal.Signals(sig).name, handler)
        elif ignored is not None and sig not in ignored:
            logger.warning("%s was no longer ignored after startup (native code replaced SIG_IGN): ignored again",
                           signal.Signals(sig).name)
        signal.signal(sig, signal.SIG_IGN)  # a sigaction even where Python's table already says SIG_IGN
    if set(STOP_SIGNALS) - signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS):
        logger.warning("the stop signals were unblocked during startup: blocked again")


def kernel_ignored() -> set[int] | None:
    """The signals this process ignores, as the kernel sees it (/proc's SigIgn), or None where
    /proc does not show it (no /proc; gVisor shows 0, while every Python process ignores SIGPIPE).
    Python's `signal.getsignal` answers from its own table, which native code does not update."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("SigIgn:"):
                    mask = int(line.split()[1], 16)
                    ignored = {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}
                    return ignored if signal.SIGPIPE in ignored else None
    except (OSError, ValueError):
        pass
    return None


def _arm_pdeathsig() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as exc:  # the polling thread still covers it
        logger.debug("PR_SET_PDEATHSIG not armed: %s", exc)


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            try:
                sys.stderr.write(f"{multiprocessing.current_process().name} (pid {os.getpid()}): "
                                 f"the server (pid {parent_pid}) is gone; exiting\n")
            except Exception:
                pass
            os._exit(1)


def kill_all() -> None:
    """SIGKILL every child started by `start` that is still alive (no waiting)."""
    for proc in list(_started):
        popen = getattr(proc, "_popen", None)  # not proc.exitcode: no reaping inside a signal handler
        if popen is not None and popen.returncode is None:
            try:
                os.kill(popen.pid, signal.SIGKILL)
            except OSError:
                pass


def _kill_leftovers() -> None:
    alive = [proc for proc in list(_started) if proc.is_alive()]
    for proc in alive:
        proc.kill()
    for proc in alive:
        proc.join(5)


atexit.register(_kill_leftovers)
