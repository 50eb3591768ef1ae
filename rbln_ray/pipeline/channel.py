"""Hidden states from one pipeline rank to the next: one stream per stage boundary.

Why a stream (:mod:`rbln_ray.common.framing`) and not a Ray call per step: a micro-batch
crosses S - 1 boundaries on every step, and a Ray call carrying a step's hidden states takes
milliseconds from one actor to the other (BENCHMARKS §9, §10); the sending rank's step
loop writing to a socket that the receiving rank's step loop reads costs one wake-up. Ray
still places the ranks and introduces the two ends of each boundary (the executor asks each
rank after the first to listen, the one before it to connect, then the first to accept), and
the bytes go worker to worker, never through the engine.

A stream carries the steps in order, and both ends know which steps carry hidden states (those
with scheduled tokens), so each message is read by the step it belongs to (its step number is
checked). A rank that fails a step sends the failure instead, so the last rank (whose result
the engine waits for) raises at once instead of waiting.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from rbln_ray.common import framing

_TENSOR, _FAILURE = 1, 2
_META = struct.Struct("!16sB")  # dtype name, number of dimensions
_DIM = struct.Struct("!q")


class ChannelError(RuntimeError):
    """The previous rank failed the step, or its stream broke."""


@dataclass(frozen=True)
class StageFailure:
    """What a rank sends instead of hidden states when it fails a step."""

    rank: int
    error: str


class HiddenStream:
    """One end of a boundary's stream: :meth:`send` on rank k, :meth:`receive` on rank k+1."""

    def __init__(self, conn: framing.Stream, peer_rank: int) -> None:
        self._conn = conn
        self._peer = peer_rank

    def send(self, seq: int, hidden: torch.Tensor) -> None:
        data = hidden.detach().contiguous()
        name = str(data.dtype).removeprefix("torch.").encode()
        meta = _META.pack(name, data.dim()) + b"".join(_DIM.pack(d) for d in data.shape)
        raw = data.view(torch.uint8).numpy() if data.numel() else b""
        framing.send_frame(self._conn, _TENSOR, seq, meta, raw)

    def send_failure(self, seq: int, failure: StageFailure) -> None:
        framing.send_frame(self._conn, _FAILURE, seq, f"{failure.rank}\n{failure.error}".encode())

    def receive(self, seq: int) -> torch.Tensor:
        """Block until the previous rank's hidden states of step ``seq`` arrive."""
        try:
            kind, got, payload = framing.recv_frame(self._conn, (_TENSOR, _FAILURE))
        except framing.StreamClosed as e:
            raise ChannelError(
                f"the stream from pipeline rank {self._peer} broke while step {seq} waited for "
                f"its hidden states ({e}): that rank stopped or died"
            ) from e
        if got != seq:
            raise ChannelError(
                f"step {seq} received pipeline rank {self._peer}'s hidden states of step {got}: "
                "the ranks disagree on which steps carry tokens"
            )
        if kind == _FAILURE:
            rank, _, error = payload.decode().partition("\n")
            raise ChannelError(f"pipeline rank {rank} failed step {seq}: {error}")
        name, ndim = _META.unpack_from(payload)
        dims = [_DIM.unpack_from(payload, _META.size + i * _DIM.size)[0] for i in range(ndim)]
        start = _META.size + ndim * _DIM.size
        dtype = getattr(torch, name.rstrip(b"\0").decode())
        return torch.frombuffer(memoryview(payload)[start:], dtype=dtype).reshape(dims)

    def close(self) -> None:
        framing.close(self._conn)
