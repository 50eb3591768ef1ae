"""``rebel.Runtime`` for the emulator: run a compiled snapshot eagerly on CPU.

Why KV sharing works the way it does: optimum creates one runtime per compiled graph
(prefill, decoder_batch_N...) in one go, and all of them must read and write the *same*
static KV buffers (``CompileContext.mark_static_address``). A second load of the same
artifact must get its own buffers. So buffers live in a ``_Load``: a runtime joins the most
recent live load of its compile group that has not yet claimed its graph, else starts a new
load. Loads are weakly registered and die with their runtimes, releasing device memory.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from rbln_ray.common.dtypes import torch_dtype
from rbln_ray.emulator import call_log, devices, reports, threads, timing
from rbln_ray.emulator.compiled_model import RBLNCompiledModel, graph_outputs
from rbln_ray.emulator.kv_host import KVHostTransfer, check_blocks, check_slots
from rbln_ray.emulator.speech_timing import graph_timing
from rbln_ray.npu import kinds

logger = logging.getLogger(__name__)

_REGISTRY_LOCK = threading.Lock()
_LOADS: dict[str, list[weakref.ReferenceType]] = {}
_COUNTER = itertools.count()


class _Load:
    """KV buffers and device charges shared by the runtimes of one model load."""

    def __init__(self, group_id: str, device_keys: list[tuple[str, int]]):
        self.group_id = group_id
        self.name = f"load-{group_id[:8]}-{next(_COUNTER)}"
        self.device_keys = device_keys
        self.claimed: set[str] = set()
        self.buffers: dict[str, torch.Tensor] = {}
        self.weights_charged = False
        acquired: list[tuple[str, int]] = []
        try:
            for key in device_keys:
                acquired.append(devices.LEDGER.acquire(key[1]))
        except Exception:
            _release(acquired, self.name)
            raise
        weakref.finalize(self, _release, list(device_keys), self.name)

    def charge(self, nbytes: int, what: str) -> None:
        share = nbytes // max(1, len(self.device_keys))
        for key in self.device_keys:
            devices.LEDGER.charge(key, self.name, share, what)

    def buffer(self, name: str, shape: list[int], dtype: str) -> torch.Tensor:
        existing = self.buffers.get(name)
        if existing is not None:
            if list(existing.shape) != list(shape):
                raise RuntimeError(
                    f"static buffer {name} has shape {list(existing.shape)} in this load but a "
                    f"graph expects {shape}"
                )
            return existing
        with torch.inference_mode(False):
            tensor = torch.zeros(shape, dtype=torch_dtype(dtype))
        self.buffers[name] = tensor
        return tensor


def _release(device_keys: list[tuple[str, int]], owner: str) -> None:
    for key in device_keys:
        devices.LEDGER.release(key, owner)


def _join_load(cm: RBLNCompiledModel, device_keys: list[tuple[str, int]]) -> _Load:
    with _REGISTRY_LOCK:
        refs = _LOADS.setdefault(cm.group_id, [])
        refs[:] = [r for r in refs if r() is not None]
        for ref in reversed(refs):
            load = ref()
            if load is not None and cm.graph_id not in load.claimed:
                if load.device_keys != device_keys:
                    continue
                load.claimed.add(cm.graph_id)
                return load
        load = _Load(cm.group_id, device_keys)
        load.claimed.add(cm.graph_id)
        refs.append(weakref.ref(load))
        return load


def _devices_for(device: int | Sequence[int] | None, num_devices: int) -> list[int]:
    if device is None:
        logical = list(range(num_devices))
    elif isinstance(device, int):
        logical = [device]
    else:
        logical = [int(d) for d in device]
    if len(logical) != num_devices:
        raise ValueError(f"model was compiled for {num_devices} device(s) but got device={device}")
    return [devices.to_physical(d) for d in logical]


def _check_npu(cm: RBLNCompiledModel) -> None:
    """A graph compiled for one NPU family does not run on another (as on hardware)."""
    here = kinds.current()
    if cm.npu and kinds.kind_by_name(cm.npu) != here:
        raise devices.DeviceError(
            f"{cm!r} was compiled for {cm.npu} but this node's emulated devices are "
            f"{here.npu_name} ({kinds.KIND_ENV}={here.family.lower()}); recompile for "
            f"{here.npu_name} or set {kinds.KIND_ENV}"
        )


class _InOrder:
    """A graph whose static buffers are not all after its other inputs (optimum-rbln's
    Qwen3.5 decoder declares its state masks after its static states), called the runtime's
    way, ``(*inputs, *static)``: each argument goes where the graph declared it."""

    def __init__(self, module: Any, order: list[str], inputs: list[str], static: list[str]):
        self.module = module
        given = {name: i for i, name in enumerate([*inputs, *static])}
        self._index = [given[name] for name in order]

    def __call__(self, *args: Any) -> Any:
        return self.module(*(args[i] for i in self._index))


# graph id -> the non-static inputs its graph reads (a compiled graph takes only those)
_USED_INPUTS: dict[str, list[str]] = {}
_USED_LOCK = threading.Lock()


def used_inputs(cm: RBLNCompiledModel) -> list[str]:
    """The non-static inputs ``cm``'s graph reads, in ``input_info`` order.

    rebel's compiler drops an input the graph never reads, and its runtime takes only the
    others (``Runtime._index_to_input_name``): optimum-rbln's Qwen3.5 decode graphs declare
    state masks they do not use. Found once per graph by tracing it (``make_fx``, real mode)
    on zero tensors of its compiled shapes, static buffers included as zeros of their own
    (never a load's live buffers, which the trace's cache writes would change)."""
    with _USED_LOCK:
        if cm.graph_id in _USED_INPUTS:
            return _USED_INPUTS[cm.graph_id]
    from torch.fx.experimental.proxy_tensor import make_fx

    shapes = {name: (shape, dtype) for name, shape, dtype in cm.input_info}
    shapes.update({name: tuple(spec) for name, spec in cm.kv_shapes.items()})
    order = cm.input_order
    args = [torch.zeros(shapes[n][0], dtype=torch_dtype(shapes[n][1])) for n in order]
    with torch.no_grad():
        graph = make_fx(lambda *a: cm.module(*a), tracing_mode="real")(*args)
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    read = {name for name, node in zip(order, placeholders, strict=True) if node.users}
    used = [name for name, _, _ in cm.input_info if name in read]
    with _USED_LOCK:
        _USED_INPUTS[cm.graph_id] = used
    return used


def is_paged(name: str) -> bool:
    """A static buffer of paged KV blocks (``past_key_values_*``), not another static state
    (Qwen3.5's ``conv_state_*`` / ``recurrent_state_*``, one row per batch slot)."""
    return "past_key_values" in name


class Runtime(KVHostTransfer):
    """Executes one compiled graph; call as ``rt(*inputs, out=[...])``.

    Callers pass the non-KV inputs in ``input_info`` order (or only those the graph reads,
    as rebel's runtime takes them: :attr:`_index_to_input_name`); the runtime adds its static
    buffers (shared with the other graphs of the same load) where the graph declared them. KV
    block methods (on the paged KV buffers): ``_copy_kv_cache`` (on-device copy), and
    ``_fetch_kv_cache`` / ``_update_kv_cache`` / ``_get_kv_cache_size`` (host transfers,
    :mod:`rbln_ray.emulator.kv_host`).
    """

    def __init__(
        self,
        compiled_model: RBLNCompiledModel,
        tensor_type: str = "pt",
        device: int | Sequence[int] | None = None,
        activate_profiler: bool | None = None,
        timeout: int | None = None,
        **kwargs: Any,
    ):
        if tensor_type != "pt":
            raise NotImplementedError("the emulator only supports tensor_type='pt'")
        self._cm = compiled_model
        _check_npu(compiled_model)
        physical = _devices_for(device, compiled_model.num_devices)
        node = devices.node_id()
        keys = [(node, p) for p in physical]
        self._load = _join_load(compiled_model, keys)
        load = self._load
        try:
            kv = compiled_model.kv_shapes
            new_kv = sum(
                b for name, b in compiled_model.kv_bytes().items() if name not in load.buffers
            )
            need = compiled_model.program_bytes() + new_kv
            if not load.weights_charged:
                need += compiled_model.weight_bytes
            load.charge(need, f"model graph {compiled_model.graph_id[:8]}")
            load.weights_charged = True
            self._kv = [load.buffer(name, *kv[name]) for name in kv]
        except Exception:
            load.claimed.discard(compiled_model.graph_id)
            raise
        names = [n for n, _, _ in compiled_model.input_info]
        static = list(compiled_model.kv_shapes)
        self._module = compiled_model.module
        if compiled_model.input_order != [*names, *static]:
            self._module = _InOrder(self._module, compiled_model.input_order, names, static)
        self._num_inputs = len(compiled_model.input_info)
        # the input shapes of each compiled variant (rebel runs the graph a call's shapes match)
        self._variants = [
            tuple(tuple(shape) for _, shape, _ in variant)
            for variant in compiled_model.input_variants
        ]
        self.physical_devices = physical
        # Timing mode (see rbln_ray.emulator.timing): sleep the modelled latency, zero outputs;
        # modelled mode: compute, then sleep the rest of the modelled latency.
        mode = timing.emulator_mode()
        self._modelled = mode == "modelled"
        self._timing = graph_timing(compiled_model) if mode != "compute" else None
        self._decode_graph = call_log.is_decode_graph(compiled_model.input_info)
        self._graph = timing.compiled_dir_name(compiled_model)
        logger.debug("emulated runtime on devices %s (node %s)", physical, node)

    def __call__(self, *inputs: torch.Tensor, out: Any = None, **named: torch.Tensor) -> Any:
        return self.run(*inputs, out=out, **named)

    def _bind(self, inputs: tuple[torch.Tensor, ...], named: dict[str, torch.Tensor]) -> tuple:
        """Inputs by position, then by their compiled names (optimum-rbln's generic encoders
        call ``runtime(input_ids=..., attention_mask=...)``), in the compiled order."""
        names = [n for n, _, _ in self._cm.input_info]
        unknown = sorted(set(named) - set(names))
        twice = sorted(set(named) & set(names[: len(inputs)]))
        if unknown or twice:
            problem = f"unknown inputs {unknown}" if unknown else f"inputs {twice} given twice"
            raise ValueError(f"{problem}; the compiled inputs are {names}")
        missing = [n for n in names[len(inputs) :] if n not in named]
        if missing:
            raise ValueError(f"missing inputs {missing}; the compiled inputs are {names}")
        return (*inputs, *(named[n] for n in names[len(inputs) :] if n in named))

    @property
    def _index_to_input_name(self) -> dict[int, str]:
        """rebel's map from a call's argument index to its input: the graph's non-static
        inputs it reads, in order (:func:`used_inputs`)."""
        return dict(enumerate(used_inputs(self._cm)))

    def _with_unread(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A call with only the inputs the graph reads, completed with zeros for the others
        (which the graph never reads); any other count is an error."""
        names = [n for n, _, _ in self._cm.input_info]
        used = used_inputs(self._cm) if len(inputs) < self._num_inputs else []
        if len(inputs) != len(used) or len(used) == self._num_inputs:
            raise ValueError(f"expected {self._num_inputs} inputs {names}, got {len(inputs)}")
        given = dict(zip(used, inputs, strict=True))
        return tuple(
            given[n] if n in given else torch.zeros(shape, dtype=torch_dtype(dtype))
            for n, shape, dtype in self._cm.input_info
        )

    def run(self, *inputs: torch.Tensor, out: Any = None, **named: torch.Tensor) -> Any:
        entered = time.perf_counter()
        if named:
            inputs = self._bind(inputs, named)
        if len(inputs) != self._num_inputs:
            inputs = self._with_unread(inputs)
        self._check_shapes(inputs)
        targets = None if out is None else out if isinstance(out, (list, tuple)) else [out]
        start = time.perf_counter()
        if self._timing is not None and not self._modelled:
            outputs = self._timing.run(self._module, inputs, self._kv, start, targets)
        else:
            with torch.no_grad(), threads.device_threads():
                result = self._module(*inputs, *self._kv)
            outputs = graph_outputs(result)
            if self._timing is not None:  # modelled: the rest of the modelled device time
                self._timing.finish_modelled(inputs, start)
            else:
                call_log.record_call(
                    start, inputs, decode_graph=self._decode_graph, graph=self._graph
                )
        computed = time.perf_counter()
        if targets is not None:
            if len(targets) != len(outputs):
                # A compiled graph's outputs are fixed; a buffer left unwritten would hand the
                # caller uninitialised memory.
                raise ValueError(
                    f"{len(targets)} output buffers for a graph with {len(outputs)} outputs"
                )
            for target, value in zip(targets, outputs, strict=True):
                if value is not target:  # timing mode wrote into the buffers already
                    target.copy_(value.reshape(target.shape))
            result = out if isinstance(out, (list, tuple)) and len(out) > 1 else targets[0]
        else:
            result = outputs[0] if len(outputs) == 1 else outputs
        if reports.capturing():  # rebel.capture_reports(): one report per call
            done = time.perf_counter()
            reports.record(
                f"graph-{self._cm.graph_id[:8]}",
                total_s=done - entered,
                device_s=computed - start,
                prepare_input_s=start - entered,
                prepare_output_s=done - computed,
            )
        return result

    forward = run

    def _check_shapes(self, inputs: tuple[torch.Tensor, ...]) -> None:
        got = tuple(tuple(t.shape) for t in inputs)
        if got in self._variants:
            return
        if len(self._variants) == 1:
            for i, (shape, want) in enumerate(zip(got, self._variants[0], strict=True)):
                if shape != want:
                    name = self._cm.input_info[i][0]
                    raise ValueError(
                        f"input {i} ({name}) has shape {list(shape)}; compiled for {list(want)}"
                    )
        names = [n for n, _, _ in self._cm.input_info]
        compiled = [dict(zip(names, map(list, v), strict=True)) for v in self._variants]
        raise ValueError(
            f"inputs of shapes {dict(zip(names, map(list, got), strict=True))} match none of "
            f"the {len(compiled)} compiled input shapes {compiled}"
        )

    def _copy_kv_cache(self, src_block: int, dst_block: int, length: int) -> None:
        """Copy the first ``length`` token slots of KV block ``src_block`` into ``dst_block``,
        in every static KV buffer of this load (all layers' K and V), on the device.

        Rebellions' runtime method of the same name; vllm-rbln 0.12 calls it on the prefill
        runtime to reuse a cached prefix that lives in another sequence's block. Block ids
        are the compiled KV block ids (``[num_blocks, Hkv, 1, block, D]`` buffers); an id
        out of range or a length past the block is an error, never a silent partial copy.
        """
        src, dst, length = int(src_block), int(dst_block), int(length)
        buffers = self.kv_buffers
        if not buffers:
            raise RuntimeError(f"{self!r} has no KV cache to copy")
        op = f"_copy_kv_cache({src}, {dst}, {length})"
        for name, buf in buffers.items():
            check_blocks(op, name, buf, (src, dst))
            check_slots(op, name, buf, 0, length)
        start = time.perf_counter()
        if self._timing is not None and not self._modelled:
            self._timing.sleep_copy(length, start)
            return
        if src != dst and length > 0:
            for buf in buffers.values():
                buf[dst, ..., :length, :] = buf[src, ..., :length, :]
        if self._timing is not None:
            self._timing.sleep_copy(length, start)
        else:
            call_log.record_copy(start)

    @property
    def kv_buffers(self) -> dict[str, torch.Tensor]:
        """The paged KV tensors this runtime adds (shared within one load); other static
        states (:func:`is_paged`) are no KV blocks to copy or transfer."""
        return {
            name: buf
            for name, buf in zip(self._cm.kv_shapes, self._kv, strict=True)
            if is_paged(name)
        }

    def __repr__(self) -> str:
        mode = "emulated"
        if self._timing is not None:
            mode = "modelled" if self._modelled else "timing"
        return f"<rebel.Runtime ({mode}) devices={self.physical_devices} {self._cm!r}>"
