"""CPU emulator of Rebellions' ``rebel`` runtime, so optimum-rbln runs unmodified without an NPU.

Layout (one job per module): ``switch`` (``RBLN_RAY_DEVICE`` and activation), ``rebel`` (the
emulated package surface), ``compiled_model`` / ``runtime`` (compile snapshots, execution,
shared KV), ``ops`` / ``kernels`` (``torch.ops.rbln_custom_ops``), ``devices`` (visibility,
per-node locks, DRAM ledger), ``compile`` (optimum-based compile helper).
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
