"""The roofline cost of a speech encoder-decoder's device calls (Whisper), on the same device
parameters as :mod:`rbln_ray.npu.cost_model` (whose module docstring has the formula's
conventions: FP16 weights and caches, max(compute, memory) plus a per-call overhead).

Why apart from the decoder model: a Whisper call is one of two graphs that are not a causal
LM's. The **encoder** call takes one 30-second window (``2 x T`` mel frames, ``T`` =
``max_source_positions`` = 1500): two convolutions, ``encoder_layers`` of bidirectional
attention over ``T`` positions and the MLP, then every decoder layer's cross-attention key
and value projections of its output, written to the request's slot. The **decoder** call
takes one token in each of its ``B`` rows (padding rows included: static shapes): self
attention over the row's own positions, cross attention over the ``T`` audio positions (each
row reads its slot's cross keys and values: ``2 x decoder_layers x T x d`` elements a row,
the dominant memory traffic of a large Whisper), the MLP and the LM head (tied to the token
embedding).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rbln_ray.npu.cost_model import CallCost, DeviceSpec


@dataclass(frozen=True)
class SpeechShape:
    """What the cost model needs to know about a Whisper-style encoder-decoder."""

    d_model: int
    encoder_layers: int
    decoder_layers: int
    heads: int
    encoder_ffn: int
    decoder_ffn: int
    vocab_size: int
    num_mel_bins: int = 80
    source_positions: int = 1500  # audio positions of one 30-second window
    name: str = "custom"
    weight_bytes: int = 2
    kv_bytes: int = 2

    @property
    def encoder_layer_params(self) -> int:
        d = self.d_model
        return 4 * d * d + 2 * d * self.encoder_ffn

    @property
    def decoder_layer_params(self) -> int:
        """Self attention (q, k, v, o), cross attention's q and o, the MLP (the cross keys
        and values are the encoder call's work)."""
        d = self.d_model
        return 6 * d * d + 2 * d * self.decoder_ffn

    @property
    def conv_params(self) -> int:
        return 3 * self.num_mel_bins * self.d_model + 3 * self.d_model * self.d_model

    @property
    def cross_projection_params(self) -> int:
        return self.decoder_layers * 2 * self.d_model * self.d_model

    @property
    def cross_kv_bytes_per_row(self) -> int:
        return 2 * self.decoder_layers * self.source_positions * self.d_model * self.kv_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "custom") -> SpeechShape:
        return cls(
            d_model=int(cfg["d_model"]),
            encoder_layers=int(cfg["encoder_layers"]),
            decoder_layers=int(cfg["decoder_layers"]),
            heads=int(cfg["decoder_attention_heads"]),
            encoder_ffn=int(cfg["encoder_ffn_dim"]),
            decoder_ffn=int(cfg["decoder_ffn_dim"]),
            vocab_size=int(cfg["vocab_size"]),
            num_mel_bins=int(cfg.get("num_mel_bins", 80)),
            source_positions=int(cfg.get("max_source_positions", 1500)),
            name=name,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Public config.json values of OpenAI's checkpoints.
PRESETS: dict[str, SpeechShape] = {
    "whisper-small": SpeechShape(768, 12, 12, 12, 3072, 3072, 51865, 80, name="whisper-small"),
    "whisper-medium": SpeechShape(1024, 24, 24, 16, 4096, 4096, 51865, 80, name="whisper-medium"),
    "whisper-large-v3": SpeechShape(
        1280, 32, 32, 20, 5120, 5120, 51866, 128, name="whisper-large-v3"
    ),
}


# What marks a config.json as an encoder-decoder's (transformers' names, which Whisper's
# config uses): the cost model reads its shape from them.
ENCODER_DECODER_KEYS = ("d_model", "encoder_layers", "decoder_layers")


def is_speech_config(cfg: dict[str, Any]) -> bool:
    """Whether a ``config.json`` is an encoder-decoder's this cost model reads (by its keys:
    which family it is, is the registry's business, above this layer)."""
    return all(key in cfg for key in ENCODER_DECODER_KEYS)


def speech_shape_from_spec(spec: str) -> SpeechShape | None:
    """A speech preset name, a config.json path (or its directory) or a JSON object of an
    encoder-decoder config; None when ``spec`` names no speech model."""
    spec = spec.strip()
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    if spec.startswith("{"):
        cfg = json.loads(spec)
    else:
        path = Path(spec)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            return None
        cfg = json.loads(path.read_text())
    if not is_speech_config(cfg):
        return None
    return SpeechShape.from_hf_config(cfg, name=cfg.get("_name_or_path") or "custom")


def _finish(flops: float, nbytes: float, spec: DeviceSpec, parts: dict[str, float]) -> CallCost:
    compute_s = flops / (spec.peak_flops * spec.compute_eff)
    memory_s = nbytes / (spec.dram_bytes_per_s * spec.dram_eff)
    return CallCost(
        flops=flops,
        bytes=nbytes,
        compute_s=compute_s,
        memory_s=memory_s,
        seconds=max(compute_s, memory_s) + spec.call_overhead_s,
        bound="compute" if compute_s >= memory_s else "bandwidth",
        breakdown={**parts, "overhead_s": spec.call_overhead_s},
    )


def encoder_cost(shape: SpeechShape, spec: DeviceSpec | None = None) -> CallCost:
    """One encoder call: one audio window, its cross keys and values written to a slot."""
    spec = spec or DeviceSpec()
    d, t = shape.d_model, shape.source_positions
    flops_conv = 2.0 * 3 * shape.num_mel_bins * d * 2 * t + 2.0 * 3 * d * d * t
    flops_linear = 2.0 * shape.encoder_layers * shape.encoder_layer_params * t
    flops_attn = 4.0 * shape.encoder_layers * d * t * t  # bidirectional over the window
    flops_cross = 2.0 * shape.cross_projection_params * t
    weights = (
        shape.encoder_layers * shape.encoder_layer_params
        + shape.conv_params
        + shape.cross_projection_params
    ) * shape.weight_bytes
    act = shape.encoder_layers * t * (6 * d + 2 * shape.encoder_ffn) * 2
    mel = 2 * t * shape.num_mel_bins * 4
    cross_write = shape.cross_kv_bytes_per_row
    flops = flops_conv + flops_linear + flops_attn + flops_cross
    nbytes = float(weights + act + mel + cross_write)
    parts = {
        "flops_conv": flops_conv,
        "flops_linear": flops_linear,
        "flops_attention": flops_attn,
        "flops_cross_projection": flops_cross,
        "bytes_weights": float(weights),
        "bytes_cross_kv_write": float(cross_write),
        "bytes_activations": float(act + mel),
    }
    return _finish(flops, nbytes, spec, parts)


def decoder_cost(
    shape: SpeechShape, positions: list[int], spec: DeviceSpec | None = None
) -> CallCost:
    """One decoder call of ``len(positions)`` rows (padding rows included), row *i* writing
    its token at ``positions[i]``."""
    spec = spec or DeviceSpec()
    d, t, layers = shape.d_model, shape.source_positions, shape.decoder_layers
    rows = len(positions)
    attended = sum(p + 1 for p in positions)
    flops_linear = 2.0 * layers * shape.decoder_layer_params * rows
    flops_head = 2.0 * shape.vocab_size * d * rows
    flops_self = 4.0 * layers * d * attended
    flops_cross = 4.0 * layers * d * t * rows
    weights = (layers * shape.decoder_layer_params + shape.vocab_size * d) * shape.weight_bytes
    kv_per_token = 2 * layers * d * shape.kv_bytes
    self_kv = kv_per_token * (sum(positions) + rows)  # read the past, write the new token
    cross_kv = shape.cross_kv_bytes_per_row * rows
    act = layers * rows * (8 * d + 2 * shape.decoder_ffn) * 2 + rows * shape.vocab_size * 4
    flops = flops_linear + flops_head + flops_self + flops_cross
    nbytes = float(weights + self_kv + cross_kv + act)
    parts = {
        "flops_linear": flops_linear,
        "flops_lm_head": flops_head,
        "flops_self_attention": flops_self,
        "flops_cross_attention": flops_cross,
        "bytes_weights": float(weights),
        "bytes_self_kv": float(self_kv),
        "bytes_cross_kv_read": float(cross_kv),
        "bytes_activations": float(act),
    }
    return _finish(flops, nbytes, spec, parts)
