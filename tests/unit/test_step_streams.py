"""The per-step data path of the Ray executor, in process: framed streams with a token, a
worker's step loop (order, results held past the next device call, failures), and the
pipeline's hidden-state streams. The same code runs between Ray actors in the executor and
pipeline tests; here each behaviour is pinned down on loopback sockets."""

from __future__ import annotations

import pickle
import select
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch

from rbln_ray.common import framing
from rbln_ray.pipeline.channel import ChannelError, HiddenStream, StageFailure
from rbln_ray.vllm_plugin.step_loop import ERROR, RESULT, STEP, Deferred, StepLoop

WAIT_S = 10.0  # bound on every wait below (a hang fails the test instead of blocking it)


def stream_pair() -> tuple:
    """Two connected ends of one framed stream on loopback (engine end, worker end)."""
    token = framing.new_token()
    listener = framing.Listener("127.0.0.1", token)
    engine = framing.connect(listener.address, token)
    return engine, listener.accept()


def test_frames_cross_in_order_and_a_close_wakes_the_reader() -> None:
    a, b = stream_pair()
    framing.send_frame(a, 7, 0, b"hello")
    framing.send_frame(a, 8, 1, b"wor", memoryview(b"ld"), b"")
    assert framing.recv_frame(b) == (7, 0, bytearray(b"hello"))
    assert framing.recv_frame(b) == (8, 1, bytearray(b"world"))

    woke: Future = Future()

    def read() -> None:
        try:
            framing.recv_frame(b)
        except framing.StreamClosed as e:
            woke.set_result(e)

    reader = threading.Thread(target=read)
    reader.start()
    framing.close(b)  # another thread closes the stream under the blocked reader
    assert isinstance(woke.result(WAIT_S), framing.StreamClosed)
    reader.join(WAIT_S)
    framing.close(a)


def test_a_stranger_connecting_first_is_refused_and_the_peer_still_gets_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection without the token's proof (a port scan, a stranger who connected first)
    is closed and the listener goes on waiting for its peer; with none, it gives up in time."""
    token = framing.new_token()
    listener = framing.Listener("127.0.0.1", token)
    intruder = framing.connect(listener.address, framing.new_token())
    silent = socket.create_connection(listener.address)  # connects, never sends a greeting
    silent.close()
    peer_box: list[framing.Stream] = []
    joiner = threading.Thread(
        target=lambda: peer_box.append(framing.connect(listener.address, token))
    )
    joiner.start()
    conn = listener.accept()
    joiner.join()
    framing.send_frame(peer_box[0], 7, 1, b"hello")
    assert framing.recv_frame(conn, (7,)) == (7, 1, bytearray(b"hello"))
    with pytest.raises(framing.StreamClosed):  # the stranger was hung up on
        framing.recv_frame(intruder)
    for c in (conn, peer_box[0], intruder):
        framing.close(c)
    monkeypatch.setattr(framing, "CONNECT_TIMEOUT_S", 0.3)
    lonely = framing.Listener("127.0.0.1", token)
    with pytest.raises((TimeoutError, OSError)):
        lonely.accept()


def test_silent_connections_do_not_delay_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dozen connections that never greet are each given their own handshake deadline:
    the peer behind them is accepted without waiting for theirs (each would hold it for
    HANDSHAKE_TIMEOUT_S if they were greeted one at a time; here that is an hour)."""
    monkeypatch.setattr(framing, "HANDSHAKE_TIMEOUT_S", 3600.0)
    monkeypatch.setattr(framing, "CONNECT_TIMEOUT_S", WAIT_S)
    token = framing.new_token()
    listener = framing.Listener("127.0.0.1", token)
    silent = [socket.create_connection(listener.address) for _ in range(12)]
    peer = framing.connect(listener.address, token)
    conn = listener.accept()  # would raise TimeoutError after WAIT_S if held up
    framing.send_frame(peer, 1, 0, b"up")
    assert framing.recv_frame(conn, (1,)) == (1, 0, bytearray(b"up"))
    for s in silent:
        s.close()
    framing.close(conn)
    framing.close(peer)


def wire_bytes(sender: framing.Stream, kind: int, seq: int, payload: bytes) -> bytearray:
    """The bytes ``sender``'s next frame puts on the wire, captured on a socketpair instead
    (the sender's keys and counter; the sender itself is left as it was)."""
    a, b = socket.socketpair()
    twin = framing.Stream(a, sender._send_key, sender._recv_key)
    twin._sent = sender._sent
    framing.send_frame(twin, kind, seq, payload)
    wire = bytearray(b.recv(1 << 16))
    a.close()
    b.close()
    return wire


def test_the_token_never_crosses_the_wire_and_frames_are_authenticated() -> None:
    """The greeting proves the token without sending it; a frame replayed (its counter is
    past) or altered in flight fails authentication and is never handed on."""
    token = framing.new_token()
    listener = framing.Listener("127.0.0.1", token)
    raw = socket.create_connection(listener.address)
    nonce = b"n" * framing.NONCE_BYTES
    greeting = framing.HELLO + nonce + framing._mac(token.encode(), framing.HELLO, nonce)
    assert token.encode() not in greeting
    raw.sendall(greeting)
    receiver = listener.accept()
    sender = framing.Stream.from_nonce(raw, token, nonce, connector=True)

    first = wire_bytes(sender, 3, 0, b"pickle-bytes")
    raw.sendall(first)
    assert framing.recv_frame(receiver, (3,)) == (3, 0, bytearray(b"pickle-bytes"))
    raw.sendall(first)  # the same frame again: a replay
    with pytest.raises(framing.FrameError, match="failed authentication"):
        framing.recv_frame(receiver, (3,))
    framing.close(receiver)
    framing.close(sender)

    listener = framing.Listener("127.0.0.1", token)
    sender = framing.connect(listener.address, token)
    receiver = listener.accept()
    wire = wire_bytes(sender, 3, 0, b"pickle-bytes")
    wire[framing._HEADER.size] ^= 1  # one payload bit flipped in flight
    sender.sock.sendall(wire)
    with pytest.raises(framing.FrameError, match="failed authentication"):
        framing.recv_frame(receiver, (3,))
    framing.close(receiver)
    framing.close(sender)


def socket_pair() -> tuple[framing.Stream, framing.Stream]:
    """Two ends of one stream over a socketpair (keys as a greeting would give them)."""
    a, b = socket.socketpair()
    token, nonce = framing.new_token(), b"x" * framing.NONCE_BYTES
    return (framing.Stream.from_nonce(a, token, nonce, connector=True),
            framing.Stream.from_nonce(b, token, nonce, connector=False))  # fmt: skip


def test_frames_of_unexpected_kind_or_size_are_refused_unread() -> None:
    a, b = socket_pair()
    framing.send_frame(a, 9, 0, b"x")
    with pytest.raises(framing.FrameError, match="kind 9"):
        framing.recv_frame(b, (1, 2))
    framing.close(a)
    framing.close(b)  # a refused frame leaves the stream out of step: it is closed, never reused
    a, b = socket_pair()
    a.sock.sendall(framing._HEADER.pack(1, 0, framing.MAX_FRAME_BYTES + 1))
    with pytest.raises(framing.FrameError, match="bytes"):
        framing.recv_frame(b, (1,))
    assert framing.wait_readable(b, 0) is False
    framing.send_frame(a, 1, 3, b"ok")
    assert framing.wait_readable(b, 1.0) and framing.recv_frame(b, (1,))[1] == 3
    framing.close(a)
    framing.close(b)


# -- the step loop ---------------------------------------------------------------------------


class Worker:
    """A fake worker: each step "calls the device" (``before_device`` then a wait the test
    releases), and returns a Deferred like the RBLN worker does."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.loop: StepLoop | None = None
        self.ran: list[int] = []
        self.device_started: dict[int, threading.Event] = {}
        self.device_done: dict[int, threading.Event] = {}
        self.fail_at = fail_at
        self.metrics: list[int] = []
        self.gates: dict[int, threading.Event] = {}  # a step waits at its start until set
        self.queued: dict[int, threading.Event] = {}  # set when the loop has step n queued

    def on_queued(self, seq: int) -> None:
        self.queued.setdefault(seq, threading.Event()).set()

    def wait_queued(self, seq: int) -> None:
        assert self.queued.setdefault(seq, threading.Event()).wait(WAIT_S)

    def start(self, conn, *, reports: bool = True, urgent: bool = False) -> StepLoop:
        self.loop = StepLoop(
            conn,
            self.run,
            reports_results=reports,
            urgent_results=urgent,
            name="t",
            on_queued=self.on_queued,
        )
        return self.loop

    def events(self, seq: int) -> tuple[threading.Event, threading.Event]:
        started = self.device_started.setdefault(seq, threading.Event())
        done = self.device_done.setdefault(seq, threading.Event())
        return started, done

    def run(self, seq: int, step: dict, grammar: object) -> Deferred:
        if seq in self.gates:
            assert self.gates[seq].wait(WAIT_S), f"step {seq} was never let in"
        self.ran.append(seq)
        if seq == self.fail_at:
            raise ValueError(f"step {seq} is broken")
        assert self.loop is not None
        self.loop.release_held()  # the runner's before_device hook
        started, done = self.events(seq)
        started.set()
        assert done.wait(WAIT_S), f"device call of step {seq} never finished"
        return Deferred(lambda: {"seq": seq, "step": step}, then=lambda: self.metrics.append(seq))


@pytest.fixture
def loop_pair() -> Iterator:
    engine, conn = stream_pair()
    worker = Worker()
    worker.start(conn)
    yield engine, worker
    worker.loop.stop()
    framing.close(engine)


def send_step(engine, seq: int) -> None:
    framing.send_frame(engine, STEP, seq, pickle.dumps(({"n": seq}, None)))


def recv_result(engine) -> tuple[int, int, object]:
    engine.sock.settimeout(WAIT_S)
    kind, seq, payload = framing.recv_frame(engine)
    return kind, seq, pickle.loads(payload) if kind == RESULT else payload.decode()


def test_a_result_waits_for_the_next_steps_device_call_when_one_is_queued(loop_pair) -> None:
    engine, worker = loop_pair
    send_step(engine, 0)
    send_step(engine, 1)
    started0, done0 = worker.events(0)
    assert started0.wait(WAIT_S)
    worker.wait_queued(1)
    done0.set()  # step 0's device call ends; step 1 is already queued
    started1, done1 = worker.events(1)
    assert started1.wait(WAIT_S)  # step 0's result may only go once step 1's call started
    kind, seq, value = recv_result(engine)
    assert (kind, seq, value) == (RESULT, 0, {"seq": 0, "step": {"n": 0}})
    assert not done1.is_set()  # ... and did, while step 1 was still "on the device"
    done1.set()
    assert recv_result(engine)[:2] == (RESULT, 1)  # no step queued: sent at once
    assert worker.ran == [0, 1]


def test_a_result_goes_at_once_when_no_step_is_queued_and_steps_run_in_order(loop_pair):
    engine, worker = loop_pair
    for seq in range(4):
        send_step(engine, seq)
        worker.events(seq)[1].set()  # every device call ends at once
        assert recv_result(engine) == (RESULT, seq, {"seq": seq, "step": {"n": seq}})
        # the bookkeeping of a step (then) runs after it is sent, before the next is sent
        assert worker.metrics[:seq] == list(range(seq)) and len(worker.metrics) <= seq + 1
    assert worker.ran == [0, 1, 2, 3]


def test_a_failed_step_sends_its_traceback_and_the_loop_goes_on() -> None:
    engine, conn = stream_pair()
    worker = Worker(fail_at=1)
    worker.start(conn)
    for seq in range(3):
        worker.events(seq)[1].set()
        send_step(engine, seq)
    results = [recv_result(engine) for _ in range(3)]
    assert [r[:2] for r in results] == [(RESULT, 0), (ERROR, 1), (RESULT, 2)]
    assert "ValueError: step 1 is broken" in results[1][2]
    worker.loop.stop()
    framing.close(engine)


def test_a_rank_that_reports_nothing_closes_its_stream_when_a_step_fails() -> None:
    """A pipeline rank before the last sends no results: closing its stream is how the
    engine learns at once that it failed (its next send to the rank raises)."""
    engine, conn = stream_pair()
    worker = Worker(fail_at=0)
    worker.start(conn, reports=False)
    send_step(engine, 0)
    engine.sock.settimeout(WAIT_S)
    with pytest.raises(framing.StreamClosed):
        framing.recv_frame(engine)
    framing.close(engine)


@pytest.mark.parametrize("urgent", [True, False])
def test_urgent_results_go_before_the_next_step_starts(urgent: bool) -> None:
    """A pipeline's last rank sends each result before it starts the next step (which waits
    for the previous rank anyway); otherwise the result waits for the next device call."""
    engine, conn = stream_pair()
    worker = Worker()
    worker.gates[1] = threading.Event()  # step 1 is stuck before its device call
    worker.start(conn, urgent=urgent)
    send_step(engine, 0)
    send_step(engine, 1)
    worker.wait_queued(1)
    worker.events(0)[1].set()
    worker.events(1)[1].set()
    if urgent:
        assert recv_result(engine)[:2] == (RESULT, 0)
    else:
        # held until step 1's device call starts: nothing to read while step 1 is stuck
        assert select.select([engine], [], [], 0.3)[0] == []
    worker.gates[1].set()
    assert [recv_result(engine)[:2] for _ in range(2 if not urgent else 1)][-1] == (RESULT, 1)
    worker.loop.stop()
    framing.close(engine)


def test_an_out_of_order_step_stops_the_loop() -> None:
    engine, conn = stream_pair()
    worker = Worker()
    worker.start(conn)
    send_step(engine, 1)  # step 0 never came
    engine.sock.settimeout(WAIT_S)
    with pytest.raises(framing.StreamClosed):
        framing.recv_frame(engine)
    assert worker.ran == []
    framing.close(engine)


# -- pipeline hidden states ------------------------------------------------------------------


@pytest.fixture
def hidden_pair() -> Iterator[tuple[HiddenStream, HiddenStream]]:
    a, b = stream_pair()
    sender, receiver = HiddenStream(a, peer_rank=1), HiddenStream(b, peer_rank=0)
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hidden_states_arrive_exact(hidden_pair, dtype) -> None:
    sender, receiver = hidden_pair
    decode = torch.randn(4, 1, 64).to(dtype)
    prefill = torch.randn(1, 128, 64).to(dtype)
    sender.send(0, decode)
    sender.send(3, prefill[:, :100])  # a view: sent contiguous
    got0, got3 = receiver.receive(0), receiver.receive(3)
    assert got0.dtype == dtype and torch.equal(got0, decode)
    assert torch.equal(got3, prefill[:, :100])


def test_a_failed_rank_makes_the_next_one_raise_naming_it(hidden_pair) -> None:
    sender, receiver = hidden_pair
    sender.send_failure(5, StageFailure(rank=0, error="RuntimeError('boom')"))
    with pytest.raises(ChannelError, match=r"rank 0 failed step 5: RuntimeError\('boom'\)"):
        receiver.receive(5)


def test_hidden_states_of_another_step_are_refused(hidden_pair) -> None:
    sender, receiver = hidden_pair
    sender.send(2, torch.zeros(1, 1, 8))
    with pytest.raises(ChannelError, match="step 1 received .* step 2"):
        receiver.receive(1)


def test_a_closed_previous_rank_is_named(hidden_pair) -> None:
    sender, receiver = hidden_pair
    sender.close()
    with pytest.raises(ChannelError, match="stream from pipeline rank 0 broke"):
        receiver.receive(0)
