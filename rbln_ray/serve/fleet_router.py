"""The cache-aware router outside Serve, for the fleet simulation (BENCHMARKS, "Fleet
simulation"): the real :class:`~rbln_ray.serve.cache_routing.CacheAwareRouter`, fed as Serve
feeds it, every decision timed on this machine.

What Serve does around a router, and what of it this does:

* **replicas**: Serve hands the router a new list of replica wrappers whenever one replica's
  membership or ``routing_stats`` change (``update_replicas``, from the controller's broadcast);
  :meth:`SimulatedRouter.update` builds such a list from the simulated replicas' reports,
  with the routing-stats keys real replicas report (:mod:`rbln_ray.serve.kv_events`,
  :mod:`rbln_ray.serve.service_times`), and re-indexes as ``update_replicas`` does;
* **a request**: Serve calls ``choose_replicas`` with the request and tries the replicas in
  the order returned; each replica answers with its queue length and accepts or refuses
  (``on_send_request``, ``on_new_queue_len_info``, then ``on_request_routed`` for the one that
  accepted, and ``decrement_queue_len_cache`` and ``on_request_completed`` when it ends):
  :meth:`route`, :meth:`sent` and :meth:`completed` make those same calls. The queue-length
  cache is Serve's own (the router's base class), on the simulation's clock;
* **not done**: Serve's routing loop itself (its pending queue, probes of replicas missing
  from the queue-length cache, back-off), the proxy, and moving requests between processes.
  The router reads a request (``_request``: its tokens and block keys) with the same code as
  in Serve, but inline rather than on its tokenizer thread (:class:`_InlineTokenizer`): on a
  loaded 2-core host every hand-off to that thread waits for a time slice, which would make
  a simulated hour take a real one, and the simulation only needs the read's result and CPU.

Timing: :meth:`route` first lets the router read the request, then times
``choose_replicas`` alone with ``time.perf_counter_ns`` (wall) and ``time.thread_time_ns``
(this thread's CPU) -- the decision proper, on the event loop every request waits behind.
Python's cyclic garbage collector is off while a decision is timed, as ``timeit`` does: in
the simulation the heap is the simulator's (every request and session), and a collection it
triggers would be charged to whichever decision allocated last.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import ReplicaID

from rbln_ray.serve.cache_routing import (
    EXACT_SCAN_MAX,
    TOP_CHOICES,
    CacheAwareRouter,
    PromptTokenizer,
)
from rbln_ray.serve.kv_events import STATS_BLOCK_SIZE, STATS_BLOCKS, STATS_EVENTS, pack_keys
from rbln_ray.serve.kv_index import extend_chain
from rbln_ray.serve.service_times import (
    STATS_LOAD,
    STATS_PREFILL_S_PER_TOKEN,
    STATS_REPORT,
    STATS_SERVICE_S,
)
from rbln_ray.upstream.ray_internals import router_identity

DEPLOYMENT, HANDLE_SOURCE = router_identity("LLMServer:fleet", "fleet")


class _InlineTokenizer(PromptTokenizer):
    """The router's tokenizer, its work run in the caller's thread (module docstring)."""

    async def _within_budget(self, work: Callable[[Any], Any], request: Any) -> Any:
        return work(request)


@dataclass(eq=False)
class _Replica:
    """What the router reads of Serve's ``RunningReplica``."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any]
    max_ongoing_requests: int


@dataclass(frozen=True)
class _Metadata:
    internal_request_id: str


@dataclass
class _Pending:
    """What the router reads of Serve's ``PendingRequest``."""

    args: list[Any]
    kwargs: dict[str, Any]
    metadata: _Metadata


@dataclass
class RouterTimings:
    """Per decision: when (simulated seconds), wall and CPU nanoseconds; per request: the
    read (tokens and keys, thread hop included); per broadcast: the re-index."""

    decided_at: list[float] = field(default_factory=list)
    decision_ns: list[int] = field(default_factory=list)
    decision_cpu_ns: list[int] = field(default_factory=list)
    read_ns: list[int] = field(default_factory=list)
    read_cpu_ns: list[int] = field(default_factory=list)
    update_ns: list[int] = field(default_factory=list)
    update_cpu_ns: list[int] = field(default_factory=list)


def block_keys(block_size: int = 128) -> Callable[[Sequence[int], Sequence[int]], list[int]]:
    """The key function replicas report with (:func:`~rbln_ray.serve.kv_index.extend_chain`:
    a conversation's prompt extends its last one)."""

    def keys(prefix_keys: Sequence[int], tokens: Sequence[int]) -> list[int]:
        return extend_chain(prefix_keys, tokens, block_size)

    return keys


class SimulatedRouter:
    """One ingress replica's cache-aware router over ``replicas`` simulated replicas
    (the :class:`~rbln_ray.planning.fleet.sim.FleetRouter` the simulation calls)."""

    def __init__(
        self,
        replicas: int,
        clock: Callable[[], float],
        batch_size: int = 4,
        max_ongoing: int = 8,
        exact_scan_max: int = EXACT_SCAN_MAX,
        top_choices: int = TOP_CHOICES,
    ) -> None:
        router = CacheAwareRouter(
            DEPLOYMENT,
            HANDLE_SOURCE,
            use_replica_queue_len_cache=True,
            get_curr_time_s=clock,
        )
        router.initialize_state(
            tokenizer=None,
            batch_size=batch_size,
            clock=clock,
            exact_scan_max=exact_scan_max,
            top_choices=top_choices,
        )
        router._tokenizer._pool.shutdown(wait=False)
        router._tokenizer = _InlineTokenizer(None)
        self.router, self.clock = router, clock
        self.ids = [ReplicaID(f"replica-{i:05d}", DEPLOYMENT) for i in range(replicas)]
        self.place = {rid.unique_id: i for i, rid in enumerate(self.ids)}
        self.max_ongoing = max_ongoing
        self.listing = [_Replica(rid, {}, max_ongoing) for rid in self.ids]
        self._reported: list[Any] = [None] * replicas  # the report each wrapper carries
        self.timings = RouterTimings()
        self._pending: dict[str, _Pending] = {}

    # ------------------------------------------------------------------ Serve's calls
    def route(self, request: Any) -> list[int]:
        pending = self._pending.get(request.rid)
        if pending is None:
            body = {"prompt": request.tokens}
            pending = _Pending([body], {"session": request.session}, _Metadata(request.rid))
            self._pending[request.rid] = pending
        t = self.timings
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        read = self.router._request(pending)  # type: ignore[arg-type]
        try:
            read.send(None)
        except StopIteration:
            pass
        else:
            read.close()
            raise RuntimeError("the router's read of a request waited")
        t.read_ns.append(time.perf_counter_ns() - wall)
        t.read_cpu_ns.append(time.thread_time_ns() - cpu)
        decision = self.router.choose_replicas(self.listing, pending)  # type: ignore[arg-type]
        collecting = gc.isenabled()
        gc.disable()
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            decision.send(None)
        except StopIteration as done:
            groups = done.value
        else:  # the request was read above: nothing left to wait for
            decision.close()
            raise RuntimeError("choose_replicas waited on a request it had read")
        finally:
            cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
            if collecting:
                gc.enable()
        t.decision_cpu_ns.append(cpu)
        t.decision_ns.append(wall)
        t.decided_at.append(self.clock())
        return [self.place[group[0].replica_id.unique_id] for group in groups]

    def sent(self, request: Any, replica: int, ongoing: int, accepted: bool) -> None:
        rid = self.ids[replica]
        self.router.on_send_request(rid)
        self.router.on_new_queue_len_info(rid, ongoing)
        if accepted:
            pending = self._pending.pop(request.rid)
            self.router.on_request_routed(pending, rid, None)  # type: ignore[arg-type]

    def completed(self, request: Any) -> None:
        rid = self.ids[request.replica]
        self.router.decrement_queue_len_cache(rid)
        self.router.on_request_completed(rid, request.rid)

    def update(self, reports: Sequence[Any]) -> None:
        """Serve's broadcast: a new replica list carrying every replica's last report (a
        replica whose report did not change keeps its wrapper: Serve builds new ones, which
        costs Serve, not the router)."""
        listing = []
        for i, (rid, report) in enumerate(zip(self.ids, reports, strict=True)):
            if report is self._reported[i]:
                listing.append(self.listing[i])
                continue
            self._reported[i] = report
            stats: dict[str, Any] = {}
            if report is not None:
                stats = {
                    STATS_BLOCK_SIZE: report.block_size,
                    STATS_BLOCKS: pack_keys(report.keys),  # as replicas send them
                    STATS_EVENTS: report.version,
                }
                if report.service_s is not None:
                    stats[STATS_SERVICE_S] = report.service_s
                    if report.prefill_s_per_token is not None:
                        stats[STATS_PREFILL_S_PER_TOKEN] = report.prefill_s_per_token
                if report.load is not None:
                    stats[STATS_LOAD], stats[STATS_REPORT] = report.load, report.seq
            listing.append(_Replica(rid, stats, self.max_ongoing))
        self.listing = listing
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        if len(listing) > self.router._exact_scan_max:  # as update_replicas does
            self.router.refresh_index(listing)  # type: ignore[arg-type]
        self.timings.update_cpu_ns.append(time.thread_time_ns() - cpu)
        self.timings.update_ns.append(time.perf_counter_ns() - wall)

    # ------------------------------------------------------------------ memory
    def state_bytes(self) -> dict[str, int]:
        """Bytes of the router's state, by part (each object counted once): the parsed
        reports and the key index (``kv_index``), recent sends, sessions, requests in flight
        (their prompts' tokens and keys), and the reports as Serve's replica list holds them."""
        seen: set[int] = set()
        r = self.router
        stats = [x.routing_stats for x in self.listing]
        return {
            "kv_index": _deep_size(seen, r._reports, r._holders._holders),
            "recent_sends": _deep_size(seen, r._recent, r._recent_masks.__dict__),
            "sessions": _deep_size(seen, r._sessions),
            "in_flight": _deep_size(seen, r._inflight, r._pending),
            "reports_as_served": _deep_size(seen, *stats),
        }


def _deep_size(seen: set[int], *roots: Any) -> int:
    """``sys.getsizeof`` of ``roots`` and everything they hold (containers, objects'
    ``__dict__``), each object once (``seen``: ids counted, of objects that stay alive)."""
    total, stack = 0, list(roots)
    while stack:
        item = stack.pop()
        if id(item) in seen or item is None or isinstance(item, bool | type):
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, str | bytes | int | float):
            stack.append(item.__dict__)
    return total
