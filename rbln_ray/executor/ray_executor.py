"""``RBLNRayExecutor``: vLLM's executor that runs RBLN workers as Ray actors.

See the package docstring for usage and the compiled-artifact location rule.

Data path: Ray starts, places and watches the workers and carries every control call
(``collective_rpc``); scheduler steps do not go through Ray. Each worker listens on a stream
(:mod:`rbln_ray.common.framing`, introduced over Ray with a per-engine token), the engine
writes every step to every worker's stream and reads the results from the last rank's: a Ray
call per step cost device idle time on every step (BENCHMARKS §3, §10), and with
pipeline stages that latency was on every micro-batch's round trip.

Failure model (why it is shaped like this): vLLM's engine thread blocks in ``future.result()``
for every step, so a dead worker must make that call raise, not hang. Four paths make sure:

* a dead worker's streams close with its process, so a step read or write fails at once and
  names the worker;
* every wait on Ray results is a ``ray.wait`` loop that fetches finished refs at once
  (a dead actor's refs finish with ``RayActorError``) and re-checks the executor's failed
  flag every second;
* a monitor thread waits on one never-returning ``sentinel`` call per actor; when one
  finishes, the actor is dead: the executor marks itself failed, closes the streams (waking
  an engine thread blocked on a result), fires vLLM's failure callback (which wakes an idle
  engine loop so it reports the error) and frees the other actors and the placement group,
  so the devices are free for a new engine;
* a worker that is alive but makes no progress (a device call that never returns, a frozen
  process, a network partition) is caught by the step deadline: when a step is outstanding
  and no result has arrived for ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (vLLM's own bound on
  a step, default 300 s), the executor fails exactly as for a dead worker and kills the
  actors (TCP keepalive on the streams catches a silent peer too, ``common/framing.py``).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NoReturn

import cloudpickle
import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

from rbln_ray.common import framing
from rbln_ray.executor import placement
from rbln_ray.executor.actor import LIVENESS_GROUP, RBLNWorkerActor
from rbln_ray.executor.cluster import connect, worker_env
from rbln_ray.vllm_plugin.step_loop import ERROR, RESULT, STEP

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often blocked waits re-check the failed flag
STOP_TIMEOUT_S = 15.0  # bound on graceful worker shutdown and on waiting for actors to die
# After a step raised in a worker: how long the engine may stay idle before the executor
# fails it (a next step fails it at once; see _failed_step).
FAILED_STEP_GRACE_S = 2.0


@dataclass
class FailedStepOutput(ModelRunnerOutput):
    """A step whose device call raised: no tokens for its requests, which the RBLN scheduler
    finishes with an error (``RBLNScheduler.update_from_output``)."""

    failed_req_ids: set[str] = field(default_factory=set)


class _StepFailed(Exception):
    """A worker's report that it failed a step (kept until the step's future asks)."""


class RBLNWorkerDiedError(RuntimeError):
    """A worker actor died; the engine cannot continue."""


@dataclass
class _Worker:
    rank: int
    actor: Any
    bundle_index: int
    node_id: str = ""
    node_ip: str = ""
    rbln_devices: str | None = None
    sentinel: Any = None

    def describe(self) -> str:
        return (
            f"RBLN worker rank {self.rank} (node {self.node_id[:8]} {self.node_ip}, "
            f"RBLN_DEVICES={self.rbln_devices})"
        )


class _LazyFuture(Future):
    """A ``Future`` resolved by the caller's ``result()`` (:meth:`_fetch`), so the wait runs in
    the engine thread with the executor's failure checks."""

    def _fetch(self, timeout: float | None) -> Any:
        raise NotImplementedError

    def result(self, timeout: float | None = None) -> Any:
        if not super().done():
            try:
                value = self._fetch(timeout)
            except TimeoutError:
                raise  # still pending: the caller may wait again
            except BaseException as e:  # noqa: BLE001 - stored and re-raised by Future
                self.set_exception(e)
            else:
                self.set_result(value)
        return super().result()


class _StepFuture(_LazyFuture):
    """A step's output, read from the last rank's result stream."""

    def __init__(self, executor: RBLNRayExecutor, seq: int) -> None:
        super().__init__()
        self._executor = executor
        self._seq = seq

    def _fetch(self, timeout: float | None) -> Any:
        return self._executor._step_result(self._seq, timeout)


class _RefsFuture(_LazyFuture):
    """The values of worker refs (a non-blocking ``collective_rpc``)."""

    def __init__(self, executor: RBLNRayExecutor, refs: list[Any], single_value: bool) -> None:
        super().__init__()
        self._executor = executor
        self._refs = refs
        self._single = single_value

    def done(self) -> bool:
        if super().done():
            return True
        ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def _fetch(self, timeout: float | None) -> Any:
        values = self._executor._wait(self._refs, timeout)
        return values[0] if self._single else values


class RBLNRayExecutor(Executor):
    """Runs one ``RBLNWorker`` per placement-group bundle, each a Ray actor on RBLN devices."""

    uses_ray: bool = True
    supports_pp: bool = True  # one worker per pipeline rank (compiled stage)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        """Steps return futures, so vLLM's engine schedules step N+1 while step N runs."""
        return True

    def _init_executor(self) -> None:
        from rbln_ray.vllm_plugin.platform import compiled_model

        self._lock = threading.Lock()
        self._failed: str | None = None
        self._failure_callback: Callable[[], None] | None = None
        self._stopping = threading.Event()
        self._workers: list[_Worker] = []
        self._resources = _Resources(self._workers)
        self._monitor: threading.Thread | None = None
        self._held_step: SchedulerOutput | None = None  # see execute_model
        self._next_seq = 0  # every step's number, in the order the workers must run them
        self._streams: list[Any] = []  # the step stream to each worker (_open_step_streams)
        self._results: dict[int, Any] = {}  # step results read ahead of their future
        # The step deadline (module docstring): steps sent and not answered, by send time.
        from vllm import envs as vllm_envs

        self._step_timeout_s = float(vllm_envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)
        self._outstanding: dict[int, float] = {}
        self._last_result_at = time.monotonic()
        self._step_reqs: dict[int, list[str]] = {}  # the requests of each step in flight
        self._fail_next: str | None = None  # a step raised: fail at the next step (or idle)
        # Speculative decoding: the drafts the last step's result carried, for the engine's
        # take_draft_token_ids (read here, never with a call to the worker's actor)
        self._drafts: DraftTokenIds | None = None

        connect(self.vllm_config)
        artifact = compiled_model(self.vllm_config)
        plan = placement.PlacementPlan.from_config(self.vllm_config, artifact.num_devices)
        existing = self.parallel_config.placement_group or ray.util.get_current_placement_group()
        pg, bundles, owns_pg = placement.acquire(existing, plan)
        self._resources.pg, self._resources.owns_pg = pg, owns_pg
        # Released at interpreter exit too, if nobody called shutdown.
        weakref.finalize(self, self._resources.release)
        try:
            self._start_workers(plan, bundles)
            self._start_monitor()
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
            if len(self._workers) > 1:
                self._connect_stages()
            self._open_step_streams()
        except BaseException:
            self.shutdown()
            raise

    # -- start-up -------------------------------------------------------------------------

    def _runtime_env(self) -> dict[str, Any]:
        base = self.parallel_config.ray_runtime_env
        runtime_env: dict[str, Any] = dict(base) if base else {}
        env_vars = dict(runtime_env.get("env_vars") or {})
        env_vars.update(worker_env())
        runtime_env["env_vars"] = env_vars
        return runtime_env

    def _start_workers(self, plan: placement.PlacementPlan, bundles: list[int]) -> None:
        runtime_env = self._runtime_env()
        for rank, bundle_index in enumerate(bundles):
            actor = (
                ray.remote(concurrency_groups={LIVENESS_GROUP: 1})(RBLNWorkerActor)
                .options(
                    num_cpus=0,
                    resources={placement.DEVICE_KEY: plan.devices_per_worker},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._resources.pg,
                        placement_group_bundle_index=bundle_index,
                        placement_group_capture_child_tasks=True,
                    ),
                    runtime_env=runtime_env,
                    max_restarts=0,
                )
                .remote()
            )
            self._workers.append(_Worker(rank=rank, actor=actor, bundle_index=bundle_index))

        where = self._wait([w.actor.placement.remote() for w in self._workers], None)
        for worker, info in zip(self._workers, where, strict=True):
            worker.node_id = info["node_id"]
            worker.node_ip = info["node_ip"]
            worker.rbln_devices = info["rbln_devices"]
            logger.info(
                "%s started (pid %s, bundle %d)",
                worker.describe(),
                info["pid"],
                worker.bundle_index,
            )
        self._wait(
            [
                w.actor.init_worker.remote(self.vllm_config, w.rank, w.rank == 0)
                for w in self._workers
            ],
            None,
        )

    def _connect_stages(self) -> None:
        """One hidden-state stream per stage boundary, rank to rank (vLLM's pipeline-parallel
        send/recv neighbours; ``rbln_ray.pipeline.channel``): every rank after the first
        listens, every rank before the last connects, then the listeners accept."""
        later = self._workers[1:]
        tokens = [framing.new_token() for _ in later]
        addresses = self._wait(
            [
                w.actor.execute_method.remote("open_inbound", token)
                for w, token in zip(later, tokens, strict=True)
            ],
            None,
        )
        connects = [
            w.actor.execute_method.remote("connect_outbound", address, token)
            for w, address, token in zip(self._workers, addresses, tokens, strict=False)
        ]
        self._wait(connects, None)
        self._wait([w.actor.execute_method.remote("accept_inbound") for w in later], None)

    def _open_step_streams(self) -> None:
        """One step stream from the engine to every worker (``rbln_ray.vllm_plugin.step_loop``):
        the worker listens, the engine connects, the worker accepts and starts its loop. The
        last rank's stream also carries the step results back."""
        tokens = [framing.new_token() for _ in self._workers]
        addresses = self._wait(
            [
                w.actor.execute_method.remote("open_step_stream", token)
                for w, token in zip(self._workers, tokens, strict=True)
            ],
            None,
        )
        self._streams = [
            framing.connect(address, token)
            for address, token in zip(addresses, tokens, strict=True)
        ]
        last = len(self._workers) - 1
        self._wait(
            [
                w.actor.execute_method.remote("accept_step_stream", w.rank == last)
                for w in self._workers
            ],
            None,
        )

    def _start_monitor(self) -> None:
        for worker in self._workers:
            worker.sentinel = worker.actor.sentinel.remote()
        self._monitor = threading.Thread(
            target=_monitor_loop, args=(weakref.ref(self),), daemon=True, name="RBLNRayMonitor"
        )
        self._monitor.start()

    # -- RPC ------------------------------------------------------------------------------

    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        single_value: bool = False,
    ) -> Any:
        self._raise_if_failed()
        sent = method if isinstance(method, str) else cloudpickle.dumps(method)
        refs = [w.actor.execute_method.remote(sent, *args, **(kwargs or {})) for w in self._workers]
        if non_block:
            return _RefsFuture(self, refs, single_value)
        values = self._wait(refs, timeout)
        return values[0] if single_value else values

    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        """Hold the step until :meth:`sample_tokens` brings its grammar bitmask, then send
        both in one call: vLLM's engine always follows a step's ``execute_model`` with
        ``sample_tokens`` (at once, or after the previous step's output for deferred
        structured output), and one actor round trip per step is what the host pays. A step
        with nothing scheduled (it only retires finished requests) goes at once."""
        if self._fail_next is not None:
            self._fail(self._fail_next)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self._run_step(scheduler_output, None, non_block)
        self._raise_if_failed()
        self._held_step = scheduler_output
        if not non_block:
            return None
        done: Future[ModelRunnerOutput | None] = Future()
        done.set_result(None)
        return done

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        step, self._held_step = self._held_step, None
        if step is None:
            raise RuntimeError("sample_tokens without a step: execute_model must come first")
        return self._run_step(step, grammar_output, non_block)

    def _run_step(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None, non_block
    ) -> Any:
        """Send step ``seq`` to every rank's step loop at once; its result comes back on the
        last rank's stream. A pipeline rank prepares the step's inputs as soon as it arrives
        and runs it when the previous rank's hidden states arrive on their own stream
        (``PipelineWorker.run_step``): hidden states move worker to worker, never through the
        engine, and with S ranks and vLLM's batch queue of S every stage works on its own
        micro-batch at once."""
        self._raise_if_failed()
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._outstanding[seq] = time.monotonic()
        self._step_reqs[seq] = list(scheduler_output.num_scheduled_tokens)
        payload = pickle.dumps((scheduler_output, grammar_output), protocol=pickle.HIGHEST_PROTOCOL)
        for worker, stream in zip(self._workers, self._streams, strict=True):
            try:
                framing.send_frame(stream, STEP, seq, payload)
            except framing.StreamClosed as e:
                self._stream_broke(worker, e)
        future = _StepFuture(self, seq)
        return future if non_block else future.result()

    def _step_result(self, seq: int, timeout: float | None) -> ModelRunnerOutput:
        """Step ``seq``'s output, read from the last rank's stream (results come in order).

        ``timeout`` is the caller's (None: vLLM's engine, which waits for ever); the step
        deadline applies whatever it is (:meth:`_check_progress`)."""
        worker, stream = self._workers[-1], self._streams[-1]
        deadline = None if timeout is None else time.monotonic() + timeout
        while seq not in self._results:
            self._raise_if_failed()
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if deadline is not None and wait <= 0:
                raise TimeoutError(f"step {seq}: no result from the RBLN worker in {timeout} s")
            if not framing.wait_readable(stream, wait):
                self._check_progress()
                continue
            try:
                kind, got, payload = framing.recv_frame(stream, (RESULT, ERROR))
            except framing.StreamClosed as e:
                self._stream_broke(worker, e)
            self._last_result_at = time.monotonic()
            self._outstanding.pop(got, None)
            if kind == ERROR:
                self._results[got] = _StepFailed(
                    f"{worker.describe()} failed step {got}:\n{payload.decode()}"
                )
            else:
                self._results[got] = pickle.loads(payload)  # from our own worker
        value = self._results.pop(seq)
        req_ids = self._step_reqs.pop(seq, [])
        self._drafts = None  # a failed step proposes nothing
        if isinstance(value, _StepFailed):
            return self._failed_step(seq, req_ids, str(value))
        if isinstance(value, BaseException):
            raise value
        self._drafts = getattr(value, "rbln_drafts", None)
        return value

    def take_draft_token_ids(self) -> DraftTokenIds | None:  # type: ignore[override]
        """Speculative decoding: the drafts proposed after the last step, which its result
        carried from the worker. vLLM's synchronous engine asks after each step; a Ray call
        to the worker would cost a round trip and run on an actor thread beside the step
        loop."""
        drafts, self._drafts = self._drafts, None
        return drafts

    def _failed_step(self, seq: int, req_ids: list[str], report: str) -> FailedStepOutput:
        """A step raised in a worker: its requests end with an error (they are what made it
        raise, as far as anyone can tell, so retrying them elsewhere would only fail another
        replica), and the engine fails once this output is processed: at its next step, or
        after ``FAILED_STEP_GRACE_S`` if it goes idle (a worker that raised mid-step may hold
        a half-updated state, so nothing more runs on it). Requests merely queued in the
        engine then fail as for a dead worker, which a Serve replica answers by retrying them
        on another replica."""
        logger.error("%s; failing its requests %s", report, req_ids)
        self._fail_next = report.splitlines()[0]
        timer = threading.Timer(FAILED_STEP_GRACE_S, self._fail, args=(self._fail_next,))
        timer.daemon = True
        timer.start()
        return FailedStepOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[] for _ in req_ids],
            failed_req_ids=set(req_ids),
        )

    def _check_progress(self) -> None:
        """Fail the executor when a step is outstanding and no result has come for the step
        deadline: the last rank (or a rank before it) is stuck, frozen or cut off."""
        if not self._outstanding:
            return
        since = max(min(self._outstanding.values()), self._last_result_at)
        stalled = time.monotonic() - since
        if stalled <= self._step_timeout_s:
            return
        oldest = min(self._outstanding)
        reason = (
            f"step {oldest}: no result from the RBLN workers for {stalled:.0f} s "
            f"(VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS={self._step_timeout_s:g}); a device call is "
            f"stuck or a worker is frozen or unreachable ({self._workers[-1].describe()} "
            "reports results)"
        )
        self._fail(reason)
        raise RBLNWorkerDiedError(reason)

    def _stream_broke(self, worker: _Worker, error: Exception) -> NoReturn:
        """A step stream closed under the engine: the worker died or stopped (or the executor
        failed and closed it)."""
        self._raise_if_failed()
        reason = f"{worker.describe()} died: its step stream closed ({error})"
        self._fail(reason)
        raise RBLNWorkerDiedError(reason) from error

    def _wait(self, refs: list[Any], timeout: float | None) -> list[Any]:
        """``ray.get`` that raises at once when any worker fails or the executor is failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(refs)
        while pending:
            self._raise_if_failed()
            budget = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if budget <= 0:
                raise TimeoutError(f"RBLN workers did not answer within {timeout} s")
            ready, pending = ray.wait(pending, num_returns=1, timeout=budget)
            for ref in ready:
                self._get_one(ref)  # surfaces a worker's error or death now
        return [self._get_one(ref) for ref in refs]

    def _get_one(self, ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=0)
        except GetTimeoutError:
            raise TimeoutError("RBLN worker result not ready") from None
        except RayActorError as e:
            worker = next((w for w in self._workers if w.actor._actor_id.hex() == e.actor_id), None)
            who = worker.describe() if worker else "an RBLN worker"
            reason = f"{who} died: {_first_line(e)}"
            self._fail(reason)
            raise RBLNWorkerDiedError(reason) from e

    # -- health and failure ---------------------------------------------------------------

    def check_health(self) -> None:
        self._raise_if_failed()
        self._check_progress()
        sentinels = [w.sentinel for w in self._workers if w.sentinel is not None]
        done, _ = ray.wait(sentinels, num_returns=1, timeout=0) if sentinels else ([], [])
        if done:
            self._on_sentinel(done[0])
            self._raise_if_failed()

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._failed is None:
                self._failure_callback = callback
                return
        callback()

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise RBLNWorkerDiedError(self._failed)

    def _on_sentinel(self, ref: Any) -> None:
        worker = next(w for w in self._workers if w.sentinel == ref)
        try:
            ray.get(ref, timeout=0)
            why = "its liveness call returned"
        except Exception as e:  # noqa: BLE001 - any error here means the actor is gone
            why = _first_line(e)
        self._fail(f"{worker.describe()} died: {why}")

    def _fail(self, reason: str) -> None:
        """Enter the permanent failed state once: log, notify vLLM, free devices."""
        with self._lock:
            if self._failed is not None or self._stopping.is_set():
                return
            self._failed = reason
            callback, self._failure_callback = self._failure_callback, None
        logger.error("RBLN Ray executor failed: %s", reason)
        self._close_streams()  # wakes an engine thread blocked on a result
        if callback is not None:
            callback()
        self._resources.release()

    def _close_streams(self) -> None:
        for stream in self._streams:
            framing.close(stream)

    # -- shutdown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop workers, kill their actors and remove the placement group (idempotent).

        Returns once the actors are dead (bounded), so their devices are free for a new
        engine as soon as this returns.
        """
        if not hasattr(self, "_stopping"):
            return  # __init__ failed before any state existed
        with self._lock:
            already = self._stopping.is_set()
            self._stopping.set()
        if not already:
            monitor = self._monitor
            if monitor is not None and monitor is not threading.current_thread():
                monitor.join(timeout=2 * POLL_S + 1)
            if self._failed is None and self._workers:
                try:
                    refs = [w.actor.execute_method.remote("shutdown") for w in self._workers]
                    ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - best effort; the actors are killed next
                    logger.warning("graceful RBLN worker shutdown failed", exc_info=True)
            self._close_streams()
        self._resources.release()


@dataclass
class _Resources:
    """What an executor holds in the cluster; released once, by whoever gets there first.

    Separate from the executor so a ``weakref.finalize`` can release it at exit without
    keeping the executor alive. Later callers block until the first release has finished,
    so "released" always means "actors dead and placement group gone".
    """

    workers: list[_Worker]
    pg: Any = None
    owns_pg: bool = False
    released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
            if not ray.is_initialized():
                return
            for worker in self.workers:
                try:
                    ray.kill(worker.actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead is fine
                    logger.debug("ray.kill(%s) failed", worker.describe(), exc_info=True)
            sentinels = [w.sentinel for w in self.workers if w.sentinel is not None]
            if sentinels:  # a killed actor's sentinel fails once Ray has reaped its process
                ray.wait(sentinels, num_returns=len(sentinels), timeout=STOP_TIMEOUT_S)
            if self.pg is not None and self.owns_pg:
                try:
                    remove_placement_group(self.pg)
                except Exception:  # noqa: BLE001
                    logger.warning("could not remove the placement group", exc_info=True)
            logger.info("RBLN Ray executor released %d worker(s)", len(self.workers))


def _monitor_loop(executor_ref: weakref.ref[RBLNRayExecutor]) -> None:
    """Wait on the actors' sentinels; the first to finish means that actor died."""
    while True:
        executor = executor_ref()
        if executor is None or executor._stopping.is_set() or executor._failed is not None:
            return
        sentinels = [w.sentinel for w in executor._workers]
        del executor  # don't keep the executor alive while waiting
        if not ray.is_initialized():
            return
        try:
            done, _ = ray.wait(sentinels, num_returns=1, timeout=POLL_S)
        except Exception:  # noqa: BLE001 - Ray going away under us ends monitoring
            logger.debug("RBLN monitor stopped", exc_info=True)
            return
        executor = executor_ref()
        if done and executor is not None and not executor._stopping.is_set():
            executor._on_sentinel(done[0])
            return


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
