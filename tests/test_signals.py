"""Stop signals to the worker's whole process group (systemd's KillMode=control-group, Ctrl-C in a
terminal, `kill -- -PGID`) drain exactly as SIGTERM to the main process does: the child processes
(engine, tensor-parallel ranks, data-parallel replicas, multiprocessing's resource tracker) ignore
them and exit when the server tells them to; a second signal stops at once; and when the server is
SIGKILLed every child is gone within seconds. Each against a real worker started in its own
session, as a service manager or a terminal starts it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from test_reliability import Collector, gen
from worker_harness import CACHE, REPO, Worker, child_pids, free_port, tiny_models

FLAGS = ("--max-model-len", "4096", "--max-total-tokens", "16384")
# Several ranks or replicas run on the CPU (gloo) here and on a one-GPU machine alike.
MULTI = ("--device", "cpu")


@pytest.fixture(scope="module")
def model_dir():
    return tiny_models()["llama-gqa-tied"]


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = child_pids(pid)
    while todo:
        p = todo.pop()
        if p not in out:
            out.append(p)
            todo.extend(child_pids(p))
    return sorted(out)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child waiting for a reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def still_alive(pids, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def ignores_stop_signals(pid: int) -> bool:
    """Whether the group's stop signals cannot end this process: /proc's SigIgn has both (a child
    after `lifetime.guard`), or SigBlk has both (a spawned child before `guard`: the signals stay
    pending and `guard` discards them, engine/lifetime.py). Every Python process ignores SIGPIPE
    from its start, so an ignore mask of 0 means this /proc does not show the masks (gVisor, on
    the GPU machine): then the tests' behaviour (the children surviving the group signal) is the
    evidence."""
    masks = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("SigIgn:", "SigBlk:")):
            masks[line.split(":")[0]] = int(line.split()[1], 16)
    if masks.get("SigIgn", 0) == 0:
        return True
    return any(all(mask & (1 << (sig - 1)) for sig in (signal.SIGTERM, signal.SIGINT)) for mask in masks.values())


def describe(pid: int) -> str:
    """A process's command line and signal masks, for a failure message."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        masks = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                 if line.startswith(("SigBlk:", "SigIgn:", "SigCgt:", "State:", "PPid:"))]
    except OSError as error:
        return f"{pid}: {error}"
    return f"{pid}: {' '.join(masks)} {cmd}"  # the masks first: a long log cut at a width keeps them


def wait_not_serving(w: Worker, within: float) -> None:
    """grpc.health.v1 says NOT_SERVING (or the port is already closed) within `within` s."""
    health = health_pb2_grpc.HealthStub(w.channel)
    deadline = time.monotonic() + within
    while True:
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                return
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and w.proc.poll() is not None:
                return  # closed: the drain was already over
        assert time.monotonic() < deadline, f"health still SERVING {within} s after the signal"
        time.sleep(0.02)


class HealthWatch(threading.Thread):
    """grpc.health.v1's Watch of the whole server, its statuses collected until the stream ends (as a
    load balancer's client-side health check holds it)."""

    def __init__(self, w: Worker) -> None:
        super().__init__(daemon=True)
        self.call = health_pb2_grpc.HealthStub(w.channel).Watch(health_pb2.HealthCheckRequest(service=""))
        self.statuses: list[int] = []
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        try:
            for response in self.call:
                self.statuses.append(response.status)
        except grpc.RpcError as e:
            self.error = e

    def wait_for(self, status: int, within: float) -> bool:
        deadline = time.monotonic() + within
        while status not in self.statuses and time.monotonic() < deadline:
            time.sleep(0.02)
        return status in self.statuses


def drain_under_group_signal(w: Worker, sig: int, streams: int, max_new: int, drain_s: float = 150) -> None:
    """`streams` streams in flight when `sig` goes to the whole group; all finish normally, health
    goes NOT_SERVING (Check, and a Watch held from before the signal), the worker exits 0 and no
    child is left. The worker's drain timeout
    (`drain_s`, as started) must outlast the streams on a loaded CPU (the suite runs two test files
    at once; the GPU machine's runs 14)."""
    kids = descendants(w.proc.pid)
    assert kids, ("the worker has no child process", w.log())
    assert all(ignores_stop_signals(k) for k in kids), ("a child would die of the group signal",
                                                        [describe(k) for k in kids], w.log())
    calls = [Collector(w.stub, gen(max_new_tokens=max_new), timeout=drain_s + 20) for _ in range(streams)]
    watch = HealthWatch(w)
    for c in calls:  # a loaded machine (a GPU suite at -n 14) may compile kernels at the first prefill
        assert c.first.wait(150), ("no first token within 150 s", c.code, c.details, w.log())
    assert watch.wait_for(health_pb2.HealthCheckResponse.SERVING, 5.0), (watch.statuses, watch.error)
    w.signal_group(sig)
    ended = [(c.completes[0].finish_reason, c.completes[0].completion_tokens) for c in calls if c.completes]
    assert not ended, ("a stream ended before the signal: make them longer", ended,
                       [len(c.messages) for c in calls], w.log()[-3000:])
    wait_not_serving(w, 1.0)
    assert watch.wait_for(health_pb2.HealthCheckResponse.NOT_SERVING, 2.0), (watch.statuses, watch.error)
    for c in calls:
        c.join(drain_s + 30)
        assert not c.is_alive()
    for c in calls:
        assert c.code == grpc.StatusCode.OK, (c.code, c.details, w.log())
        assert [(x.finish_reason, x.completion_tokens) for x in c.completes] == [("length", max_new)]
        assert c.messages[-1].HasField("complete")
    assert w.proc.wait(30) == 0, w.log()
    assert still_alive(kids, 5.0) == [], w.log()
    assert "exited unexpectedly" not in w.log()


def test_group_sigterm_under_load_drains_every_stream_and_exits_0(model_dir):
    w = Worker(model_dir, *FLAGS, "--drain-timeout", "150", new_session=True)
    try:
        drain_under_group_signal(w, signal.SIGTERM, streams=8, max_new=400)  # still streaming at the signal on a GPU too
    finally:
        w.stop()


def test_group_sigint_drains_like_sigterm(model_dir):
    w = Worker(model_dir, *FLAGS, "--drain-timeout", "150", new_session=True)
    try:
        drain_under_group_signal(w, signal.SIGINT, streams=3, max_new=600)  # 300 once ended one early in CI
    finally:
        w.stop()


def test_one_stop_sent_twice_at_once_still_drains(model_dir):
    """GNU `timeout` sends SIGTERM to its child, then to the child's group, moments apart: the
    same stop, not a second one (which would skip the drain). A later one stops at once."""
    w = Worker(model_dir, *FLAGS, "--drain-timeout", "60", new_session=True)
    try:
        calls = [Collector(w.stub, gen()) for _ in range(2)]  # to the context limit: minutes on a CPU
        for c in calls:
            assert c.first.wait(60), w.log()
        w.proc.send_signal(signal.SIGTERM)
        time.sleep(0.02)  # apart enough for the handler to run between them (closer ones arrive as one)
        w.signal_group(signal.SIGTERM)
        wait_not_serving(w, 1.0)
        time.sleep(1.0)
        assert w.proc.poll() is None and all(c.is_alive() for c in calls), w.log()  # still draining
        assert "the same stop, still draining" in w.log()
        w.signal_group(signal.SIGTERM)
        assert w.proc.wait(20) == 0, w.log()
        for c in calls:
            c.join(10)
            assert not c.is_alive()
    finally:
        w.stop()


def test_second_group_signal_mid_drain_aborts_the_rest_and_exits_promptly(model_dir):
    w = Worker(model_dir, *FLAGS, "--drain-timeout", "60", new_session=True)
    try:
        kids = descendants(w.proc.pid)
        calls = [Collector(w.stub, gen()) for _ in range(4)]  # to the context limit: minutes on a CPU
        for c in calls:
            assert c.first.wait(60), w.log()
        w.signal_group(signal.SIGTERM)
        wait_not_serving(w, 1.0)
        time.sleep(1.0)
        assert w.proc.poll() is None and all(c.is_alive() for c in calls)  # draining, 59 s to go
        w.signal_group(signal.SIGINT)  # either signal counts as the second
        t0 = time.monotonic()
        assert w.proc.wait(20) == 0, w.log()
        stopped_after = time.monotonic() - t0
        for c in calls:
            c.join(10)
            assert not c.is_alive()
            # Exactly one terminal message: a GenerateComplete (abort) closing an OK stream, or a status.
            if c.code == grpc.StatusCode.OK:
                assert [x.finish_reason for x in c.completes] == ["abort"], c.messages[-1:]
                assert c.messages[-1].HasField("complete")
            else:
                assert c.completes == [], (c.code, c.details)
        # Promptly: not the 59 s of drain left. Under 5 s here alone; the bound is the server's 5 s window
        # for the aborted streams' last messages plus the engine's stop, which a GPU shared by a dozen
        # test processes (the GPU suite) stretched to 6 s.
        assert stopped_after < 15, f"the worker took {stopped_after:.1f} s to stop on the second signal:\n{w.log()}"
        assert still_alive(kids, 5.0) == [], w.log()
        assert "second stop signal: aborting" in w.log()
    finally:
        w.stop()


@pytest.mark.slow
def test_tp2_group_sigterm_drains_and_every_rank_exits(model_dir):
    # Two CPU ranks: a loaded GPU machine once took more than 150 s for these streams.
    w = Worker(model_dir, *FLAGS, "--drain-timeout", "400", "--tp", "2", *MULTI, new_session=True)
    try:
        assert len(descendants(w.proc.pid)) >= 3  # engine (rank 0), rank 1, resource tracker
        drain_under_group_signal(w, signal.SIGTERM, streams=3, max_new=300, drain_s=400)
    finally:
        w.stop()


@pytest.mark.slow
def test_dp2_group_sigterm_drains_and_every_replica_exits(model_dir):
    w = Worker(model_dir, *FLAGS, "--drain-timeout", "400", "--dp-size", "2", *MULTI, new_session=True)
    try:
        assert len(descendants(w.proc.pid)) >= 3  # two engines, resource tracker
        drain_under_group_signal(w, signal.SIGTERM, streams=4, max_new=300, drain_s=400)  # 60 ended a stream before the last first token (CI)
    finally:
        w.stop()


@pytest.mark.slow
def test_server_sigkilled_while_the_engine_is_stuck_leaves_no_child(model_dir):
    """The engine hangs inside a step (so it never reads its pipe to see the server gone) and rank 1
    waits for rank 0's next plan: only the parent-death signal or the parent watch can end them."""
    w = Worker(model_dir, *FLAGS, "--tp", "2", *MULTI, env={"TOKENSPEED_FAULT_INJECT": "hang@20"}, new_session=True)
    try:
        kids = descendants(w.proc.pid)
        assert len(kids) >= 3  # engine (rank 0), rank 1, resource tracker
        c = Collector(w.stub, gen(max_new_tokens=200))
        assert c.first.wait(60), w.log()
        seen, since = -1, time.monotonic()
        while time.monotonic() - since < 2.0:  # no token for 2 s: hung at step 20
            if len(c.messages) != seen:
                seen, since = len(c.messages), time.monotonic()
            assert time.monotonic() - since < 60 and c.is_alive(), "the engine did not hang at step 20"
            time.sleep(0.05)
        assert seen < 30, seen
        os.kill(w.proc.pid, signal.SIGKILL)  # the main pid only
        assert w.proc.wait(5) == -signal.SIGKILL
        assert still_alive(kids, 5.0) == [], (kids, w.log())
    finally:
        w.stop()


def test_server_sigkilled_during_startup_leaves_no_child(model_dir):
    """Killed while the engine starts (interpreter, imports, loading) and rank 1 waits to meet it."""
    log_path = CACHE / "logs" / f"worker-startup-kill-{os.getpid()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tokenspeed_worker", str(model_dir), "--host", "127.0.0.1",
                                 "--grpc-port", str(free_port()), *FLAGS, "--tp", "2", *MULTI],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while len(descendants(proc.pid)) < 3:  # resource tracker, rank 1, engine
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.05)
            time.sleep(1.0)  # in their imports and the rendezvous
            kids = descendants(proc.pid)
            assert "serving" not in log_path.read_text()
            proc.kill()
            proc.wait(5)
            assert still_alive(kids, 5.0) == [], log_path.read_text()
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_group_sigterm_during_startup_exits_0_and_leaves_no_child(model_dir):
    log_path = CACHE / "logs" / f"worker-startup-term-{os.getpid()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tokenspeed_worker", str(model_dir), "--host", "127.0.0.1",
                                 "--grpc-port", str(free_port()), *FLAGS],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while len(descendants(proc.pid)) < 2:  # resource tracker, engine
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.05)
            kids = descendants(proc.pid)
            os.killpg(proc.pid, signal.SIGTERM)  # lands in the engine's interpreter start or imports
            assert proc.wait(10) == 0, log_path.read_text()
            assert still_alive(kids, 5.0) == [], log_path.read_text()
            assert "SIGTERM during startup" in log_path.read_text()
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_other_node_waits_for_node_0_to_drain(model_dir):
    """`--node-rank 1` (ranks only) gets the stop signal first: its rank keeps serving node 0 until
    node 0, signalled in turn, drains and stops it; both exit 0."""
    addr = f"127.0.0.1:{free_port()}"
    dist = ("--tp", "2", "--nnodes", "2", "--dist-init-addr", addr, *MULTI)
    log_path = CACHE / "logs" / f"node1-signals-{addr.split(':')[1]}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "tokenspeed_worker", str(model_dir), *FLAGS, *dist,
                                  "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                 start_new_session=True)
        try:
            # The drain outlasts the 400 tokens on a loaded 2-core machine (TP 2 over gloo, tests in
            # parallel): the request must end by its length, not by the drain timeout.
            w = Worker(model_dir, *FLAGS, *dist, "--node-rank", "0", "--drain-timeout", "180", new_session=True)
            try:
                kids = descendants(node1.pid)
                c = Collector(w.stub, gen(max_new_tokens=400), timeout=190)  # still streaming 1 s after the signal
                assert c.first.wait(60), w.log()
                os.killpg(node1.pid, signal.SIGTERM)
                time.sleep(1.0)
                assert node1.poll() is None and c.is_alive()  # still serving node 0
                w.signal_group(signal.SIGTERM)
                c.join(200)
                assert c.code == grpc.StatusCode.OK and [x.finish_reason for x in c.completes] == ["length"], w.log()
                assert w.proc.wait(30) == 0, w.log()
            finally:
                w.stop()
            assert node1.wait(30) == 0, log_path.read_text()
            assert still_alive(kids, 5.0) == [], log_path.read_text()
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node1.pid, signal.SIGKILL)
            node1.wait()


def _still_guarded_warnings() -> list[str]:
    """lifetime.still_guarded() in this child, and what it logged."""
    import logging

    from tokenspeed_worker.engine import lifetime

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("tokenspeed_worker.engine.lifetime").addHandler(handler)
    lifetime.still_guarded()
    return [r.getMessage() for r in records]


def _child_whose_library_took_sigterm(conn) -> None:
    """A child as the engine starts: guard first, then something it loads installs its own SIGTERM
    handler (as a library may), then still_guarded before it would say it is ready."""
    from tokenspeed_worker.engine import lifetime

    lifetime.guard()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    messages = _still_guarded_warnings()
    conn.send(([signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGINT)], messages))


def _guarded_child(target):
    """(process, connection): `target(conn)` running in a child started as the worker starts its
    children (spawned, through lifetime.start)."""
    import multiprocessing

    from tokenspeed_worker.engine import lifetime

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,), daemon=True)
    lifetime.start(proc)
    return proc, parent


def _report_of_a_guarded_child(target):
    """What `target(conn)`, run in a guarded child (_guarded_child), sends back."""
    proc, parent = _guarded_child(target)
    try:
        assert parent.poll(60)
        return parent.recv()
    finally:
        proc.join(10)


def test_a_child_ignores_the_stop_signals_again_if_its_startup_undid_it():
    from tokenspeed_worker.engine import lifetime

    ignored, messages = _report_of_a_guarded_child(_child_whose_library_took_sigterm)
    assert ignored == [True, True]
    assert len(messages) == 1 and messages[0].startswith("SIGTERM was no longer ignored after startup")
    lifetime.still_guarded()  # outside a child: nothing to do, nothing changed
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_IGN


def _native_signal(sig: int, disposition: int) -> None:
    """Set `sig`'s disposition through libc, behind Python's back, as native code (LLVM inside
    Triton, compiling a kernel) does."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    assert libc.signal(sig, disposition) != ctypes.c_void_p(-1).value, ctypes.get_errno()


def _child_whose_native_code_took_sigterm_at_startup(conn) -> None:
    """guard, then native code sets SIGTERM back to its default (Python's table still says
    SIG_IGN), then still_guarded: it must notice from the kernel's view."""
    from tokenspeed_worker.engine import lifetime

    lifetime.guard()
    _native_signal(signal.SIGTERM, 0)  # SIG_DFL
    conn.send((_still_guarded_warnings(), lifetime.kernel_ignored() is not None))


def _child_whose_native_code_took_sigterm_while_serving(conn) -> None:
    """guard and still_guarded, then native code sets SIGTERM back to its default while the child
    serves (a kernel compiled after startup); the signal must still not end it."""
    from tokenspeed_worker.engine import lifetime

    lifetime.guard()
    lifetime.still_guarded()
    _native_signal(signal.SIGTERM, 0)  # SIG_DFL
    _native_signal(signal.SIGINT, 0)
    conn.send("serving")
    conn.recv()  # the test signalled this process meanwhile
    conn.send("still here")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libc's signal() and /proc's masks")
def test_a_stop_signal_cannot_end_a_child_after_native_code_replaced_its_disposition():
    proc, parent = _guarded_child(_child_whose_native_code_took_sigterm_while_serving)
    try:
        assert parent.poll(60) and parent.recv() == "serving"
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert proc.is_alive(), f"the child died of the signal: exit code {proc.exitcode}"
        parent.send("go")
        assert parent.poll(30) and parent.recv() == "still here"
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()

    messages, kernel_view = _report_of_a_guarded_child(_child_whose_native_code_took_sigterm_at_startup)
    if kernel_view:  # where /proc shows the masks (not gVisor)
        assert messages == ["SIGTERM was no longer ignored after startup (native code replaced SIG_IGN): "
                            "ignored again"], messages
