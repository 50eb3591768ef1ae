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
from rbln_ray.families.tiny import ROBERTA_PAIR
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

    # two layers: ModernBERT's first is global, its second local (one layer: transformers
    # 5.15.1 rejects the config's rope parameters)
    out = build_tiny_encoder(family=family, out_dir=tmp_path / family, num_layers=2)
    assert encoder_for_dir(out) is ENCODERS[family]
    tok = AutoTokenizer.from_pretrained(out)
    pair = tok("query", "document")
    # BERT marks the document as segment 1; ModernBERT frames pairs alike without segment
    # ids; RoBERTa has one segment and frames with </s></s>.
    if "token_type_ids" in ENCODERS[family].input_names:
        assert set(pair["token_type_ids"]) == {0, 1}
    else:
        assert "token_type_ids" not in pair
        roberta = ENCODERS[family].tiny.framing == ROBERTA_PAIR
        assert pair["input_ids"].count(tok.eos_token_id) == (3 if roberta else 2)


def test_decoder_checkpoints_read_as_pooling_models_by_runner_and_overrides() -> None:
    """A Qwen3 causal LM checkpoint is its decoder's for generation and the Qwen3 embedder as
    a pooling model; with vLLM's reranker overrides it is the reranker; an architecture alone
    never names a decoder-based pooling family."""
    from rbln_ray.families.registry import (
        POOLING_DECODERS,
        DecoderFamily,
        pooling_decoder_for,
    )

    qwen3 = {"architectures": ["Qwen3ForCausalLM"]}
    assert isinstance(family_for_architectures(qwen3["architectures"]), DecoderFamily)
    assert pooling_decoder_for(qwen3) is POOLING_DECODERS["qwen3-embedding"]
    reranker = {**qwen3, **POOLING_DECODERS["qwen3-reranker"].hf_overrides}
    assert pooling_decoder_for(reranker) is POOLING_DECODERS["qwen3-reranker"]
    # the reranker's architecture without the marker (a checkpoint with its own score head)
    assert pooling_decoder_for({"architectures": ["Qwen3ForSequenceClassification"]}) is None
    assert pooling_decoder_for({"architectures": ["LlamaForCausalLM"]}) is None
    assert pooling_decoder_for({"architectures": ["BertModel"]}) is None


@pytest.mark.parametrize(
    ("arch", "why"),
    [("T5EncoderModel", "no T5 model"), ("Qwen3_5MoeForCausalLM", "no RBLNQwen3_5Moe class")],
)
def test_refused_architectures_say_why(arch: str, why: str) -> None:
    with pytest.raises(UnsupportedModelError, match=why):
        family_for_architectures([arch])


def test_embed_purpose_keeps_earlier_compile_keys_and_never_reaches_optimum() -> None:
    from rbln_ray.compile.settings import CompileSettings

    plain = CompileSettings(max_seq_len=128)
    embed = plain.model_copy(update={"purpose": "embed"})
    assert "purpose" not in plain.cache_fields()  # compiles cached before it keep their keys
    assert embed.cache_fields()["purpose"] == "embed"
    assert "rbln_purpose" not in embed.rbln_kwargs()
    assert plain.rbln_kwargs() == embed.rbln_kwargs()


class _RecordingEncoder:
    """Stands in for a compiled encoder: records its inputs, returns one logit per row."""

    def __init__(self) -> None:
        self.inputs: dict = {}

    def __call__(self, **inputs):
        from types import SimpleNamespace

        import torch

        self.inputs = inputs
        return SimpleNamespace(logits=torch.zeros(inputs["input_ids"].shape[0], 1))


def test_cross_encoder_pairs_reach_the_graph_with_their_segment_ids() -> None:
    """vLLM's score requests say where a pair's second segment starts (pooling params'
    ``compressed_token_type_ids``, as vLLM's own runner reads them); the compiled call gets 1
    from there to the end of the prompt, 0 before it and in the padding."""
    from types import SimpleNamespace

    import torch

    from rbln_ray.vllm_plugin.pooling_runner import RBLNPoolingRunner

    runner = RBLNPoolingRunner.__new__(RBLNPoolingRunner)
    runner.artifact = SimpleNamespace(
        batch_size=3,
        max_seq_len=8,
        input_names=("input_ids", "attention_mask", "token_type_ids"),
        family=ENCODERS["bert-reranker"],
    )
    from rbln_ray.vllm_plugin.model_runner import StepStats

    runner.stats = StepStats()
    runner.rbln_model = _RecordingEncoder()
    pair = SimpleNamespace(
        pooling_params=SimpleNamespace(extra_kwargs={"compressed_token_type_ids": 3})
    )
    single = SimpleNamespace(pooling_params=SimpleNamespace(extra_kwargs=None))
    lens = [6, 4]
    segments = [
        RBLNPoolingRunner._segment_start(n, k) for n, k in zip([pair, single], lens, strict=True)
    ]
    assert segments == [3, 4]
    ids = torch.ones(3, 8, dtype=torch.long)
    runner._encode(ids, torch.ones_like(ids), lens, segments)
    types = runner.rbln_model.inputs["token_type_ids"]
    assert types.tolist() == [[0, 0, 0, 1, 1, 1, 0, 0], [0] * 8, [0] * 8]
