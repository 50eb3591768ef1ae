"""Free TCP ports for processes this process is about to start.

Why not just ``bind(0)`` and close: a port released that way is free again, and the kernel
may hand it out to the very next ``bind(0)``; two components started with "free" ports
picked back to back then collide (Ray refuses to start: "metrics_export is trying to use a
port number ... used by other components"). Ports handed out here are remembered for the
life of the process and never handed out twice.
"""

from __future__ import annotations

import socket
import threading

_issued: set[int] = set()
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now and not returned before by this process."""
    with _lock:
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _issued:
                _issued.add(port)
                return port
