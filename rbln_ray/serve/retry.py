"""Which failures of a model call the ingress retries: only those that cannot have run twice.

Why this rule: a request is retried (once, on another replica) only when its replica or that
replica's engine is *known dead* and nothing of the response has reached the client. A dead
actor or a dead engine cannot finish the first attempt, so the retry can never make a
request run to completion twice. Everything else keeps its first answer:

* client errors (4xx) are results, not exceptions: the ingress relays them as they are;
* back-pressure (Serve's ``BackPressureError``) is a 429 for the client to retry later;
* ``ActorUnavailableError`` means "unreachable right now", not dead: the first attempt may
  still be running, so it is not retried (the caller gets a 503);
* any other exception in a replica is a bug or a request-specific failure: a 503.

A replica whose engine died turns itself into a dead actor (``LLMServer`` kills its own
actor), so Serve's router drops it at once (Ray 2.60 ``serve/_private/router.py``: an
``ActorDiedError`` from a replica calls ``on_replica_actor_died``) and the retry lands on
another replica. :class:`ReplicaUnavailableError` covers the moment before that kill lands.
"""

from __future__ import annotations

from ray.exceptions import ActorDiedError, RayTaskError

from rbln_ray.serve.request_metrics import ENGINE_DIED, REPLICA_DIED


class ReplicaUnavailableError(RuntimeError):
    """Raised by a replica whose engine is dead, for a request whose response had not begun."""


def _cause(exc: BaseException) -> BaseException:
    """The replica-side exception a ``RayTaskError`` carries (or ``exc`` itself)."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    return exc


def retry_reason(exc: BaseException) -> str | None:
    """The ``rbln_request_retries_total`` reason if ``exc`` may be retried, else None."""
    cause = _cause(exc)
    if isinstance(cause, ActorDiedError):
        return REPLICA_DIED
    if isinstance(cause, ReplicaUnavailableError):
        return ENGINE_DIED
    return None
