"""CPU emulator of Rebellions' ``rebel`` runtime, so optimum-rbln runs unmodified without an NPU.

Layout (one job per module): ``switch`` (``RBLN_RAY_DEVICE`` and activation), ``rebel`` (the
emulated package surface, with ``rebel.core.torch_compile``'s ``rbln_backend``),
``compiled_model`` / ``runtime`` (compile snapshots, execution, shared KV), ``kv_host`` (KV
block checks and host transfers), ``ops`` / ``kernels`` / ``sampling``
(``torch.ops.rbln_custom_ops`` and ``torch.ops.rbln``), ``devices`` (visibility, per-node
locks, per-chiplet DRAM ledger), ``device_kinds`` (ATOM / REBEL), ``reports``
(``rebel.capture_reports``), ``threads`` (device compute threads), ``timing`` (timing mode),
``compile`` (optimum-based compile helper).
"""

from __future__ import annotations

from typing import Any

from rbln_ray.emulator.devices import DeviceError, DeviceInfo, list_devices
from rbln_ray.emulator.switch import (
    RuntimeSelectionError,
    activate,
    ensure_runtime,
    is_emulated,
    mode,
    real_rebel_spec,
)


def compile_hf_model(*args: Any, **kwargs: Any):
    """See :func:`rbln_ray.emulator.compile.compile_hf_model` (imported lazily)."""
    from rbln_ray.emulator.compile import compile_hf_model as _compile

    return _compile(*args, **kwargs)


__all__ = [
    "DeviceError",
    "DeviceInfo",
    "RuntimeSelectionError",
    "activate",
    "compile_hf_model",
    "ensure_runtime",
    "is_emulated",
    "list_devices",
    "mode",
    "real_rebel_spec",
]
