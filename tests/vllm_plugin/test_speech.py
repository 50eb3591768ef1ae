"""Speech to text through ``vllm.LLM`` on the emulator, token-exact against transformers'
greedy ``generate`` on the same weights.

Whisper (acceptance 1 of the speech issue): a tiny Whisper built locally with Whisper's real
feature extractor and tokenizer layout, four WAV clips (one longer than 30 seconds, split as
vLLM's server splits it; one sentence spoken by ``espeak-ng``), the transcribe and translate
tasks and a timestamps prompt, all submitted at once to a compiled decoder of 4 rows, so
requests join rows while others decode.

Qwen3-ASR (the catalogue issue): a tiny one with transformers' own processor, the same clips
and chunks, each with the transcription prompts vLLM's server builds (language detected,
forced, a request's context as the system turn, a translation), all at once to a decoder of
4 rows, and a text-only prompt: prompt ids and greedy tokens equal transformers' on the HF
processor's inputs, a 30-second chunk's 390 audio tokens prefilled over several 128-token
chunks while others decode."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rbln_ray.models import build_tiny_vlm, build_tiny_whisper
from tests.helpers import run_script
from tests.speech import MAX_TOKENS, PROMPT, asr_reference, chunks, clips, reference

pytestmark = pytest.mark.slow

BATCH = 4


@pytest.fixture(scope="module")
def transcribed(tmp_path_factory) -> dict:
    """Every request's tokens from rbln-ray and from transformers, and the engine's stats."""
    model = build_tiny_whisper()
    work = tmp_path_factory.mktemp("speech")
    transcribe = PROMPT.format(lang="en", task="transcribe")
    requests, audio = [], []
    for name, wav in clips().items():
        pieces = chunks(wav)
        prompts = [transcribe]
        if name == "tone-3s":
            prompts.append(PROMPT.format(lang="en", task="translate"))
        if name == "tone-12s":  # vLLM's verbose_json prompt: timestamps predicted
            prompts.append(transcribe.replace("<|notimestamps|>", "<|0.00|>"))
        for i, piece in enumerate(pieces):
            path = work / f"{name}-{i}.npy"
            np.save(path, piece)
            for prompt in prompts:
                # lengths that differ, so requests finish apart and others take their rows
                budget = MAX_TOKENS - 7 * (len(requests) % 4)
                requests.append({"audio": str(path), "prompt": prompt, "max_tokens": budget})
                audio.append(piece)
    spec = {
        "model": str(model),
        "llm_kwargs": {
            "max_model_len": 448,
            "additional_config": {"rbln_compile": {"batch_size": BATCH}},
        },
        "requests": requests,
        "refusals": [{"runner": "pooling"}, {"max_model_len": 449}],
    }
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    ours = run_script("vllm_speech.py", f"@{spec_path}", timeout=900)
    want = reference(
        model, audio, [r["prompt"] for r in requests], [r["max_tokens"] for r in requests]
    )
    return {"requests": requests, "ours": ours, "want": want, "lengths": [len(a) for a in audio]}


def test_transcriptions_are_token_exact_with_transformers(transcribed) -> None:
    ours, want = transcribed["ours"], transcribed["want"]
    assert ours["tasks"] == ["transcription"]
    # a clip longer than Whisper's window became two requests, as vLLM's server splits it
    assert max(transcribed["lengths"]) <= 30 * 16000 < sum(transcribed["lengths"][:8])
    for i, (got, expected) in enumerate(zip(ours["tokens"], want, strict=True)):
        assert got == expected, (i, transcribed["requests"][i]["prompt"], got, expected)
    # the references tell the inputs apart (agreeing with them is not agreeing with a constant)
    assert len({tuple(t[:8]) for t in want}) == len(want)


def test_requests_share_decoder_calls_and_join_mid_flight(transcribed) -> None:
    """The encoder ran once per request; decoder calls carried several requests' rows, and a
    request started in a call where another was already decoding (continuous batching)."""
    (stats,) = transcribed["ours"]["step_stats"]
    n = len(transcribed["requests"])
    assert stats["encoder_calls"] == n
    assert stats["shared_calls"] > 0 and stats["batch_size"] == BATCH
    first: dict[str, int] = {}
    joined_mid_flight = 0
    for call, _, live in stats["history"]:
        for req in live:
            first.setdefault(req, call)
        new = [r for r in live if first[r] == call]
        joined_mid_flight += bool(new) and len(new) < len(live)
    assert len(first) == n and joined_mid_flight > 0


def test_what_a_compiled_whisper_cannot_serve_is_refused(transcribed) -> None:
    pooling, too_long = transcribed["ours"]["refused"]
    assert pooling is not None and "transcribes" in pooling and "pooling" in pooling
    assert too_long is not None and "449" in too_long and "448" in too_long


# ------------------------------------------------------------------------- Qwen3-ASR
ASR_PROMPTS = {  # name -> (the request's prompt (context), the language it forces)
    "detect": (None, None),
    "english": (None, "English"),
    "context": ("Words: fox, dog, device.", "English"),
    "german": (None, "German"),  # a translation's to_language: the prompt names it alike
}


@pytest.fixture(scope="module")
def asr(tmp_path_factory) -> dict:
    from rbln_ray.families.qwen3_asr import transcription_prompt

    model = build_tiny_vlm(family="qwen3_asr")
    work = tmp_path_factory.mktemp("qwen3_asr")
    requests, audio = [], []
    for name, wav in clips().items():
        for i, piece in enumerate(chunks(wav)):
            path = work / f"{name}-{i}.npy"
            np.save(path, piece)
            chosen = list(ASR_PROMPTS) if name == "tone-3s" else ["detect", "english"]
            for kind in chosen:
                context, language = ASR_PROMPTS[kind]
                budget = MAX_TOKENS - 7 * (len(requests) % 4)
                prompt = transcription_prompt(context, language)
                requests.append(
                    {"audio": str(path), "prompt": prompt, "max_tokens": budget, "kind": kind}
                )
                audio.append(piece)
    text_only = "<|im_start|>user\nno audio, only text<|im_end|>\n<|im_start|>assistant\n"
    requests.append({"audio": None, "prompt": text_only, "max_tokens": MAX_TOKENS, "kind": "text"})
    audio.append(None)
    spec = {
        "model": str(model),
        "audio_in_prompt": True,
        "llm_kwargs": {
            "max_model_len": 1024,
            "additional_config": {"rbln_compile": {"batch_size": BATCH}},
        },
        "requests": requests,
    }
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    ours = run_script("vllm_speech.py", f"@{spec_path}", timeout=900)
    want = asr_reference(
        model, audio, [r["prompt"] for r in requests], [r["max_tokens"] for r in requests]
    )
    return {"requests": requests, "ours": ours, "want": want}


def test_qwen3_asr_prompts_and_tokens_equal_transformers(asr) -> None:
    ours, want = asr["ours"], asr["want"]
    assert ours["tasks"] == ["generate", "transcription"]
    for i, (ids, tokens) in enumerate(want):
        prompt = asr["requests"][i]["prompt"]
        assert ours["prompt_token_ids"][i] == ids, (i, prompt)
        assert ours["tokens"][i] == tokens, (i, prompt, ours["tokens"][i], tokens)
    # the references tell the inputs apart (agreeing with them is not agreeing with a
    # constant): each chunk its own tokens, and the 3-second clip's prompts theirs
    pairs = list(zip(asr["requests"], want, strict=True))
    detected = {tuple(t[:8]) for r, (_, t) in pairs if r["kind"] == "detect"}
    assert len(detected) == 5  # chunks
    short = {tuple(t[:8]) for r, (_, t) in pairs if (r["audio"] or "").endswith("tone-3s-0.npy")}
    assert len(short) == len(ASR_PROMPTS)


def test_qwen3_asr_long_chunks_prefill_in_pieces_beside_decodes(asr) -> None:
    """A 30-second chunk is 390 audio tokens: its prompt took several prefill calls, and
    decoder calls carried several requests' rows."""
    (stats,) = asr["ours"]["step_stats"]
    assert max(len(ids) for ids, _ in asr["want"]) > 390 > 3 * 128
    assert stats["prefill_requests"] == len(asr["requests"])
    assert stats["prefill_steps"] > stats["prefill_requests"]  # chunked prefills
    assert stats["decode_rows"] > stats["decode_steps"] and stats["batch_size"] == BATCH
    # a prompt chunk ran while another request was between two of its decode steps
    decoding: dict[str, list[int]] = {}
    for step, kind, live in stats["history"]:
        if kind == "decode":
            for req in live:
                decoding.setdefault(req, []).append(step)
    prefills = [step for step, kind, _ in stats["history"] if kind == "prefill"]
    between = [p for steps in decoding.values() for p in prefills if steps[0] < p < steps[-1]]
    assert between, stats["history"]
