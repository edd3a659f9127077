"""server/pipe_sender.PipeSender: what the server sends an engine arrives whole and in order, the
sender never waits for the engine to read, and the pipe end stays a normal blocking Connection."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest

from tokenspeed_worker.engine.messages import AbortRequests, AddRequest, Shutdown
from tokenspeed_worker.sampling.params import SamplingParams
from tokenspeed_worker.server.pipe_sender import PipeSender


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
