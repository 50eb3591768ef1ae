"""The fleet: sessions arrive, routers choose, replicas serve, reports flow back.

One run (:func:`run_fleet`): the workload's sessions (:mod:`.workload`) start at their times
and send each turn when the previous one has finished and the user has thought (open loop,
as ``benchmarks.sessions.run_sessions``; no turn starts after ``stop_s``, turns under way
finish). Each turn goes to one of the ingress replicas' routers (uniformly at random: Serve's
proxy balances its ingress replicas), whose order Serve follows: the first replica with
room (fewer than ``max_ongoing`` requests) takes it, the replicas before it refuse, and the
router hears of each as Serve tells it (:class:`FleetRouter`). When all refuse, the request
waits for the next request to finish anywhere and is routed again.

Every replica reports what it caches and its service times every ``report_period_s`` (± 10
%); every ``broadcast_period_s`` the reports that changed reach every router at once (Serve's
controller broadcasts its replica list to every handle in its control loop).

Routers are injected: this package may not import :mod:`rbln_ray.serve` (the layers), so the
router that decides (the real cache-aware router, :mod:`rbln_ray.serve.fleet_router`) and
the block-key function replicas report with come from the caller.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rbln_ray.planning.fleet.events import EventQueue
from rbln_ray.planning.fleet.replica import Replica, ReplicaConfig, Report, SimRequest, StepCosts
from rbln_ray.planning.fleet.workload import Corpus, Workload, prompt


class FleetRouter(Protocol):
    """What the simulation asks of one ingress replica's router."""

    def route(self, request: SimRequest) -> list[int]:
        """Replica indices, most preferred first."""

    def sent(self, request: SimRequest, replica: int, ongoing: int, accepted: bool) -> None:
        """Serve sent ``request`` to ``replica``, which answered that it now has ``ongoing``
        requests and accepted it or not."""

    def completed(self, request: SimRequest) -> None:
        """``request`` finished on ``request.replica``."""

    def update(self, reports: Sequence[Report | None]) -> None:
        """Serve's broadcast: every replica's last report (None: none yet)."""


Keyer = Callable[[Sequence[int], Sequence[int]], list[int]]  # (keys of a prefix, tokens) -> keys


@dataclass(frozen=True)
class FleetConfig:
    replicas: int
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    stop_s: float = 300.0  # no turn starts later (the workload's duration)
    broadcast_period_s: float = 0.1  # Serve's control loop
    seed: int = 0


@dataclass
class FleetRun:
    """What one run leaves: every sent turn, the replicas' counters, the routers."""

    config: FleetConfig
    requests: list[SimRequest]
    replicas: list[Replica]
    routers: Sequence[Any]
    events: int
    retries: int = 0
    broadcasts: int = 0
    end_s: float = 0.0  # when the last turn finished


class Fleet:
    def __init__(
        self,
        config: FleetConfig,
        workload: Workload,
        corpus: Corpus,
        routers: Sequence[FleetRouter],
        keyer: Keyer,
        queue: EventQueue | None = None,
    ) -> None:
        self.config, self.workload, self.corpus = config, workload, corpus
        self.routers, self.keyer = list(routers), keyer
        self.queue = queue if queue is not None else EventQueue()
        self.rng = random.Random(config.seed)
        costs = StepCosts(config.replica)
        self.replicas = [
            Replica(i, config.replica, costs, self._now, self.queue.after, self._first,
                    self._finish)
            for i in range(config.replicas)
        ]  # fmt: skip
        self.requests: list[SimRequest] = []
        self.backlog: list[SimRequest] = []
        self.reports: list[Report | None] = [None] * config.replicas
        self.dirty = False
        self.retries = self.broadcasts = 0
        self.inflight = 0  # requests accepted by a replica and not finished
        self._sessions = {s.sid: s for s in workload.sessions}

    def _now(self) -> float:
        return self.queue.now

    # ------------------------------------------------------------------ the run
    def run(self) -> FleetRun:
        queue, cfg = self.queue, self.config
        for session in self.workload.sessions:
            queue.at(session.start_s, self._send, session.sid, 0)
        period = cfg.replica.report_period_s
        for replica in self.replicas:
            queue.at(self.rng.uniform(0, period), self._report, replica.index)
        queue.at(cfg.broadcast_period_s, self._broadcast)
        queue.run()
        return FleetRun(cfg, self.requests, self.replicas, self.routers, queue.processed,
                        self.retries, self.broadcasts, queue.now)  # fmt: skip

    def _busy(self) -> bool:
        """Work remains: turns to send or under way (reports stop with the work)."""
        return self.queue.now < self.config.stop_s or self.inflight > 0 or bool(self.backlog)

    def _report(self, index: int) -> None:
        self.reports[index] = self.replicas[index].report()
        self.dirty = True
        if self._busy():
            period = self.config.replica.report_period_s
            self.queue.after(period * self.rng.uniform(0.9, 1.1), self._report, index)

    def _broadcast(self) -> None:
        if self.dirty:
            for router in self.routers:
                router.update(self.reports)
            self.dirty = False
            self.broadcasts += 1
        if self._busy():
            self.queue.after(self.config.broadcast_period_s, self._broadcast)

    # ------------------------------------------------------------------ requests
    def _send(self, sid: str, turn: int) -> None:
        session = self._sessions[sid]
        if self.queue.now >= self.config.stop_s:
            return  # past the run's window: no turn starts (run_sessions)
        tokens = prompt(self.workload, self.corpus, session, turn)
        session.keys = self.keyer(session.keys, tokens)
        request = SimRequest(
            rid=f"{sid}-t{turn}",
            session=sid,
            turn=turn,
            sent=self.queue.now,
            tokens=tokens,
            keys=session.keys,
            out_len=session.turns[turn].max_tokens,
            router=self.rng.randrange(len(self.routers)),
        )
        self.requests.append(request)
        self._dispatch(request)

    def _dispatch(self, request: SimRequest) -> None:
        router = self.routers[request.router]
        for index in router.route(request):
            replica = self.replicas[index]
            accepted = replica.ongoing < self.config.replica.max_ongoing
            router.sent(request, index, replica.ongoing + accepted, accepted)
            if accepted:
                request.tokens = None  # routed: the prompt's tokens are no longer needed
                self.inflight += 1
                replica.accept(request)
                return
        self.backlog.append(request)  # every replica refused: route again later

    def _first(self, request: SimRequest) -> None:
        pass

    def _finish(self, request: SimRequest) -> None:
        self.inflight -= 1
        self.routers[request.router].completed(request)
        session = self._sessions[request.session]
        nxt = request.turn + 1
        if nxt < len(session.turns):
            self.queue.after(session.think_s[request.turn], self._send, session.sid, nxt)
        if self.backlog:
            waiting, self.backlog = self.backlog, []
            for pending in waiting:
                self.retries += 1
                self._dispatch(pending)


def run_fleet(
    config: FleetConfig,
    workload: Workload,
    routers: Sequence[FleetRouter],
    keyer: Keyer,
    corpus: Corpus | None = None,
) -> FleetRun:
    """Simulate ``workload`` on ``config.replicas`` replicas behind ``routers``."""
    corpus = corpus or Corpus(workload.spec.corpus_tokens)
    return Fleet(config, workload, corpus, routers, keyer).run()
