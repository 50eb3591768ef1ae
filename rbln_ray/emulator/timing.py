"""Emulator *timing mode*: an ATOM/REBEL latency model, spent sleeping instead of computing.

Why: on a 2-core host the emulator can run one or two devices' worth of real compute. For
replica scaling and capacity planning we need many emulated devices at once with realistic
device latency, so in timing mode (``RBLN_RAY_EMULATOR_MODE=timing``) a ``rebel.Runtime``
call does **not** run the graph: it works out the FLOPs and DRAM bytes of the call from the
model's shape and the call's inputs, converts them to seconds with a roofline model of the
device kind being emulated (ATOM by default, REBEL with ``RBLN_RAY_EMULATED_NPU=rebel``; see
:mod:`rbln_ray.npu.kinds`) and sleeps that long (no CPU burnt, the GIL released).

**Outputs in timing mode are zeros and the KV cache is never written: generated text is
garbage by design.** Timing mode exists for throughput/latency measurements only; it is never
on by default, it logs a warning in every process that enables it, and ``Runtime`` reprs say
``timing``. Nothing that checks token correctness may run with it.

The cost model (formula, device parameters, overrides) is :mod:`rbln_ray.npu.cost_model`,
the same one ``rbln-ray plan`` uses; ``RBLN_RAY_TIMING_SHAPE`` models the latency of a preset
(e.g. ``llama-3-8b``) or a JSON shape instead of the compiled graph's own config, for every
graph or per compiled directory (``"<dir name>=llama-3-8b;<draft dir>=llama-3.2-1b"``: a
target and its speculative-decoding draft model in one process).

**Modelled mode** (``RBLN_RAY_EMULATOR_MODE=modelled``) computes every call as compute mode
does (real outputs, real KV writes) and then sleeps until the modelled device time of the
call has passed since it started: outputs are the model's and the wall time is the modelled
device's, as long as the host computes the (small) graph faster than the modelled device
would run the modelled model. Calls where it does not are counted (``overrun_calls``,
``overrun_seconds`` in the call log): a benchmark reports them. Speculative decoding needs it:
its speed depends on how many drafts the real model accepts, which zero outputs cannot tell.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rbln_ray.common import envs
from rbln_ray.common.artifact_files import PIPELINE_MANIFEST, RBLN_CONFIG
from rbln_ray.emulator.call_log import describe, is_decode_graph, record_call, record_copy
from rbln_ray.emulator.compiled_model import graph_outputs
from rbln_ray.npu.cost_model import (
    PRESETS,
    CallCost,
    DeviceSpec,
    ModelShape,
    Row,
    call_cost,
    copy_cost,
    host_transfer_cost,
    network_transfer_cost,
    shape_from_spec,
)

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- mode
_WARNED = False


MODES = ("compute", "timing", "modelled")


def emulator_mode() -> str:
    """``compute`` (real outputs at host speed), ``timing`` (modelled device time, zero
    outputs) or ``modelled`` (real outputs, then the rest of the modelled device time)."""
    global _WARNED
    value = envs.get("RBLN_RAY_EMULATOR_MODE")
    if value not in MODES:
        raise envs.EnvError(f"RBLN_RAY_EMULATOR_MODE={value!r}; expected one of {', '.join(MODES)}")
    if value == "timing" and not _WARNED:
        _WARNED = True
        logger.warning(
            "rebel emulator in TIMING mode: device calls sleep the modelled device latency and "
            "return zeros; generated tokens are NOT the model's output"
        )
    elif value == "modelled" and not _WARNED:
        _WARNED = True
        logger.warning(
            "rebel emulator in MODELLED mode: device calls compute their real outputs, then "
            "sleep the rest of the modelled device latency (calls that compute longer are "
            "counted as overruns)"
        )
    return value


def timing_enabled() -> bool:
    """Whether emulated runtimes sleep the modelled latency instead of computing."""
    return emulator_mode() == "timing"


# ----------------------------------------------------------------------------- the runtime side
class GraphTiming:
    """Timing-mode behaviour of one emulated runtime: cost per call, zero outputs."""

    def __init__(self, cm: Any) -> None:
        self.spec = DeviceSpec.from_env()
        self.shape, self.lm_head = graph_shape(cm), True
        stage = pipeline_stage(cm)
        if stage is not None:  # a pipeline stage: its share of the layers, maybe no LM head
            share, self.lm_head = stage
            self.shape = replace(
                self.shape, num_layers=max(1, round(self.shape.num_layers * share))
            )
        self.num_devices = int(getattr(cm, "num_devices", 1) or 1)
        self.decode_graph = is_decode_graph(cm.input_info)
        self.graph = compiled_dir_name(cm)
        names = [name for name, _, _ in cm.input_info]
        self._pos_index = names.index("cache_position") if "cache_position" in names else None
        self._one_logit = "query_position" in names
        self._outputs: list[tuple[tuple[int, ...], Any]] | None = None

    def rows(self, inputs: tuple[Any, ...]) -> tuple[list[Row], int, str]:
        kind, batch, length = describe(inputs, self.decode_graph)
        if self._pos_index is not None:
            starts = inputs[self._pos_index].reshape(batch, -1)[:, 0].tolist()
        else:
            starts = [0] * batch
        rows = [Row(length, max(0, int(s))) for s in starts]
        logit_rows = batch if (kind == "decode" or self._one_logit) else batch * length
        return rows, logit_rows, kind

    def cost(self, inputs: tuple[Any, ...]) -> CallCost:
        rows, logit_rows, _ = self.rows(inputs)
        return call_cost(
            self.shape, rows, logit_rows, self.spec, self.num_devices, lm_head=self.lm_head
        )

    def run(
        self,
        module: Any,
        inputs: tuple[Any, ...],
        kv: list[Any],
        start: float,
        out: list[Any] | None = None,
    ) -> list[Any]:
        """One timing-mode call: zero outputs after sleeping the modelled latency. Given the
        caller's output buffers (``out``), they are the outputs, zeroed within the modelled
        time: a device writes its results there as part of the call (the model counts the
        bytes), so no host copy follows."""
        import torch

        seconds = self.cost(inputs).seconds
        if self._outputs is None:  # output shapes, found once without computing
            self._outputs = _output_specs(module, inputs, kv)
            start = time.perf_counter()  # the one-off shape pass is not device time
        if out is not None and len(out) == len(self._outputs):
            outputs = [buf.zero_() for buf in out]
        else:
            outputs = [torch.zeros(s, dtype=d) for s, d in self._outputs]
        sleep_until(start + seconds)
        record_call(start, inputs, seconds, decode_graph=self.decode_graph, graph=self.graph)
        return outputs

    def finish_modelled(self, inputs: tuple[Any, ...], start: float) -> None:
        """Modelled mode, after a call computed its real outputs: sleep until the modelled
        device time has passed since ``start`` and log the call (an overrun if the compute
        took longer)."""
        seconds = self.cost(inputs).seconds
        overrun = time.perf_counter() - (start + seconds)
        sleep_until(start + seconds)
        record_call(
            start,
            inputs,
            seconds,
            decode_graph=self.decode_graph,
            graph=self.graph,
            overrun_s=max(0.0, overrun),
        )

    def sleep_copy(self, tokens: int, start: float) -> None:
        """Timing-mode ``_copy_kv_cache`` (nothing is copied; timing mode never writes the KV
        cache), or modelled mode's after the copy: sleep the rest of the modelled copy time."""
        seconds = copy_cost(self.shape, tokens, self.spec)
        sleep_until(start + seconds)
        record_copy(start, seconds)


    def sleep_transfer(self, tokens: int, start: float) -> None:
        """A host KV transfer of ``tokens`` slots (``_fetch_kv_cache``/``_update_kv_cache``):
        sleep until its modelled time over the host link has passed since ``start``."""
        seconds = host_transfer_cost(self.shape, tokens, self.spec)
        sleep_until(start + seconds)
        record_copy(start, seconds, kind="host")


def _output_specs(module: Any, inputs: tuple[Any, ...], kv: list[Any]):
    import torch

    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, torch.no_grad():
            fake_kv = [mode.from_tensor(t) for t in kv]
            result = module(*inputs, *fake_kv)
    except Exception:  # noqa: BLE001 - fall back to one real call (tiny graphs only)
        logger.debug("fake-tensor shape pass failed; running the graph once", exc_info=True)
        with torch.no_grad():
            result = module(*[t.clone() for t in inputs], *[t.clone() for t in kv])
    outs = graph_outputs(result)
    return [(tuple(o.shape), o.dtype) for o in outs]


def pipeline_stage(cm: Any) -> tuple[float, bool] | None:
    """(share of the model's layers, has the LM head) when ``cm`` is one stage's graph of a
    staged artifact (``<dir>/stage_<i>/*.rbln`` beside ``<dir>/rbln_pipeline.json``)."""
    path = getattr(cm, "path", None)
    if path is None or not (Path(path).parents[1] / PIPELINE_MANIFEST).is_file():
        return None
    manifest = json.loads((Path(path).parents[1] / PIPELINE_MANIFEST).read_text())
    stage_dir = Path(path).parent.name
    for stage in manifest["stages"]:
        if stage["subdir"] == stage_dir:
            layers = stage["layer_end"] - stage["layer_start"]
            return layers / manifest["num_hidden_layers"], bool(stage["has_lm_head"])
    return None


def compiled_dir_name(cm: Any) -> str:
    """The compiled directory a graph belongs to (its ``.rbln`` file's directory, or the one
    above for a pipeline stage's or a verify graph's subdirectory); "" when unknown."""
    path = getattr(cm, "path", None)
    if path is None:
        return ""
    for directory in (Path(path).parent, Path(path).parents[1]):
        if (directory / "config.json").is_file():
            return directory.name
    return Path(path).parent.name


def timing_shape_override(directory: str) -> str:
    """``RBLN_RAY_TIMING_SHAPE`` for graphs of ``directory``: the whole value, or in the
    per-directory form ``"<dir>=<shape>;<dir>=<shape>"`` the entry of that directory name
    ("" when none matches: the graph's own shape)."""
    value = (envs.get("RBLN_RAY_TIMING_SHAPE") or "").strip()
    if "=" not in value.split("{", 1)[0]:
        return value
    for entry in value.split(";"):
        name, _, shape = entry.partition("=")
        if name.strip() and name.strip() == directory:
            return shape.strip()
    return ""


def graph_shape(cm: Any) -> ModelShape:
    """The shape to model: ``RBLN_RAY_TIMING_SHAPE`` (for the graph's directory), else the
    compiled dir's config.json (a pipeline stage's or verify graph's finds it one up);
    either way stored as the artifact stores it (quantized weights, fp8 KV, LoRA adapters:
    its rbln_config.json)."""
    shape = _model_shape(cm)
    path = getattr(cm, "path", None)
    return _stored_as(shape, Path(path).parent) if path is not None else shape


def _stored_as(shape: ModelShape, directory: Path) -> ModelShape:
    """``shape`` as the artifact in ``directory`` stores it (its rbln_config.json, if any)."""
    config = directory / RBLN_CONFIG
    return shape.with_rbln_config(json.loads(config.read_text())) if config.is_file() else shape


def _config_shape(directory: Path) -> ModelShape | None:
    """The shape of the model whose config.json is in ``directory``, if there is one."""
    config = directory / "config.json"
    if not config.is_file():
        return None
    return ModelShape.from_hf_config(json.loads(config.read_text()), name=directory.name)


def _model_shape(cm: Any) -> ModelShape:
    override = timing_shape_override(compiled_dir_name(cm))
    if override:
        return shape_from_spec(override)
    path = getattr(cm, "path", None)
    for directory in (Path(path).parent, Path(path).parents[1]) if path is not None else ():
        shape = _config_shape(directory)
        if shape is not None:
            return shape
    for module in cm.module.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "num_hidden_layers"):
            return ModelShape.from_hf_config(cfg.to_dict())
    raise RuntimeError(
        f"timing mode cannot find the model config of {cm!r}; set RBLN_RAY_TIMING_SHAPE to a "
        f"preset ({', '.join(sorted(PRESETS))}) or a config.json path"
    )


def network_seconds(model_dir: str | Path, tokens: int) -> float:
    """Modelled seconds for ``tokens`` of the compiled model's KV over the node-to-node network
    (prefill/decode disaggregation across nodes): 0 in compute mode, which runs at host speed,
    so that no timing or modelled benchmark gets a handover between nodes for free."""
    if emulator_mode() == "compute":
        return 0.0
    directory = Path(model_dir)
    override = timing_shape_override(directory.name)
    shape = shape_from_spec(override) if override else _config_shape(directory)
    if shape is None:
        raise RuntimeError(f"timing mode cannot find the model config of {directory}")
    return network_transfer_cost(_stored_as(shape, directory), tokens, DeviceSpec.from_env())


def sleep_until(deadline: float) -> None:
    """Sleep (not spin) until ``time.perf_counter()`` reaches ``deadline``."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)
