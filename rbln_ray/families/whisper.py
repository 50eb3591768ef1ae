"""Whisper on RBLN: what rbln-ray knows of the family beyond its registry record: how
optimum-rbln compiles it for rbln-ray's speech runner, and how a tiny one is built.

* **Compile.** optimum-rbln compiles an audio encoder (one 30-second log-mel window in, every
  decoder layer's cross-attention keys and values out, written to the slot its
  ``block_tables`` names) and a decoder of ``batch_size`` rows; the decoder's length is the
  model's ``max_target_positions`` (448 in every released checkpoint). rbln-ray's runner
  gives padding rows a scratch block, so the decoder gets ``batch_size + 1`` self-attention
  blocks, and reads only the logits (no ``token_timestamps`` output).
* **Tiny model.** Whisper's real feature extractor and tokenizer layout over the local
  byte-level BPE's text vocabulary: ``<|endoftext|>``, ``<|startoftranscript|>``, the 100
  language tokens, the task tokens, ``<|notimestamps|>``, then 1501 timestamp tokens
  (``<|0.00|>`` .. ``<|30.00|>``), so that transformers' and vLLM's notions of where
  timestamps begin agree. The builder (cache, audio for tests) is
  :mod:`rbln_ray.models.speech`.

The speech cost model reads a Whisper ``config.json`` by its encoder-decoder keys
(:mod:`rbln_ray.npu.speech_cost`, below this layer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rbln_ray.families.contract import SpeechCode

# Whisper's special tokens after the language tokens, in its tokenizer's order.
SPECIALS_AFTER_LANGUAGES = (
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
)
DECODER_LENGTH = 448  # max_target_positions of every released checkpoint
TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|>, 20 ms apart


class Whisper(SpeechCode):
    def decoder_length(self, hf_config: Mapping[str, Any]) -> int:
        return int(hf_config.get("max_target_positions") or DECODER_LENGTH)

    def rbln_kwargs(self, batch_size: int) -> dict[str, Any]:
        return {
            "rbln_batch_size": batch_size,
            # one block per row, and the scratch block padding rows write
            "rbln_kvcache_num_blocks": batch_size + 1,
            "rbln_token_timestamps": False,  # a second output the runner would not read
        }

    def tiny_tokenizer(self, vocab: Mapping[str, int], merges: Sequence[tuple[str, str]]) -> Any:
        from transformers import AddedToken, WhisperTokenizer
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        tokenizer = WhisperTokenizer(vocab=dict(vocab), merges=list(merges))
        names = (
            ["<|endoftext|>", "<|startoftranscript|>"]
            + [f"<|{code}|>" for code in LANGUAGES]
            + list(SPECIALS_AFTER_LANGUAGES)
        )
        # extra_special_tokens, not add_tokens(special_tokens=True): only these join
        # all_special_ids, from which transformers derives where timestamps begin
        tokenizer.add_special_tokens(
            {"extra_special_tokens": [AddedToken(n, special=True, normalized=False) for n in names]}
        )
        tokenizer.add_tokens(
            [
                AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False)
                for i in range(TIMESTAMPS)
            ]
        )
        return tokenizer

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """Whisper's recipe at the spec's shape (encoder and decoder alike), with the
        generation config transformers' ``generate`` reads and the processor (Whisper's
        feature extractor at the spec's mel bins, the tokenizer)."""
        from transformers import (
            GenerationConfig,
            WhisperConfig,
            WhisperFeatureExtractor,
            WhisperForConditionalGeneration,
            WhisperProcessor,
        )
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        ids = tokenizer.convert_tokens_to_ids
        eot, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
        config = WhisperConfig(
            vocab_size=len(tokenizer),
            num_mel_bins=spec.num_mel_bins,
            d_model=spec.d_model,
            encoder_layers=spec.layers,
            decoder_layers=spec.layers,
            encoder_attention_heads=spec.heads,
            decoder_attention_heads=spec.heads,
            encoder_ffn_dim=spec.ffn_dim,
            decoder_ffn_dim=spec.ffn_dim,
            max_source_positions=1500,  # the feature extractor's 3000 frames, conv stride 2
            max_target_positions=DECODER_LENGTH,
            pad_token_id=eot,
            bos_token_id=eot,
            eos_token_id=eot,
            decoder_start_token_id=sot,
            # vLLM applies neither: the reference must not either
            suppress_tokens=None,
            begin_suppress_tokens=None,
            init_std=spec.init_std,
            architectures=["WhisperForConditionalGeneration"],
            torch_dtype="float32",
        )
        model = WhisperForConditionalGeneration(config).eval()
        model.generation_config = GenerationConfig(
            decoder_start_token_id=sot,
            eos_token_id=eot,
            pad_token_id=eot,
            bos_token_id=eot,
            max_length=DECODER_LENGTH,
            is_multilingual=True,
            lang_to_id={f"<|{c}|>": ids(f"<|{c}|>") for c in LANGUAGES},
            task_to_id={"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
            no_timestamps_token_id=ids("<|notimestamps|>"),
            prev_sot_token_id=ids("<|startofprev|>"),
            suppress_tokens=None,
            begin_suppress_tokens=None,
        )
        processor = WhisperProcessor(
            feature_extractor=WhisperFeatureExtractor(feature_size=spec.num_mel_bins),
            tokenizer=tokenizer,
        )
        return model, processor


CODE = Whisper()
