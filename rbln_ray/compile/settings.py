"""Compile settings: the typed form users give (CLI, Serve config, ``additional_config``) and
the one mapping onto optimum-rbln's ``rbln_*`` keyword arguments.

Why one mapping: the single-graph compile (:mod:`.optimum_compile`) and the pipeline compile
(:mod:`.pipeline_compile`) must spell every option the same way optimum does, and leave
optimum's own default in force when a setting is not given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


def rbln_kwargs(
    *,
    batch_size: int,
    max_seq_len: int,
    attn_impl: str = "eager",
    kvcache_partition_len: int | None = None,
    num_devices: int = 1,
    decoder_batch_sizes: list[int] | tuple[int, ...] | None = None,
    use_attention_mask: bool = False,
    create_runtimes: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """optimum-rbln's ``from_pretrained`` / ``prepare_rbln_config`` keyword arguments.

    ``None`` means optimum's default (the key is left out); ``extra`` keys are passed as
    ``rbln_<name>`` (e.g. ``kvcache_num_blocks=8``).
    """
    kwargs: dict[str, Any] = {
        "rbln_batch_size": batch_size,
        "rbln_max_seq_len": max_seq_len,
        "rbln_attn_impl": attn_impl,
        "rbln_num_devices": num_devices,
        "rbln_use_attention_mask": use_attention_mask,
        "rbln_create_runtimes": create_runtimes,
    }
    if kvcache_partition_len is not None:
        kwargs["rbln_kvcache_partition_len"] = kvcache_partition_len
    if decoder_batch_sizes is not None:
        kwargs["rbln_decoder_batch_sizes"] = list(decoder_batch_sizes)
    kwargs.update({f"rbln_{k}": v for k, v in extra.items() if v is not None})
    return kwargs


@dataclass(frozen=True)
class CompileSettings:
    """How an HF directory is compiled when no compiled artifact is given."""

    batch_size: int = 4
    max_seq_len: int | None = None  # default: the model's max_position_embeddings (≤ 4096)
    attn_impl: str = "eager"
    kvcache_partition_len: int | None = None
    num_devices: int = 1
    use_attention_mask: bool = False
    decoder_batch_sizes: tuple[int, ...] | None = None  # default: optimum's ([batch_size])
    # default: optimum's (eager: one block per sequence; flash: as many as DRAM holds)
    kvcache_num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.attn_impl not in ("eager", "flash_attn"):
            raise ValueError(f"attn_impl must be 'eager' or 'flash_attn', not {self.attn_impl!r}")
        if self.batch_size < 1 or self.num_devices < 1:
            raise ValueError("batch_size and num_devices must be >= 1")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> CompileSettings:
        raw = dict(raw or {})
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown RBLN compile settings {sorted(unknown)}; "
                f"known: {sorted(cls.__dataclass_fields__)}"
            )
        if raw.get("decoder_batch_sizes") is not None:
            raw["decoder_batch_sizes"] = tuple(raw["decoder_batch_sizes"])
        return cls(**raw)

    def with_max_seq_len(self, hf_config: dict[str, Any]) -> CompileSettings:
        """These settings with ``max_seq_len`` filled from the model (capped at 4096)."""
        if self.max_seq_len is not None:
            return self
        return replace(self, max_seq_len=min(hf_config.get("max_position_embeddings", 4096), 4096))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
