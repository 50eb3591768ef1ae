"""The encoder table and artifact reader (no compile, no device)."""

from __future__ import annotations

import json

import pytest

from rbln_ray.compile.encoders import EncoderArtifact, EncoderArtifactError
from rbln_ray.families.registry import (
    ENCODERS,
    UnsupportedModelError,
    encoder_for_dir,
    family_for_architectures,
)
from rbln_ray.models import build_tiny_encoder


def write_dir(path, arch: str, rbln: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    if rbln is not None:
        (path / "rbln_config.json").write_text(json.dumps(rbln))
    return path


def test_encoder_artifact_reads_shape_and_rejects_others(tmp_path) -> None:
    rbln = {
        "cls_name": "RBLNBertModelConfig",
        "batch_size": 4,
        "max_seq_len": 128,
        "model_input_names": ["input_ids", "attention_mask", "token_type_ids"],
        "_compile_cfgs": [{"num_devices": None}],
    }
    art = EncoderArtifact.load(write_dir(tmp_path / "ok", "BertModel", rbln))
    assert (art.batch_size, art.max_seq_len, art.num_devices, art.num_stages) == (4, 128, 1, 1)
    assert art.input_names[-1] == "token_type_ids" and art.family.name == "bert"
    with pytest.raises(EncoderArtifactError, match="RBLNBertModelConfig"):
        wrong = {**rbln, "cls_name": "RBLNBertForMaskedLMConfig"}
        EncoderArtifact.load(write_dir(tmp_path / "wrong", "BertModel", wrong))
    with pytest.raises(EncoderArtifactError, match="not a compiled encoder"):
        EncoderArtifact.load(write_dir(tmp_path / "hf", "BertModel"))
    assert encoder_for_dir(write_dir(tmp_path / "llama", "LlamaForCausalLM")) is None


def test_unsupported_architecture_names_the_encoders_too() -> None:
    with pytest.raises(
        UnsupportedModelError,
        match="for embeddings and scores: BertModel, XLMRobertaModel, XLMRoberta",
    ):
        family_for_architectures(["RobertaModel"])


@pytest.mark.parametrize("family", list(ENCODERS))
def test_tiny_encoders_are_the_architecture_the_table_serves(tmp_path, family: str) -> None:
    from transformers import AutoTokenizer

    out = build_tiny_encoder(family=family, out_dir=tmp_path / family, num_layers=1)
    assert encoder_for_dir(out) is ENCODERS[family]
    tok = AutoTokenizer.from_pretrained(out)
    pair = tok("query", "document")
    # BERT marks the document as segment 1; RoBERTa has one segment and frames with </s></s>.
    if family == "bert":
        assert set(pair["token_type_ids"]) == {0, 1}
    else:
        assert "token_type_ids" not in pair
        assert pair["input_ids"].count(tok.eos_token_id) == 3
