"""rbln-ray's engine options, read once from vLLM's ``additional_config``.

Why ``additional_config``: it is vLLM's public, serialised place for platform-specific engine
settings; it reaches the engine-core process and every worker with the rest of the config
(``LLM(..., additional_config={...})``, ``vllm serve --additional-config '{...}'``, a Serve
model's ``engine_kwargs: {additional_config: {...}}``).

=====================================  =======  ==============================================
key                                    default  meaning
=====================================  =======  ==============================================
``rbln_decode_steps_between_chunks``   1        decode steps that run between two chunks
                                                of one prompt while requests are decoding
                                                (chunked prefill): each decode step is then
                                                delayed by at most one chunk. Larger values
                                                slow fewer decode steps but delay the long
                                                prompt's first token (measured: 2,048 tokens
                                                on a modelled ATOM, 2.8 s at 1, 5.0 s at 3);
                                                0 runs its chunks back to back
=====================================  =======  ==============================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DECODE_STEPS_KEY = "rbln_decode_steps_between_chunks"


class RBLNOptionError(ValueError):
    """An rbln-ray option in ``additional_config`` has an invalid value."""


@dataclass(frozen=True)
class RBLNOptions:
    """Typed, validated rbln-ray engine options."""

    decode_steps_between_chunks: int = 1

    @classmethod
    def from_additional_config(cls, extra: dict[str, Any] | None) -> RBLNOptions:
        extra = extra or {}
        steps = extra.get(DECODE_STEPS_KEY, cls.decode_steps_between_chunks)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise RBLNOptionError(
                f"additional_config[{DECODE_STEPS_KEY!r}] must be an integer >= 0, not {steps!r}"
            )
        return cls(decode_steps_between_chunks=steps)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> RBLNOptions:
        extra = vllm_config.additional_config
        return cls.from_additional_config(extra if isinstance(extra, dict) else None)
