"""server/pipe_sender.PipeSender: what the server sends an engine arrives whole and in order, the
sender never waits for the engine to read, and the pipe end stays a normal blocking Connection.
PipeReader: what an engine sends arrives on the event loop whole and in order (frames split over
reads, bursts, frames past 1 MiB), a failing message does not stop the rest, the peer's end is
reported once, and the loop never waits for a partial frame."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest

from tokenspeed_worker.engine.messages import AbortRequests, AddRequest, Shutdown
from tokenspeed_worker.sampling.params import SamplingParams
from tokenspeed_worker.server.pipe_sender import PipeReader, PipeSender, frame


@pytest.fixture
def pipe():
    ours, theirs = mp.get_context("spawn").Pipe(duplex=True)
    yield ours, theirs
    ours.close()
    theirs.close()


def sends_without_waiting(sender: PipeSender, msgs) -> None:
    """All of `msgs` sent while nobody reads: returns only if no send waited for the reader."""
    done = threading.Event()

    def go():
        for m in msgs:
            sender.send(m)
        done.set()

    threading.Thread(target=go, daemon=True).start()
    assert done.wait(30), "a send waited for the reader"


def test_a_backlog_past_the_socket_buffer_arrives_whole_and_in_order(pipe):
    ours, theirs = pipe
    sender = PipeSender(ours, "test-writer")
    rng = np.random.default_rng(0)
    # Prompts from one token to 300k (1.2 MB, past any socket buffer), as AddRequests.
    msgs = [AddRequest(i, rng.integers(0, 32000, size=int(rng.choice([1, 100, 5000, 300_000])), dtype=np.int32),
                       16, SamplingParams(seed=i)) for i in range(120)]
    sends_without_waiting(sender, msgs)
    assert sender.backlog > 0  # nobody read: the writer thread holds the rest
    got = [theirs.recv() for _ in msgs]
    assert [m.req_id for m in got] == list(range(120))
    assert all(np.array_equal(a.prompt_ids, b.prompt_ids) and a.sampling_params == b.sampling_params
               for a, b in zip(msgs, got))
    deadline = time.monotonic() + 10
    while sender.backlog and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.backlog == 0
    sender.send(AbortRequests([7]))  # with the backlog written, straight to the socket again
    assert sender.backlog == 0
    assert theirs.recv() == AbortRequests([7])
    sender.close()


def test_senders_on_several_threads_never_interleave_frames(pipe):
    ours, theirs = pipe
    sender = PipeSender(ours, "test-writer")
    per_thread = 200

    def go(k):
        for i in range(per_thread):
            sender.send((k, i, np.full(1 + (i * 977) % 20000, k, dtype=np.int32)))

    threads = [threading.Thread(target=go, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    seen = {k: [] for k in range(4)}
    for _ in range(4 * per_thread):
        k, i, arr = theirs.recv()
        assert arr.shape == (1 + (i * 977) % 20000,) and (arr == k).all()
        seen[k].append(i)
    for t in threads:
        t.join()
    assert all(seen[k] == list(range(per_thread)) for k in range(4))  # each thread's order kept
    sender.close()


def test_the_connection_stays_blocking_and_duplex(pipe):
    ours, theirs = pipe
    sender = PipeSender(ours, "test-writer")
    assert os.get_blocking(ours.fileno())
    sender.send(Shutdown())
    assert theirs.recv() == Shutdown()
    theirs.send("reply")
    assert ours.recv() == "reply"  # the reader thread's side
    sender.close()
    assert os.get_blocking(ours.fileno())
    ours.send("after close")  # the connection itself is still open
    assert theirs.recv() == "after close"


def test_a_peer_that_is_gone_is_not_an_error_and_later_sends_are_dropped(pipe):
    ours, theirs = pipe
    sender = PipeSender(ours, "test-writer")
    theirs.close()
    sends_without_waiting(sender, [np.zeros(100_000, np.int32)] * 20)  # no raise, no hang
    sender.close()
    sender.send("dropped")


def _read_on_loop(ours, until, timeout=30.0, on_message=None):
    """Run a PipeReader on a fresh loop until `until(got, closed)`; returns (messages, closed count)."""
    got, closed = [], []

    async def main():
        loop = asyncio.get_running_loop()
        reader = PipeReader(ours, loop, on_message or got.append, lambda: closed.append(1))
        deadline = time.monotonic() + timeout
        while not until(got, closed) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        reader.close()
        reader.close()  # idempotent

    asyncio.run(main())
    return got, len(closed)


def test_reader_delivers_bursts_split_frames_and_large_frames_in_order(pipe):
    ours, theirs = pipe
    rng = np.random.default_rng(1)
    msgs = [AddRequest(i, rng.integers(0, 32000, size=int(rng.choice([1, 100, 400_000])), dtype=np.int32),
                       8, SamplingParams()) for i in range(40)]

    def engine():  # as an engine sends: whole frames, a burst, and one frame dribbled a few bytes at a time
        for m in msgs[:30]:
            theirs.send(m)
        data = frame(msgs[30])
        for i in range(0, len(data), 7):
            os.write(theirs.fileno(), data[i:i + 7])
            if i < 70:
                time.sleep(0.01)
        for m in msgs[31:]:
            theirs.send(m)

    t = threading.Thread(target=engine, daemon=True)
    t.start()
    got, closed = _read_on_loop(ours, lambda g, c: len(g) == len(msgs))
    t.join(10)
    assert closed == 0
    assert [m.req_id for m in got] == list(range(40))
    for a, b in zip(got, msgs):
        np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    assert ours.poll(0) is False  # nothing left behind; the connection still works for a plain recv
    theirs.send("after")
    assert ours.recv() == "after"


def test_reader_survives_a_failing_message_and_reports_the_peer_gone_once(pipe, caplog):
    ours, theirs = pipe
    seen = []

    def on_message(msg):
        if msg == "bad":
            raise ValueError("boom")
        seen.append(msg)

    for m in ("a", "bad", "b"):
        theirs.send(m)
    theirs.close()
    _, closed = _read_on_loop(ours, lambda g, c: bool(c), on_message=on_message)
    assert seen == ["a", "b"]
    assert closed == 1
    assert "handling an engine message failed" in caplog.text


@pytest.mark.timeout(90)
def test_sender_backlog_arrives_when_uvloop_watches_the_pipe(pipe):
    """uvloop (the worker's loop) makes a descriptor it watches non-blocking, and the sender's copy
    shares that mode: the writer thread must still wait for room, not drop the backlog (a served
    burst of 256 streams' requests hung the worker so)."""
    uvloop = pytest.importorskip("uvloop")
    ours, theirs = pipe
    msgs = [AddRequest(i, np.full(200_000, i, dtype=np.int32), 8, SamplingParams()) for i in range(12)]  # 9.6 MB
    got = []

    async def main():
        loop = asyncio.get_running_loop()
        reader = PipeReader(ours, loop, lambda m: None, lambda: None)
        assert os.get_blocking(ours.fileno()) is False  # what libuv did to the shared descriptor
        sender = PipeSender(ours, "test-writer")
        for m in msgs:
            sender.send(m)  # far past the socket buffer: most of it goes to the writer thread
        for _ in msgs:  # the engine reads slowly, off the loop; a dropped backlog never arrives
            msg = await loop.run_in_executor(None, lambda: theirs.recv() if theirs.poll(20) else None)
            if msg is None:
                break
            got.append(msg)
        reader.close()
        sender.close()

    uvloop.run(main())
    assert [m.req_id for m in got] == list(range(12))
    assert all((m.prompt_ids == m.req_id).all() for m in got)
