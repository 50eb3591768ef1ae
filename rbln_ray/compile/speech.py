"""Speech-to-text encoder-decoder models (Whisper): how they are compiled, and what a compiled
one looks like (the family is a record of :mod:`rbln_ray.families.registry`).

Why apart from the decoder compile: optimum-rbln compiles Whisper as two graphs sharing static
buffers. The encoder takes one 30-second log-mel window ``[1, mel_bins, 3000]`` and writes the
cross-attention keys and values of every decoder layer into the slot its ``block_tables``
names; the decoder takes ``[batch_size, 1]`` tokens, each row at its own ``cache_position``
with its own self-attention block, and reads row *i*'s cross-attention from slot *i*. There is
no prefill graph (a prompt's few tokens go through the decoder one call each), no chunk size,
one KV block per sequence (``kvcache_block_size`` = ``dec_max_seq_len``), and the sequence
length comes from the model (``max_target_positions``), so none of the decoder's settings
but ``batch_size`` apply.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from rbln_ray.common.artifact_files import RBLN_CONFIG
from rbln_ray.compile.settings import CompileSettings
from rbln_ray.families.registry import Family, SpeechFamily, speech_for_dir

logger = logging.getLogger(__name__)


class SpeechArtifactError(ValueError):
    """A directory is not a usable compiled optimum-rbln speech model."""


@dataclass(frozen=True)
class SpeechArtifact:
    """What rbln-ray needs to know about a compiled Whisper directory."""

    path: Path
    family: SpeechFamily
    batch_size: int  # decoder rows of one compiled call (= requests in flight)
    max_seq_len: int  # decoder tokens of a sequence (dec_max_seq_len), prompt included
    enc_max_seq_len: int  # audio positions of one window (1500 for 30 s)
    kvcache_num_blocks: int  # self-attention blocks: one per row, and a scratch block
    kvcache_block_size: int
    use_attention_mask: bool
    token_timestamps: bool  # a second decoder output (cross-attention weights), unused
    dtype: str = "float32"
    num_devices: int = 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages: the two graphs run on one device group, never staged."""
        return 1

    @property
    def max_num_seqs(self) -> int:
        return self.batch_size

    @property
    def scratch_block(self) -> int:
        """The self-attention block no request owns: padding rows of a decoder call write it
        (a padding row at position 0 of a request's block would overwrite its first KV)."""
        return self.batch_size

    @classmethod
    def load(cls, path: str | Path, family: Family | None = None) -> SpeechArtifact:
        """The artifact of ``path``, a compiled speech model of ``family`` (looked up when not
        given)."""
        path = Path(path)
        if family is None:
            family = speech_for_dir(path)
        if not isinstance(family, SpeechFamily):
            family = None
        cfg_path = path / RBLN_CONFIG
        if family is None or not cfg_path.is_file():
            raise SpeechArtifactError(f"{path} is not a compiled speech model (no {RBLN_CONFIG})")
        raw = json.loads(cfg_path.read_text())
        if raw.get("cls_name") != family.config_class:
            raise SpeechArtifactError(
                f"{cfg_path} was compiled as {raw.get('cls_name')!r}; {family.architecture} "
                f"is served from {family.config_class}"
            )
        batch = int(raw["batch_size"])
        blocks = int(raw["kvcache_num_blocks"])
        if blocks < batch + 1:
            raise SpeechArtifactError(
                f"{cfg_path}: kvcache_num_blocks={blocks}; serving needs batch_size + 1 = "
                f"{batch + 1} (one block per row and a scratch block for padding rows)"
            )
        compile_cfgs = raw.get("_compile_cfgs") or [{}]
        return cls(
            path=path,
            family=family,
            batch_size=batch,
            max_seq_len=int(raw["dec_max_seq_len"]),
            enc_max_seq_len=int(raw["enc_max_seq_len"]),
            kvcache_num_blocks=blocks,
            kvcache_block_size=int(raw["kvcache_block_size"]),
            use_attention_mask=bool(raw.get("use_attention_mask")),
            token_timestamps=bool(raw.get("token_timestamps")),
            dtype=raw.get("dtype") or "float32",
            num_devices=int(compile_cfgs[-1].get("num_devices") or 1),
        )


def compile_speech(
    hf_dir: str | Path, out_dir: str | Path, settings: CompileSettings, family: SpeechFamily
) -> Path:
    """Compile ``hf_dir`` with its family's optimum-rbln class: an audio encoder and a decoder
    of ``batch_size`` rows, compiled as the family's module says (Whisper: ``batch_size + 1``
    self-attention blocks, a scratch block for padding rows); returns ``out_dir``. The
    decoder's other settings do not apply and are refused when set (the sequence length is
    the model's own)."""
    from rbln_ray.emulator.switch import require_runtime

    not_speech = {
        k: v
        for k, v in settings.cache_fields().items()
        if k not in ("batch_size", "max_seq_len") and v != CompileSettings.model_fields[k].default
    }
    code = family.code()
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    length = code.decoder_length(hf_config)
    if settings.max_seq_len is not None and settings.max_seq_len > length:
        not_speech["max_seq_len"] = settings.max_seq_len
    if not_speech:
        raise ValueError(
            f"{family.architecture} is compiled as an audio encoder and a decoder of "
            f"batch_size rows ({length} tokens, the model's max_target_positions): "
            f"{not_speech} do not apply"
        )
    require_runtime("compile a model")
    from rbln_ray.upstream.optimum_models import rbln_class

    cls = rbln_class(family.optimum_class)
    batch = settings.batch_size
    logger.info("compiling speech model %s -> %s (batch %d)", hf_dir, out_dir, batch)
    model = cls.from_pretrained(
        str(hf_dir), export=True, rbln_create_runtimes=False, **code.rbln_kwargs(batch)
    )
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
