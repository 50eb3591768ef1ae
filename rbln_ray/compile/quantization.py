"""Quantized artifacts: which pre-quantized checkpoints rbln-ray compiles, and how.

Why a module of its own: optimum-rbln 0.12 compiles a *pre-quantized* checkpoint through its
own path (``rbln_quantization``: the seven projections become ``QIntLinear``/``QFloatLinear``,
fp8 KV caches get per-layer ``k_scale``/``v_scale``), but it reads neither the checkpoint's
``quantization_config`` nor checks most of what it loads: int8 weights without scales, zero
points, packed weights or a float checkpoint are all accepted and give garbage (a float weight
copied into an int8 parameter is truncated, not quantized). rbln-ray therefore translates the
checkpoint's ``quantization_config`` into one :class:`QuantSpec`, checks every tensor the
spec needs in the safetensors headers before optimum loads anything, and refuses, naming it,
whatever it cannot compile faithfully.

What is compiled (the arithmetic of the compiled graph, ``optimum/rbln/transformers/utils/
qlinear.py``): weights int8 (``W = q * scale``, per output channel) or fp8 e4m3
(``W = q.float() * scale``), activations in the model dtype (W8A16), KV caches in the model
dtype or fp8 e4m3 (``kv = (x / scale).clamp(+-448).to(fp8)``, read back as ``code * scale``).

Refused, with the reason: fp8 KV without quantized weights (optimum 0.12 rejects weights and
activations both fp16), int8/fp8 activations (static int8 is never rescaled in
``QIntLinear``; ``dynamic`` is not serialised into ``rbln_config.json``; fp8 activations are
only clamped, never rounded, in the graph, so the emulator would not predict an NPU), int4
(``RBLN_QUANT_BITS`` packing is not emulated), fp8 KV on sliding-window layers (optimum's
sliding-window attention has no fp8 variant), and every checkpoint format whose tensors
optimum would mis-load (packed, asymmetric, grouped, dynamic, block-scaled).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# The projections optimum-rbln 0.12 converts (rbln_quantization.QUANTIZED_WEIGHTS): every one
# present in the model, whatever the checkpoint quantized.
QUANTIZED_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
# quantization_config methods rbln-ray translates (everything else is refused, naming it)
METHODS = ("rbln", "compressed-tensors")
# methods another path serves: gpt-oss's MXFP4 experts (custom_moe_glu_mxfp4)
OTHER_PATHS = ("mxfp4",)

WeightDtype = Literal["int8", "fp8"]
KVDtype = Literal["fp16", "fp8"]
_SAFETENSORS_DTYPE = {"int8": "I8", "fp8": "F8_E4M3"}


class QuantizationError(ValueError):
    """A quantization setting or checkpoint rbln-ray cannot compile (the message says why)."""


@dataclass(frozen=True)
class QuantSpec:
    """What a quantized artifact stores: weights int8/fp8, KV caches fp16 (the model dtype)
    or fp8. Activations stay in the model dtype (W8A16)."""

    weights: WeightDtype
    kv_caches: KVDtype = "fp16"

    def __post_init__(self) -> None:
        if self.weights not in ("int8", "fp8"):
            raise QuantizationError(
                f"weights={self.weights!r}: rbln-ray compiles int8 or fp8 weights "
                "(int4 packing is not emulated)"
            )
        if self.kv_caches not in ("fp16", "fp8"):
            raise QuantizationError(f"kv_caches={self.kv_caches!r}: expected fp16 or fp8")

    def as_optimum(self) -> dict[str, str]:
        """optimum-rbln's ``rbln_quantization`` (``RBLNQuantizationConfig`` fields)."""
        return {
            "format": "rbln",
            "weights": self.weights,
            "activations": "fp16",
            "kv_caches": self.kv_caches,
        }

    @property
    def name(self) -> str:
        return self.weights + ("+fp8kv" if self.kv_caches == "fp8" else "")

    @classmethod
    def from_rbln_config(cls, raw: Mapping[str, Any] | None) -> QuantSpec | None:
        """The spec a compiled ``rbln_config.json``'s ``quantization`` records (``{}`` when
        the artifact is not quantized)."""
        if not raw or raw.get("weights") in (None, "fp16"):
            return None
        return cls(raw["weights"], raw.get("kv_caches") or "fp16")


# ----------------------------------------------------------------------------- translation
def spec_from_hf_config(hf_config: Mapping[str, Any]) -> QuantSpec | None:
    """The spec of an HF ``config.json``'s ``quantization_config`` (None without one, or for a
    method another path serves). Raises :class:`QuantizationError` naming what is refused."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method in OTHER_PATHS:
        return None
    if method == "rbln":
        return _from_rbln(qc)
    if method == "compressed-tensors":
        return _from_compressed_tensors(qc)
    raise QuantizationError(
        f"quantization_config.quant_method={method!r} is not compiled on RBLN; rbln-ray compiles "
        f"pre-quantized checkpoints of {', '.join(METHODS)} (int8 or fp8 weights, optional fp8 KV)"
    )


def _from_rbln(qc: Mapping[str, Any]) -> QuantSpec:
    activations = qc.get("activations") or "fp16"
    if activations != "fp16":
        raise QuantizationError(_ACTIVATIONS_REFUSED.format(what=f"activations={activations!r}"))
    if qc.get("dynamic"):
        raise QuantizationError("dynamic=true is not kept by optimum-rbln 0.12 (not serialised)")
    weights = qc.get("weights") or "fp16"
    kv = qc.get("kv_caches") or "fp16"
    if weights == "fp16":
        raise QuantizationError(_FP16_WEIGHTS_REFUSED.format(kv=kv))
    return QuantSpec(weights, kv)


_ACTIVATIONS_REFUSED = (
    "{what}: quantized activations are refused on RBLN (optimum-rbln 0.12 never rescales "
    "static int8 activations, does not serialise dynamic ones, and only clamps fp8 ones in the "
    "graph); use a weight-only (W8A16) checkpoint"
)
_FP16_WEIGHTS_REFUSED = (
    "weights=fp16 with kv_caches={kv}: optimum-rbln 0.12 compiles fp8 KV caches only together "
    "with int8 or fp8 weights (it rejects weights and activations both fp16)"
)


def _from_compressed_tensors(qc: Mapping[str, Any]) -> QuantSpec:
    fmt = qc.get("format")
    if fmt not in ("int-quantized", "float-quantized", "naive-quantized"):
        raise QuantizationError(
            f"compressed-tensors format={fmt!r}: rbln-ray compiles unpacked int8/fp8 weights "
            "(int-quantized, float-quantized, naive-quantized); packed weights are not loaded "
            "by optimum-rbln 0.12"
        )
    ignore = [m for m in qc.get("ignore") or [] if m.split(".")[-1] in QUANTIZED_PROJECTIONS]
    if ignore:
        raise QuantizationError(
            f"compressed-tensors ignore={ignore}: optimum-rbln 0.12 quantizes every "
            f"{'/'.join(QUANTIZED_PROJECTIONS)} projection, so none may be left unquantized"
        )
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise QuantizationError("compressed-tensors quantization_config has no config_groups")
    weights: set[str] = set()
    for group in groups:
        w = group.get("weights") or {}
        problems = []
        if w.get("num_bits") != 8 or w.get("type") not in ("int", "float"):
            problems.append(f"num_bits={w.get('num_bits')} type={w.get('type')!r} (need 8-bit)")
        if not w.get("symmetric", True):
            problems.append("asymmetric (zero points)")
        if w.get("strategy") not in ("channel", "tensor"):
            problems.append(f"strategy={w.get('strategy')!r} (need channel or tensor)")
        if w.get("dynamic"):
            problems.append("dynamic weights")
        if problems:
            raise QuantizationError(
                "compressed-tensors weights " + ", ".join(problems) + ": not compiled on RBLN"
            )
        if group.get("input_activations"):
            raise QuantizationError(_ACTIVATIONS_REFUSED.format(what="input_activations"))
        weights.add("int8" if w["type"] == "int" else "fp8")
    if len(weights) != 1:
        raise QuantizationError(f"compressed-tensors mixes {sorted(weights)} weights")
    kv = "fp16"
    scheme = qc.get("kv_cache_scheme")
    if scheme:
        if scheme.get("num_bits") != 8 or scheme.get("type") != "float" or scheme.get("dynamic"):
            raise QuantizationError(
                f"kv_cache_scheme {dict(scheme)}: RBLN compiles static fp8 (e4m3) KV caches only"
            )
        kv = "fp8"
    return QuantSpec(weights.pop(), kv)


def resolve_spec(
    hf_config: Mapping[str, Any], weights: str | None, kv_cache_dtype: str | None, where: str
) -> QuantSpec | None:
    """The spec to compile ``where`` (an HF directory) with: the checkpoint's own, checked
    against what the user asked for (``weights``: int8/fp8; ``kv_cache_dtype``: fp8). Asking
    for quantization of a checkpoint that is not quantized is an error (rbln-ray compiles
    pre-quantized checkpoints; it does not quantize)."""
    found = spec_from_hf_config(hf_config)
    if found is None:
        if weights is not None or kv_cache_dtype == "fp8":
            asked = ", ".join(
                f"{k}={v}"
                for k, v in (("quantization", weights), ("kv_cache_dtype", kv_cache_dtype))
                if v
            )
            if kv_cache_dtype == "fp8" and weights is None:
                raise QuantizationError(
                    f"{asked} for {where}: {_FP16_WEIGHTS_REFUSED.format(kv='fp8')}, and the "
                    "checkpoint has no quantization_config"
                )
            raise QuantizationError(
                f"{asked} for {where}, which is not a pre-quantized checkpoint (its config.json "
                "has no quantization_config): rbln-ray compiles quantized checkpoints as they "
                "are (int8/fp8 weights with their scales); quantize it first"
            )
        return None
    if weights is not None and weights != found.weights:
        raise QuantizationError(
            f"quantization={weights} conflicts with {where}, whose checkpoint holds "
            f"{found.weights} weights"
        )
    if kv_cache_dtype == "fp8" and found.kv_caches != "fp8":
        raise QuantizationError(
            f"kv_cache_dtype=fp8 for {where}, whose checkpoint has no fp8 KV scales "
            "(kv_cache_scheme / k_scale, v_scale): fp8 KV needs calibrated scales"
        )
    return found


# ----------------------------------------------------------------------------- checkpoint
def validate_checkpoint(hf_dir: str | Path, spec: QuantSpec, hf_config: Mapping[str, Any]) -> None:
    """Check, from the safetensors headers alone, that every tensor optimum will load for
    ``spec`` is there in the right dtype; raise :class:`QuantizationError` naming the first
    problems (optimum-rbln 0.12 would load most of them silently wrong)."""
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise QuantizationError(
            f"{hf_dir} has no *.safetensors file: optimum-rbln loads quantized checkpoints from "
            "safetensors only"
        )
    dtypes: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                dtypes[key] = f.get_slice(key).get_dtype()
    problems: list[str] = []
    bad = [k for k in dtypes if k.rsplit(".", 1)[-1] in _UNSUPPORTED_TENSORS]
    if bad:
        problems.append(f"tensors optimum-rbln 0.12 cannot use: {bad[:3]}")
    want = _SAFETENSORS_DTYPE[spec.weights]
    projections = [k for k in dtypes if _projection_weight(k)]
    if not projections:
        problems.append("no q_proj/.../down_proj weights found under model.layers")
    for key in projections:
        base = key[: -len("weight")]
        if dtypes[key] != want:
            problems.append(
                f"{key} is {dtypes[key]}, not {want} ({spec.weights} weights)"
                + ("" if dtypes[key] not in ("F32", "F16", "BF16") else ": quantize it first")
            )
        if not any(base + alias in dtypes for alias in _WEIGHT_SCALE_ALIASES):
            problems.append(f"{key} has no {base}weight_scale")
        if len(problems) >= 4:
            break
    if spec.kv_caches == "fp8":
        for layer in range(int(hf_config.get("num_hidden_layers", 0))):
            prefix = f"model.layers.{layer}.self_attn."
            names = ("k_scale", "v_scale", "k_proj.k_scale", "v_proj.v_scale", "kv_scale")
            if not any(prefix + n in dtypes for n in names):
                problems.append(f"fp8 KV: no {prefix}k_scale / v_scale")
                break
    if problems:
        raise QuantizationError(
            f"{hf_dir} is not a {spec.name} checkpoint rbln-ray can compile: " + "; ".join(problems)
        )


_UNSUPPORTED_TENSORS = ("weight_zero_point", "weight_packed", "weight_g_idx", "weight_shape")
_WEIGHT_SCALE_ALIASES = ("weight_scale", "scales", "w_scale", "scale")


def _projection_weight(key: str) -> bool:
    parts = key.split(".")
    return (
        len(parts) >= 3
        and parts[-1] == "weight"
        and parts[-2] in QUANTIZED_PROJECTIONS
        and ".layers." in key
    )


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(hf_dir) / "config.json").read_text())


def for_compile(
    hf_dir: Path, family: Any, hf_config: Mapping[str, Any], settings: Any
) -> QuantSpec | None:
    """The spec a compile of ``hf_dir`` (a decoder of ``family``) uses, checked against the
    family and the checkpoint's tensors; None for an unquantized compile."""
    spec = resolve_spec(hf_config, settings.quantization, settings.kv_cache_dtype, str(hf_dir))
    if spec is None:
        return None
    if not getattr(family, "quantization", False):
        raise QuantizationError(
            f"{hf_dir}: quantized {family.architecture} checkpoints are not served yet (verified "
            "families: docs/guides/lora-quantization.md)"
        )
    if spec.kv_caches == "fp8" and family.sliding_window_used(hf_config):
        raise QuantizationError(
            f"{hf_dir}: fp8 KV caches with sliding-window layers: optimum-rbln 0.12's "
            "sliding-window attention has no fp8 variant"
        )
    validate_checkpoint(hf_dir, spec, hf_config)
    return spec
