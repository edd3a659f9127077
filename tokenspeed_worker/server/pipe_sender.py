"""The server's messages to one engine process: sent from the caller's thread when the pipe has room,
by a writer thread when it has not.

The engine reads them with `multiprocessing.connection.Connection.recv`: each a frame of a 4-byte
big-endian length (-1 and an 8-byte length past 2 GiB) and the pickle. The event loop must never
block on the pipe (a long prompt can fill the socket buffer while the engine is inside a step), and
handing every message to a thread costs the server a GIL hand-off and a wake-up per request. So a
frame is first offered to the socket without waiting (MSG_DONTWAIT); what does not fit (the rest of
a frame the socket took part of, and every frame after it until that backlog is written) goes to
the writer thread, which sends it blocking, in order. multiprocessing has no non-blocking send, and
asyncio's pipe transports would make the descriptor non-blocking for the reader thread too: hence
this small class.
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import threading
from multiprocessing.reduction import ForkingPickler


def frame(msg) -> bytes:
    """`msg` framed exactly as `Connection.send` frames it."""
    payload = ForkingPickler.dumps(msg)
    n = len(payload)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return header + payload


class PipeSender:
    """Sends to the peer of `conn` (a duplex `multiprocessing.Pipe` end: a Unix socket) in call order.

    `send` is thread-safe and never waits for the peer to read. The connection stays usable for
    receiving (the reader thread's `recv`); its descriptor stays blocking."""

    def __init__(self, conn, name: str) -> None:
        # A second handle on the same socket: its blocking mode is the connection's (left as is);
        # each direct send is non-blocking by its flag alone.
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._lock = threading.Lock()
        self._backlog = 0  # frames (or rests of frames) handed to the writer and not fully written
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        """Queue `msg` for the engine behind everything sent before it. A peer that is gone is not
        an error here (the reader thread sees it and fails the requests)."""
        data = frame(msg)
        with self._lock:
            if self._closed:
                return
            if self._backlog == 0:  # nothing of an earlier frame is still waiting: write now
                try:
                    sent = self._sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    return
                if sent == len(data):
                    return
                data = data[sent:]
            self._backlog += 1
            self._queue.put(data)

    def _write(self) -> None:
        while True:
            data = self._queue.get()
            if data is None:
                break
            try:
                self._sock.sendall(data)
            except OSError:  # the peer is gone: drop the rest
                with self._lock:
                    self._closed = True
                break
            with self._lock:
                self._backlog -= 1
        self._sock.close()

    def close(self) -> None:
        """Stop after what is queued is written (or the peer is gone); later sends are dropped. The
        connection itself stays open."""
        with self._lock:
            self._closed = True
        self._queue.put(None)

    @property
    def backlog(self) -> int:
        """Frames waiting for the writer thread (0: every send so far went straight to the socket or
        has been written)."""
        return self._backlog
