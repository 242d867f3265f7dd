"""OpenAI error envelope and request validation for sglang-omni's speech-to-text endpoints.

sglang-omni 0.1.9 answers user mistakes on ``/v1/audio/transcriptions`` with FastAPI's
``{"detail": ...}`` (400 or 422), and forwards nonsense such as ``temperature=-1`` or
``language=klingon`` to the model. ``install()`` (called by ``_autoload`` right after
``sglang_omni.serve.openai_api`` is imported) wraps that module's ``create_app`` so every app
it builds gets, for the two audio endpoints only (``AUDIO_ENDPOINTS``):

* a replacement of the shared form dependency (``app.dependency_overrides``), which parses
  the same fields plus ``timestamp_granularities[]`` and refuses bad values *before* the
  route runs (``validate_form``): OpenAI's ranges, no model call, no traceback;
* exception handlers that turn ``HTTPException`` (the routes' own 4xx/5xx),
  ``RequestValidationError`` (FastAPI's 422) and any unexpected exception into
  ``{"error": {"message", "type", "param", "code"}}``.

Every other path keeps FastAPI's stock answers. Valid requests reach the stock route with
exactly the form the stock dependency would have built.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import math
from dataclasses import dataclass

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("sglang_omni_flash.openai_errors")

AUDIO_ENDPOINTS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
STREAM_RESPONSE_FORMATS = ("json", "text")  # what sglang-omni can stream
TIMESTAMP_GRANULARITIES = ("segment",)  # "word" is OpenAI's too, but Whisper here has no word timings
TEMPERATURE_RANGE = (0.0, 1.0)  # OpenAI's documented range for the audio endpoints
MAX_MESSAGE_CHARS = 1000
INSTALLED_FLAG = "_sglang_omni_flash_openai_errors"


@dataclass(eq=False)
class InvalidRequest(Exception):
    """A user mistake, answered with HTTP ``status_code`` and the OpenAI envelope."""

    message: str
    param: str | None
    code: str | None = "invalid_value"
    status_code: int = 400

    def __post_init__(self) -> None:
        Exception.__init__(self, self.message)


def envelope(message: str, *, status_code: int, param: str | None = None,
             code: str | None = None, error_type: str | None = None) -> JSONResponse:
    if error_type is None:
        error_type = "invalid_request_error" if status_code < 500 else "server_error"
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return JSONResponse(status_code=status_code,
                        content={"error": {"message": message, "type": error_type, "param": param, "code": code}})


# ---------------------------------------------------------------------------- validation

def known_languages() -> frozenset[str]:
    """Whisper's language codes and names (as the Whisper tokenizer accepts them)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    return frozenset(LANGUAGES) | frozenset(TO_LANGUAGE_CODE) | {"eng"}  # "eng": sglang-omni's alias


def parse_temperature(raw: str | None) -> float | None:
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise InvalidRequest(f"temperature must be a number between 0 and 1, got {raw!r}", "temperature") from None
    low, high = TEMPERATURE_RANGE
    if not math.isfinite(value) or not low <= value <= high:
        raise InvalidRequest(f"temperature must be between {low:g} and {high:g}, got {raw!r}", "temperature")
    return value


FLOAT_SUBTYPES = ("FLOAT", "DOUBLE")


def check_audio(audio: bytes, *, filename: str | None, content_type: str | None) -> None:
    """Refuse an empty or undecodable upload, reading only headers and the first frame."""
    if not audio:
        raise InvalidRequest("The uploaded audio file is empty.", "file", code="empty_file")
    import av
    import soundfile
    from sglang_omni.utils.g711 import resolve_g711_encoding, wrap_g711_as_wav

    encoding = resolve_g711_encoding(content_type, filename)
    if encoding is not None:  # headerless G.711: sglang-omni wraps it the same way
        audio = wrap_g711_as_wav(audio, encoding)
    try:
        with soundfile.SoundFile(io.BytesIO(audio)) as sound:
            if sound.frames == 0:
                raise InvalidRequest("The uploaded audio file contains no samples.", "file", code="empty_file")
            if sound.subtype in FLOAT_SUBTYPES:  # only float samples can be NaN or infinite
                import numpy as np

                if not np.isfinite(sound.read(dtype="float32")).all():
                    raise InvalidRequest("The uploaded audio contains NaN or infinite samples.", "file",
                                         code="invalid_audio")
            return
    except soundfile.LibsndfileError:
        pass  # not a libsndfile format: FFmpeg decides, as in sglang-omni's loader
    except RuntimeError:
        pass
    try:
        with av.open(io.BytesIO(audio)) as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise InvalidRequest("The uploaded file has no audio stream.", "file", code="invalid_audio")
            for _frame in container.decode(stream):
                return
    except InvalidRequest:
        raise
    except Exception:  # FFmpegError, ValueError, ...: whatever it is, the file is not audio we can read
        pass
    raise InvalidRequest(
        f"Could not decode the uploaded file{f' {filename!r}' if filename else ''} as audio; "
        "send a WAV, FLAC, MP3, OGG, M4A or WebM file.", "file", code="invalid_audio")


@dataclass(frozen=True)
class RawForm:
    """The multipart fields as sent, before validation (strings where sglang-omni parses types)."""

    response_format: str
    stream: bool
    temperature: str | None
    language: str | None
    timestamp_granularities: list[str]


def validate_form(form: RawForm, *, languages: frozenset[str]) -> tuple[str, float | None]:
    """Raise ``InvalidRequest`` for the first bad field; returns (response_format, temperature)."""
    response_format = form.response_format.strip().lower()  # sglang-omni normalises the same way
    if response_format not in RESPONSE_FORMATS:
        raise InvalidRequest(
            f"Invalid response_format {form.response_format!r}: expected one of {', '.join(RESPONSE_FORMATS)}.",
            "response_format")
    if form.stream and response_format not in STREAM_RESPONSE_FORMATS:
        raise InvalidRequest(
            f"stream=true supports response_format {' or '.join(STREAM_RESPONSE_FORMATS)}, "
            f"not {response_format!r}.", "response_format", code="unsupported_value")
    temperature = parse_temperature(form.temperature)
    if form.language is not None and form.language.strip():
        if form.language.strip().lower() not in languages:
            raise InvalidRequest(
                f"Unknown language {form.language!r}: use an ISO-639-1 code such as 'en' or 'de' "
                "(or the Whisper language name).", "language", code="unsupported_language")
    for granularity in form.timestamp_granularities:
        if granularity not in ("word", "segment"):
            raise InvalidRequest(
                f"Invalid timestamp_granularities value {granularity!r}: expected 'segment' or 'word'.",
                "timestamp_granularities")
        if granularity not in TIMESTAMP_GRANULARITIES:
            raise InvalidRequest(
                f"timestamp_granularities {granularity!r} is not supported by this server "
                f"(supported: {', '.join(TIMESTAMP_GRANULARITIES)}).", "timestamp_granularities",
                code="unsupported_value")
    if form.timestamp_granularities and response_format != "verbose_json":
        raise InvalidRequest("timestamp_granularities requires response_format 'verbose_json'.",
                             "timestamp_granularities")
    return response_format, temperature


def make_form_dependency(languages: frozenset[str]):
    """A drop-in for sglang-omni's ``parse_speech_to_text_form`` that validates first."""
    from sglang_omni.serve.speech_to_text import SpeechToTextForm

    async def parse_validated_speech_to_text_form(
        file: UploadFile | None = File(default=None),
        model: str | None = Form(default=None),
        language: str | None = Form(default=None),
        prompt: str | None = Form(default=None),
        response_format: str = Form(default="json"),
        temperature: str | None = Form(default=None),
        repetition_penalty: float | None = Form(default=None, gt=0.0, le=2.0),
        max_new_tokens: int | None = Form(default=None, ge=1),
        stream: bool = Form(default=False),
        timestamp_granularities: list[str] | None = Form(default=None, alias="timestamp_granularities[]"),
        timestamp_granularities_plain: list[str] | None = Form(default=None, alias="timestamp_granularities"),
    ) -> SpeechToTextForm:
        if file is None or not hasattr(file, "read"):
            raise InvalidRequest("No audio file was sent: add a multipart field 'file'.", "file",
                                 code="missing_required_parameter")
        raw = RawForm(response_format=response_format, stream=stream, temperature=temperature,
                      language=language,
                      timestamp_granularities=[*(timestamp_granularities or ()), *(timestamp_granularities_plain or ())])
        _, parsed_temperature = validate_form(raw, languages=languages)
        audio = await file.read()
        await file.seek(0)  # the stock route reads the upload again
        check_audio(audio, filename=file.filename, content_type=file.content_type)
        return SpeechToTextForm(
            file=file, model=model, language=language, prompt=prompt, response_format=response_format,
            temperature=parsed_temperature, repetition_penalty=repetition_penalty,
            max_new_tokens=max_new_tokens, stream=stream,
        )

    return parse_validated_speech_to_text_form


# ---------------------------------------------------------------------------- handlers

def _param_from_message(message: str) -> str | None:
    """Best guess of the field a stock sglang-omni 4xx message is about."""
    lowered = message.lower()
    for needle, param in (("response_format", "response_format"), ("stream", "stream"),
                          ("language", "language"), ("temperature", "temperature"), ("audio", "file"),
                          ("decode", "file"), ("max_new_tokens", "max_new_tokens"), ("model", "model")):
        if needle in lowered:
            return param
    return None


def _is_audio_endpoint(request: Request) -> bool:
    return request.url.path.rstrip("/") in AUDIO_ENDPOINTS


async def on_invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
    return envelope(exc.message, status_code=exc.status_code, param=exc.param, code=exc.code)


async def on_http_exception(request: Request, exc: StarletteHTTPException):
    if not _is_audio_endpoint(request):
        return await http_exception_handler(request, exc)
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail, default=str)
    if exc.status_code == 405:
        return envelope(detail, status_code=405, code="method_not_allowed")
    param = _param_from_message(detail) if exc.status_code < 500 else None
    return envelope(detail, status_code=exc.status_code, param=param)


async def on_validation_error(request: Request, exc: RequestValidationError):
    if not _is_audio_endpoint(request):
        return await request_validation_exception_handler(request, exc)
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "form")]
    param = loc[0].removesuffix("[]") if loc else None
    if first.get("type") == "missing":
        return envelope(f"Missing required parameter: {param!r}.", status_code=400, param=param,
                        code="missing_required_parameter")
    message = f"Invalid value for {param!r}: {first.get('msg', 'invalid value')}" if param else \
        "The request body could not be parsed as multipart/form-data."
    return envelope(message, status_code=400, param=param, code="invalid_value")


async def on_unexpected_error(request: Request, exc: Exception):
    # Starlette's ServerErrorMiddleware calls this, then re-raises: the traceback goes to
    # the server log, the client gets a message without it.
    if not _is_audio_endpoint(request):
        return PlainTextResponse("Internal Server Error", status_code=500)
    return envelope("The server had an error while processing the request; see the server log.",
                    status_code=500)


def install_on(app: FastAPI) -> FastAPI:
    """Add the dependency override and the handlers to one app; idempotent."""
    if getattr(app.state, INSTALLED_FLAG, False):
        return app
    from sglang_omni.serve import speech_to_text

    app.dependency_overrides[speech_to_text.parse_speech_to_text_form] = make_form_dependency(known_languages())
    app.add_exception_handler(InvalidRequest, on_invalid_request)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected_error)
    setattr(app.state, INSTALLED_FLAG, True)
    return app


def install() -> None:
    """Wrap ``sglang_omni.serve.openai_api.create_app`` (and the launcher's imported name)."""
    import sys

    from sglang_omni.serve import openai_api

    original = openai_api.create_app
    if getattr(original, INSTALLED_FLAG, False):
        return

    @functools.wraps(original)
    def create_app(*args, **kwargs):
        app = original(*args, **kwargs)
        try:
            install_on(app)
        except Exception:  # serve with stock errors rather than not at all
            logger.warning("sglang-omni-flash: could not install the OpenAI error envelope", exc_info=True)
        try:
            from sglang_omni_flash.integration.routes import transcriptions

            transcriptions.install_on(app)
        except Exception:  # serve the stock routes rather than not at all
            logger.warning("sglang-omni-flash: could not install the timestamped routes", exc_info=True)
        return app

    setattr(create_app, INSTALLED_FLAG, True)
    openai_api.create_app = create_app
    launcher = sys.modules.get("sglang_omni.serve.launcher")
    if launcher is not None and getattr(launcher, "create_app", None) is original:
        launcher.create_app = create_app
