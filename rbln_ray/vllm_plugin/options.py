"""rbln-ray's engine options (read once from vLLM's ``additional_config``) and the decisions
the driver hands the engine's other processes.

Why ``additional_config``: it is vLLM's public, serialised place for platform-specific engine
settings; it reaches the engine-core process and every worker with the rest of the config
(``LLM(..., additional_config={...})``, ``vllm serve --additional-config '{...}'``, a Serve
model's ``engine_kwargs: {additional_config: {...}}``). Every option is a field of
:class:`RBLNOptions`, spelled ``rbln_<field>`` in ``additional_config``; an unknown ``rbln_*``
key is an error (a typo must not be silently ignored).

The platform's config hook replaces the user's dict by :class:`RBLNAdditionalConfig` (vLLM
accepts any object with ``compute_hash`` there): the user's keys untouched, the options
parsed once, and :class:`EngineDecisions`, what the driver decided (the compiled artifact in
use, its Ray cluster) for the engine core and the workers, in a typed field of its own.

=====================================  ==========  ===========================================
key                                    default     meaning
=====================================  ==========  ===========================================
``rbln_compile``                       {}          compile settings for an HF directory
                                                   (:class:`~rbln_ray.compile.CompileSettings`
                                                   fields)
``rbln_decode_steps_between_chunks``   1           decode steps that run between two chunks
                                                   of one prompt while requests are decoding
                                                   (chunked prefill): each decode step is then
                                                   delayed by at most one chunk. Larger values
                                                   slow fewer decode steps but delay the long
                                                   prompt's first token (BENCHMARKS.md §6);
                                                   0 runs its chunks back to back
``rbln_placement_strategy``            PACK        Ray placement strategy of the workers
                                                   (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)
``rbln_placement_timeout_s``           120         seconds to wait for the workers' devices
``rbln_spec_policy``                   auto        speculative decoding: ``auto`` verifies
                                                   drafts in a step only when the expected
                                                   tokens per second beat a plain decode
                                                   step's (:mod:`~rbln_ray.vllm_plugin.spec.
                                                   policy`); ``always`` verifies whenever a
                                                   row has drafts
``rbln_spec_min_gain``                 1.05        auto: verify only when it is expected to
                                                   yield this many times a decode step's
                                                   tokens per second
``rbln_spec_probe_steps``              32          auto, draft model: decode steps between
                                                   probes while speculation is off
=====================================  ==========  ===========================================
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from rbln_ray.compile.settings import CompileSettings

PREFIX = "rbln_"
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class RBLNOptionError(ValueError):
    """An rbln-ray option in ``additional_config`` is unknown or has an invalid value."""


class PlacementSettings(BaseModel):
    """Where an engine's worker actors go: declared once, for the engine options and (as the
    same fields of each model) the Serve config."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    placement_strategy: PlacementStrategy = Field(
        "PACK", description="Ray placement strategy of an engine's workers"
    )
    placement_timeout_s: float = Field(
        120.0, gt=0, description="seconds to wait for the workers' RBLN devices"
    )

    @field_validator("placement_strategy", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    def placement(self) -> PlacementSettings:
        """Just the placement fields (of a subclass, e.g. a Serve model's config)."""
        return PlacementSettings(
            placement_strategy=self.placement_strategy,
            placement_timeout_s=self.placement_timeout_s,
        )


class RBLNOptions(PlacementSettings):
    """Typed, validated rbln-ray engine options (``additional_config["rbln_<field>"]``)."""

    compile: CompileSettings = Field(default_factory=CompileSettings)
    decode_steps_between_chunks: StrictInt = Field(1, ge=0)
    spec_policy: Literal["auto", "always"] = "auto"
    spec_min_gain: float = Field(1.05, gt=0)
    spec_probe_steps: StrictInt = Field(32, ge=1)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(PREFIX + name for name in cls.model_fields)

    @classmethod
    def from_additional_config(cls, extra: dict[str, Any] | None) -> RBLNOptions:
        extra = extra or {}
        ours = {k: v for k, v in extra.items() if k.startswith(PREFIX)}
        unknown = sorted(set(ours) - set(cls.keys()))
        if unknown:
            raise RBLNOptionError(f"unknown rbln-ray options {unknown}; known: {list(cls.keys())}")
        values = {k.removeprefix(PREFIX): v for k, v in ours.items()}
        try:
            if "compile" in values:
                values["compile"] = CompileSettings.from_dict(values["compile"])
            return cls(**values)
        except ValidationError as exc:
            problems = "; ".join(
                f"additional_config[{PREFIX + str(e['loc'][0])!r}]: {e['msg']} "
                f"(got {e.get('input')!r})"
                for e in exc.errors()
            )
            raise RBLNOptionError(problems) from None
        except ValueError as exc:  # CompileSettingsError
            raise RBLNOptionError(f"additional_config[{PREFIX}compile]: {exc}") from None

    def as_additional_config(self) -> dict[str, Any]:
        """These options as ``additional_config`` keys (what a Serve replica passes vLLM)."""
        return {PREFIX + name: value for name, value in self.model_dump(mode="json").items()}


@dataclass(frozen=True)
class EngineDecisions:
    """What the driver decided for the engine core and the workers (never user input)."""

    compiled_dir: str | None = None  # the compiled artifact in use (compiled on first use)
    ray_address: str | None = None  # the driver's Ray cluster (GCS address)
    driver_pid: int | None = None  # the driver process connected to it
    draft_compiled_dir: str | None = None  # speculative decoding's draft model, compiled


@dataclass
class RBLNAdditionalConfig:
    """vLLM's ``additional_config`` on the RBLN platform once read: the user's dict as given,
    the options parsed from it, and the driver's decisions. vLLM hashes it through
    :meth:`compute_hash` (the user's keys and the artifact: not the Ray address, so every
    replica of a deployment has one config hash)."""

    user: dict[str, Any]
    options: RBLNOptions
    decisions: EngineDecisions = field(default_factory=EngineDecisions)

    def compute_hash(self) -> str:
        text = json.dumps(self.user, sort_keys=True, default=str) + str(self.decisions.compiled_dir)
        if self.decisions.draft_compiled_dir:
            text += str(self.decisions.draft_compiled_dir)
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style reads of the user's keys (other vLLM code reads additional_config so)."""
        return self.user.get(key, default)


def _state(vllm_config: Any) -> RBLNAdditionalConfig:
    """The engine's :class:`RBLNAdditionalConfig`, made from the user's dict on first use."""
    extra = vllm_config.additional_config
    if isinstance(extra, RBLNAdditionalConfig):
        return extra
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise RBLNOptionError(
            f"additional_config must be a dict on the RBLN platform, not {type(extra).__name__}"
        )
    state = RBLNAdditionalConfig(user=extra, options=RBLNOptions.from_additional_config(extra))
    vllm_config.additional_config = state
    return state


def engine_options(vllm_config: Any) -> RBLNOptions:
    """The engine's options (parsed once; an invalid one raises :class:`RBLNOptionError`)."""
    return _state(vllm_config).options


def engine_decisions(vllm_config: Any) -> EngineDecisions:
    return _state(vllm_config).decisions


def decide(vllm_config: Any, **decisions: Any) -> None:
    """Record driver decisions (fields of :class:`EngineDecisions`) for the other processes."""
    state = _state(vllm_config)
    state.decisions = replace(state.decisions, **decisions)
