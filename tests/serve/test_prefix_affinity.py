"""Cache-aware routing end to end (``routing: cache_aware``, two replicas): a prefix group
stays on one replica, whose vLLM prefix cache then hits (visible per replica in Ray's metrics
export); a session's turns stay on the replica that reports holding its history, traffic
moves on when that replica is full, and routing recovers when it is killed."""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.ray_metrics import samples
from tests.serve.conftest import RunningApp, free_port, start_app, stop_app

pytestmark = pytest.mark.slow

GROUPS = 3
PER_GROUP = 8


@pytest.fixture(scope="module")
def affinity_app() -> Iterator[RunningApp]:
    os.environ["RBLN_RAY_DEVICE"] = "emulated"  # the compile below runs in this process
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import demo_model_dir
    from rbln_ray.models.demo import DEMO_COMPILE

    hf_dir = demo_model_dir()
    compiled = resolve_compiled_dir(hf_dir, CompileSettings.from_dict(DEMO_COMPILE))
    config = {
        "routing": "cache_aware",
        "models": [{"name": "demo", "model": str(compiled), "num_replicas": 2}],
        # Serve accepts an autoscaling ingress in front of cache-aware routing (one replica
        # here: scaling it is Serve's own, and routers agree through the replicas' reports)
        "ingress": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                                           "target_ongoing_requests": 512}},
    }  # fmt: skip
    app = start_app(config, free_port(), hf_dir)
    try:
        yield app
    finally:
        stop_app()


def replica_prefills() -> dict[str, int]:
    """Completed prefills per replica (keyed by its actor name), from every replica."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer:demo", "rbln-ray")
    seen: dict[str, int] = {}
    for _ in range(60):  # each call reaches one replica: 60 calls miss one w.p. 2^-60
        stats = handle.engine_stats.remote().result()
        seen[stats["actor_name"]] = sum(s["prefill_requests"] for s in stats["steps"])
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only reached replicas {sorted(seen)}")


def system_prompt(group: int) -> str:
    lines = [f"# group {group}: module {group} helpers"]
    lines += [f"def helper_{group}_{i}(value):\n    return value * {i + group}" for i in range(24)]
    return "\n".join(lines) + "\n"


def test_prefix_groups_stay_on_one_replica_and_hit_its_cache(affinity_app: RunningApp) -> None:
    url = f"{affinity_app.url}/v1/completions"

    def one(prompt: str) -> int:
        body = {"model": "demo", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        return httpx.post(url, json=body, timeout=300).status_code

    shares = []
    for group in range(GROUPS):
        before = replica_prefills()
        prompts = [system_prompt(group) + f"# request {i}\n" for i in range(PER_GROUP)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, prompts)) == [200] * PER_GROUP
        after = replica_prefills()
        served = {name: after[name] - before[name] for name in after}
        assert sum(served.values()) == PER_GROUP, served
        shares.append(max(served.values()) / PER_GROUP)
    assert min(shares) >= 0.9, f"share of each group on its busiest replica: {shares}"

    # vLLM's prefix-cache counters, per replica, through Ray's metrics export.
    deadline = time.monotonic() + 60
    hits: dict[str, float] = {}
    while time.monotonic() < deadline:
        hits = {s.labels["ReplicaId"]: s.value for s in samples("ray_vllm_prefix_cache_hits_total")}
        queries = {s.labels["ReplicaId"] for s in samples("ray_vllm_prefix_cache_queries_total")}
        if len(queries) == 2 and sum(hits.values()) > 0:
            break
        time.sleep(1)  # polling Ray's export (every second in tests)
    # vLLM's Ray counters start at their first increment: both replicas were queried, and
    # the shared system prompts hit.
    assert len(queries) == 2, f"per-replica prefix-cache query counters missing: {queries}"
    assert sum(hits.values()) > 0, hits


# ------------------------------------------------------------------ sessions (issue 35)
def chat_turn(app: RunningApp, session: str, history: list[dict], turn: int, **extra) -> dict:
    """One turn of a conversation (its history grows by the user text and an answer)."""
    history.append({"role": "user", "content": f"# turn {turn}: extend helper_{turn}\n"})
    body = {"model": "demo", "messages": list(history), "max_tokens": 4, "temperature": 0}
    body |= {"return_token_ids": True, **extra}
    r = httpx.post(
        f"{app.url}/v1/chat/completions",
        json=body,
        headers={"x-session-id": session},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    history.append({"role": "assistant", "content": f"    return value * {turn}\n"})
    return {"body": body, "response": r.json()}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: count - before.get(name, 0) for name, count in after.items()}


def reachable_replicas() -> dict[str, int]:
    """:func:`replica_prefills` of the replicas Serve reaches now (one while one restarts)."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer:demo", "rbln-ray")
    seen: dict[str, int] = {}
    for _ in range(30):
        stats = handle.engine_stats.remote().result()
        seen[stats["actor_name"]] = sum(s["prefill_requests"] for s in stats["steps"])
    return seen


def replica_reports() -> list[dict]:
    """Every replica's routing stats as it would report them now (distinct reports)."""
    from ray import serve

    from rbln_ray.serve.kv_events import report_keys

    handle = serve.get_deployment_handle("LLMServer:demo", "rbln-ray")
    found: dict[frozenset, dict] = {}
    for _ in range(60):
        stats = handle.record_routing_stats.remote().result()
        found[report_keys(stats["kv_blocks"])] = stats
    return list(found.values())


def test_template_bombs_are_refused_and_never_stall_the_app(affinity_app: RunningApp) -> None:
    """Eight chat requests whose chat_template_kwargs carry a template that loops 10^10
    times (they once stalled this app: the router rendered them in the ingress) each get
    vLLM's 400, and an ordinary chat request right after them is answered. Before the fix
    the ingress rendered the templates and the ordinary request timed out."""
    bomb = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x"
    url = f"{affinity_app.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "def main():"}]
    bombs = [{"model": "demo", "messages": messages, "max_tokens": 4,
              "chat_template_kwargs": {"chat_template": bomb}}] * 8  # fmt: skip

    def send(body: dict) -> httpx.Response:
        return httpx.post(url, json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, bombs))
    assert [r.status_code for r in answers] == [400] * 8, [r.text[:200] for r in answers]
    refusals = [r.json()["error"]["message"] for r in answers]  # vLLM's, not rendered
    assert all("untrusted chat template" in m for m in refusals), refusals
    ordinary = send({"model": "demo", "messages": messages, "max_tokens": 4})
    assert ordinary.status_code == 200, ordinary.text


def test_a_session_sticks_moves_when_full_and_survives_its_replica(
    affinity_app: RunningApp,
) -> None:
    """Issue 35, acceptance 2. (1) A 4-turn session lands on one replica, which reports
    holding its last prompt's blocks under the keys the router computes from the prompt's
    tokens (the router's tokenization equals vLLM's renderer's); (2) 16 concurrent turns of
    that session spill to the other replica once its replica is loaded; (3) with that
    replica killed the next turn succeeds, the session continues on the survivor, and the
    replica Serve starts in its place takes new sessions."""
    import ray

    from rbln_ray.serve.cache_routing import PromptTokenizer
    from rbln_ray.serve.kv_events import report_keys
    from rbln_ray.serve.kv_index import chain_hashes
    from rbln_ray.serve.service_times import STATS_PREFILL_S_PER_TOKEN, STATS_SERVICE_S

    tokenizer = PromptTokenizer(str(affinity_app.model_dir))
    history = [{"role": "system", "content": system_prompt(7)}]
    before = replica_prefills()
    turns = [chat_turn(affinity_app, "alice", history, t) for t in range(4)]
    served = delta(before, replica_prefills())
    assert sorted(served.values()) == [0, 4], served
    home = max(served, key=served.get)
    other = next(name for name in served if name != home)
    for turn in turns:  # the router's tokens are the replica's prompt tokens
        assert tokenizer.tokens(turn["body"]) == turn["response"]["prompt_token_ids"]

    last = turns[-1]["response"]["prompt_token_ids"]

    def holders() -> int:
        reports = replica_reports()
        size = next((r["kv_block_size"] for r in reports if r["kv_block_size"]), None)
        keys = set(chain_hashes(last, size)) if size else set()
        return sum(keys <= report_keys(r["kv_blocks"]) for r in reports) if keys else -1

    deadline = time.monotonic() + 60
    while holders() != 1:  # the replica's KV event listener catches up within milliseconds
        assert time.monotonic() < deadline, "no single replica reports the session's blocks"
        time.sleep(0.5)  # polling the replicas' reports
    # the replica that served the turns also reports their times, from vLLM's request stats
    timed = [r for r in replica_reports() if STATS_SERVICE_S in r]
    assert timed and all(r[STATS_PREFILL_S_PER_TOKEN] > 0 for r in timed), replica_reports()

    # (2) a burst of the session's turns: its replica takes them while waiting for one of its
    # decode slots costs less than prefilling the history on the other, the rest go there
    before = replica_prefills()
    burst = [list(history) for _ in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(
            pool.map(
                lambda i: chat_turn(
                    affinity_app, "alice", burst[i], 100 + i, max_tokens=48, ignore_eos=True
                ),
                range(16),
            )
        )
    served = delta(before, replica_prefills())
    assert served[home] >= 5 and served[other] >= 4, served

    # (3) kill the session's replica; the next turn goes on
    ray.kill(ray.get_actor(home, namespace="serve"), no_restart=True)
    before_kill = dict(served)
    chat_turn(affinity_app, "alice", history, 4)
    deadline = time.monotonic() + 600
    while len(seen := reachable_replicas()) != 2 or home in seen:  # Serve replaces it
        assert time.monotonic() < deadline, f"no replacement replica: {seen}"
        time.sleep(1)  # polling Serve's replica set
    new = next(name for name in seen if name != other)
    before = replica_prefills()
    for t in range(5, 8):
        chat_turn(affinity_app, "alice", history, t)
    served = delta(before, replica_prefills())
    assert served == {other: 3, new: 0}, (served, before_kill)
    # new sessions with prompts nobody holds spread by their hash: the new replica takes some
    before = replica_prefills()
    for i in range(12):
        chat_turn(
            affinity_app, f"bob-{i}", [{"role": "system", "content": system_prompt(20 + i)}], 0
        )
    served = delta(before, replica_prefills())
    assert served[new] >= 1 and sum(served.values()) == 12, served
