"""Compile settings: the one typed declaration of how an HF directory is compiled, and the one
mapping onto optimum-rbln's ``rbln_*`` keyword arguments.

Why one class: ``rbln-ray compile``'s flags are generated from its fields
(:func:`rbln_ray.cli.compile_flags.add_compile_flags`), the Serve config holds it typed
(``models[].compile``), engine options carry it (``additional_config["rbln_compile"]``) and
every compile path takes it; each default therefore lives here once, and a setting that is
not given leaves optimum's own default in force (the key is left out of the ``rbln_*``
arguments).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# max_seq_len when neither the user nor the artifact says: the model's context, capped here
DEFAULT_MAX_SEQ_LEN_CAP = 4096
# Settings rbln-ray compiles itself (graphs beside optimum's), never passed to optimum.
OWN_SETTINGS = ("spec_tokens",)


# Settings rbln-ray translates into optimum's own (quantization, lora_config) after checking
# them against the checkpoint, rather than passing them on as they are.
TRANSLATED = ("quantization", "kv_cache_dtype", "lora_modules")


class CompileSettingsError(ValueError):
    """A compile setting is unknown or has an invalid value (the message names it)."""


class CompileSettings(BaseModel):
    """How an HF directory is compiled (decoders; encoders and vision-language models take
    the fields that apply to them, see :mod:`rbln_ray.compile.family_compile`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(4, ge=1, description="sequences one compiled decode step runs")
    max_seq_len: int | None = Field(
        None,
        ge=1,
        description="tokens per sequence (default: the model's max_position_embeddings, "
        f"at most {DEFAULT_MAX_SEQ_LEN_CAP})",
    )
    attn_impl: Literal["eager", "flash_attn"] = Field(
        "eager", description="eager: one KV block per sequence; flash_attn: paged partitions"
    )
    kvcache_partition_len: int | None = Field(
        None, ge=1, description="flash_attn: tokens per KV partition (default: optimum's)"
    )
    num_devices: int = Field(1, ge=1, description="RBLN devices one compiled model spans")
    use_attention_mask: bool = Field(
        False, description="compile graphs that take an attention mask"
    )
    decoder_batch_sizes: tuple[int, ...] | None = Field(
        None,
        description="compiled decode batches, e.g. 4,2,1 (default: optimum's: batch_size)",
    )
    kvcache_num_blocks: int | None = Field(
        None,
        ge=1,
        description="compiled KV blocks (default: optimum's; blocks beyond batch x "
        "sequences keep more prefixes cached)",
    )
    # Translated by rbln_ray.compile.quantization / .lora, never passed to optimum as they are.
    quantization: Literal["int8", "fp8"] | None = Field(
        None,
        description="weights of a pre-quantized checkpoint (default: what its "
        "quantization_config says; rbln-ray compiles quantized checkpoints, it does not quantize)",
    )
    kv_cache_dtype: Literal["fp8"] | None = Field(
        None, description="fp8: fp8 (e4m3) KV caches, with the checkpoint's KV scales"
    )
    lora_modules: dict[str, str] | None = Field(
        None,
        description="LoRA adapters compiled into the model, NAME=DIR (PEFT directories); "
        "requests choose one by name",
    )

    spec_tokens: int | None = Field(
        None,
        ge=1,
        le=32,
        description="speculative decoding: also compile verify graphs that score this many "
        "draft tokens (+1) per sequence in one decode call, for every decode batch",
    )
    purpose: Literal["generate", "embed"] = Field(
        "generate",
        description="decoders: what the compiled prefill returns: generate (logits; text, "
        "and rerankers read as classifiers) or embed (every position's hidden state: a "
        "decoder-based embedding model such as Qwen3-Embedding, served with runner=pooling)",
    )

    @field_validator("decoder_batch_sizes", mode="before")
    @classmethod
    def _sizes(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(int(s) for s in value.split(",") if s.strip())
        return value

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _modules(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):  # NAME=DIR strings (the CLI's, vLLM's form)
            pairs = [str(v).partition("=") for v in value]
            bad = [f"{n}{s}{p}" for n, s, p in pairs if not (n and s and p)]
            if bad:
                raise ValueError(f"expected NAME=DIR, got {bad}")
            return {n: p for n, _, p in pairs}
        return value

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | CompileSettings | None) -> CompileSettings:
        """Validated settings from a plain dict (config files, ``additional_config``)."""
        if isinstance(raw, CompileSettings):
            return raw
        raw = dict(raw or {})
        unknown = sorted(set(raw) - set(cls.model_fields))
        if unknown:
            raise CompileSettingsError(
                f"unknown RBLN compile settings {unknown}; known: {sorted(cls.model_fields)}"
            )
        try:
            return cls(**raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise CompileSettingsError(f"invalid RBLN compile settings: {problems}") from None

    def with_max_seq_len(self, hf_config: dict[str, Any]) -> CompileSettings:
        """These settings with ``max_seq_len`` filled from the model (capped)."""
        if self.max_seq_len is not None:
            return self
        context = (
            hf_config.get("max_position_embeddings")
            or hf_config.get("max_target_positions")  # an encoder-decoder's decoder (Whisper)
            or DEFAULT_MAX_SEQ_LEN_CAP
        )
        return self.model_copy(update={"max_seq_len": min(context, DEFAULT_MAX_SEQ_LEN_CAP)})

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def cache_fields(self) -> dict[str, Any]:
        """What identifies a compile of these settings (the compile cache's key): every
        field, but ``purpose`` only when it is not the default, so compiles cached before it
        existed keep their keys."""
        fields = self.model_dump()
        if fields["purpose"] == "generate":
            del fields["purpose"]
        return fields

    def rbln_config(self, **extra: Any) -> dict[str, Any]:
        """optimum's ``rbln_config`` entries (unprefixed) for these settings plus ``extra``;
        a setting left at None is left out, so optimum's default applies."""
        if self.max_seq_len is None:
            raise CompileSettingsError("max_seq_len is not set (see with_max_seq_len)")
        values = {**self.model_dump(exclude={*OWN_SETTINGS, *TRANSLATED, "purpose"}), **extra}
        if values.get("decoder_batch_sizes") is not None:
            values["decoder_batch_sizes"] = list(values["decoder_batch_sizes"])
        return {k: v for k, v in values.items() if v is not None}

    def rbln_kwargs(self, **extra: Any) -> dict[str, Any]:
        """optimum-rbln's ``from_pretrained`` / ``prepare_rbln_config`` keyword arguments
        (``rbln_<name>``); runtimes are not created, so compiling needs no free device."""
        config = {"create_runtimes": False, **self.rbln_config(**extra)}
        return {f"rbln_{k}": v for k, v in config.items()}
