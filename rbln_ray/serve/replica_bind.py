"""In single-host mode, the one Serve socket no public option moves: onto 127.0.0.1.

Why an internal (reached through :mod:`rbln_ray.upstream.ray_internals`): Ray Serve 2.60
starts, in every replica, a gRPC server for inter-deployment calls bound to ``[::]:0``
(``ray/serve/_private/replica.py``, ``Replica._on_initialized``:
``add_port_to_grpc_server(self._server, "[::]:0")``); no option or environment variable
changes the address. In rbln-ray's single-host mode
(:mod:`rbln_ray.serve.local_ray`) every other Ray socket follows the node IP 127.0.0.1, so this
one alone would listen on all interfaces (guarded only by Ray's token authentication, which
is on only when a token exists). The replica runs its deployment's constructor before it
starts that server, so each rbln-ray deployment calls :func:`bind_replica_grpc_to_loopback`
first; Serve advertises the server as the replica's node IP (127.0.0.1 here) plus its port,
so callers reach it as before.

Applied only in single-host mode, on Ray 2.60.x, and only while the function it wraps exists;
otherwise it does nothing and says why (then the socket stays on ``[::]``, as in Ray).
"""

from __future__ import annotations

import logging
import os

from rbln_ray.serve.local_ray import LOOPBACK, SINGLE_HOST_ENV

logger = logging.getLogger(__name__)

WILDCARD = "[::]:0"
SUPPORTED_RAY = "2.60."


def bind_replica_grpc_to_loopback() -> bool:
    """Make this replica's inter-deployment gRPC server bind 127.0.0.1; True if arranged."""
    if os.environ.get(SINGLE_HOST_ENV) != "0":
        return False
    import ray

    if not ray.__version__.startswith(SUPPORTED_RAY):
        logger.warning(
            "Ray %s: not moving Serve's replica gRPC server to %s (written for Ray %sx)",
            ray.__version__,
            LOOPBACK,
            SUPPORTED_RAY,
        )
        return False
    from rbln_ray.upstream.ray_internals import rewrite_replica_grpc_bind

    if not rewrite_replica_grpc_bind(lambda a: f"{LOOPBACK}:0" if a == WILDCARD else a):
        logger.warning("Serve's replica module has no add_port_to_grpc_server; left as is")
        return False
    return True
