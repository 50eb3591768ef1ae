"""Optional prefix-affinity routing between the replicas of one model.

Why: requests that share a prompt prefix (a system prompt, a few-shot header) land on the same
replica, which keeps their work (and any future prefix reuse) together, while Serve's own
capacity checks still move a request on when that replica is full. Rendezvous hashing of the
first ``PREFIX_CHARS`` characters ranks the replicas: the same prefix always prefers the same
replica, and adding or removing a replica only moves the prefixes that replica owned.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

PREFIX_CHARS = 256


def prompt_prefix(request: Any) -> str:
    """The routing key of a completion or chat request: the start of its prompt text."""
    prompt = getattr(request, "prompt", None)
    if prompt is None and getattr(request, "messages", None) is not None:
        prompt = "\n".join(str(m.get("content", "")) for m in request.messages)
    return str(prompt or "")[:PREFIX_CHARS]


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
        if pending_request is None or not pending_request.args:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = rank(prompt_prefix(pending_request.args[0]), list(by_id))
        return [[by_id[replica_id]] for replica_id in order]
