"""The emulator's "compiled model": a snapshot of the traced torch module plus its I/O contract.

Why: optimum-rbln compiles one wrapper object several times (prefill, then each decode batch
size) and mutates ``wrapper.phase`` in between, so each compile keeps its own structural copy
of the module (parameters are shared, not copied). KV inputs arrive as meta tensors at compile
time and flash attention with automatic block counts compiles with one block and multiplies
later, so only KV *shapes* are stored; runtimes allocate the real buffers.

Saved ``.rbln`` files are ``torch.save`` pickles loaded with ``weights_only=False``, so a file
is loaded only when :func:`rbln_ray.emulator.trusted_files.opened_trusted` trusts it (owner,
modes, and the digest written beside it at save time).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import pickle
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rbln_ray.common.dtypes import torch_dtype
from rbln_ray.emulator.trusted_files import opened_trusted, write_digest
from rbln_ray.npu import kinds

logger = logging.getLogger(__name__)

FORMAT = "rbln-ray-emulated/1"
_ALIGN = 2**21
_SHARED_WEIGHTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _align(n: int) -> int:
    return int(math.ceil(n / _ALIGN) * _ALIGN)


@dataclass
class CompileGroup:
    """State shared by every graph compiled in one ``CompileContext`` (weight sharing)."""

    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    static_names: dict[str, torch.Tensor] = field(default_factory=dict)
    weights_owner: str | None = None


def _snapshot(module: torch.nn.Module) -> torch.nn.Module:
    """Structural deep copy that shares parameters and buffers with the original."""
    memo: dict[int, Any] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        memo[id(tensor)] = tensor
    return copy.deepcopy(module, memo)


def graph_outputs(result: Any) -> list[torch.Tensor]:
    """A graph's outputs as a compiled graph returns them: a flat list of tensors, nested
    outputs flattened in order and ``None`` left out, as tracing does. A module that returns a
    mapping (a transformers ``ModelOutput``, e.g. a classifier's ``SequenceClassifierOutput``
    when its ``return_dict`` cannot be switched off) gives its values in order; a vision
    tower compiled with ``output_hidden_states`` gives its last state, its pooled output, then
    every layer's state (optimum's LLaVA pre-allocates one output buffer for each)."""
    if isinstance(result, Mapping):
        result = list(result.values())
    if isinstance(result, (tuple, list)):
        return [t for item in result if item is not None for t in graph_outputs(item)]
    return [result]


def _weight_bytes(module: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.device.type != "meta":
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


class RBLNCompiledModel:
    """``rebel.RBLNCompiledModel``: load with ``RBLNCompiledModel(path)``, persist with ``save``."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, _payload: dict | None = None):
        if _payload is None:
            if path is None:
                raise TypeError("RBLNCompiledModel needs a path")
            with opened_trusted(path) as checked:  # the file checked is the file loaded
                _payload = torch.load(checked, map_location="cpu", weights_only=False, mmap=True)
            if not isinstance(_payload, dict) or _payload.get("format") != FORMAT:
                raise ValueError(f"{path} is not an emulated RBLN compiled model ({FORMAT})")
            _share_weights(_payload["module"], _payload["group_id"])
            _restore_output_capture(_payload["module"])
        self._p = _payload
        self.path = Path(path) if path is not None else None

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_torch(
        cls,
        module: torch.nn.Module,
        input_info: list[tuple[str, list[int], Any]] | list[list[tuple[str, list[int], Any]]],
        group: CompileGroup,
        npu: str | None,
        num_devices: int,
    ) -> RBLNCompiledModel:
        """Snapshot ``module`` for ``input_info``: one list of ``(name, shape, dtype)``, or
        several (rebel compiles one graph per list, and its runtime runs the one whose input
        shapes a call matches; optimum-rbln 0.12 compiles Qwen2-VL's vision tower so, one
        list per ``max_seq_len``). The variants must agree on names, order and KV inputs."""
        graph_id = uuid.uuid4().hex
        variants = input_info if is_multiple_input_info(input_info) else [input_info]
        first = variants[0]
        static = set(group.static_names) or {n for n, _, _ in first if "past_key_values" in n}
        kv: dict[str, tuple[list[int], str]] = {}
        shapes: list[list[tuple[str, list[int], str]]] = []
        for variant in variants:
            if [n for n, _, _ in variant] != [n for n, _, _ in first]:
                raise ValueError(
                    "input_info variants must name the same inputs in the same order: "
                    f"{[n for n, _, _ in first]} vs {[n for n, _, _ in variant]}"
                )
            inputs = []
            for name, shape, dtype in variant:
                spec = (list(shape), str(torch_dtype(dtype)).replace("torch.", ""))
                if name not in static:
                    inputs.append((name, *spec))
                elif kv.setdefault(name, spec) != spec:
                    raise ValueError(f"input_info variants disagree on static buffer {name}")
            shapes.append(inputs)
        if group.weights_owner is None:
            group.weights_owner = graph_id
        snap = _snapshot(module).eval()
        payload = {
            "format": FORMAT,
            "module": snap,
            "inputs": shapes[0],
            "kv": kv,
            "input_order": [name for name, _, _ in first],
            "graph_id": graph_id,
            "group_id": group.group_id,
            "owns_weights": group.weights_owner == graph_id,
            "weight_bytes": _weight_bytes(snap),
            "npu": npu,
            "num_devices": int(num_devices or 1),
        }
        if len(shapes) > 1:
            payload["input_variants"] = shapes
        return cls(_payload=payload)

    def save(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            torch.save(self._p, tmp)
        except (AttributeError, pickle.PicklingError):
            # rebel stores a compiled graph, which holds no Python classes; the emulator stores
            # the module itself, and a wrapper class defined inside a function (optimum-rbln
            # 0.12's generic RBLNTransformerEncoder._wrap_model_if_needed, for XLM-R, RoBERTa,
            # ...) cannot be pickled by reference: cloudpickle stores that class by value.
            # The file still loads with torch.load (cloudpickle's reconstructors are importable).
            import cloudpickle

            torch.save(self._p, tmp, pickle_module=cloudpickle)
        os.replace(tmp, path)
        write_digest(path)

    # -- contract -------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self._p["module"]

    @property
    def input_info(self) -> list[tuple[str, list[int], str]]:
        """The non-KV inputs (of the first variant, when compiled with several)."""
        return list(self._p["inputs"])

    @property
    def input_variants(self) -> list[list[tuple[str, list[int], str]]]:
        """Every compiled set of non-KV input shapes (one unless compiled with several)."""
        return [list(v) for v in self._p.get("input_variants") or [self._p["inputs"]]]

    @property
    def kv_shapes(self) -> dict[str, tuple[list[int], str]]:
        return {k: (list(s), d) for k, (s, d) in self._p["kv"].items()}

    @property
    def input_order(self) -> list[str]:
        """Every input of the graph, static buffers included, in its compiled order."""
        return list(self._p["input_order"])

    @property
    def graph_id(self) -> str:
        return self._p["graph_id"]

    @property
    def group_id(self) -> str:
        return self._p["group_id"]

    @property
    def num_devices(self) -> int:
        return self._p["num_devices"]

    @property
    def weight_bytes(self) -> int:
        return self._p["weight_bytes"]

    @property
    def npu(self) -> str | None:
        """The NPU name this graph was compiled for (``RBLN-CA25``, ``RBLN-CR13``...)."""
        return self._p.get("npu")

    @property
    def kind(self) -> kinds.DeviceKind:
        """The NPU family compiled for (this process's kind when no NPU was named)."""
        return kinds.kind_by_name(self.npu) if self.npu else kinds.current()

    def kv_bytes(self) -> dict[str, int]:
        return {
            name: math.prod(shape) * torch.empty((), dtype=torch_dtype(d)).element_size()
            for name, (shape, d) in self._p["kv"].items()
        }

    def program_bytes(self) -> int:
        """A stand-in for instructions + activations: 2 MiB plus 16x the non-KV I/O (of the
        largest variant)."""
        io = max(
            sum(
                math.prod(s) * torch.empty((), dtype=torch_dtype(d)).element_size()
                for _, s, d in variant
            )
            for variant in self.input_variants
        )
        return _align(2**21 + 16 * io)

    # -- memory introspection used by optimum's automatic KV block count --------------------
    # Shapes are [device][chiplet] (optimum calls the outer index "node"): ATOM has one
    # chiplet per device, REBEL four; the emulator spreads every allocation evenly.
    def _per_device(self, nbytes: int) -> list[list[int]]:
        n, chiplets = self.num_devices, self.kind.chiplets
        return [[_align(nbytes // n // chiplets)] * chiplets for _ in range(n)]

    def get_alloc_per_chiplet_by_key(self) -> dict[str, list[list[int]]]:
        weights = self.weight_bytes if self._p["owns_weights"] else 0
        return {
            "Weight": self._per_device(weights),
            "Program": self._per_device(self.program_bytes()),
            "DramTensor": self._per_device(sum(self.kv_bytes().values())),
        }

    def get_alloc_per_node_by_key(self) -> dict[str, list[int]]:
        return {k: [sum(c) for c in v] for k, v in self.get_alloc_per_chiplet_by_key().items()}

    def exp_get_dram_tensor_sizes(self) -> dict[str, list[list[int]]]:
        n, chiplets = self.num_devices, self.kind.chiplets
        return {
            name: [[b // n // chiplets] * chiplets for _ in range(n)]
            for name, b in self.kv_bytes().items()
        }

    def exp_multiply_buffer_size(self, multipliers: dict[str, int]) -> None:
        for name, factor in multipliers.items():
            shape, d = self._p["kv"][name]
            self._p["kv"][name] = ([shape[0] * int(factor), *shape[1:]], d)

    def exp_rescale_buffer_size(self, ratios: dict[str, tuple[int, int]]) -> None:
        for name, (target, current) in ratios.items():
            shape, d = self._p["kv"][name]
            if (shape[0] * target) % current:
                raise ValueError(f"cannot rescale {name} {shape} by {target}/{current}")
            self._p["kv"][name] = ([shape[0] * target // current, *shape[1:]], d)

    def __repr__(self) -> str:
        names = [n for n, _, _ in self._p["inputs"]]
        return f"<RBLNCompiledModel (emulated) inputs={names} kv={len(self._p['kv'])}>"


def is_multiple_input_info(input_info: Any) -> bool:
    """Whether ``input_info`` is several lists of ``(name, shape, dtype)`` rather than one
    (an entry of one list starts with its input's name)."""
    return bool(input_info) and all(
        isinstance(v, (list, tuple)) and bool(v) and not isinstance(v[0], str) for v in input_info
    )


def _restore_output_capture(module: torch.nn.Module) -> None:
    """Give a loaded module the per-class output capture its construction registered.

    transformers 5.15 (``utils/output_capturing.py``) returns ``hidden_states`` /
    ``attentions`` only for classes in its process-wide ``_CAN_RECORD_REGISTRY``, which
    ``PreTrainedModel.__init__`` fills. A compiled graph is traced at compile time, when the
    model was constructed; a module unpickled in another process was never constructed, so
    without this a vision tower compiled with ``output_hidden_states`` (optimum's LLaVA) would
    return its last state only. Internal name, isolated here; a transformers upgrade that
    moves it makes this a no-op (and the emulator test of a loaded vision tower fail).
    """
    try:
        from transformers.modeling_utils import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return
    for mod in module.modules():
        if isinstance(mod, PreTrainedModel):
            _CAN_RECORD_REGISTRY.setdefault(str(mod.__class__), mod._can_record_outputs)


def _share_weights(module: torch.nn.Module, group_id: str) -> None:
    """Make graphs of one compile group loaded in this process use one copy of each weight."""
    for mod_name, mod in module.named_modules():
        for attr, tensor in list(mod._parameters.items()) + list(mod._buffers.items()):
            if tensor is None:
                continue
            key = (group_id, f"{mod_name}.{attr}", tuple(tensor.shape), tensor.dtype)
            shared = _SHARED_WEIGHTS.get(key)
            if shared is None:
                _SHARED_WEIGHTS[key] = tensor
            elif attr in mod._parameters:
                mod._parameters[attr] = shared
            else:
                mod._buffers[attr] = shared
