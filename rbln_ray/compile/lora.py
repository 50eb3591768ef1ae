"""LoRA adapters compiled into an artifact: which adapters rbln-ray accepts, and how.

Why compiled in: optimum-rbln 0.12 builds LoRA into the graphs (``rbln_config.lora_config``;
every adapter's A/B matrices become constants, stacked and zero-padded to the largest rank,
and each call takes one adapter id per row, 0 for the base model), so the adapters a model
serves are fixed when it is compiled. rbln-ray compiles the adapters an engine is started with
(``CompileSettings.lora_modules``) and requests pick one by name.

What this module checks, because optimum-rbln does not (it logs a warning and uses zero
weights for a key it cannot find, so a wrong adapter would silently serve the base model):
the PEFT ``adapter_config.json`` options optimum cannot compile (DoRA, biases, per-layer
ranks, extra trained modules, ...), target modules outside the seven projections optimum can
adapt, and every ``lora_A``/``lora_B`` tensor's name and shape in ``adapter_model.safetensors``.
rsLoRA adapters are compiled with ``scaling_factor = r``: optimum 0.12 scales them by
``alpha / r**1.5`` where PEFT uses ``alpha / sqrt(r)``.

Where adapters live: copied into the artifact (``lora_adapters/<name>/``), and its
``rbln_config.json`` records those paths. optimum re-validates every recorded ``lora_path``
each time the artifact loads (an absolute path that is gone is an error, a relative one a Hub
download), so an artifact must not depend on the user's adapter directories staying where
they were; :func:`loadable_dir` also serves an artifact that was moved or copied.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rbln_ray.common.artifact_files import RBLN_CONFIG

ADAPTERS_DIR = "lora_adapters"  # inside a compiled artifact
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION + MLP  # what optimum-rbln 0.12 can adapt (LoRALinear)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# PEFT adapter_config.json options optimum-rbln 0.12 ignores -> what they would change
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA magnitude vectors",
    "modules_to_save": "fully trained extra modules",
    "layers_to_transform": "a subset of layers",
    "layers_pattern": "a subset of layers",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "fan_in_fan_out": "transposed (Conv1D) weights",
}


class LoRAError(ValueError):
    """An adapter rbln-ray cannot compile, or a LoRA setting that conflicts (message names it)."""


@dataclass(frozen=True)
class LoRAAdapter:
    """One PEFT LoRA adapter directory, checked against the base model."""

    name: str
    path: Path
    r: int
    alpha: float
    target_modules: tuple[str, ...]
    rslora: bool
    digest: str  # of its config and weights: what the compile and the cache key see

    def optimum(self, lora_int_id: int, path: Path) -> dict[str, Any]:
        """optimum's ``RBLNLoRAAdapterConfig`` fields for this adapter at ``path``."""
        return {
            "lora_int_id": lora_int_id,
            "lora_name": self.name,
            "lora_path": str(path),
            "r": self.r,
            "lora_alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "use_rslora": self.rslora,
            # optimum scales rsLoRA by alpha / r**1.5; PEFT by alpha / sqrt(r)
            "scaling_factor": float(self.r) if self.rslora else 1.0,
        }


@dataclass(frozen=True)
class CompiledAdapter:
    """An adapter as a compiled artifact records it (``rbln_config.json`` ``lora_config``)."""

    name: str
    lora_int_id: int  # the id the compiled graphs take for its rows (0: the base model)
    r: int
    target_modules: tuple[str, ...]
    path: str  # as recorded (the artifact's own copy)


@dataclass(frozen=True)
class LoRAInfo:
    """A compiled artifact's adapters."""

    adapters: tuple[CompiledAdapter, ...]
    max_lora_rank: int

    @classmethod
    def from_rbln_config(cls, raw: Mapping[str, Any] | None) -> LoRAInfo | None:
        if not raw or not raw.get("adapters"):
            return None
        adapters = tuple(
            CompiledAdapter(
                name=a["lora_name"],
                lora_int_id=int(a["lora_int_id"]),
                r=int(a["r"]),
                target_modules=tuple(a.get("target_modules") or ()),
                path=str(a["lora_path"]),
            )
            for a in raw["adapters"]
        )
        rank = raw.get("max_lora_rank") or max(a.r for a in adapters)
        return cls(adapters, int(rank))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.adapters)

    def by_name(self, name: str) -> CompiledAdapter | None:
        return next((a for a in self.adapters if a.name == name), None)


# ----------------------------------------------------------------------------- reading
def adapter_digest(path: Path) -> str:
    """Hash of an adapter directory's config and weights (by content, not by path)."""
    h = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        h.update(name.encode())
        h.update((path / name).read_bytes())
    return h.hexdigest()[:16]


def projection_dims(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each adaptable projection of a Llama-style model."""
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    inter = int(hf_config["intermediate_size"])
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _targets(name: str, raw: Any) -> tuple[str, ...]:
    if raw == "all-linear":
        return PROJECTIONS
    if isinstance(raw, str) or not raw:
        raise LoRAError(
            f"LoRA adapter {name!r}: target_modules={raw!r}; rbln-ray compiles adapters that "
            f"list their projections (or 'all-linear'), from {list(PROJECTIONS)}"
        )
    targets = tuple(str(t) for t in raw)
    outside = [t for t in targets if t not in PROJECTIONS]
    if outside:
        raise LoRAError(
            f"LoRA adapter {name!r} targets {outside}, which the compiled graphs cannot adapt: "
            f"optimum-rbln 0.12 compiles LoRA into {list(PROJECTIONS)} only"
        )
    return tuple(t for t in PROJECTIONS if t in targets)


def read_adapter(name: str, path: str | Path, hf_config: Mapping[str, Any]) -> LoRAAdapter:
    """The adapter at ``path``, checked against the base model's ``config.json``; raises
    :class:`LoRAError` naming the adapter and what cannot be compiled."""
    from safetensors import safe_open

    if not NAME.match(name):
        raise LoRAError(
            f"LoRA adapter name {name!r}: use letters, digits, '.', '_' or '-' (it is a model "
            "name requests use)"
        )
    path = Path(path).expanduser().resolve()
    where = f"LoRA adapter {name!r} ({path})"
    if not (path / ADAPTER_CONFIG).is_file():
        raise LoRAError(f"{where}: no {ADAPTER_CONFIG} (a PEFT LoRA adapter directory)")
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise LoRAError(f"{where}: no {ADAPTER_WEIGHTS} (save the adapter with safetensors)")
    cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type={cfg.get('peft_type')!r}, not LORA")
    if (cfg.get("bias") or "none") != "none":
        raise LoRAError(f"{where}: bias={cfg['bias']!r}; optimum-rbln 0.12 compiles bias='none'")
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if cfg.get(key):
            raise LoRAError(f"{where}: {key}={cfg[key]!r} ({what}) is not compiled by optimum-rbln")
    r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoRAError(f"{where}: r={r!r}, lora_alpha={alpha!r}; need a positive rank and alpha")
    targets = _targets(name, cfg.get("target_modules"))
    dims = projection_dims(hf_config)
    layers = int(hf_config["num_hidden_layers"])
    expected: dict[str, tuple[int, int]] = {}
    for layer in range(layers):
        for proj in targets:
            module = "self_attn" if proj in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            fan_in, fan_out = dims[proj]
            expected[f"{key}.lora_A.weight"] = (r, fan_in)
            expected[f"{key}.lora_B.weight"] = (fan_out, r)
    with safe_open(str(path / ADAPTER_WEIGHTS), "pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    missing = [k for k in expected if k not in found]
    extra = [k for k in found if k not in expected]
    wrong = [f"{k} {found[k]} != {v}" for k, v in expected.items() if k in found and found[k] != v]
    if missing or extra or wrong:
        problems = [
            f"{label} {items[:2]}{' ...' if len(items) > 2 else ''}"
            for label, items in (("missing", missing), ("unexpected", extra), ("shape", wrong))
            if items
        ]
        raise LoRAError(
            f"{where} does not match what optimum-rbln 0.12 loads for its target_modules "
            f"{list(targets)} (keys base_model.model.model.layers.<i>.<module>.<proj>."
            f"lora_A|lora_B.weight of a {layers}-layer model): " + "; ".join(problems)
        )
    return LoRAAdapter(
        name=name,
        path=path,
        r=r,
        alpha=float(alpha),
        target_modules=targets,
        rslora=bool(cfg.get("use_rslora")),
        digest=adapter_digest(path),
    )


def read_adapters(modules: Mapping[str, str], hf_config: Mapping[str, Any]) -> list[LoRAAdapter]:
    return [read_adapter(name, path, hf_config) for name, path in modules.items()]


def modules_key(modules: Mapping[str, str]) -> dict[str, str]:
    """``lora_modules`` as a compile-cache key sees them: name -> content digest (an adapter
    rewritten in place is compiled again; the same one elsewhere is not)."""
    out = {}
    for name, path in modules.items():
        directory = Path(path).expanduser()
        if (
            not (directory / ADAPTER_CONFIG).is_file()
            or not (directory / ADAPTER_WEIGHTS).is_file()
        ):
            raise LoRAError(
                f"LoRA adapter {name!r} ({path}): no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
            )
        out[name] = adapter_digest(directory)
    return out


# ----------------------------------------------------------------------------- artifact
def stage_adapters(adapters: list[LoRAAdapter], out_dir: Path) -> dict[str, Any]:
    """Copy the adapters into ``out_dir``'s ``lora_adapters/`` and return optimum's
    ``lora_config`` naming those copies (ids 1..N in the given order)."""
    entries = []
    for i, adapter in enumerate(adapters, start=1):
        dest = out_dir.resolve() / ADAPTERS_DIR / adapter.name
        dest.mkdir(parents=True, exist_ok=True)
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(adapter.path / name, dest / name)
        if adapter_digest(dest) != adapter.digest:
            raise LoRAError(f"LoRA adapter {adapter.name!r} changed while it was being copied")
        entries.append(adapter.optimum(i, dest))
    return {"adapters": entries, "max_lora_rank": max(a.r for a in adapters)}


def relocate(artifact_dir: Path, final_dir: Path) -> None:
    """Record ``final_dir``'s adapter copies in ``artifact_dir``'s ``rbln_config.json``
    (compiles are written to a temporary directory, then renamed to ``final_dir``)."""
    cfg_path = artifact_dir / RBLN_CONFIG
    raw = json.loads(cfg_path.read_text())
    if not (raw.get("lora_config") or {}).get("adapters"):
        return
    for adapter in raw["lora_config"]["adapters"]:
        adapter["lora_path"] = str(final_dir.resolve() / ADAPTERS_DIR / adapter["lora_name"])
    cfg_path.write_text(json.dumps(raw, indent=2))


def loadable_dir(artifact_dir: Path) -> Path:
    """A directory optimum can load the artifact from: itself while its recorded adapter
    paths exist; for an artifact that was moved (or copied), a private view of it (symlinks
    to its files) whose ``rbln_config.json`` names its own adapter copies. Raises
    :class:`LoRAError` when an adapter is in neither place."""
    raw = json.loads((artifact_dir / RBLN_CONFIG).read_text())
    adapters = (raw.get("lora_config") or {}).get("adapters") or []
    if all(Path(a["lora_path"]).is_dir() for a in adapters):
        return artifact_dir
    for adapter in adapters:
        own = artifact_dir.resolve() / ADAPTERS_DIR / adapter["lora_name"]
        if not (own / ADAPTER_CONFIG).is_file():
            raise LoRAError(
                f"{artifact_dir}: LoRA adapter {adapter['lora_name']!r} is compiled in, but "
                f"neither {adapter['lora_path']} nor {own} holds it (optimum-rbln checks that the "
                "adapter directory exists whenever it loads the model)"
            )
        adapter["lora_path"] = str(own)
    view = Path(tempfile.mkdtemp(prefix=f"rbln-ray-view-{artifact_dir.name}-"))
    for entry in artifact_dir.resolve().iterdir():
        if entry.name == RBLN_CONFIG:
            continue
        if entry.is_dir():
            os.symlink(entry, view / entry.name)
            continue
        try:  # files by hard link: the runtime opens graphs without following symlinks
            os.link(entry, view / entry.name)
        except OSError:  # another filesystem
            shutil.copy2(entry, view / entry.name)
    (view / RBLN_CONFIG).write_text(json.dumps(raw, indent=2))
    return view


def for_compile(
    hf_dir: Path, family: Any, hf_config: Mapping[str, Any], settings: Any, quantized: bool
) -> list[LoRAAdapter]:
    """The adapters a compile of ``hf_dir`` (a decoder of ``family``) builds in, checked."""
    if not settings.lora_modules:
        return []
    if not getattr(family, "lora", False):
        raise LoRAError(
            f"{hf_dir}: LoRA adapters for {family.architecture} are not served yet (verified "
            "families: docs/guides/lora-quantization.md)"
        )
    if quantized:
        raise LoRAError(
            f"{hf_dir}: LoRA adapters on a quantized checkpoint: optimum-rbln 0.12 cannot wrap "
            "its quantized projections (QIntLinear/QFloatLinear) in LoRA layers"
        )
    if family.sliding_window_used(hf_config):
        raise LoRAError(f"{hf_dir}: LoRA with sliding-window layers is not verified on RBLN")
    return read_adapters(settings.lora_modules, hf_config)
