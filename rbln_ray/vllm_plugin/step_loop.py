"""A worker's scheduler steps: read from the engine's stream, run back to back on one thread.

Why: with async scheduling the engine sends step N+1 while step N runs on the device, and with
S pipeline ranks it keeps S steps in flight; whatever the host does between two device calls
is lost device time. Steps used to arrive as Ray actor calls, and between two device calls a
worker paid Ray's hand-over of the next call and the return of the previous result on every
step (BENCHMARKS §3, §10). Here the step loop's thread reads each step from the engine's stream
(:mod:`rbln_ray.common.framing`; Ray introduced the two ends) and runs it, so between two
device calls there is only the runner's own work (sampling step N, preparing step N+1).
What only the engine needs (step N's output object, device metrics) is a :class:`Deferred`
that a writer thread builds and sends back while the device runs the next step.

Three threads per worker: a reader that receives and unpickles steps as they come (mostly
while the device works), the loop that runs them in the executor's order, and a writer that
finishes and sends results. Nothing here polls: the threads block on the stream or a queue.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rbln_ray.common import framing

logger = logging.getLogger(__name__)

STEP, RESULT, ERROR = 1, 2, 3  # frame kinds: engine -> worker, worker -> engine


class Deferred:
    """A step's result, built by ``output()`` once the next step's device call is about to
    start (:meth:`StepLoop.release_held`), or at once when no step waits; ``then()`` runs
    after it is sent (bookkeeping the engine does not wait for)."""

    def __init__(self, output: Callable[[], Any], then: Callable[[], None] | None = None) -> None:
        self.output = output
        self.then = then


_SENT = object()  # a Deferred's output already sent by the loop thread (urgent results)


@dataclass
class Ahead:
    """A step its worker prepared on the reader thread (``StepLoop(prepare=...)``): what
    ``prepare`` returned, or raised (raised again by :meth:`get`, on the loop thread)."""

    scheduler_output: Any
    prepared: Any = None
    error: Exception | None = None

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.prepared


class StepLoop:
    """Runs ``run(seq, scheduler_output, grammar_output)`` for every step the engine sends on
    ``conn``, in order, on one thread; sends the results back when ``reports_results`` (the
    last pipeline rank, or the only worker), else only builds them (their metrics).

    ``prepare``: run on the reader thread for each step as it arrives (so while earlier steps
    are still on the device); ``run`` then gets an :class:`Ahead` instead of the scheduler
    output. For a worker whose step preparation does not depend on earlier steps' device
    results (a pipeline rank before the last: it samples nothing).

    ``urgent_results``: the loop thread sends each result as soon as its step returns, before
    reading the next step. For a pipeline's last rank: the engine's turn-around to the next
    micro-batch is on the pipeline's critical path, while this rank's next step waits for the
    previous rank anyway. (A writer thread would wait for the GIL while the loop prepares the
    next step.) Otherwise the result waits for the next step's device call (``Deferred``).
    """

    def __init__(
        self,
        conn: framing.Stream,
        run: Callable[..., Any],
        *,
        reports_results: bool,
        urgent_results: bool,
        name: str,
        prepare: Callable[[Any], Any] | None = None,
        on_queued: Callable[[int], None] | None = None,
    ) -> None:
        self._conn = conn
        self._run = run
        self._reports = reports_results
        self._urgent = urgent_results
        self._prepare = prepare
        self._on_queued = on_queued  # told each step number once it waits for the loop
        self._held: tuple[int, Deferred] | None = None  # the loop thread's only
        self._inbox: queue.SimpleQueue[tuple[int, Any, Any] | None] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name=f"{name}-in", daemon=True)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"{name}-out", daemon=True)
        for thread in (self._writer, self._thread, self._reader):
            thread.start()

    def release_held(self) -> None:
        """Hand the previous step's held result to the writer (on the loop thread: by the
        running step right before its device call, or by the loop itself)."""
        held, self._held = self._held, None
        if held is not None:
            self._outbox.put(held)

    def stop(self) -> None:
        """Close the stream: the loop ends after its current step (idempotent)."""
        self._stopping = True
        framing.close(self._conn)

    def _read(self) -> None:
        """Receive and unpickle the engine's steps as they come, mostly while the loop thread
        waits on the device, so the loop finds each step ready to run."""
        expected = 0
        try:
            while True:
                _, seq, payload = framing.recv_frame(self._conn, (STEP,))
                if seq != expected:
                    raise RuntimeError(f"step {seq} arrived, step {expected} was expected")
                expected += 1
                scheduler_output, grammar_output = pickle.loads(payload)  # our own engine's
                if self._prepare is not None:
                    scheduler_output = self._ahead(scheduler_output)
                self._inbox.put((seq, scheduler_output, grammar_output))
                if self._on_queued is not None:
                    self._on_queued(seq)
        except framing.StreamClosed:
            if not self._stopping:
                logger.warning("the engine's step stream closed; the step loop stops")
        except Exception:
            logger.exception("reading the engine's steps failed; the step loop stops")
        finally:
            self._inbox.put(None)

    def _ahead(self, scheduler_output: Any) -> Ahead:
        assert self._prepare is not None
        try:
            return Ahead(scheduler_output, prepared=self._prepare(scheduler_output))
        except Exception as e:  # noqa: BLE001 - raised again by the step, in order
            return Ahead(scheduler_output, error=e)

    def _loop(self) -> None:
        try:
            while (step := self._inbox.get()) is not None:
                seq, scheduler_output, grammar_output = step
                try:
                    result = self._run(seq, scheduler_output, grammar_output)
                except Exception as e:  # noqa: BLE001 - goes to the engine, which fails
                    logger.exception("RBLN worker step %d failed", seq)
                    self.release_held()
                    if not self._reports:
                        break  # closing the stream is how this rank tells the engine
                    result = e
                self.release_held()  # the step ran no device call: deliver in order now
                if self._urgent:
                    self._send_now(seq, result)
                elif isinstance(result, Deferred) and not self._inbox.empty():
                    self._held = (seq, result)  # sent once the next step's device call starts
                else:
                    self._outbox.put((seq, result))
        finally:
            self.release_held()
            self._outbox.put(None)
            framing.close(self._conn)

    def _send_now(self, seq: int, result: Any) -> None:
        then = None
        if isinstance(result, Deferred):
            result, then = _built(seq, result.output), result.then
        self._send(seq, result)
        if then is not None:
            self._outbox.put((seq, Deferred(lambda: _SENT, then)))

    def _write(self) -> None:
        while (item := self._outbox.get()) is not None:
            seq, result = item
            then = None
            if isinstance(result, Deferred):
                result, then = _built(seq, result.output), result.then
            if result is not _SENT and not self._send(seq, result):
                return  # the engine went away; the loop thread ends too
            if then is not None:
                try:
                    then()
                except Exception:  # noqa: BLE001 - bookkeeping must not stop the results
                    logger.exception("after step %d", seq)

    def _send(self, seq: int, value: Any) -> bool:
        """Send a step's result (or failure) to the engine; False once the stream is closed.

        Whatever goes wrong on the way (a result that does not pickle, a frame too large) is
        sent as the step's failure instead: the engine waits for every step's answer, so a
        writer that died silently would hang it."""
        if not self._reports:
            return True
        try:
            if not isinstance(value, BaseException):
                try:
                    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                    framing.send_frame(self._conn, RESULT, seq, data)
                    return True
                except framing.StreamClosed as e:
                    if not isinstance(e, framing.FrameError):
                        raise
                    value = e
                except Exception as e:  # noqa: BLE001 - reported as the step's failure
                    logger.exception("RBLN worker step %d: its result cannot be sent", seq)
                    value = e
            text = "".join(traceback.format_exception(value)).strip()
            framing.send_frame(self._conn, ERROR, seq, text.encode()[: framing.MAX_FRAME_BYTES])
        except framing.StreamClosed:
            return False
        return True


def _built(seq: int, output: Callable[[], Any]) -> Any:
    try:
        return output()
    except Exception as e:  # noqa: BLE001 - goes to the engine, which fails
        logger.exception("RBLN worker step %d failed", seq)
        return e
