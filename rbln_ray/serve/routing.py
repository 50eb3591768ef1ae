"""Request routers between the replicas of one model.

* :class:`PrefixAffinityRouter` (``routing: prefix_affinity``): requests that share a prompt
  prefix (a system prompt, a few-shot header) land on the same replica, which keeps their
  work (and its prefix cache) together, while Serve's own capacity checks still move a
  request on when that replica is full. Rendezvous hashing of the call's prefix
  (:attr:`~rbln_ray.serve.http_call.HTTPCall.prefix`) ranks the replicas: the same prefix
  always prefers the same replica, and adding or removing a replica only moves the prefixes
  that replica owned.
* :class:`ResponseAffinityRouter` (models with ``responses_store``): a call about a stored
  Responses API response (retrieve, cancel, ``previous_response_id``) goes to the replica
  holding it (:attr:`~rbln_ray.serve.http_call.HTTPCall.replica`); other calls are load
  balanced as Serve's default router does (two random replicas, the less loaded one).

Both honour a call's required replica, and neither hands requests out in FIFO order: Serve's
``FIFOMixin`` gives a chosen replica to the oldest waiting request, which could be another
request than the one pinned to it.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from ray.serve.request_router import LocalityMixin, PendingRequest, RequestRouter, RunningReplica

from rbln_ray.serve.http_call import PREFIX_CHARS, routing_prefix


def prompt_prefix(request: Any) -> str:
    """The routing key of a request: an :class:`HTTPCall`'s prefix, or the start of a parsed
    request's prompt text (``RBLNClient``-style objects)."""
    prefix = getattr(request, "prefix", None)
    if isinstance(prefix, str):
        return prefix
    return routing_prefix(request)[:PREFIX_CHARS]


def required_replica(pending_request: PendingRequest | None) -> str | None:
    """The replica (unique id) a call must reach, if it names one."""
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "replica", None)


def pinned(candidates: list[RunningReplica], replica: str) -> list[list[RunningReplica]]:
    """That replica; or, when it is gone, any (whose vLLM answers 404 for a response it
    never stored, as a restarted ``vllm serve`` would)."""
    chosen = [r for r in candidates if r.replica_id.unique_id == replica]
    return [chosen] if chosen else [candidates]


def fixed_choice(
    candidates: list[RunningReplica], pending_request: PendingRequest | None
) -> list[list[RunningReplica]] | None:
    """The choice no routing policy weighs, else None: a call without arguments (Serve's
    own) may go to any replica, one that names its replica goes there (:func:`pinned`)."""
    if pending_request is None or not pending_request.args:
        return [candidates]
    replica = required_replica(pending_request)
    return pinned(candidates, replica) if replica else None


def rank(prefix: str, replica_ids: list[str]) -> list[str]:
    """Replica ids ordered by rendezvous hash with ``prefix`` (most preferred first)."""

    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{prefix}\0{replica_id}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)


class PrefixAffinityRouter(RequestRouter):
    """Serve request router: prefer the prefix's replica, then the others in hash order."""

    # How long Serve waits for a replica's queue length before it routes to the next replica
    # in our order (Serve's default 0.1 s, ``RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S``).
    # A replica busy with its engine may answer later than that, and the request then leaves
    # its prefix's replica although that one has room: on a loaded 2-core host 3 of a
    # group's first 8 requests went elsewhere (the prefix-affinity end-to-end test). A full
    # replica still answers at once and a dead one fails at once, so only a slow answer
    # waits longer; a prefix-cache hit saves far more than the wait.
    queue_len_response_deadline_s = max(RequestRouter.queue_len_response_deadline_s, 0.5)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        fixed = fixed_choice(candidate_replicas, pending_request)
        if fixed is not None:
            return fixed
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = rank(prompt_prefix(pending_request.args[0]), list(by_id))
        return [[by_id[replica_id]] for replica_id in order]


class ResponseAffinityRouter(LocalityMixin, RequestRouter):
    """Serve request router: a call's required replica, else the less loaded of two random
    replicas (on this node first, as Serve's default router)."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        replica = required_replica(pending_request)
        if replica:
            return pinned(candidate_replicas, replica)
        near = self.apply_locality_routing(pending_request=pending_request)
        pool = [r for r in candidate_replicas if r.replica_id in near] or candidate_replicas
        return [random.sample(pool, min(2, len(pool)))]
