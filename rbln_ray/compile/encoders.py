"""Encoder (pooling) models: which architectures rbln-ray serves for embeddings, how they are
compiled, and what a compiled one looks like.

Why apart from :mod:`.zoo`: an encoder has no KV cache, no decode phase and no sampling. One
compiled graph takes ``[batch_size, max_seq_len]`` token ids with an attention mask and
returns every position's hidden state; pooling (CLS, mean, ...) and normalisation stay on the
host, in vLLM's own pooler, exactly as plain vLLM pools its own BERT. So the families, the
compile call and the artifact fields differ from a decoder's in every line.

Supported means what it means in the zoo: a tiny model of the family, built locally by
:func:`rbln_ray.models.build_tiny_encoder`, compiled with optimum-rbln 0.12 on the emulator and
served by ``vllm.LLM(runner="pooling")`` gives plain vLLM-CPU's embeddings
(``tests/vllm_plugin/test_embeddings.py``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from rbln_ray.common.artifact_files import RBLN_CONFIG, architectures
from rbln_ray.compile.settings import CompileSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderFamily:
    """One encoder architecture optimum-rbln 0.12 compiles, served for embeddings."""

    name: str  # rbln-ray's family name (``rbln-ray build-model <name>``)
    architecture: str  # ``config.json`` ``architectures[0]``
    optimum_class: str
    input_names: tuple[str, ...]  # the compiled graph's inputs, in order
    # What the compiled graph returns, so which of vLLM's poolers takes it: "embed" (every
    # position's hidden state; vLLM pools and normalises) or "classify" (the sequence
    # classifier's logits, head included; vLLM applies the activation: a cross-encoder's
    # relevance score, ``/v1/score`` and ``/v1/rerank``).
    task: str = "embed"

    @property
    def config_class(self) -> str:
        return self.optimum_class + "Config"


ENCODERS: dict[str, EncoderFamily] = {
    "bert": EncoderFamily(
        name="bert",
        architecture="BertModel",
        optimum_class="RBLNBertModel",
        input_names=("input_ids", "attention_mask", "token_type_ids"),
    ),
    # e.g. BAAI/bge-m3, multilingual-e5
    "xlm-roberta": EncoderFamily(
        name="xlm-roberta",
        architecture="XLMRobertaModel",
        optimum_class="RBLNXLMRobertaModel",
        input_names=("input_ids", "attention_mask"),
    ),
    # Cross-encoder rerankers, e.g. BAAI/bge-reranker-v2-m3 (no segment ids: RoBERTa has one)
    "xlm-roberta-reranker": EncoderFamily(
        name="xlm-roberta-reranker",
        architecture="XLMRobertaForSequenceClassification",
        optimum_class="RBLNXLMRobertaForSequenceClassification",
        input_names=("input_ids", "attention_mask"),
        task="classify",
    ),
    "roberta-reranker": EncoderFamily(
        name="roberta-reranker",
        architecture="RobertaForSequenceClassification",
        optimum_class="RBLNRobertaForSequenceClassification",
        input_names=("input_ids", "attention_mask"),
        task="classify",
    ),
}


def encoder_for_dir(model_dir: str | Path) -> EncoderFamily | None:
    """The encoder family of an HF or compiled directory, or None for anything else."""
    by_arch = {f.architecture: f for f in ENCODERS.values()}
    for arch in architectures(model_dir):
        if arch in by_arch:
            return by_arch[arch]
    return None


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

    @classmethod
    def load(cls, path: str | Path) -> EncoderArtifact:
        path = Path(path)
        family = encoder_for_dir(path)
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


def compile_encoder(hf_dir: str | Path, out_dir: str | Path, settings: CompileSettings) -> Path:
    """Compile ``hf_dir`` with its optimum-rbln encoder class: one graph of ``batch_size`` x
    ``max_seq_len`` tokens on one device; returns ``out_dir``. Decoder-only settings
    (attention, KV blocks, decode batches) do not apply and are refused when set."""
    from rbln_ray.emulator.switch import require_runtime

    family = encoder_for_dir(hf_dir)
    if family is None:
        raise ValueError(f"{hf_dir} is not an encoder rbln-ray compiles")
    decoder_only = {
        k: v
        for k, v in settings.as_dict().items()
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
    import optimum.rbln

    cls = getattr(optimum.rbln, family.optimum_class)
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
