"""Framed messages over a TCP stream between two rbln-ray processes, for the per-step data path.

Why a stream of our own next to Ray: a Ray actor call hands a message between several threads
of both processes, which takes milliseconds, more when calls come rarely (an idle CPU wakes
slowly; BENCHMARKS §10), and a scheduler step crossed three of them. A socket read by the
thread that needs the message costs one wake-up.
Ray still starts, places and watches the processes and introduces the two ends (an address
and a per-connection token, passed in Ray calls); only the per-step bytes take the stream.

A frame is ``kind`` (one byte, the caller's), ``seq`` (the step it belongs to) and a payload.
Both ends block (nothing polls); a closed or broken stream raises :class:`StreamClosed`.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import struct

CONNECT_TIMEOUT_S = 60.0  # the other end was just asked to connect / to accept
_HEADER = struct.Struct("!Bqq")  # kind, seq, payload length


class StreamClosed(ConnectionError):
    """The other end closed the stream, or it broke."""


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
        """The connection whose first bytes are this stream's token (one attempt)."""
        self._sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            conn, _ = self._sock.accept()
        finally:
            self._sock.close()
        conn.settimeout(CONNECT_TIMEOUT_S)
        try:
            token = read_exact(conn, len(self._token))
        except BaseException:
            conn.close()
            raise
        if not secrets.compare_digest(bytes(token), self._token):
            conn.close()
            raise PermissionError("a connection to an rbln-ray stream did not present its token")
        return _ready(conn)


def connect(address: tuple[str, int], token: str) -> socket.socket:
    """Connect to a :class:`Listener` at ``address`` and present ``token``."""
    conn = socket.create_connection(tuple(address), timeout=CONNECT_TIMEOUT_S)
    conn.sendall(token.encode())
    return _ready(conn)


def _ready(conn: socket.socket) -> socket.socket:
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def send_frame(conn: socket.socket, kind: int, seq: int, *parts: bytes | memoryview) -> None:
    """One frame whose payload is ``parts`` concatenated (sent without copying them)."""
    size = sum(memoryview(p).nbytes for p in parts)
    try:
        conn.sendall(_HEADER.pack(kind, seq, size))
        for part in parts:
            conn.sendall(part)
    except OSError as e:
        raise StreamClosed(f"the stream broke while sending ({e})") from e


def recv_frame(conn: socket.socket) -> tuple[int, int, bytearray]:
    """The next frame: ``(kind, seq, payload)``; blocks until it arrives."""
    kind, seq, size = _HEADER.unpack(read_exact(conn, _HEADER.size))
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
