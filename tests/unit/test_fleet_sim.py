"""The fleet simulation's pieces (rbln_ray/planning/fleet): its clock, the replica model
against the cost model, the figures BENCHMARKS compares with the measured run, and the real
router driven through the harness."""

from __future__ import annotations

import random

import pytest

from rbln_ray.npu.cost_model import Row, call_cost, copy_cost
from rbln_ray.planning.fleet import (
    Corpus,
    EventQueue,
    Fleet,
    FleetConfig,
    ReplicaConfig,
    SessionSpec,
    SimRequest,
    StepCosts,
    build_sessions,
    summarise,
)
from rbln_ray.planning.fleet.ingress import DEFAULT_MODE, replicas_needed
from rbln_ray.planning.fleet.replica import Replica
from rbln_ray.planning.fleet.sim import FleetRun

CFG = ReplicaConfig()
HOST = CFG.host_s_per_step


# ------------------------------------------------------------------ the clock
def test_events_run_in_time_order_then_in_the_order_scheduled() -> None:
    queue, seen = EventQueue(), []
    queue.at(2.0, seen.append, "c")
    queue.at(1.0, seen.append, "a")
    queue.at(1.0, seen.append, "b")  # same time: after the one scheduled first
    queue.at(1.0, lambda: queue.after(0.0, seen.append, "a2"))  # now: after what is due
    queue.run(until=1.5)
    assert seen == ["a", "b", "a2"] and queue.now == 1.5 and len(queue) == 1
    with pytest.raises(ValueError, match="past"):
        queue.at(1.0, seen.append, "x")
    queue.run()
    assert seen[-1] == "c" and queue.now == 2.0 and queue.processed == 5
    assert not EventQueue()  # an empty queue is falsy: callers compare with None


# ------------------------------------------------------------------ the replica model
def one_replica(cfg: ReplicaConfig = CFG) -> tuple[EventQueue, Replica, list, list]:
    queue, firsts, done = EventQueue(), [], []
    replica = Replica(
        0, cfg, StepCosts(cfg), lambda: queue.now, queue.after, firsts.append, done.append
    )
    return queue, replica, firsts, done


def request(rid: str, tokens: list[int], out: int, sent: float = 0.0) -> SimRequest:
    from rbln_ray.serve.kv_index import chain_hashes

    return SimRequest(rid, rid, 0, sent, tokens, chain_hashes(tokens, 128), out)


def prefill_s(start: int, end: int) -> float:
    """Chunks of 128 from ``start`` to past ``end``, each a static 128-token call."""
    return sum(
        call_cost(CFG.shape, [Row(128, s)], 1, CFG.spec).seconds + HOST
        for s in range(start, end, 128)
    )


def decode_s(positions: list[int], batch: int = 1) -> float:
    rows = [Row(1, p) for p in positions] + [Row(1, 0)] * (batch - len(positions))
    return call_cost(CFG.shape, rows, batch, CFG.spec).seconds + HOST


def test_decode_costs_are_the_cost_models() -> None:
    for devices in (1, 2, 8):  # a shard group: the cost model's num_devices
        costs = StepCosts(ReplicaConfig(devices=devices))
        for batch in (1, 2, 4):
            for positions in (0, 1, 1000, 4095 * batch):
                assert costs.decode(batch, positions) == pytest.approx(
                    costs.decode_call(batch, positions), rel=1e-12
                )
    assert StepCosts(CFG).decode_call(4, 100) == pytest.approx(
        call_cost(CFG.shape, [Row(1, 10), Row(1, 20), Row(1, 30), Row(1, 40)], 4).seconds
    )


def test_a_request_takes_the_cost_models_time_and_its_repeat_hits_the_cache() -> None:
    queue, replica, firsts, done = one_replica()
    prompt = list(range(1000, 1000 + 300))  # 2 full blocks, 3 chunks
    first = request("a", prompt, out=3)
    replica.accept(first)
    queue.run()
    ttft = prefill_s(0, 300)
    assert first.first == pytest.approx(ttft)
    # two decode steps: positions 300 and 301, batch 1 (the smallest compiled batch)
    assert first.last == pytest.approx(ttft + decode_s([300]) + decode_s([301]))
    assert (replica.queries, replica.hits) == (300, 0) and done == [first]
    # the same prompt again: 256 tokens cached (two whole blocks), one chunk left
    again = request("b", prompt, out=1, sent=queue.now)
    start = queue.now
    replica.accept(again)
    queue.run()
    assert again.hit == 256 and (replica.queries, replica.hits) == (600, 256)
    assert again.first - start == pytest.approx(prefill_s(256, 300))
    # a prompt that is exactly whole blocks: vLLM recomputes its last block
    exact = request("c", prompt[:256], out=1, sent=queue.now)
    replica.accept(exact)
    queue.run()
    assert exact.hit == 128
    report = replica.report()
    assert set(first.keys or request("x", prompt, 1).keys) <= set(report.keys)
    assert report.block_size == 128 and report.service_s is not None


def test_a_hit_in_a_running_requests_block_is_copied() -> None:
    queue, replica, _, _ = one_replica()
    prompt = list(range(5000, 5000 + 512))
    replica.accept(request("a", prompt, out=200))  # keeps its block while decoding
    queue.run(until=prefill_s(0, 512) + 0.001)
    second = request("b", prompt + [1, 2, 3], out=1, sent=queue.now)
    replica.accept(second)
    queue.run()
    assert second.hit == 512 and replica.copied_tokens == 512
    steps_before = second.scheduled - second.sent
    assert 0 <= steps_before < decode_s([600])  # it waited for one step at most
    assert second.first - second.scheduled == pytest.approx(
        copy_cost(CFG.shape, 512, CFG.spec) + prefill_s(512, 515)
    )


def test_a_decode_run_is_cut_at_the_step_boundary_when_a_slot_can_take_a_request() -> None:
    """A request arriving during a run of decode steps starts at the boundary of the step
    under way, exactly as when every step is its own event."""
    queue, replica, _, _ = one_replica()
    a = request("a", list(range(100)), out=50)
    replica.accept(a)
    queue.run(until=a.first if a.first > 0 else prefill_s(0, 100))
    t0 = prefill_s(0, 100)
    steps = [decode_s([100 + k]) for k in range(10)]
    arrive = t0 + sum(steps[:3]) + steps[3] / 2  # during the 4th decode step
    queue.run(until=arrive)
    b = request("b", list(range(7000, 7100)), out=1, sent=arrive)
    replica.accept(b)
    queue.run()
    boundary = t0 + sum(steps[:4])
    assert b.scheduled == pytest.approx(boundary)
    assert b.first == pytest.approx(boundary + prefill_s(0, 100))
    assert a.generated == 50 and a.last > b.first


def test_the_model_needs_a_block_per_sequence() -> None:
    with pytest.raises(ValueError, match="one RBLN block per sequence"):
        one_replica(ReplicaConfig(kv_blocks=4))


# ------------------------------------------------------------------ the figures
def test_the_summary_is_benchmarks_sessions_summary() -> None:
    from benchmarks.sessions import Session
    from benchmarks.sessions import summarise as bench_summarise

    rng = random.Random(2)
    sims, sessions = [], []
    for i in range(200):
        sent = rng.uniform(0, 100)
        first = sent + rng.expovariate(1.0)
        out = rng.randint(1, 60)
        last = first + (out - 1) * rng.uniform(0.05, 0.2)
        r = SimRequest(f"r{i}", f"s{i}", 0, sent, None, [], out, prompt_len=rng.randint(10, 99))
        r.first, r.last, r.generated = first, last, out
        sims.append(r)
        record = {"sent": sent, "first": first, "last": last, "output_tokens": out,
                  "prompt_tokens": r.prompt_len}  # fmt: skip
        sessions.append(Session(f"s{i}", sent, "", [], [], records=[record]))
    run = FleetRun(FleetConfig(replicas=2), sims, [], [], 0, end_s=110.0)
    mine = summarise(run, (20, 90), 2.0, 0.15)
    theirs = bench_summarise(sessions, (20, 90), 2.0, 0.15)
    for key in ("requests", "completed", "slo_met", "goodput_req_per_s", "req_per_s",
                "output_tok_per_s", "prompt_tokens", "slo_attainment"):  # fmt: skip
        assert mine[key] == pytest.approx(theirs[key]), key
    for key in ("ttft_ms", "tpot_ms"):
        for q in ("mean", "p50", "p99", "max"):
            assert mine[key][q] == pytest.approx(theirs[key][q]), (key, q)
    assert mine["goodput_per_device"] == pytest.approx(theirs["goodput_req_per_s"] / 2)


def test_ingress_replicas_share_streams_but_each_pays_every_broadcast() -> None:
    tokens = 10_000.0
    k = replicas_needed(tokens, 100, 0.001, 0, 0, DEFAULT_MODE)
    cores = tokens * DEFAULT_MODE.cpu_s_per_token + 100 * 0.001
    assert k == -(-cores // 0.8)
    # each replica re-indexes every broadcast: 10/s x 30 ms leaves 0.5 of 0.8 cores
    assert replicas_needed(tokens, 100, 0.001, 10, 0.03, DEFAULT_MODE) == -(-cores // 0.5)
    with pytest.raises(ValueError, match="no number of ingress replicas"):
        replicas_needed(tokens, 100, 0.001, 10, 0.08, DEFAULT_MODE)


# ------------------------------------------------------------------ the fleet
class _Stub:
    """A router that always prefers replica 0, then 1, ..."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, []

    def route(self, r):
        self.calls.append(("route", r.rid))
        return list(range(self.n))

    def sent(self, r, replica, ongoing, accepted):
        self.calls.append(("sent", r.rid, replica, ongoing, accepted))

    def completed(self, r):
        self.calls.append(("done", r.rid))

    def update(self, reports):
        self.calls.append(("update", sum(x is not None for x in reports)))


def test_serve_tries_replicas_in_order_and_retries_when_all_refuse() -> None:
    cfg = ReplicaConfig(max_ongoing=1)
    spec = SessionSpec(rate=40.0, duration_s=3.0, seed=1, tenants=2, num_docs=2)
    workload = build_sessions(spec)
    router = _Stub(2)
    queue = EventQueue()
    fleet = Fleet(FleetConfig(2, cfg, stop_s=3.0), workload, Corpus(), [router],
                  lambda keys, tokens: [hash(tuple(tokens[: 128 * (i + 1)]))
                                        for i in range(len(tokens) // 128)], queue)  # fmt: skip
    run = fleet.run()
    sent = [c for c in router.calls if c[0] == "sent"]
    assert sent[0][2:] == (0, 1, True)  # the first goes to replica 0
    assert any(c[2] == 0 and not c[4] for c in sent)  # replica 0 full: it refuses ...
    assert any(c[2] == 1 and c[4] for c in sent)  # ... and replica 1 takes one
    assert run.retries > 0  # both full: routed again when one finished
    assert all(r.last > 0 for r in run.requests)  # every sent turn finished
    assert any(c[0] == "update" for c in router.calls)
    assert len([c for c in router.calls if c[0] == "done"]) == len(run.requests)


def test_the_real_router_routes_a_small_fleet_through_the_harness() -> None:
    from rbln_ray.serve.fleet_router import SimulatedRouter, block_keys
    from rbln_ray.serve.kv_events import STATS_BLOCKS

    spec = SessionSpec(rate=6.0, duration_s=40.0, seed=3, tenants=4, num_docs=4)
    queue = EventQueue()
    routers = [SimulatedRouter(12, lambda: queue.now) for _ in range(2)]
    run = Fleet(
        FleetConfig(12, stop_s=40.0), build_sessions(spec), Corpus(), routers, block_keys(), queue
    ).run()
    res = summarise(run, (10, 40), 2.0, 0.15)
    assert res["completed"] == res["requests"] > 50 and res["hit_rate"] > 0.3
    for sim in routers:
        t = sim.timings
        assert len(t.decision_ns) == len(t.decided_at) >= 1 and t.update_ns
        assert not sim.router._inflight and sum(sim.router._load.values()) == 0
        assert any(r.routing_stats.get(STATS_BLOCKS) for r in sim.listing)
        assert sim.router._indexed is sim.listing  # 12 > 8 replicas: indexed
    parts = routers[0].state_bytes()
    assert parts["kv_index"] > 0 and set(parts) >= {"kv_index", "sessions", "in_flight"}


# ------------------------------------------------------------------ sizing (rbln-ray plan)
@pytest.mark.parametrize("first", [1, 3, 5, 9, 100])
def test_sizing_finds_the_fewest_replicas_that_meet_the_target(monkeypatch, first) -> None:
    from rbln_ray.planning.fleet import sizing

    tried = []

    def fake(n, *args, **kwargs):
        tried.append(n)
        return {"met": n >= 5, "slo_attainment": 1.0 if n >= 5 else 0.5}

    monkeypatch.setattr(sizing, "simulate_count", fake)
    target = sizing.SizingTarget(rate=1.0, max_replicas=64)
    found = sizing.size_fleet(target, CFG, lambda n, clock: [], lambda k, t: [], first)
    assert found.replicas == 5 and 4 in tried and len(tried) == len(set(tried))
    assert [r["replicas"] for r in found.tried] == sorted(set(tried))
    target = sizing.SizingTarget(rate=1.0, max_replicas=4)
    assert sizing.size_fleet(target, CFG, lambda n, c: [], lambda k, t: [], first).replicas is None


def test_rbln_ray_plan_sizes_a_fleet_by_simulating_it(capsys) -> None:
    import json

    from rbln_ray.cli.plan_cmd import main as plan_main

    rc = plan_main(
        ["--model", "llama-3-8b", "--input-len", "2048", "--output-len", "80", "--rate", "3",
         "--batch-sizes", "4", "--simulate", "--sim-duration", "90", "--json"]
    )  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    sim = out["simulation"]
    devices = out["chosen"]["devices_per_worker"]
    assert rc == 0 and sim["replicas"] >= 1 and sim["cards"] == sim["replicas"] * devices
    met = {r["replicas"]: r["met"] for r in sim["tried"]}
    assert met[sim["replicas"]] and not met.get(sim["replicas"] - 1, False)
    assert sim["replica"] == {"devices": devices, "batch": 4, "max_seq_len": 4096,
                              "kv_blocks": sim["replica"]["kv_blocks"]}  # fmt: skip
    assert sim["replica"]["kv_blocks"] > 4 and sim["ingress_replicas"]["default"] >= 1


def test_plan_says_why_it_cannot_simulate_a_replica_without_room_for_sequences() -> None:
    from rbln_ray.cli.plan_cmd import add_arguments, build, simulation_replica

    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "llama-3-8b", "--input-len", "512", "--output-len",
                              "64", "--rate", "1", "--batch-sizes", "4"])  # fmt: skip
    result = build(args)
    result.chosen.kv_per_device_gib = result.chosen.free_per_device_gib = 0.1
    why = simulation_replica(result, args)
    assert isinstance(why, str) and "sequences of 4096 tokens" in why
