"""CPU emulator of Rebellions' ``rebel`` runtime, so optimum-rbln runs unmodified without an NPU.

Layout (one job per module): ``switch`` (``RBLN_RAY_DEVICE`` and activation), ``rebel`` (the
emulated package surface, with ``rebel.core.torch_compile``'s ``rbln_backend``),
``compiled_model`` / ``runtime`` (compile snapshots, execution, shared KV), ``kv_host`` (KV
block checks and host transfers), ``ops`` / ``kernels`` / ``sampling``
(``torch.ops.rbln_custom_ops`` and ``torch.ops.rbln``), ``devices`` (visibility, per-node
locks, per-chiplet DRAM ledger; device kinds and budgets are :mod:`rbln_ray.npu`), ``reports``
(``rebel.capture_reports``), ``threads`` (device compute threads), ``timing`` (timing mode),
``call_log`` (the per-process log of runtime calls). Compiling is :mod:`rbln_ray.compile`'s.
"""

from __future__ import annotations

from rbln_ray.emulator.devices import DeviceError, DeviceInfo, list_devices
from rbln_ray.emulator.switch import (
    RuntimeSelectionError,
    activate,
    ensure_runtime,
    is_emulated,
    mode,
    real_rebel_spec,
    require_runtime,
)

__all__ = [
    "DeviceError",
    "DeviceInfo",
    "RuntimeSelectionError",
    "activate",
    "ensure_runtime",
    "is_emulated",
    "list_devices",
    "mode",
    "real_rebel_spec",
    "require_runtime",
]
