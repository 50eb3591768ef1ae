"""``rebel.core.torch_compile.rbln_backend``: a ``torch.compile`` backend that runs on the CPU.

Why: vllm-rbln 0.12.0 compiles its sampler (``v1/sample/rbln_sampler.py``), its rejection
sampler and, on its non-optimum path, whole models with
``torch.compile(fn, backend=rbln_backend, dynamic=False, fullgraph=True, options={...})``
(``vllm_rbln/compilation/compiler.py``); torch hands the options to the backend as
``options=``. On an NPU the backend compiles the FX graph for the device and returns a
runtime; the emulator validates the same options, keeps the FX graph and runs it eagerly
(the ``torch.ops.rbln.*`` calls in it reach :mod:`rbln_ray.emulator.sampling`).

Options (the set vllm-rbln 0.12.0 passes; anything else is refused, naming it):

=========================  ===================================================================
``compile_context``        a ``rebel.CompileContext`` (graphs of one context share buffers);
                           accepted, nothing to share for a stateless graph
``num_devices``            devices the graph spans; only 1 is emulated
``global_device_id``       logical device the graph runs on (checked against the visible
                           devices, as a runtime placement would be); default 0
``use_global_ctx``         run in the process-wide device context; accepted
``mode``                   list of ``"strict"`` (accepted: unsupported ops already fail) and
                           ``"compile_only"`` (the result refuses to run, like a graph with
                           no runtime)
``_runtime_holder``        a list; the runtime object (:class:`GraphRuntime`) is appended
``model_trace_method``     ``""`` or ``"export"``; accepted (the FX graph is already traced)
``process_group_dict``     collective groups; accepted (single device)
``guard_filter_fn``        dynamo guard filter; accepted (guards stay dynamo's)
``use_static_output``      reuse output buffers; accepted (outputs are fresh tensors)
``cache_dir``,             rebel's compile cache; accepted, nothing is cached (compiling an FX
``mega_cache_only``        graph for the CPU is immediate)
``dtype``                  compile dtype: refused unless empty; the emulator runs the graph in
                           its own dtypes (``rebel.compile`` has no ``dtype`` parameter either,
                           which is what vllm-rbln's ``check_dtype_option_supported`` probes)
=========================  ===================================================================
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rbln_ray.emulator import devices, reports, threads

logger = logging.getLogger(__name__)

ACCEPTED_OPTIONS = frozenset(
    {
        "compile_context",
        "num_devices",
        "global_device_id",
        "use_global_ctx",
        "mode",
        "_runtime_holder",
        "model_trace_method",
        "process_group_dict",
        "guard_filter_fn",
        "use_static_output",
        "cache_dir",
        "mega_cache_only",
        "dtype",
    }
)
MODES = frozenset({"strict", "compile_only"})
_COUNTER = itertools.count(1)


class GraphRuntime:
    """The emulated runtime of one compiled FX graph: ``rt(*inputs)`` runs it eagerly."""

    def __init__(self, gm: torch.fx.GraphModule, device: int, compile_only: bool) -> None:
        self.graph_module = gm
        self.device = device
        self.compile_only = compile_only
        self.name = f"torch_compile#{next(_COUNTER)}"

    def __call__(self, *inputs: Any) -> Any:
        if self.compile_only:
            raise RuntimeError(
                f"{self.name} was compiled with mode 'compile_only' (VLLM_RBLN_COMPILE_ONLY); "
                "it has no runtime to execute"
            )
        start = time.perf_counter()
        with torch.no_grad(), threads.device_threads():
            out = self.graph_module(*inputs)
        if reports.capturing():
            elapsed = time.perf_counter() - start
            reports.record(self.name, elapsed, elapsed)
        return out

    def __repr__(self) -> str:
        return f"<rebel GraphRuntime (emulated) {self.name} device={self.device}>"


def _modes(value: Any) -> list[str]:
    if value in (None, ""):
        return []
    items = [value] if isinstance(value, str) else list(value)
    unknown = [m for m in items if m not in MODES]
    if unknown:
        raise ValueError(f"rbln_backend: unknown mode(s) {unknown}; known: {sorted(MODES)}")
    return items


def rbln_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Compile ``gm`` for the emulated device: validate ``options``, return a runner."""
    options = dict(options or {})
    unknown = sorted(set(options) - ACCEPTED_OPTIONS)
    if unknown:
        raise TypeError(
            f"rbln_backend got unknown option(s) {unknown}; the emulator accepts "
            f"{sorted(ACCEPTED_OPTIONS)}"
        )
    if options.get("dtype"):
        raise NotImplementedError(
            f"rbln_backend: compile option dtype={options['dtype']!r} is not emulated; the "
            "emulator runs graphs in their own dtypes"
        )
    num_devices = options.get("num_devices") or 1
    if int(num_devices) != 1:
        raise NotImplementedError(f"rbln_backend: num_devices={num_devices}; only 1 is emulated")
    modes = _modes(options.get("mode")) + _modes(mode)
    device = int(options.get("global_device_id") or 0)
    devices.to_physical(device)  # raises naming the visible devices if it is not one of them
    runtime = GraphRuntime(gm, device, compile_only="compile_only" in modes)
    holder = options.get("_runtime_holder")
    if holder is not None:
        holder.append(runtime)
    logger.debug(
        "rbln_backend: %s (%d inputs, modes %s) on device %d",
        runtime.name,
        len(example_inputs),
        modes,
        device,
    )
    return runtime
