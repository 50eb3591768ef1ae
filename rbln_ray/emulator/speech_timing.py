"""Timing mode for a speech encoder-decoder's graphs (Whisper): the encoder call and the
decoder call costed by :mod:`rbln_ray.npu.speech_cost` instead of the decoder-only model.

Why a subclass: the runtime side of timing mode (zero outputs, sleeping, the call log) is
:class:`~rbln_ray.emulator.timing.GraphTiming`'s; only what a call costs differs, and a
Whisper ``config.json`` is no decoder-only shape. ``RBLN_RAY_TIMING_SHAPE`` may name a Whisper
preset (``whisper-small``, ``whisper-medium``, ``whisper-large-v3``) to model a real
checkpoint's latency on the tiny graphs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rbln_ray.common import envs
from rbln_ray.emulator.timing import GraphTiming
from rbln_ray.npu.cost_model import CallCost, DeviceSpec
from rbln_ray.npu.speech_cost import (
    PRESETS,
    SpeechShape,
    decoder_cost,
    encoder_cost,
    is_speech_config,
    speech_shape_from_spec,
)


def speech_shape_of(cm: Any) -> SpeechShape | None:
    """The speech shape to model for a compiled graph of a speech encoder-decoder's directory
    (the override when set), or None when the graph is not a speech model's (its
    ``config.json`` is no encoder-decoder's)."""
    path = getattr(cm, "path", None)
    config = Path(path).parent / "config.json" if path is not None else None
    if config is None or not config.is_file():
        return None
    cfg = json.loads(config.read_text())
    if not is_speech_config(cfg):
        return None
    override = (envs.get("RBLN_RAY_TIMING_SHAPE") or "").strip()
    if not override:
        return SpeechShape.from_hf_config(cfg, name=config.parent.name)
    shape = speech_shape_from_spec(override)
    if shape is None:
        raise ValueError(
            f"RBLN_RAY_TIMING_SHAPE={override!r} names no speech model, and {config.parent} is "
            f"a speech encoder-decoder; speech presets: {', '.join(sorted(PRESETS))}"
        )
    return shape


class SpeechGraphTiming(GraphTiming):
    """Timing-mode behaviour of a Whisper encoder or decoder runtime."""

    def __init__(self, cm: Any, shape: SpeechShape) -> None:  # noqa: D107 - see the class
        # GraphTiming's own __init__ reads a decoder-only shape; this sets what run() uses.
        self.spec = DeviceSpec.from_env()
        self.speech = shape
        self.num_devices = int(getattr(cm, "num_devices", 1) or 1)
        names = [name for name, _, _ in cm.input_info]
        self.is_encoder = "input_features" in names
        self._pos_index = names.index("cache_position") if "cache_position" in names else None
        self._outputs = None

    def cost(self, inputs: tuple[Any, ...]) -> CallCost:
        if self.is_encoder or self._pos_index is None:
            return encoder_cost(self.speech, self.spec)
        positions = [int(p) for p in inputs[self._pos_index].reshape(-1).tolist()]
        return decoder_cost(self.speech, positions, self.spec)


def graph_timing(cm: Any) -> GraphTiming:
    """The timing of one emulated runtime: a speech encoder-decoder's graphs are costed by
    their own model (:class:`SpeechGraphTiming`), every other graph as a decoder's."""
    speech = speech_shape_of(cm)
    return SpeechGraphTiming(cm, speech) if speech is not None else GraphTiming(cm)
