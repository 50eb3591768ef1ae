"""Framed messages over a TCP stream between two rbln-ray processes, for the per-step data path.

Why a stream of our own next to Ray: a Ray actor call hands a message between several threads
of both processes, which takes milliseconds, more when calls come rarely (an idle CPU wakes
slowly; BENCHMARKS §10), and a scheduler step crossed three of them. A socket read by the
thread that needs the message costs one wake-up.
Ray still starts, places and watches the processes and introduces the two ends (an address
and a per-connection token, passed in Ray calls); only the per-step bytes take the stream.

A frame is ``kind`` (one byte, the caller's), ``seq`` (the step it belongs to) and a payload.
Both ends block (nothing polls); a closed or broken stream raises :class:`StreamClosed`, and so
does a peer that stops answering (TCP keepalive: a partitioned or frozen host is noticed within
about :data:`KEEPALIVE_DEAD_S`, not never). A frame of a kind the reader does not expect, or
larger than :data:`MAX_FRAME_BYTES`, is refused before its payload is read (:class:`FrameError`).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import selectors
import socket
import struct
import time
from collections.abc import Collection

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 60.0  # the other end was just asked to connect / to accept
# A step's scheduler output is kilobytes; a pipeline boundary's hidden states at most
# batch x prefill chunk x hidden x 4 bytes (tens of MiB for the largest models).
MAX_FRAME_BYTES = 1 << 30
# TCP keepalive: probe an idle stream after KEEPALIVE_IDLE_S, then every KEEPALIVE_INTERVAL_S;
# KEEPALIVE_PROBES unanswered probes break it.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
KEEPALIVE_DEAD_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES
_HEADER = struct.Struct("!Bqq")  # kind, seq, payload length


class StreamClosed(ConnectionError):
    """The other end closed the stream, or it broke (or stopped answering keepalives)."""


class FrameError(StreamClosed):
    """A frame the reader cannot accept (unexpected kind, impossible size): the stream is not
    one of ours, or it is out of step; it is closed, like a broken one."""


def new_token() -> str:
    """The secret both ends of one stream present (handed to them over Ray)."""
    return secrets.token_hex(16)


class Listener:
    """One stream's listening end, until the other end has connected (:meth:`accept`)."""

    def __init__(self, host: str, token: str) -> None:
        self._token = token.encode()
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])

    def accept(self) -> socket.socket:
        """The first connection whose first bytes are this stream's token, within
        :data:`CONNECT_TIMEOUT_S`. A connection that presents something else (a port scan, a
        stranger who connected first) is closed and the wait goes on."""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no connection presented this stream's token within {CONNECT_TIMEOUT_S} s"
                    )
                self._sock.settimeout(left)
                conn, peer = self._sock.accept()
                conn.settimeout(min(left, 5.0))  # the token is the first thing a peer sends
                try:
                    token = read_exact(conn, len(self._token))
                except (StreamClosed, OSError):
                    token = b""
                if secrets.compare_digest(bytes(token), self._token):
                    return _ready(conn)
                conn.close()
                logger.warning("refused a connection from %s: it did not present the token", peer)
        finally:
            self._sock.close()


def connect(address: tuple[str, int], token: str) -> socket.socket:
    """Connect to a :class:`Listener` at ``address`` and present ``token``."""
    conn = socket.create_connection(tuple(address), timeout=CONNECT_TIMEOUT_S)
    conn.sendall(token.encode())
    return _ready(conn)


def _ready(conn: socket.socket) -> socket.socket:
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    return conn


def wait_readable(conn: socket.socket, timeout: float) -> bool:
    """Whether ``conn`` has data (or closed) within ``timeout`` seconds (``selectors``: any
    descriptor number, unlike ``select.select``'s 1024 limit)."""
    with selectors.DefaultSelector() as selector:
        selector.register(conn, selectors.EVENT_READ)
        return bool(selector.select(max(0.0, timeout)))


def send_frame(conn: socket.socket, kind: int, seq: int, *parts: bytes | memoryview) -> None:
    """One frame whose payload is ``parts`` concatenated (sent without copying them)."""
    size = sum(memoryview(p).nbytes for p in parts)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes (at most {MAX_FRAME_BYTES}), step {seq}")
    try:
        conn.sendall(_HEADER.pack(kind, seq, size))
        for part in parts:
            conn.sendall(part)
    except OSError as e:
        raise StreamClosed(f"the stream broke while sending ({e})") from e


def recv_frame(
    conn: socket.socket, kinds: Collection[int] | None = None
) -> tuple[int, int, bytearray]:
    """The next frame: ``(kind, seq, payload)``; blocks until it arrives. ``kinds``: the
    kinds the caller accepts (others raise :class:`FrameError`, payload unread)."""
    kind, seq, size = _HEADER.unpack(read_exact(conn, _HEADER.size))
    if kinds is not None and kind not in kinds:
        raise FrameError(f"frame of kind {kind} (expected one of {sorted(kinds)}), step {seq}")
    if not 0 <= size <= MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes (at most {MAX_FRAME_BYTES}), step {seq}")
    return kind, seq, read_exact(conn, size)


def read_exact(conn: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        try:
            n = conn.recv_into(view[got:])
        except OSError as e:
            raise StreamClosed(f"the stream broke ({e})") from e
        if n == 0:
            raise StreamClosed("the other end closed the stream")
        got += n
    return buf


def close(conn: socket.socket | None) -> None:
    """Close a stream; a thread blocked reading it wakes with :class:`StreamClosed`."""
    if conn is None:
        return
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    conn.close()
