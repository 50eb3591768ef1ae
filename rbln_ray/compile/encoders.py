"""Encoder (pooling) models: how they are compiled, and what a compiled one looks like (the
families are records of :mod:`rbln_ray.families.registry`).

Why apart from the decoder compile: an encoder has no KV cache, no decode phase and no
sampling. One compiled graph takes ``[batch_size, max_seq_len]`` token ids with an attention
mask and returns every position's hidden state; pooling (CLS, mean, ...) and normalisation
stay on the host, in vLLM's own pooler, exactly as plain vLLM pools its own BERT. So the
compile call and the artifact fields differ from a decoder's in every line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from rbln_ray.common.artifact_files import RBLN_CONFIG
from rbln_ray.compile.settings import CompileSettings
from rbln_ray.families.registry import EncoderFamily, Family, encoder_for_dir

logger = logging.getLogger(__name__)


class EncoderArtifactError(ValueError):
    """A directory is not a usable compiled optimum-rbln encoder."""


@dataclass(frozen=True)
class EncoderArtifact:
    """What rbln-ray needs to know about a compiled encoder directory."""

    path: Path
    family: EncoderFamily
    batch_size: int  # rows of one compiled call
    max_seq_len: int  # tokens of each row (shorter inputs are padded, masked out)
    input_names: tuple[str, ...]
    num_devices: int = 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages: an encoder is one compiled graph, never staged."""
        return 1

    @property
    def max_num_seqs(self) -> int:
        """Sequences one engine runs at once: the rows of one compiled call."""
        return self.batch_size

    @classmethod
    def load(cls, path: str | Path, family: Family | None = None) -> EncoderArtifact:
        """The artifact of ``path``, a compiled encoder of ``family`` (looked up when not
        given)."""
        path = Path(path)
        if family is None:
            family = encoder_for_dir(path)
        if not isinstance(family, EncoderFamily):
            family = None
        cfg_path = path / RBLN_CONFIG
        if family is None or not cfg_path.is_file():
            raise EncoderArtifactError(f"{path} is not a compiled encoder (no {RBLN_CONFIG})")
        raw = json.loads(cfg_path.read_text())
        if raw.get("cls_name") != family.config_class:
            raise EncoderArtifactError(
                f"{cfg_path} was compiled as {raw.get('cls_name')!r}; {family.architecture} "
                f"is served from {family.config_class}"
            )
        compile_cfgs = raw.get("_compile_cfgs") or [{}]
        return cls(
            path=path,
            family=family,
            batch_size=int(raw["batch_size"]),
            max_seq_len=int(raw["max_seq_len"]),
            input_names=tuple(raw.get("model_input_names") or family.input_names),
            num_devices=int(compile_cfgs[0].get("num_devices") or 1),
        )


def compile_encoder(
    hf_dir: str | Path, out_dir: str | Path, settings: CompileSettings, family: EncoderFamily
) -> Path:
    """Compile ``hf_dir`` with its family's optimum-rbln encoder class: one graph of
    ``batch_size`` x ``max_seq_len`` tokens on one device; returns ``out_dir``. Decoder-only
    settings (attention, KV blocks, decode batches) do not apply and are refused when set."""
    from rbln_ray.emulator.switch import require_runtime

    decoder_only = {
        k: v
        for k, v in settings.cache_fields().items()
        if k not in ("batch_size", "max_seq_len") and v != CompileSettings.model_fields[k].default
    }
    if decoder_only:
        raise ValueError(
            f"{family.architecture} is an encoder (one graph on one device): "
            f"{decoder_only} do not apply"
        )
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    settings = settings.with_max_seq_len(hf_config)
    batch_size, max_seq_len = settings.batch_size, settings.max_seq_len
    require_runtime("compile a model")
    from rbln_ray.upstream.optimum_models import rbln_class

    cls = rbln_class(family.optimum_class)
    shape = f"batch {batch_size} x {max_seq_len} tokens"
    logger.info("compiling encoder %s -> %s (%s)", hf_dir, out_dir, shape)
    model = cls.from_pretrained(
        str(hf_dir),
        export=True,
        rbln_batch_size=batch_size,
        rbln_max_seq_len=max_seq_len,
        rbln_model_input_names=list(family.input_names),
        rbln_create_runtimes=False,
    )
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
