"""``rebel.capture_reports()``: per-call timing reports of the runtime calls made in a block.

Why: vllm-rbln 0.12.0 probes ``hasattr(rebel, "capture_reports")`` and, when present, wraps
each model forward and each sampler call in ``with rebel.capture_reports() as reports:``;
with ``VLLM_RBLN_METRICS`` on it reads ``reports[0]["total_host"]``, ``["total_device"]``,
``["total_ccl"]`` and ``reports[1]["prepare_input_us"]`` + ``["prepare_output_us"]``
(``v1/worker/metrics.py``, all logged as microseconds). What the call sites show, and what
this module gives: the context manager yields a list that receives one dict per device
call (a ``rebel.Runtime`` call or a graph compiled by the ``rbln_backend`` torch.compile
backend) made by this thread inside the block, in call order, each with those keys in
integer microseconds. Nested captures each see the calls made inside them.

Emulator meaning of the fields: ``total_device`` = time inside the graph (compute mode) or
the modelled device latency (timing mode); ``prepare_input_us`` = input checks before it;
``prepare_output_us`` = copying results into caller buffers after it; ``total_host`` =
the rest of the call; ``total_ccl`` = 0 (the emulator has no collective communication).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_LOCAL = threading.local()


def _active() -> list[list[dict[str, Any]]]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


@contextlib.contextmanager
def capture_reports() -> Iterator[list[dict[str, Any]]]:
    """Collect a report per device call made by this thread inside the ``with`` block."""
    reports: list[dict[str, Any]] = []
    stack = _active()
    stack.append(reports)
    try:
        yield reports
    finally:
        stack.remove(reports)


def capturing() -> bool:
    """Whether any capture is open in this thread (reports are only built then)."""
    return bool(getattr(_LOCAL, "stack", None))


def record(
    graph: str,
    total_s: float,
    device_s: float,
    prepare_input_s: float = 0.0,
    prepare_output_s: float = 0.0,
) -> None:
    """Add one call's report to every capture open in this thread."""
    stack = getattr(_LOCAL, "stack", None)
    if not stack:
        return
    host_s = max(0.0, total_s - device_s)
    report = {
        "graph": graph,
        "total_host": round(host_s * 1e6),
        "total_device": round(device_s * 1e6),
        "total_ccl": 0,
        "prepare_input_us": round(prepare_input_s * 1e6),
        "prepare_output_us": round(prepare_output_s * 1e6),
    }
    for reports in stack:
        reports.append(dict(report))
