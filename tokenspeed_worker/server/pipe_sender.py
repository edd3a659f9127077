"""The server's side of one engine process's pipe: `PipeSender` sends from the caller's thread when the
pipe has room, by a writer thread when it has not; `PipeReader` receives on the event loop.

Both speak `multiprocessing.connection.Connection`'s framing (the engine's side is a plain
Connection): a 4-byte big-endian length (-1 and an 8-byte length past 2 GiB), then the pickle.

Sending: the event loop must never block on the pipe (a long prompt can fill the socket buffer while
the engine is inside a step), and handing every message to a thread costs the server a GIL hand-off
and a wake-up per request. So a frame is first offered to the socket without waiting (MSG_DONTWAIT);
what does not fit (the rest of a frame the socket took part of, and every frame after it until that
backlog is written) goes to the writer thread, which writes it in order, waiting for room with poll.

Receiving: a reader thread would hand each frame to the loop through a GIL hand-off and a wake-up of
the loop (`call_soon_threadsafe`), and while the loop is busy (many streams) the thread waits for the
GIL before every read. `PipeReader` reads on the loop whenever the socket is readable (`add_reader`) and delivers every
whole frame that has arrived, in order, in that one callback.

multiprocessing has no non-blocking send or receive, hence these two small classes. Every read and
write here is non-blocking by its flag (MSG_DONTWAIT): the descriptor's own mode is not ours to rely
on, since libuv (uvloop) makes a descriptor it watches non-blocking, and the copies share the mode.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import select
import socket
import struct
import threading
from multiprocessing.reduction import ForkingPickler

logger = logging.getLogger(__name__)


def frame(msg) -> bytes:
    """`msg` framed exactly as `Connection.send` frames it."""
    payload = ForkingPickler.dumps(msg)
    n = len(payload)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return header + payload


class PipeSender:
    """Sends to the peer of `conn` (a duplex `multiprocessing.Pipe` end: a Unix socket) in call order.

    `send` is thread-safe and never waits for the peer to read."""

    def __init__(self, conn, name: str) -> None:
        # A second handle on the same socket; each send is non-blocking by its flag alone.
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._lock = threading.Lock()
        self._backlog = 0  # frames (or rests of frames) handed to the writer and not fully written
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        """Queue `msg` for the engine behind everything sent before it. A peer that is gone is not
        an error here (the reader sees it and fails the requests)."""
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
                self._send_all(data)
            except OSError:  # the peer is gone: drop the rest
                with self._lock:
                    self._closed = True
                break
            with self._lock:
                self._backlog -= 1
        self._sock.close()

    def _send_all(self, data: bytes) -> None:
        """Write all of `data`, waiting for room with poll: the descriptor may be non-blocking (libuv
        makes a descriptor it watches non-blocking, and the reader's copy shares this one's flags), so
        a plain sendall could fail with EAGAIN instead of waiting."""
        view = memoryview(data)
        poller = None
        while view:
            try:
                view = view[self._sock.send(view, socket.MSG_DONTWAIT):]
            except (BlockingIOError, InterruptedError):
                if poller is None:
                    poller = select.poll()
                    poller.register(self._sock.fileno(), select.POLLOUT)
                poller.poll()

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


class PipeReader:
    """Receives the peer of `conn`'s frames on `loop`: `on_message(msg)` for each, in order, and
    `on_closed()` once when the peer is gone (end of stream or a socket error). Never blocks the
    loop: it reads what has arrived and keeps a partial frame until the rest comes."""

    _CHUNK = 1 << 20

    def __init__(self, conn, loop, on_message, on_closed) -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._loop = loop
        self._on_message = on_message
        self._on_closed = on_closed
        self._buf = bytearray()
        self._open = True
        loop.add_reader(self._sock.fileno(), self._readable)

    def _readable(self) -> None:
        closed = False
        while True:
            try:
                chunk = self._sock.recv(self._CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                closed = True
                break
            self._buf += chunk
            if len(chunk) < self._CHUNK:
                break
        buf, pos = self._buf, 0
        try:
            while len(buf) - pos >= 4:
                (n,), header = struct.unpack_from("!i", buf, pos), 4
                if n == -1:
                    if len(buf) - pos < 12:
                        break
                    (n,), header = struct.unpack_from("!Q", buf, pos + 4), 12
                if len(buf) - pos - header < n:
                    break
                start = pos + header
                pos = start + n
                try:  # one message's failure is logged, as the loop logs a failed callback; the rest go on
                    self._on_message(pickle.loads(buf[start:pos]))
                except Exception:
                    logger.exception("handling an engine message failed")
        finally:
            del buf[:pos]
        if closed:
            self.close()
            self._on_closed()

    def close(self) -> None:
        """Stop reading (idempotent); the connection itself stays open."""
        if self._open:
            self._open = False
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
