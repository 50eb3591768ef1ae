"""The emulated ``rebel`` package: the subset of Rebellions' runtime API that optimum-rbln
0.12.0 and vllm-rbln 0.12.0 (its optimum path) use.

Installed as ``sys.modules["rebel"]`` by :func:`rbln_ray.emulator.activate`, with its
submodules (``rebel.compile_context``, ``rebel.core``, ``rebel.core.torch_compile``); never
imported under that name otherwise, so a real ``rebel`` is never shadowed by accident.
``tests/emulator/test_rebel_contract.py`` scans both packages for every ``rebel`` name they
use and fails naming any this package lacks (with an explicit, reasoned exclusion list).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rbln_ray.emulator import devices, ops
from rbln_ray.emulator.compiled_model import CompileGroup, RBLNCompiledModel
from rbln_ray.emulator.rebel import compile_context, core
from rbln_ray.emulator.rebel.compile_context import CompileContext
from rbln_ray.emulator.reports import capture_reports
from rbln_ray.emulator.runtime import Runtime
from rbln_ray.emulator.sampling import manual_seed
from rbln_ray.npu import kinds

__version__ = "0.12.0+emulated"
__rbln_ray_emulated__ = True

logger = logging.getLogger(__name__)

ops.register()


class RBLNRuntimeError(RuntimeError):
    """Raised for runtime failures (kept for API parity)."""


def compile(  # noqa: A001 - mirrors rebel.compile; optimum inspects this signature
    model: Any,
    input_info: list[tuple[str, list[int], Any]] | None = None,
    npu: str | None = None,
    num_devices: int = 1,
    example_inputs: list[torch.Tensor] | None = None,
    compile_context: CompileContext | None = None,
    **kwargs: Any,
) -> RBLNCompiledModel:
    """Compile (snapshot) a torch module; accepts ``num_devices`` (not ``tensor_parallel_size``)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError("the emulator can only compile torch.nn.Module objects")
    if input_info is None:
        raise ValueError("input_info is required")
    if "tensor_parallel_size" in kwargs:
        num_devices = int(kwargs.pop("tensor_parallel_size"))
    group = compile_context.group if compile_context is not None else CompileGroup()
    cm = RBLNCompiledModel.from_torch(model, input_info, group, npu or get_npu_name(0), num_devices)
    logger.debug("emulated compile: %s", cm)
    return cm


def compile_from_torch(
    model: torch.nn.Module,
    input_info: list[tuple[str, list[int], Any]],
    npu: str | None = None,
    num_devices: int = 1,
    example_inputs: list[torch.Tensor] | None = None,
    compile_context: CompileContext | None = None,
    **kwargs: Any,
) -> RBLNCompiledModel:
    """``rebel.compile_from_torch``: see :func:`compile`."""
    return compile(
        model,
        input_info=input_info,
        npu=npu,
        num_devices=num_devices,
        example_inputs=example_inputs,
        compile_context=compile_context,
        **kwargs,
    )


def device_count() -> int:
    """Devices visible to this process (all emulated devices of the node when unrestricted)."""
    return len(devices.visible_physical_ids())


def npu_is_available(device: int = 0) -> bool:
    return 0 <= device < device_count()


def get_npu_name(device: int = 0) -> str | None:
    """The NPU name of a visible device (``RBLN-CA25``, or ``RBLN-CR13`` when emulating
    REBEL: ``RBLN_RAY_EMULATED_NPU``), ``None`` otherwise."""
    return kinds.current().npu_name if npu_is_available(device) else None


__all__ = [
    "CompileContext",
    "RBLNCompiledModel",
    "RBLNRuntimeError",
    "Runtime",
    "capture_reports",
    "compile",
    "compile_context",
    "compile_from_torch",
    "core",
    "device_count",
    "get_npu_name",
    "manual_seed",
    "npu_is_available",
]
