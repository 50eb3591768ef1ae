"""Per-process log of emulated runtime calls, and the vLLM worker extension that reads it.

Why: benchmarks split a step's time into device and host time; every emulated ``Runtime``
call (compute or timing mode) and every KV copy lands here, and
``worker_extension_cls="rbln_ray.emulator.call_log.RuntimeCallsExtension"`` lets a benchmark
read the log of every worker with ``collective_rpc("emulator_calls")``. The extension is
duck-typed (no vLLM import), so Rebellions' own vLLM plugin can load it too.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from rbln_ray.common import envs


@dataclass
class CallRecord:
    start: float  # time.perf_counter() at entry
    end: float
    modelled_s: float | None  # None in compute mode
    # "prefill", "decode", "verify" (several tokens per row, a decode graph), "copy" (on the
    # device) or "host" (a host KV transfer)
    kind: str
    batch: int
    graph: str = ""  # the compiled directory the graph belongs to (a draft model's vs a target's)


class Recorder:
    """Per-process log of runtime calls: totals plus the last ``maxlen`` calls."""

    def __init__(self, maxlen: int = 20000) -> None:
        self._lock = threading.Lock()
        self.calls: deque[CallRecord] = deque(maxlen=maxlen)
        self.total_calls = 0
        self.total_seconds = 0.0
        self.total_modelled = 0.0
        # modelled mode: calls whose real compute took longer than the modelled device time
        # (the call then lasted its compute time, not the model's)
        self.overrun_calls = 0
        self.overrun_seconds = 0.0

    def add(self, rec: CallRecord, overrun_s: float = 0.0) -> None:
        with self._lock:
            self.calls.append(rec)
            self.total_calls += 1
            self.total_seconds += rec.end - rec.start
            self.total_modelled += rec.modelled_s or 0.0
            if overrun_s > 0:
                self.overrun_calls += 1
                self.overrun_seconds += overrun_s

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.total_calls, self.total_seconds, self.total_modelled = 0, 0.0, 0.0
            self.overrun_calls, self.overrun_seconds = 0, 0.0

    def snapshot(self) -> dict[str, Any]:
        import torch

        with self._lock:
            return {
                "pid": os.getpid(),
                "mode": envs.get("RBLN_RAY_EMULATOR_MODE"),
                "torch_threads": torch.get_num_threads(),  # what compute-mode calls ran on
                "total_calls": self.total_calls,
                "total_seconds": self.total_seconds,
                "total_modelled_seconds": self.total_modelled,
                "overrun_calls": self.overrun_calls,
                "overrun_seconds": self.overrun_seconds,
                "calls": [asdict(c) for c in self.calls],
            }


RECORDER = Recorder()


def snapshot(*_: Any) -> dict[str, Any]:
    """Recorded calls of this process (usable as a ``collective_rpc`` callable)."""
    return RECORDER.snapshot()


def reset(*_: Any) -> bool:
    RECORDER.reset()
    return True


def describe(inputs: tuple[Any, ...], decode_graph: bool = False) -> tuple[str, int, int]:
    """(kind, batch, tokens per row) of a call from its first input ``[batch, tokens]``.

    ``decode_graph``: the graph takes a block table per row (a decode graph); several tokens
    per row are then a speculative-decoding verify call, else a prefill chunk."""
    first = inputs[0]
    batch, length = (int(first.shape[0]), int(first.shape[1])) if first.dim() >= 2 else (1, 1)
    if length == 1:
        return "decode", batch, length
    return ("verify" if decode_graph else "prefill"), batch, length


def is_decode_graph(input_info: list[tuple[str, Any, Any]]) -> bool:
    """Whether a compiled graph takes one block-table row per sequence (``[B, blocks]``)."""
    return any(n == "block_tables" and len(shape) == 2 for n, shape, _ in input_info)


def record_call(
    start: float,
    inputs: tuple[Any, ...],
    modelled_s: float | None = None,
    *,
    decode_graph: bool = False,
    graph: str = "",
    overrun_s: float = 0.0,
) -> None:
    kind, batch, _ = describe(inputs, decode_graph)
    RECORDER.add(CallRecord(start, time.perf_counter(), modelled_s, kind, batch, graph), overrun_s)


def record_copy(start: float, modelled_s: float | None = None, kind: str = "copy") -> None:
    """Log one ``_copy_kv_cache`` call (kind ``"copy"``, batch 1), or a host KV transfer
    (kind ``"host"``)."""
    RECORDER.add(CallRecord(start, time.perf_counter(), modelled_s, kind, 1))


class RuntimeCallsExtension:
    """vLLM ``worker_extension_cls``: exposes this process's runtime-call log to
    ``collective_rpc("emulator_calls")`` / ``collective_rpc("emulator_calls_reset")``."""

    def emulator_calls(self) -> dict[str, Any]:
        return snapshot()

    def emulator_calls_reset(self) -> bool:
        return reset()
