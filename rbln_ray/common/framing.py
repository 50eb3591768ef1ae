"""Framed messages over a TCP stream between two rbln-ray processes, for the per-step data path.

Why a stream of our own next to Ray: a Ray actor call hands a message between several threads
of both processes, which takes milliseconds, more when calls come rarely (an idle CPU wakes
slowly; BENCHMARKS §10), and a scheduler step crossed three of them. A socket read by the
thread that needs the message costs one wake-up.
Ray still starts, places and watches the processes and introduces the two ends (an address
and a per-connection token, passed in Ray calls); only the per-step bytes take the stream.

A frame is ``kind`` (one byte, the caller's), ``seq`` (the step it belongs to), a payload and
a tag. Both ends block (nothing polls); a closed or broken stream raises
:class:`StreamClosed`, and so does a peer that stops answering (TCP keepalive: a partitioned
or frozen host is noticed within about :data:`KEEPALIVE_DEAD_S`, not never). A frame of a
kind the reader does not expect, or larger than :data:`MAX_FRAME_BYTES`, is refused before
its payload is read (:class:`FrameError`).

Why every frame is authenticated: payloads are pickles (a step's scheduler output, a stage's
hidden states), and unpickling runs code, so a byte on this stream that its peer did not
write must never reach ``pickle.loads``. The token itself never crosses the wire: the
connecting end sends a fresh nonce and an HMAC of it under the token (:func:`connect`); both
ends derive one key per direction from the token and the nonce; every frame carries an
HMAC-SHA256 tag over its direction's frame counter, header and payload
(:data:`TAG_BYTES`), checked before the payload is handed on. A forged, altered, replayed or
reordered frame is a :class:`FrameError`, and the stream is closed.

Why the listener greets each connection on a thread of its own, from the moment it listens:
a connection that says nothing (a port scan, a stranger) waits out its own
:data:`HANDSHAKE_TIMEOUT_S` without holding up the peer's, so a dozen silent connections
delay nobody's start.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import queue
import secrets
import selectors
import socket
import struct
import threading
from collections.abc import Collection

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 60.0  # the other end was just asked to connect / to accept
HANDSHAKE_TIMEOUT_S = 5.0  # one connection's greeting must arrive within this
# A step's scheduler output is kilobytes; a pipeline boundary's hidden states at most
# batch x prefill chunk x hidden x 4 bytes (tens of MiB for the largest models).
MAX_FRAME_BYTES = 1 << 30
# TCP keepalive: probe an idle stream after KEEPALIVE_IDLE_S, then every KEEPALIVE_INTERVAL_S;
# KEEPALIVE_PROBES unanswered probes break it.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
KEEPALIVE_DEAD_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES
_HEADER = struct.Struct("!Bqq")  # kind, seq, payload length
HELLO = b"rbln-ray-stream-1"  # the greeting's first bytes (a protocol version)
NONCE_BYTES = 16
TAG_BYTES = 16  # HMAC-SHA256, truncated
_GREETING_BYTES = len(HELLO) + NONCE_BYTES + hashlib.sha256().digest_size


class StreamClosed(ConnectionError):
    """The other end closed the stream, or it broke (or stopped answering keepalives)."""


class FrameError(StreamClosed):
    """A frame the reader cannot accept (unexpected kind, impossible size, a tag that does not
    authenticate it): the stream is not one of ours, or it is out of step or tampered with;
    it is closed, like a broken one."""


def new_token() -> str:
    """The secret both ends of one stream know (handed to them over Ray; never sent on the
    stream itself)."""
    return secrets.token_hex(16)


def _mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


class Stream:
    """One authenticated stream: its socket, and per direction a key and a frame counter
    (what :func:`send_frame` and :func:`recv_frame` need besides the bytes)."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = self._received = 0
        self._send_lock = threading.Lock()

    @classmethod
    def from_nonce(cls, sock: socket.socket, token: str, nonce: bytes, connector: bool) -> Stream:
        """The stream of one greeting: keys derived from the token and the connector's nonce
        (one per direction, so a frame cannot be reflected back to its sender)."""
        key = token.encode()
        to_listener, to_connector = _mac(key, b"to-listener", nonce), _mac(key, b"to-connector",
                                                                           nonce)  # fmt: skip
        if connector:
            return cls(sock, to_listener, to_connector)
        return cls(sock, to_connector, to_listener)

    def fileno(self) -> int:
        return self.sock.fileno()


class Listener:
    """One stream's listening end. It greets connections from the moment it exists (each on
    a thread of its own, module docstring); :meth:`accept` returns the first that proves it
    knows the token."""

    def __init__(self, host: str, token: str) -> None:
        self._token = token
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])
        self._winner: queue.Queue[Stream] = queue.Queue(maxsize=1)
        self._done = threading.Event()
        threading.Thread(target=self._accept_loop, name="rbln-stream-accept", daemon=True).start()

    def accept(self) -> Stream:
        """The first connection that greeted with this stream's token, within
        :data:`CONNECT_TIMEOUT_S`. Connections that present something else are closed."""
        try:
            return self._winner.get(timeout=CONNECT_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(
                f"no connection presented this stream's token within {CONNECT_TIMEOUT_S} s"
            ) from None
        finally:
            self._done.set()
            self._sock.close()

    def _accept_loop(self) -> None:
        while not self._done.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed by accept()
            threading.Thread(target=self._greet, args=(conn, peer), daemon=True).start()

    def _greet(self, conn: socket.socket, peer: tuple) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            greeting = bytes(read_exact(conn, _GREETING_BYTES))
        except (StreamClosed, OSError):
            greeting = b""
        hello, nonce = greeting[: len(HELLO)], greeting[len(HELLO) : len(HELLO) + NONCE_BYTES]
        proof = greeting[len(HELLO) + NONCE_BYTES :]
        expected = _mac(self._token.encode(), HELLO, nonce)
        if hello == HELLO and hmac.compare_digest(proof, expected) and not self._done.is_set():
            with contextlib.suppress(queue.Full):  # a second proof of one token: ignored
                self._winner.put_nowait(Stream.from_nonce(_ready(conn), self._token, nonce,
                                                          connector=False))  # fmt: skip
                return
        conn.close()
        logger.warning("refused a connection from %s: it did not prove it knows the token", peer)


def connect(address: tuple[str, int], token: str) -> Stream:
    """Connect to a :class:`Listener` at ``address`` and greet it with ``token``'s proof."""
    conn = socket.create_connection(tuple(address), timeout=CONNECT_TIMEOUT_S)
    nonce = secrets.token_bytes(NONCE_BYTES)
    conn.sendall(HELLO + nonce + _mac(token.encode(), HELLO, nonce))
    return Stream.from_nonce(_ready(conn), token, nonce, connector=True)


def _ready(conn: socket.socket) -> socket.socket:
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    return conn


def wait_readable(stream: Stream, timeout: float) -> bool:
    """Whether ``stream`` has data (or closed) within ``timeout`` seconds (``selectors``: any
    descriptor number, unlike ``select.select``'s 1024 limit)."""
    with selectors.DefaultSelector() as selector:
        selector.register(stream.sock, selectors.EVENT_READ)
        return bool(selector.select(max(0.0, timeout)))


def send_frame(stream: Stream, kind: int, seq: int, *parts: bytes | memoryview) -> None:
    """One frame whose payload is ``parts`` concatenated (sent without copying them), then
    its tag."""
    size = sum(memoryview(p).nbytes for p in parts)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes (at most {MAX_FRAME_BYTES}), step {seq}")
    header = _HEADER.pack(kind, seq, size)
    with stream._send_lock:
        counter = stream._sent.to_bytes(8, "big")
        tag = _mac(stream._send_key, counter, header, *parts)[:TAG_BYTES]
        try:
            stream.sock.sendall(header)
            for part in parts:
                stream.sock.sendall(part)
            stream.sock.sendall(tag)
        except OSError as e:
            raise StreamClosed(f"the stream broke while sending ({e})") from e
        stream._sent += 1


def recv_frame(stream: Stream, kinds: Collection[int] | None = None) -> tuple[int, int, bytearray]:
    """The next frame: ``(kind, seq, payload)``; blocks until it arrives. ``kinds``: the
    kinds the caller accepts (others raise :class:`FrameError`, payload unread). A frame
    whose tag does not authenticate it raises :class:`FrameError`."""
    header = read_exact(stream.sock, _HEADER.size)
    kind, seq, size = _HEADER.unpack(header)
    if kinds is not None and kind not in kinds:
        raise FrameError(f"frame of kind {kind} (expected one of {sorted(kinds)}), step {seq}")
    if not 0 <= size <= MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes (at most {MAX_FRAME_BYTES}), step {seq}")
    payload = read_exact(stream.sock, size)
    tag = read_exact(stream.sock, TAG_BYTES)
    counter = stream._received.to_bytes(8, "big")
    if not hmac.compare_digest(bytes(tag), _mac(stream._recv_key, counter, header,
                                                payload)[:TAG_BYTES]):  # fmt: skip
        raise FrameError(f"frame {stream._received} (step {seq}) failed authentication")
    stream._received += 1
    return kind, seq, payload


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


def close(stream: Stream | None) -> None:
    """Close a stream; a thread blocked reading it wakes with :class:`StreamClosed`."""
    if stream is None:
        return
    with contextlib.suppress(OSError):
        stream.sock.shutdown(socket.SHUT_RDWR)
    stream.sock.close()
