"""srt, vtt and verbose_json with model timestamps, for audio of any length, on both audio routes.

sglang-omni 0.1.9 answers ``response_format=srt|vtt`` of audio over 30 s with a 400 ("chunk
boundary timestamps are not model-derived"), gives verbose_json one segment per 30 s chunk (or
one for the whole file), does not chunk ``/v1/audio/translations`` at all, and answers that route
with 404 for any ``model`` but the served name (``whisper-1`` from the OpenAI client), while
``/v1/audio/transcriptions`` takes any. ``install_on(app)`` puts one handler in front of each of
the two stock POST routes:

* timestamped formats (srt, vtt, verbose_json; not streamed) are decoded here, short audio as
  one chunk and long audio through sglang-omni's own chunk plan and chunk runner
  (``plan_audio_chunks``, ``transcribe_audio_chunks``: its splitting, concurrency limits,
  abort-on-failure and disconnect handling). Each chunk is decoded with ``segment_timestamps``
  (the stage's timestamp rules); its segments are placed at the chunk's exact start offset plus
  the model's timestamps (``segments.py``);
* a window whose decode closed its last segment well before the window's end, with speech
  left after it, is decoded again from that timestamp (openai-whisper's seek to the last
  timestamp): without it Whisper's habit of stopping early in timestamp mode drops whole
  sentences from subtitles. At most ``MAX_RESUMES`` times per chunk;
* ``/v1/audio/translations`` of long audio in json/text goes through the same chunk runner;
* temperature fallback (a request at temperature 0 or none, when the stage has it on): json/text
  take this path too, and each window the stage judged too repetitive or unsure is decoded again
  at the next temperature, a silent one answers empty text (``_ChunkClient``, ``window_scores``);
* every other request (json/text with a temperature, streams) reaches the stock route unchanged;
* both routes treat ``model`` alike: the served model answers whatever name is sent.

Streaming keeps sglang-omni's rules (``stream=true`` with srt or vtt is a 400, from
``openai_errors``). Word timestamps stay a clear 400 there too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute

from sglang_omni_flash.integration.routes.segments import parse_chunk_segments, verbose_segments

logger = logging.getLogger("sglang_omni_flash.transcriptions")

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
TIMESTAMPED_FORMATS = frozenset({"srt", "vtt", "verbose_json"})
PLAIN_FORMATS = frozenset({"json", "text"})
INSTALLED_FLAG = "_sglang_omni_flash_timestamped_routes"
SAMPLE_RATE = 16000
MAX_RESUMES = 2  # re-decodes of one chunk's tail after an early stop
RESUME_MIN_TAIL_S = 1.0  # a shorter tail after the last segment is left as it is
RMS_FRAME = 1600  # 100 ms
SPEECH_RMS = 0.01  # -40 dBFS in some 100 ms of the tail: speech, not a recording's noise floor


@dataclasses.dataclass(frozen=True)
class Piece:
    """One decoded window: where it starts in the upload, how long it is, its rendered text."""

    start_s: float
    duration_s: float
    rendered: str
    start_sample: int
    end_sample: int
    report: dict | None = None  # the stage's verdict of the kept decode (window_scores.window_report)


def resume_at(piece: Piece, waveform) -> int | None:
    """The sample to decode again from, when the piece's decode stopped early with speech left."""
    import numpy as np

    segments = parse_chunk_segments(piece.rendered, piece.duration_s)
    if not segments or not segments[-1].closed_by_model:
        return None
    if piece.duration_s - segments[-1].end < RESUME_MIN_TAIL_S:
        return None
    start = piece.start_sample + int(round(segments[-1].end * SAMPLE_RATE))
    tail = waveform[start: piece.end_sample]
    frames = tail[: tail.size // RMS_FRAME * RMS_FRAME].reshape(-1, RMS_FRAME)
    if frames.size == 0 or float(np.sqrt((frames ** 2).mean(axis=1)).max()) < SPEECH_RMS:
        return None  # noise or silence after the last segment: Whisper was right to stop
    return start


class _ChunkClient:
    """The app's pipeline client, seen by sglang-omni's chunk runner: each chunk request gets this
    route's task and timestamp flag, and the runner gets back the chunk's plain text (what it
    joins and conditions on) while the timestamped text is kept here by request id.

    With ``fallback`` (a request at temperature 0), a window the stage judged too repetitive or
    too unsure (its verdict rides in ``omni_rollout``, ``window_scores``) is decoded again at the
    verdict's next temperature until one passes or the ladder ends; the last decode is kept, as
    in openai-whisper. A window judged silence answers empty text.
    """

    def __init__(self, client, *, task: str, timestamps: bool, fallback: bool = False):
        self._client = client
        self._task = task
        self._timestamps = timestamps
        self._fallback = fallback
        self.rendered: dict[str, str] = {}
        self.reports: dict[str, dict] = {}  # the kept decode's verdict, by chunk request id
        self.language: str | None = None
        self._retrying: dict[str, str] = {}  # chunk request id -> the id of its retry in flight

    async def completion(self, gen_req, request_id: str):
        from sglang_omni_flash.integration.scoring.window_scores import ATTEMPT_PARAM, REPORT_KEY

        params = dict(gen_req.extra_params or {})
        params["task"] = self._task
        if self._timestamps:
            params["segment_timestamps"] = True
        request, rid = dataclasses.replace(gen_req, extra_params=params), request_id
        result = await self._client.completion(request, request_id=rid)
        report = (result.omni_rollout or {}).get(REPORT_KEY)
        no_speech = report and report["no_speech_prob"]
        try:
            while self._fallback and report and report["retry"] and report["next_temperature"] is not None:
                attempt = report["attempt"] + 1
                sampling = dataclasses.replace(request.sampling, temperature=report["next_temperature"])
                retry = dataclasses.replace(request, sampling=sampling, extra_params={**params, ATTEMPT_PARAM: attempt})
                rid = self._retrying[request_id] = f"{request_id}-fallback{attempt}"
                result = await self._client.completion(retry, request_id=rid)
                report = (result.omni_rollout or {}).get(REPORT_KEY)
        finally:
            self._retrying.pop(request_id, None)
        if report is not None:
            if report["no_speech_prob"] is None:  # a retry served from the prefix cache: same SOT row
                report = {**report, "no_speech_prob": no_speech}
            self.reports[request_id] = report
        text = "" if report is not None and report["silence"] else result.text
        self.rendered[request_id] = text
        self.language = self.language or result.language
        if not self._timestamps:
            return dataclasses.replace(result, text=text)
        from sglang_omni.serve.transcription_adapters.whisper_asr import WhisperASRAdapter

        return dataclasses.replace(result, text=WhisperASRAdapter().postprocess_text(text))

    async def abort(self, request_id: str):
        retry = self._retrying.get(request_id)
        if retry is not None:
            await self._client.abort(retry)
        return await self._client.abort(request_id)

    def chunk_texts(self, plan, request_id: str) -> list[tuple[str, dict | None]]:
        """(rendered text, verdict) per span (the runner's retry's, where it retried one), ("", None) for silence."""
        out = []
        for span in plan.spans:
            rid = f"{request_id}-chunk-{span.index}"
            rid = f"{rid}-retry" if f"{rid}-retry" in self.rendered else rid
            out.append((self.rendered.get(rid, ""), self.reports.get(rid)))
        return out


def one_chunk_plan(audio_bytes: bytes):
    """A plan of one span for audio that fits one window: the same path as long audio."""
    import numpy as np
    from sglang_omni.serve.transcription_chunking import SILENT_CHUNK_PEAK_THRESHOLD, ChunkPlan, ChunkSpan
    from sglang_omni.utils.audio import load_audio

    waveform = load_audio(audio_bytes, source_name="transcription", target_sample_rate=SAMPLE_RATE)
    n = int(waveform.shape[-1])
    has_speech = bool(n) and float(np.max(np.abs(waveform))) >= SILENT_CHUNK_PEAK_THRESHOLD
    span = ChunkSpan(index=0, start_sample=0, end_sample=n, start_s=0.0, end_s=n / SAMPLE_RATE,
                     has_speech=has_speech)
    return ChunkPlan(sample_rate=SAMPLE_RATE, duration_s=n / SAMPLE_RATE, spans=[span], waveform=waveform)


@functools.lru_cache(maxsize=4)
def _tokenizer(model_path: str):
    from transformers import WhisperTokenizerFast

    return WhisperTokenizerFast.from_pretrained(model_path)


def _token_encoder():
    """(encode, timestamp_begin) of the served model's tokenizer, or (None, None) without one."""
    from sglang_omni_flash.integration.serve.config import served_model_path

    path = served_model_path()
    if path is None:
        return None, None
    try:
        tok = _tokenizer(path)
    except Exception:  # the segments still have times and text; only `tokens` stays empty
        logger.warning("no tokenizer at %s: verbose_json segments carry no tokens", path, exc_info=True)
        return None, None
    begin = tok.convert_tokens_to_ids("<|notimestamps|>") + 1
    return (lambda text: tok.encode(text, add_special_tokens=False)), begin


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went away first


async def _decode_chunks(request: Request, app: FastAPI, form, *, task: str, timestamps: bool,
                         request_id: str, audio_bytes: bytes, duration_s: float, fallback: bool = False):
    """(plan, decoded pieces in order, language) of an upload, long or short."""
    from sglang_omni.client import ClientError
    from sglang_omni.serve import speech_to_text
    from sglang_omni.serve.openai_errors import generation_error_status_code
    from sglang_omni.serve.transcription_chunking import (
        ChunkPlan, ChunkSpan, check_total_duration, needs_chunking, plan_audio_chunks,
    )
    from sglang_omni.serve.transcriptions import (
        await_transcription_with_disconnect_abort, transcribe_audio_chunks,
    )

    chunking = app.state.audio_chunking
    admission = app.state.long_audio_admission
    admitted = False
    if needs_chunking(duration_s, chunking):
        try:  # before decoding: a small compressed file can hold hours of audio
            check_total_duration(duration_s, chunking)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        admission.acquire_or_reject()
        admitted = True
    try:
        plan = await asyncio.to_thread(plan_audio_chunks, audio_bytes, chunking) if admitted else None
        if plan is None:
            plan = await asyncio.to_thread(one_chunk_plan, audio_bytes)
        try:
            check_total_duration(plan.duration_s, chunking)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        model = form.model or app.state.model_name
        language = form.language
        first_speech = next((s for s in plan.spans if s.has_speech), None)
        if task == "translate" and language is None and first_speech is not None:
            language = await speech_to_text.detect_speech_language(
                app.state.client, audio_bytes=plan.encode(first_speech), filename=form.file.filename,
                content_type="audio/wav", model=model, request_id=request_id)
        adapter = speech_to_text.resolve_speech_to_text_adapter(getattr(app.state, "architectures", None))

        async def run(spans, suffix: str) -> list[tuple[str, dict | None]]:
            """(rendered text, verdict) per span, through sglang-omni's chunk runner."""
            client = _ChunkClient(app.state.client, task=task, timestamps=timestamps, fallback=fallback)
            sub = ChunkPlan(sample_rate=plan.sample_rate, duration_s=plan.duration_s, spans=spans,
                            waveform=plan.waveform)
            rid = f"{request_id}{suffix}"
            try:
                await await_transcription_with_disconnect_abort(request, transcribe_audio_chunks(
                    client, sub, request_id=rid, model=model, filename=form.file.filename,
                    language=language, prompt=form.prompt, temperature=form.temperature,
                    repetition_penalty=form.repetition_penalty, max_new_tokens=form.max_new_tokens,
                    max_concurrent=chunking.max_concurrent_chunks,
                    condition_on_previous_text=chunking.condition_on_previous_text, adapter=adapter))
            except ClientError as exc:
                raise HTTPException(status_code=generation_error_status_code(exc), detail=str(exc)) from exc
            except (HTTPException, asyncio.CancelledError):
                raise
            except Exception as exc:
                status = generation_error_status_code(exc)
                if status == 500:
                    logger.exception("chunked %s failed for request %s", task, request_id)
                raise HTTPException(status_code=status, detail=str(exc)) from exc
            nonlocal detected
            detected = detected or client.language
            return client.chunk_texts(sub, rid)

        detected = None
        pieces = [Piece(s.start_s, s.duration_s, text, s.start_sample, s.end_sample, report)
                  for s, (text, report) in zip(plan.spans, await run(plan.spans, ""))]
        for attempt in range(MAX_RESUMES if timestamps else 0):
            starts = {i: resume_at(p, plan.waveform) for i, p in enumerate(pieces)}
            starts = {i: at for i, at in starts.items() if at is not None}
            if not starts:
                break
            tails = [ChunkSpan(index=n, start_sample=at, end_sample=pieces[i].end_sample,
                               start_s=at / plan.sample_rate, end_s=pieces[i].end_sample / plan.sample_rate)
                     for n, (i, at) in enumerate(starts.items())]
            texts = await run(tails, f"-resume{attempt}")
            for span, (text, report) in zip(tails, texts):
                pieces.append(Piece(span.start_s, span.duration_s, text, span.start_sample, span.end_sample, report))
            # a resumed piece's tail is its own piece now: cut the parent there
            for i, at in starts.items():
                pieces[i] = dataclasses.replace(pieces[i], end_sample=at,
                                                duration_s=(at - pieces[i].start_sample) / plan.sample_rate)
            pieces.sort(key=lambda p: p.start_sample)
        return plan, pieces, language or detected
    finally:
        if admitted:
            admission.release()


def _respond(fmt: str, *, task: str, plan, pieces: list[Piece], language: str | None, temperature: float | None,
             timestamps: bool) -> Response:
    from sglang_omni.serve.protocol import TranscriptionSegment
    from sglang_omni.serve.subtitles import segments_to_srt, segments_to_vtt
    from sglang_omni.serve.transcription_adapters.whisper_asr import WhisperASRAdapter
    from sglang_omni.serve.transcription_chunking import join_transcript_parts

    duration = plan.duration_s
    usage = {"type": "duration", "seconds": math.ceil(duration)} if duration > 0 else None
    rendered = [p.rendered for p in pieces]
    if not timestamps:
        text = join_transcript_parts(rendered)
        if fmt == "text":
            return PlainTextResponse(text)
        return JSONResponse({"text": text, **({"usage": usage} if usage else {})})
    encode, timestamp_begin = _token_encoder() if fmt == "verbose_json" else (None, None)
    chunks = [(p.start_s, p.duration_s, p.rendered, p.report) for p in pieces]
    segments = verbose_segments(chunks, temperature=temperature or 0.0, encode=encode,
                                timestamp_begin=timestamp_begin)
    if fmt in ("srt", "vtt"):
        cues = [TranscriptionSegment(id=s["id"], start=s["start"], end=s["end"], text=s["text"]) for s in segments]
        return PlainTextResponse(segments_to_srt(cues) if fmt == "srt" else segments_to_vtt(cues))
    text = join_transcript_parts(s["text"] for s in segments)
    if not segments:  # silence, or a window without a closed segment: the plain text, untimed
        text = join_transcript_parts(WhisperASRAdapter().postprocess_text(r) for r in rendered)
    body = {"task": task, "language": language, "duration": round(duration, 3), "text": text,
            "segments": segments}
    if usage:
        body["usage"] = usage
    return JSONResponse(body)


def _stock_endpoint(app: FastAPI, path: str):
    """Remove the stock POST route of `path` from the app; returns its endpoint function."""
    for route in list(app.router.routes):
        if isinstance(route, APIRoute) and route.path == path and "POST" in route.methods:
            app.router.routes.remove(route)
            return route.endpoint
    raise LookupError(f"sglang-omni registered no POST {path}")


def install_on(app: FastAPI) -> FastAPI:
    """Front the two stock audio routes with the handlers above; idempotent."""
    if getattr(app.state, INSTALLED_FLAG, False):
        return app
    import uuid

    from sglang_omni.serve import speech_to_text

    def falls_back(form) -> bool:
        """openai-whisper's temperature fallback: at temperature 0 (or none), when the stage has it on."""
        from sglang_omni_flash.integration.serve.config import served_fallback

        return not form.temperature and served_fallback()

    stock_transcriptions = _stock_endpoint(app, TRANSCRIPTIONS)
    stock_translations = _stock_endpoint(app, TRANSLATIONS)

    async def timed(request: Request, form, *, task: str, fmt: str, timestamps: bool, audio_bytes: bytes,
                    duration_s: float) -> Response:
        try:
            plan, pieces, language = await _decode_chunks(
                request, app, form, task=task, timestamps=timestamps, request_id=f"{task}-{uuid.uuid4()}",
                audio_bytes=audio_bytes, duration_s=duration_s, fallback=falls_back(form))
        except asyncio.CancelledError:
            # the client hung up: its chunks were aborted and nobody reads an answer; let the request end
            # quietly instead of as an "Exception in ASGI application" with a traceback (server shutdown
            # cancels too, and then the cancellation goes on)
            if await request.is_disconnected():
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            raise
        return _respond(fmt, task=task, plan=plan, pieces=pieces, language=language,
                        temperature=form.temperature, timestamps=timestamps)

    async def read_upload(form) -> tuple[bytes, float]:
        audio_bytes = await speech_to_text.read_and_validate_speech_to_text_audio(form.file)
        await form.file.seek(0)  # a delegated request is read again by the stock route
        return audio_bytes, await asyncio.to_thread(speech_to_text.probe_audio_duration, audio_bytes)

    @app.post(TRANSCRIPTIONS)
    async def create_transcription(
        request: Request,
        form: speech_to_text.SpeechToTextForm = Depends(speech_to_text.parse_speech_to_text_form),
    ) -> Response:
        fmt = form.response_format.strip().lower()
        if form.stream or fmt not in TIMESTAMPED_FORMATS | PLAIN_FORMATS or (
                fmt in PLAIN_FORMATS and not falls_back(form)):
            return await stock_transcriptions(request=request, form=form)
        audio_bytes, duration_s = await read_upload(form)
        return await timed(request, form, task="transcribe", fmt=fmt, timestamps=fmt in TIMESTAMPED_FORMATS,
                           audio_bytes=audio_bytes, duration_s=duration_s)

    @app.post(TRANSLATIONS)
    async def create_translation(
        request: Request,
        form: speech_to_text.SpeechToTextForm = Depends(speech_to_text.parse_speech_to_text_form),
    ) -> Response:
        # the served model answers any model name, as on /v1/audio/transcriptions
        form = dataclasses.replace(form, model=None)
        fmt = form.response_format.strip().lower()
        if form.stream or not app.state.supports_audio_translation:
            return await stock_translations(request=request, form=form)
        audio_bytes, duration_s = await read_upload(form)
        from sglang_omni.serve.transcription_chunking import needs_chunking

        timestamps = fmt in TIMESTAMPED_FORMATS
        if not timestamps and not (fmt in PLAIN_FORMATS and falls_back(form)) and not needs_chunking(
                duration_s, app.state.audio_chunking):
            return await stock_translations(request=request, form=form)
        return await timed(request, form, task="translate", fmt=fmt, timestamps=timestamps,
                           audio_bytes=audio_bytes, duration_s=duration_s)

    setattr(app.state, INSTALLED_FLAG, True)
    return app
