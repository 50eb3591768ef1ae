"""rbln-ray's engine options, read once from vLLM's ``additional_config`` into typed values.

Why ``additional_config``: it is vLLM's public, serialised place for platform-specific engine
settings; it reaches the engine-core process and every worker with the rest of the config
(``LLM(..., additional_config={...})``, ``vllm serve --additional-config '{...}'``, a Serve
model's ``engine_kwargs: {additional_config: {...}}``). Every key is declared here, parsed and
validated by :meth:`RBLNOptions.from_vllm_config`; an unknown ``rbln_*`` key is an error (a
typo must not be silently ignored). Two keys are written by rbln-ray itself, through
:func:`record`, so that the spawned engine core sees what the driver decided.

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
                                                   prompt's first token (measured: 2,048
                                                   tokens on a modelled ATOM, 2.8 s at 1,
                                                   5.0 s at 3); 0 runs its chunks back to back
``rbln_placement_strategy``            PACK        Ray placement strategy of the workers
                                                   (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)
``rbln_placement_timeout_s``           60          seconds to wait for the workers' devices
``rbln_compiled_dir``                  (written)   the compiled artifact in use
``rbln_ray_address``                   (written)   the driver's Ray cluster (GCS address)
``rbln_ray_driver_pid``                (written)   the driver process connected to it
=====================================  ==========  ===========================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rbln_ray.compile.settings import CompileSettings

COMPILE_KEY = "rbln_compile"
DECODE_STEPS_KEY = "rbln_decode_steps_between_chunks"
STRATEGY_KEY = "rbln_placement_strategy"
TIMEOUT_KEY = "rbln_placement_timeout_s"
COMPILED_DIR_KEY = "rbln_compiled_dir"
RAY_ADDRESS_KEY = "rbln_ray_address"
DRIVER_PID_KEY = "rbln_ray_driver_pid"
WRITTEN_KEYS = (COMPILED_DIR_KEY, RAY_ADDRESS_KEY, DRIVER_PID_KEY)
KEYS = (COMPILE_KEY, DECODE_STEPS_KEY, STRATEGY_KEY, TIMEOUT_KEY, *WRITTEN_KEYS)
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class RBLNOptionError(ValueError):
    """An rbln-ray option in ``additional_config`` is unknown or has an invalid value."""


def _extra(vllm_config: Any) -> dict[str, Any]:
    extra = vllm_config.additional_config
    if extra is None:
        extra = vllm_config.additional_config = {}
    if not isinstance(extra, dict):
        raise RBLNOptionError(
            f"additional_config must be a dict on the RBLN platform, not {type(extra).__name__}"
        )
    return extra


@dataclass(frozen=True)
class RBLNOptions:
    """Typed, validated rbln-ray engine options."""

    compile: CompileSettings = field(default_factory=CompileSettings)
    decode_steps_between_chunks: int = 1
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 60.0
    compiled_dir: str | None = None
    ray_address: str | None = None
    driver_pid: int | None = None

    @classmethod
    def from_additional_config(cls, extra: dict[str, Any] | None) -> RBLNOptions:
        extra = extra or {}
        unknown = sorted(k for k in extra if k.startswith("rbln_") and k not in KEYS)
        if unknown:
            raise RBLNOptionError(f"unknown rbln-ray options {unknown}; known: {list(KEYS)}")
        steps = extra.get(DECODE_STEPS_KEY, cls.decode_steps_between_chunks)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise RBLNOptionError(
                f"additional_config[{DECODE_STEPS_KEY!r}] must be an integer >= 0, not {steps!r}"
            )
        strategy = str(extra.get(STRATEGY_KEY, cls.placement_strategy)).upper()
        if strategy not in STRATEGIES:
            raise RBLNOptionError(
                f"additional_config[{STRATEGY_KEY!r}]={strategy!r}; expected one of {STRATEGIES}"
            )
        try:
            timeout_s = float(extra.get(TIMEOUT_KEY, cls.placement_timeout_s))
        except (TypeError, ValueError):
            timeout_s = -1.0
        if timeout_s <= 0:
            raise RBLNOptionError(
                f"additional_config[{TIMEOUT_KEY!r}] must be a number of seconds > 0, "
                f"not {extra.get(TIMEOUT_KEY)!r}"
            )
        try:
            settings = CompileSettings.from_dict(extra.get(COMPILE_KEY))
        except (TypeError, ValueError) as e:
            raise RBLNOptionError(f"additional_config[{COMPILE_KEY!r}]: {e}") from None
        pid = extra.get(DRIVER_PID_KEY)
        return cls(
            compile=settings,
            decode_steps_between_chunks=steps,
            placement_strategy=strategy,
            placement_timeout_s=timeout_s,
            compiled_dir=extra.get(COMPILED_DIR_KEY),
            ray_address=extra.get(RAY_ADDRESS_KEY),
            driver_pid=int(pid) if pid is not None else None,
        )

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> RBLNOptions:
        return cls.from_additional_config(_extra(vllm_config))


def record(vllm_config: Any, key: str, value: Any) -> None:
    """Write one of the keys rbln-ray decides in the driver (``WRITTEN_KEYS``)."""
    if key not in WRITTEN_KEYS:
        raise KeyError(f"{key!r} is not an option rbln-ray writes ({WRITTEN_KEYS})")
    _extra(vllm_config)[key] = value
