"""Speech to text over HTTP: ``/v1/audio/transcriptions`` and ``/v1/audio/translations``, as
``vllm serve`` answers them (a multipart upload, vLLM's own request models and serving
classes, its JSON and SSE bodies).

At the ingress (:func:`parse_upload`), before a replica sees the request: the API key, the
body cap (``limits.max_request_bytes``: a 413), the form validated with vLLM's own
``TranscriptionRequest`` / ``TranslationRequest``, the model (it must be one that serves
transcription: a chat model asked for a transcription is a 400 naming the speech models),
and the audio's header (:func:`check_audio`): a file that is no audio, an audio stream no
decoder here can read (an unsupported codec), or audio longer than
``limits.max_audio_seconds`` is a 400 naming the problem. Reading a header decodes nothing:
the samples are decoded once, in the replica.

In the replica (:func:`serve_upload`): vLLM's ``OpenAIServingTranscription`` /
``OpenAIServingTranslation`` (created by ``init_app_state`` for a model whose worker reports
the ``transcription`` task) decode, resample to 16 kHz, split audio longer than 30 seconds,
and run one engine request per window. The replica enforces the duration cap again
(:func:`replica_env`: vLLM's own decode limit), so a header that lies about its length buys
nothing.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from rbln_ray.serve.config import RequestLimits

TASKS = {"transcription": "/v1/audio/transcriptions", "translation": "/v1/audio/translations"}
# vLLM's serving object (in the replica's app state) and method for each task
SERVING = {
    "transcription": ("openai_serving_transcription", "create_transcription"),
    "translation": ("openai_serving_translation", "create_translation"),
}


@dataclass(frozen=True)
class AudioUpload:
    """A validated upload as the ingress relays it to the replica (an ``UploadFile`` does not
    cross a Serve handle: the bytes and the form's other fields do)."""

    model: str
    task: str  # "transcription" or "translation"
    fields: dict[str, Any]  # the form's fields but the file (strings; lists when repeated)
    audio: bytes = field(repr=False)
    filename: str = "audio"


@dataclass(frozen=True)
class AudioInfo:
    """What an audio file's header says."""

    seconds: float | None  # None: the container does not say
    codec: str


def request_model(task: str) -> Any:
    """vLLM's protocol model of a task's form."""
    if task == "transcription":
        from vllm.entrypoints.speech_to_text.transcription.protocol import TranscriptionRequest

        return TranscriptionRequest
    from vllm.entrypoints.speech_to_text.translation.protocol import TranslationRequest

    return TranslationRequest


def probe_audio(data: bytes) -> AudioInfo | str:
    """The audio's duration and codec from its header, or why it is not audio this server
    can decode. The decoders vLLM uses, in its order: libsndfile (``soundfile``: WAV, FLAC,
    OGG, MP3, ...), then FFmpeg's demuxers and decoders (PyAV: MP4/M4A, WebM, ...)."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
        return AudioInfo(info.frames / info.samplerate, f"{info.format}/{info.subtype}")
    except (soundfile.LibsndfileError, RuntimeError, ValueError):
        pass
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            audio = [s for s in container.streams if s.type == "audio"]
            if not audio:
                kinds = ", ".join(f"{s.type} ({s.codec_context.name})" for s in container.streams)
                return f"the file holds no audio stream ({kinds or 'no streams'})"
            stream = audio[0]
            if stream.codec_context is None:
                return (
                    f"the audio stream's codec (in a {container.format.name} container) is "
                    "not supported: no decoder for it"
                )
            seconds = None
            if stream.duration is not None and stream.time_base is not None:
                seconds = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                seconds = container.duration / av.time_base
            return AudioInfo(seconds, f"{container.format.name}/{stream.codec_context.name}")
    except av.FFmpegError as exc:
        return f"the file is not audio in a format this server decodes ({exc.strerror})"


def check_audio(data: bytes, limits: RequestLimits) -> tuple[int, str] | None:
    """(HTTP status, message) of the first problem with an uploaded audio file, or None."""
    if not data:
        return 400, "file: the uploaded audio file is empty"
    info = probe_audio(data)
    if isinstance(info, str):
        return 400, f"file: {info}"
    cap = limits.max_audio_seconds
    if info.seconds is not None and info.seconds > cap:
        return 400, (
            f"file: the audio is {info.seconds:.1f} s long, more than "
            f"limits.max_audio_seconds = {cap}"
        )
    return None


def replica_env(limits: RequestLimits) -> dict[str, str]:
    """vLLM's own decode limit in a replica, set to the app's cap (before its serving objects
    are created)."""
    return {"VLLM_MAX_AUDIO_DECODE_DURATION_S": str(limits.max_audio_seconds)}


async def read_form(request: Any, raw: bytes) -> Any:
    """The multipart form of a request whose body was already read (``raw``, within the
    cap): at most one file and a few fields."""
    from starlette.requests import Request

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    return await Request(request.scope, receive).form(max_files=1, max_fields=64)


async def read_capped(request: Any, limits: RequestLimits) -> bytes | tuple[int, str]:
    """The body, read within ``limits.max_request_bytes`` and ``body_read_timeout_s``, or
    (status, message) of why not (as the ingress reads a JSON body)."""
    import asyncio

    from rbln_ray.serve.ingress import read_body

    cap = limits.max_request_bytes
    if int(request.headers.get("content-length") or 0) > cap:
        return 413, f"request body exceeds {cap} bytes"
    try:
        raw = await asyncio.wait_for(read_body(request, cap), limits.body_read_timeout_s)
    except TimeoutError:
        return 408, (
            f"the request body did not arrive within {limits.body_read_timeout_s:g} s "
            "(limits.body_read_timeout_s)"
        )
    return (413, f"request body exceeds {cap} bytes") if raw is None else raw


async def parse_upload(
    request: Any,
    task: str,
    limits: RequestLimits,
    models: list[str],
    speech_models: list[str],
) -> AudioUpload | tuple[int, str]:
    """The upload of a speech request, validated, or (status, message) of why it is refused.
    ``models``: every served model; ``speech_models``: the ones that transcribe."""
    import asyncio

    from pydantic import ValidationError
    from starlette.datastructures import UploadFile

    from rbln_ray.serve.ingress import validation_message

    kind = request.headers.get("content-type", "")
    if not kind.startswith("multipart/form-data"):
        return 400, f"{TASKS[task]} takes multipart/form-data with a 'file' part (got {kind!r})"
    raw = await read_capped(request, limits)
    if isinstance(raw, tuple):
        return raw
    try:
        form = await read_form(request, raw)
    except Exception as exc:  # noqa: BLE001 - starlette's parse errors, all the client's
        return 400, f"the multipart body cannot be parsed: {exc}"
    upload = form.get("file")
    fields: dict[str, Any] = {}
    for key in form:
        if key == "file":
            continue
        values = [v for v in form.getlist(key) if isinstance(v, str)]
        fields[key] = values if len(values) > 1 or key.endswith("[]") else values[0]
    if not isinstance(upload, UploadFile):
        return 400, "file: field required (the audio file, as a multipart file part)"
    audio = await upload.read()
    try:
        parsed = request_model(task).model_validate({**fields, "file": upload})
    except ValidationError as exc:
        return 400, validation_message(exc)
    except ValueError as exc:  # vLLM's own request checks
        return 400, str(exc)
    model = parsed.model or (speech_models[0] if len(speech_models) == 1 else None)
    known = ", ".join(sorted(models))
    if not model:
        return 400, f"model: field required (speech-to-text models: {', '.join(speech_models)})"
    if model not in models:
        return 404, f"model {model!r} does not exist; served models: {known}"
    if model not in speech_models:
        return 400, (
            f"model {model!r} does not serve {TASKS[task]} (it is not a speech-to-text "
            f"model); speech-to-text models: {', '.join(speech_models) or 'none'}"
        )
    problem = await asyncio.to_thread(check_audio, audio, limits)
    if problem is not None:
        return problem
    fields["model"] = model
    return AudioUpload(model, task, fields, audio, upload.filename or "audio")


async def serve_upload(server: Any, upload: AudioUpload) -> Any:
    """Run an upload through the replica's vLLM speech-to-text serving object; yields what
    ``LLMServer._serve`` yields (a response dict, or SSE lines)."""
    from starlette.datastructures import UploadFile

    handler, method = SERVING[upload.task]
    file = UploadFile(io.BytesIO(upload.audio), filename=upload.filename)
    request = request_model(upload.task).model_validate({**upload.fields, "file": file})

    async def create(req: Any) -> Any:
        return await getattr(serving, method)(upload.audio, req, None)

    serving = getattr(server.state, handler, None)
    if serving is None:  # the ingress routes speech to speech models only; a stale config
        async for item in server._route(handler, method, request):
            yield item
        return
    async for item in server._serve(create, request):
        yield item
