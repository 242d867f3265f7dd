"""Stability of a Whisper-Flash speculative ASR server: functional checks, bad inputs, a soak with chaos.

    .venv/bin/python benchmarks/asr_stability.py                          # own server, 5-minute soak
    .venv/bin/python benchmarks/asr_stability.py --duration 1800 --concurrency 1,2,4,8,16,32 \\
        --out docs/stability-cpu.json                                     # the documented 30-minute run
    .venv/bin/python benchmarks/asr_stability.py --url http://127.0.0.1:8000 \\
        --server-log /path/to/server.log                                  # a server you started yourself

Without `--url` the script starts its own server the way the tests do (`Server(ServeOptions(...))`,
converted `--model` (default base), `--asr.speculative whisper-flash`, 127.0.0.1, a free port) and
stops it at the end. Sections, each recorded check by check in the JSON result:

  functional   every response_format (json, text, verbose_json, srt, vtt) is 200 and well formed;
               /v1/audio/translations answers; a stream's deltas and final text equal the non-stream
               text; a stream hung up after its first delta, then a new stream of the same clip, works;
               clips of 29.9 s and 30.1 s (either side of Whisper's 30 s window) and one > 60 s
               (chunked) transcribe; a WAV truncated inside its data is not a 5xx.
  bad_inputs   empty file, garbage bytes, a WAV cut inside its header, a header-only WAV, NaN samples,
               an upload over the server's audio limit, a stream of audio over 30 s, a missing file,
               a JSON body, and every bad form field of tests/test_openai_errors.py: each must be a 4xx
               with the OpenAI envelope {"error": {"message", "type", "param", "code"}}, never a 5xx.
  soak         `--duration` seconds split evenly over the `--concurrency` levels. Worker threads send
               test-set clips (mixed formats, some streams, each upload a fresh variant so the
               encoder cache does not answer) and long files (60-120 s, several windows: the 65 s
               joined reading, or `--long-manifest`'s files) in every response format, each sent as
               the same bytes every time, so every repeat of a file in a format must answer the
               same bytes as its first (speculation, batching and load must never change them); a chaos thread (seeded by `--seed`) at random moments
               sends a malformed upload, hangs up a stream, or drops a connection mid-request or
               mid-upload. Errors: any 5xx, connection failure, unexpected 4xx, malformed 200, stream
               error event that chaos did not cause on purpose, or a long file answered differently.
  after_soak   after an idle wait: no request left in the speculative worker (/whisper-flash/stats),
               the KV pool's free slots back at their idle value, /health 200, the server alive.

The KV pool's free count is read as tests/test_integration_spec_server.py reads it: the decode worker
logs `kv_free=N` when a request leaves it, and the same clip sent to an idle server always logs the
same N. The script sends one probe clip at the start and again after the soak and compares the two;
that needs the server's log (its own, or `--server-log` with `--url`).

Writes one JSON object (`--out FILE`, default stdout) with a top-level "ok"; the exit code is 0 only
when everything passed (1: a check failed, 2: bad arguments).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import platform
import random
import re
import socket
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import requests
import soundfile as sf
from tqdm import tqdm

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
SAMPLE_RATE = 16000
WINDOW_S = 30.0  # Whisper's window: the boundary clips sit either side of it
DEFAULT_MAX_AUDIO_S = 3600.0  # sglang-omni's audio_chunking.max_total_audio_s (config/schema.py)
# The decode worker's line when a request leaves it (worker.runner forget); see the module docstring.
FINISH_LINE = re.compile(r"whisper-flash (\S+): proposed=(\d+) accepted=(\d+) \(\d+%\) target_calls=(\d+) "
                         r"kv_free=(\d+)(?: ids=\[([\d, ]*)\])?")
SRT_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d),(\d\d\d) --> (\d\d):(\d\d):(\d\d),(\d\d\d)$")
VTT_TIME = re.compile(r"^(?:(\d\d):)?(\d\d):(\d\d)\.(\d\d\d) --> (?:(\d\d):)?(\d\d):(\d\d)\.(\d\d\d)$")
# Bad form fields (tests/test_openai_errors.py checks the same list): (fields, the param the envelope must name).
BAD_FIELDS = {
    "temperature_negative": ({"temperature": "-1"}, "temperature"),
    "temperature_above_one": ({"temperature": "1.5"}, "temperature"),
    "temperature_not_a_number": ({"temperature": "warm"}, "temperature"),
    "temperature_nan": ({"temperature": "nan"}, "temperature"),
    "response_format_unknown": ({"response_format": "xml"}, "response_format"),
    "response_format_srt_streamed": ({"response_format": "srt", "stream": "true"}, "response_format"),
    "language_unknown": ({"language": "klingon"}, "language"),
    "timestamp_granularity_unknown": (
        {"timestamp_granularities[]": "phoneme", "response_format": "verbose_json"}, "timestamp_granularities"),
    "timestamp_granularity_word_unsupported": (
        {"timestamp_granularities[]": "word", "response_format": "verbose_json"}, "timestamp_granularities"),
    "timestamp_granularities_without_verbose_json": (
        {"timestamp_granularities[]": "segment", "response_format": "json"}, "timestamp_granularities"),
    "max_new_tokens_zero": ({"max_new_tokens": "0"}, "max_new_tokens"),
}
# What the soak's workers send, with weights: mostly the default json, every other kind too.
SOAK_KINDS = (("json", 35), ("text", 10), ("verbose_json", 10), ("srt", 10), ("vtt", 5),
              ("stream", 20), ("stream_text", 5), ("translation", 5), ("long", 10))
CHAOS_ACTIONS = ("malformed_upload", "cancel_stream", "disconnect_mid_request", "disconnect_mid_upload")
MAX_RECORDED_ERRORS = 50


# ---------------------------------------------------------------------------- audio


@dataclass
class Clip:
    """Audio the script sends: a test-set clip or a clip built from them."""

    id: str
    audio: np.ndarray  # float32 mono at 16 kHz
    text: str  # reference words (for the built clips: of the clips wholly inside)
    real: bool = False  # a LibriVox reading, not a synthetic voice

    @property
    def duration(self) -> float:
        return len(self.audio) / SAMPLE_RATE

    def wav(self, variant: int | None = None) -> bytes:
        """16-bit WAV bytes; `variant` n moves the first samples by a few LSB so the server's
        encoder cache (keyed by the audio) sees a new upload, as asr_server_bench.py does."""
        pcm = np.clip(np.round(self.audio * 32767), -32768, 32767).astype(np.int32)
        if variant is not None:
            code = variant + 1
            for j in range(12):
                pcm[j] += -((code >> (2 * j)) & 3) if pcm[j] > 0 else (code >> (2 * j)) & 3
        return wav_bytes(pcm.astype(np.int16), "PCM_16")


def wav_bytes(audio: np.ndarray, subtype: str, rate: int = SAMPLE_RATE) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, audio, rate, format="WAV", subtype=subtype)
    return buffer.getvalue()


def load_test_clips(manifest: Path | None) -> list[Clip]:
    """The default test set (built into the user cache on first use) or a manifest's clips, 16 kHz mono."""
    from sglang_omni_flash.corpus.manifest import read_manifest

    if manifest is None:
        from sglang_omni_flash.corpus.synth import build_test_set
        from sglang_omni_flash.paths import audio_dir

        manifest = build_test_set(audio_dir(), progress=False).combined
    clips = []
    for utterance in read_manifest(manifest):
        audio, rate = sf.read(utterance.audio, dtype="float32", always_2d=True)
        if rate != SAMPLE_RATE:
            raise SystemExit(f"error: {utterance.audio} is {rate} Hz; the stability clips must be 16 kHz")
        clips.append(Clip(utterance.id, audio.mean(axis=1), utterance.text, utterance.voice.startswith("librivox")))
    if not clips:
        raise SystemExit(f"error: {manifest} lists no clips")
    return clips


def joined_clip(clip_id: str, parts: list[Clip], seconds: float, *, trim: bool) -> Clip:
    """Real clips one after the other (0.4 s of silence between them) until `seconds` is reached;
    with `trim`, cut to exactly `seconds` (speech runs up to the end, across the boundary)."""
    gap = np.zeros(int(0.4 * SAMPLE_RATE), dtype=np.float32)
    pieces, words, total = [], [], 0
    for part in itertools.cycle(parts):
        if total >= seconds * SAMPLE_RATE:
            break
        pieces += [part.audio, gap]
        total += len(part.audio) + len(gap)
        if not trim or total <= seconds * SAMPLE_RATE:
            words.append(part.text)  # wholly inside: its words must be heard
    audio = np.concatenate(pieces)
    if trim:
        audio = audio[: int(round(seconds * SAMPLE_RATE))]
    return Clip(clip_id, audio.astype(np.float32), " ".join(words))


def header_wav(seconds: float, rate: int = 8000) -> bytes:
    """An 8-bit 8 kHz WAV of silence lasting `seconds`: the smallest well-formed file of that length."""
    frames = int(seconds * rate)
    header = b"RIFF" + struct.pack("<I", 36 + frames) + b"WAVE"
    header += b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate, 1, 8)
    header += b"data" + struct.pack("<I", frames)
    return header + b"\x80" * frames


# ---------------------------------------------------------------------------- responses


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def cue_timeline(fmt: str, body: str, duration: float) -> tuple[list[tuple[float, float]], str | None, str]:
    """(start, end) of each srt / vtt cue, what is wrong with the document (None: well formed), and
    the cues' text."""
    lines = body.strip("\n").split("\n")
    if fmt == "vtt":
        if not lines or lines[0] != "WEBVTT":
            return [], "does not start with WEBVTT", ""
        lines = lines[1:]
    times, texts, expected_index = [], [], 1
    blocks = [b for b in "\n".join(lines).strip("\n").split("\n\n") if b.strip()]
    if not blocks:
        return [], "no cues", ""
    for block in blocks:
        rows = block.split("\n")
        if fmt == "srt":
            if rows[0].strip() != str(expected_index):
                return times, f"cue {expected_index}: index line {rows[0]!r}", ""
            rows = rows[1:]
            expected_index += 1
        match = (SRT_TIME if fmt == "srt" else VTT_TIME).match(rows[0].strip()) if rows else None
        if match is None:
            return times, f"bad time line {rows[0] if rows else ''!r}", ""
        g = [int(x) if x else 0 for x in match.groups()]
        start = g[0] * 3600 + g[1] * 60 + g[2] + g[3] / 1000
        end = g[4] * 3600 + g[5] * 60 + g[6] + g[7] / 1000
        if not "".join(rows[1:]).strip():
            return times, f"cue at {start:.3f} s has no text", ""
        times.append((start, end))
        texts.append(" ".join(row.strip() for row in rows[1:]))
    return times, timeline_problem(times, duration), " ".join(texts)


def timeline_problem(times: list[tuple[float, float]], duration: float) -> str | None:
    if not times:
        return "no segments"
    if not all(0 <= s <= e <= duration + 0.01 for s, e in times):
        return f"a segment outside 0..{duration:.2f} s: {times[:5]}"
    if not all(a[1] <= b[0] + 1e-6 for a, b in zip(times, times[1:])):
        return f"segments go back in time: {times[:5]}"
    return None


def body_problem(fmt: str, resp: requests.Response, duration: float) -> tuple[str | None, str]:
    """(what is wrong with a 200 body of `fmt`, its text)."""
    if fmt in ("json", "verbose_json"):
        try:
            body = resp.json()
        except ValueError:
            return "not JSON", ""
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str) or not text.strip():
            return "no text", ""
        if fmt == "verbose_json":
            segments = body.get("segments")
            if not isinstance(segments, list) or not segments:
                return "no segments", text
            if [s.get("id") for s in segments] != list(range(len(segments))):
                return "segment ids are not 0..n-1", text
            problem = timeline_problem([(s["start"], s["end"]) for s in segments], duration)
            if problem:
                return problem, text
            if abs(float(body.get("duration", -1)) - duration) > 0.05:
                return f"duration {body.get('duration')} for {duration:.2f} s of audio", text
        return None, text
    text = resp.text
    if fmt == "text":
        return (None if text.strip() else "empty"), text
    _, problem, cue_text = cue_timeline(fmt, text, duration)
    return problem, cue_text


def envelope_problem(resp: requests.Response, param: str | None, *, check_param: bool = True) -> str | None:
    """What is wrong with a refusal: it must be a 4xx with the OpenAI error envelope."""
    if not 400 <= resp.status_code < 500:
        return f"HTTP {resp.status_code}, expected a 4xx: {resp.text[:200]}"
    if "Traceback" in resp.text:
        return "traceback in the answer"
    try:
        body = resp.json()
    except ValueError:
        return f"not JSON: {resp.text[:200]}"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return f"not the OpenAI envelope: {body}"
    error = body["error"]
    if set(error) != {"message", "type", "param", "code"}:
        return f"envelope fields {sorted(error)}"
    if error["type"] != "invalid_request_error" or not isinstance(error["message"], str) or not error["message"]:
        return f"envelope {error}"
    if check_param and error["param"] != param:
        return f"param {error['param']!r}, expected {param!r}"
    return None


def read_stream(resp: requests.Response, stop_after: int | None = None) -> tuple[list[str], str | None, str | None]:
    """(deltas, final text, error event) of an SSE transcription stream; stops early after
    `stop_after` deltas (the caller then closes the connection: a client hanging up)."""
    deltas, done, error = [], None, None
    for line in resp.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        if event.get("type") == "transcript.text.delta":
            deltas.append(event["delta"])
            if stop_after is not None and len(deltas) >= stop_after:
                break
        elif event.get("type") == "transcript.text.done":
            done = event["text"]
        elif event.get("type") == "error":
            error = json.dumps(event.get("error"))[:300]
    return deltas, done, error


# ---------------------------------------------------------------------------- results


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    status: int | None = None
    extra: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        out = {"name": self.name, "ok": self.ok, "detail": self.detail}
        if self.status is not None:
            out["status"] = self.status
        out.update(self.extra)
        return out


class Client:
    """Multipart requests to one server, with a session per thread (keep-alive, as real clients)."""

    def __init__(self, url: str, timeout_s: float):
        self.url = url
        self.timeout_s = timeout_s
        self._local = threading.local()

    @property
    def session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def post(self, audio: bytes | None, *, endpoint: str = TRANSCRIPTIONS, name: str = "clip.wav",
             streamed: bool = False, **fields: str) -> requests.Response:
        """POST `audio` as the multipart field "file" with form `fields`; `streamed`: an SSE stream,
        read by the caller (fields may also hold "stream" as sent, e.g. for a refusal)."""
        files = None if audio is None else {"file": (name, audio, "audio/wav")}
        data = {"model": "whisper", **fields}
        if streamed:
            data["stream"] = "true"
        return self.session.post(self.url + endpoint, data=data, files=files, stream=streamed,
                                 timeout=self.timeout_s)

    def get_json(self, path: str) -> dict:
        resp = self.session.get(self.url + path, timeout=30)
        resp.raise_for_status()
        return resp.json()


# ---------------------------------------------------------------------------- functional checks


def check_format(client: Client, clip: Clip, fmt: str, *, endpoint: str = TRANSCRIPTIONS,
                 name: str | None = None) -> tuple[Check, str]:
    name = name or f"format_{fmt}"
    try:
        resp = client.post(clip.wav(), endpoint=endpoint, name=f"{clip.id}.wav", response_format=fmt)
    except requests.RequestException as exc:
        return Check(name, False, f"{type(exc).__name__}: {exc}"), ""
    if resp.status_code != 200:
        return Check(name, False, f"HTTP {resp.status_code}: {resp.text[:300]}", resp.status_code), ""
    problem, text = body_problem(fmt, resp, clip.duration)
    detail = problem or f"{len(words(text))} words from {clip.duration:.1f} s ({clip.id})"
    return Check(name, problem is None, detail, 200), text


def heard_enough(text: str, clip: Clip, share: float = 0.6) -> str | None:
    """None when the transcript has at least `share` of the reference's word count."""
    got, want = len(words(text)), len(words(clip.text))
    return None if got >= share * want else f"{got} words heard, reference has {want}"


def functional_checks(client: Client, clips: list[Clip], built: dict[str, Clip]) -> list[Check]:
    checks: list[Check] = []
    reference = built["formats"]

    def record(check: Check) -> Check:
        checks.append(check)
        print(f"  {'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}", file=sys.stderr)
        return check

    try:
        resp = client.session.get(client.url + "/health", timeout=30)
        record(Check("health_before", resp.status_code == 200, resp.text[:200], resp.status_code))
    except requests.RequestException as exc:
        record(Check("health_before", False, f"{type(exc).__name__}: {exc}"))

    texts = {}
    for fmt in FORMATS:
        check, texts[fmt] = check_format(client, reference, fmt)
        record(check)
    if texts["json"] and texts["text"]:
        same = texts["json"].strip() == texts["text"].strip()
        record(Check("format_text_equals_json", same, "" if same else f"{texts['text']!r} vs {texts['json']!r}"))
    check, _ = check_format(client, reference, "json", endpoint=TRANSLATIONS, name="translations_json")
    record(check)

    # a stream against the non-stream json text of the same clip
    try:
        with client.post(reference.wav(), name=f"{reference.id}.wav", streamed=True) as resp:
            if resp.status_code != 200:
                record(Check("stream_equals_non_stream", False, f"HTTP {resp.status_code}: {resp.text[:300]}",
                             resp.status_code))
            else:
                deltas, done, error = read_stream(resp)
                joined = "".join(deltas).strip()
                ok = error is None and done is not None and joined == done.strip() == texts["json"].strip()
                record(Check("stream_equals_non_stream", ok,
                             f"{len(deltas)} deltas" if ok else f"deltas {joined!r}, done {done!r}, "
                             f"json {texts['json']!r}, error {error}", 200))
    except requests.RequestException as exc:
        record(Check("stream_equals_non_stream", False, f"{type(exc).__name__}: {exc}"))

    # hang up a stream after its first delta, then the same client streams the clip again
    longest = built["cancel"]
    try:
        plain = client.post(longest.wav(), name=f"{longest.id}.wav", response_format="json")
        with client.post(longest.wav(), name=f"{longest.id}.wav", streamed=True) as resp:
            first, done, _ = read_stream(resp, stop_after=1)
        with client.post(longest.wav(), name=f"{longest.id}.wav", streamed=True) as resp:
            deltas, again, error = read_stream(resp)
        expected = plain.json().get("text", "").strip() if plain.status_code == 200 else None
        ok = bool(first) and done is None and error is None and again is not None and \
            again.strip() == "".join(deltas).strip() == expected
        record(Check("stream_cancel_then_reconnect", ok,
                     f"hung up after {len(first)} delta; reconnect streamed {len(deltas)} deltas" if ok else
                     f"first {first!r} done {done!r}; again {again!r} error {error}; json {expected!r}"))
    except (requests.RequestException, ValueError) as exc:
        record(Check("stream_cancel_then_reconnect", False, f"{type(exc).__name__}: {exc}"))

    # either side of Whisper's 30 s window, and a long upload chunked by the server
    for key, formats in (("clip_29.9s", ("json", "verbose_json")), ("clip_30.1s", ("json", "verbose_json")),
                         ("clip_long", ("json", "srt"))):
        clip = built[key]
        for fmt in formats:
            check, text = check_format(client, clip, fmt, name=f"{key}_{fmt}")
            if check.ok and fmt in ("json", "verbose_json"):
                short = heard_enough(text, clip)
                if short:
                    check.ok, check.detail = False, short
            check.extra["duration_s"] = round(clip.duration, 2)
            record(check)

    # a WAV cut inside its data is still audio (decoders read what is there): anything but a 5xx
    cut = reference.wav()
    try:
        resp = client.post(cut[: len(cut) // 2], name="truncated-in-data.wav", response_format="json")
        record(Check("truncated_in_data_no_5xx", resp.status_code < 500,
                     f"HTTP {resp.status_code}: {resp.text[:200]}", resp.status_code))
    except requests.RequestException as exc:
        record(Check("truncated_in_data_no_5xx", False, f"{type(exc).__name__}: {exc}"))
    return checks


# ---------------------------------------------------------------------------- bad inputs


def bad_uploads(reference: Clip, max_audio_s: float | None) -> dict[str, tuple[bytes, str | None]]:
    """name -> (file bytes, the param the envelope must name); each must be a 4xx. Without
    `max_audio_s` the two that cost a decode or 30 MB (NaN samples, oversized) are left out."""
    wav = reference.wav()
    uploads = {
        "empty_file": (b"", "file"),
        "garbage_bytes": (random.Random(0).randbytes(4096), "file"),
        "truncated_wav": (wav[:40], "file"),  # cut inside the header: no data chunk at all
        "header_only_wav": (wav[:44], "file"),  # the header promises data that is not there
    }
    if max_audio_s is not None:
        nan_audio = reference.audio.copy()
        nan_audio[::7] = np.nan
        uploads["nan_samples"] = (wav_bytes(nan_audio, "FLOAT"), "file")
        # sglang-omni has no byte limit on transcription uploads (a TODO in serve/transcriptions.py);
        # its limit is audio_chunking.max_total_audio_s, checked on the header before decoding
        uploads["oversized_upload"] = (header_wav(max_audio_s + 60), "file")
    return uploads


def bad_input_checks(client: Client, reference: Clip, over_window: Clip, max_audio_s: float) -> list[Check]:
    checks: list[Check] = []
    wav = reference.wav()
    cases: list[tuple[str, dict]] = []
    for name, (audio, param) in bad_uploads(reference, max_audio_s).items():
        cases.append((name, {"audio": audio, "fields": {"response_format": "json"}, "param": param}))
    cases.append(("stream_over_30s", {"audio": over_window.wav(), "fields": {"stream": "true"}, "param": None,
                                      "check_param": False}))
    cases.append(("missing_file", {"audio": None, "fields": {}, "param": "file"}))
    for name, (fields, param) in BAD_FIELDS.items():
        cases.append((name, {"audio": wav, "fields": fields, "param": param}))
    cases.append(("translations_garbage_bytes", {"audio": b"garbage", "fields": {}, "param": "file",
                                                 "endpoint": TRANSLATIONS}))
    cases.append(("translations_temperature_negative", {"audio": wav, "fields": {"temperature": "-1"},
                                                        "param": "temperature", "endpoint": TRANSLATIONS}))
    for name, case in cases:
        try:
            resp = client.post(case["audio"], endpoint=case.get("endpoint", TRANSCRIPTIONS), **case["fields"])
            problem = envelope_problem(resp, case["param"], check_param=case.get("check_param", True))
            error = resp.json().get("error", {}) if problem is None else {}
            detail = problem or f"{resp.status_code} {error.get('code')}: {error.get('message', '')[:120]}"
            check = Check(name, problem is None, detail, resp.status_code,
                          {"param": error.get("param"), "code": error.get("code")} if problem is None else {})
        except requests.RequestException as exc:
            check = Check(name, False, f"{type(exc).__name__}: {exc}")
        checks.append(check)
        print(f"  {'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}", file=sys.stderr)
    try:  # a JSON body where multipart is expected
        resp = client.session.post(client.url + TRANSCRIPTIONS, json={"file": "x"}, timeout=client.timeout_s)
        problem = envelope_problem(resp, "file")
        checks.append(Check("json_body", problem is None, problem or f"{resp.status_code}", resp.status_code))
    except requests.RequestException as exc:
        checks.append(Check("json_body", False, f"{type(exc).__name__}: {exc}"))
    print(f"  {'ok  ' if checks[-1].ok else 'FAIL'} json_body: {checks[-1].detail}", file=sys.stderr)
    return checks


# ---------------------------------------------------------------------------- soak


class SoakStats:
    """Counters shared by the workers and the chaos thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.latencies: dict[int, list[float]] = {}
        self.requests: dict[int, int] = {}
        self.errors: dict[int, int] = {}
        self.kinds: dict[str, int] = {}
        self.error_kinds: dict[str, int] = {}
        self.chaos: dict[str, int] = {}
        self.chaos_outcomes: dict[str, int] = {}
        self.chaos_errors = 0
        self.error_samples: list[dict] = []
        self.long_bodies: dict[tuple[str, str], str] = {}  # (file, format) -> its first answer
        self.long_sent: dict[tuple[str, str], int] = {}

    def same_as_first(self, key: tuple[str, str], body: str) -> bool:
        """Whether a long file's answer in a format equals the first one it got (the first is kept)."""
        with self.lock:
            self.long_sent[key] = self.long_sent.get(key, 0) + 1
            return self.long_bodies.setdefault(key, body) == body

    def request(self, level: int, kind: str, latency: float | None, error: str | None, error_kind: str = ""):
        with self.lock:
            self.requests[level] = self.requests.get(level, 0) + 1
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if error is None:
                self.latencies.setdefault(level, []).append(latency)
            else:
                self.errors[level] = self.errors.get(level, 0) + 1
                self.error_kinds[error_kind] = self.error_kinds.get(error_kind, 0) + 1
                self._sample({"source": "worker", "concurrency": level, "kind": kind, "error": error[:300]})

    def chaos_action(self, action: str, outcome: str, error: str | None = None):
        with self.lock:
            self.chaos[action] = self.chaos.get(action, 0) + 1
            self.chaos_outcomes[f"{action}:{outcome}"] = self.chaos_outcomes.get(f"{action}:{outcome}", 0) + 1
            if error is not None:
                self.chaos_errors += 1
                self._sample({"source": "chaos", "kind": action, "error": error[:300]})

    def _sample(self, item: dict) -> None:
        if len(self.error_samples) < MAX_RECORDED_ERRORS:
            self.error_samples.append({"t": round(time.time(), 2), **item})

    def totals(self) -> tuple[int, int, int]:
        with self.lock:
            return sum(self.requests.values()), sum(self.errors.values()) + self.chaos_errors, sum(self.chaos.values())


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50_s": None, "p90_s": None, "p99_s": None, "max_s": None, "mean_s": None}
    a = np.array(values)
    return {"p50_s": round(float(np.percentile(a, 50)), 3), "p90_s": round(float(np.percentile(a, 90)), 3),
            "p99_s": round(float(np.percentile(a, 99)), 3), "max_s": round(float(a.max()), 3),
            "mean_s": round(float(a.mean()), 3)}


_variants = itertools.count()
_variants_lock = threading.Lock()


def next_variant() -> int:
    with _variants_lock:
        return next(_variants)


def soak_request(client: Client, clip: Clip, kind: str, fresh: bool = True) -> tuple[float, str | None, str, str]:
    """Send one worker request (`fresh`: a new variant of the clip, else its own bytes);
    (latency, error or None, error kind, body)."""
    audio = clip.wav(next_variant() if fresh else None)
    started = time.perf_counter()
    try:
        if kind in ("stream", "stream_text"):
            fmt = "json" if kind == "stream" else "text"
            with client.post(audio, name=f"{clip.id}.wav", streamed=True, response_format=fmt) as resp:
                if resp.status_code != 200:
                    return 0.0, f"HTTP {resp.status_code}: {resp.text[:200]}", status_kind(resp.status_code), ""
                deltas, done, error = read_stream(resp)
            if error is not None:
                return 0.0, f"stream error event: {error}", "stream_error", ""
            if done is None or "".join(deltas).strip() != done.strip() or not done.strip():
                return 0.0, f"stream ended without a matching done event ({len(deltas)} deltas, done {done!r})", \
                    "malformed", ""
            return time.perf_counter() - started, None, "", done
        endpoint, fmt = (TRANSLATIONS, "json") if kind == "translation" else (TRANSCRIPTIONS, kind)
        resp = client.post(audio, endpoint=endpoint, name=f"{clip.id}.wav", response_format=fmt)
        latency = time.perf_counter() - started
        if resp.status_code != 200:
            return latency, f"HTTP {resp.status_code}: {resp.text[:200]}", status_kind(resp.status_code), ""
        problem, _ = body_problem(fmt, resp, clip.duration)
        if problem:
            return latency, f"{fmt} body: {problem}", "malformed", ""
        return latency, None, "", resp.text
    except requests.RequestException as exc:
        return time.perf_counter() - started, f"{type(exc).__name__}: {exc}", "connection", ""
    except ValueError as exc:  # a stream line that is not JSON
        return time.perf_counter() - started, f"{type(exc).__name__}: {exc}", "malformed", ""


def status_kind(status: int) -> str:
    return "5xx" if status >= 500 else "unexpected_4xx"


def worker(client: Client, clips: list[Clip], long_clips: list[Clip], level: int, deadline: float,
           rng: random.Random, stats: SoakStats, first_long: bool = False) -> None:
    kinds, weights = zip(*SOAK_KINDS)
    first = first_long  # the first request: a long file in json (so every level repeats one)
    while time.monotonic() < deadline:
        kind = "long" if first else rng.choices(kinds, weights)[0]
        if kind != "long":
            latency, error, error_kind, _ = soak_request(client, rng.choice(clips), kind)
        else:  # a long file as the same bytes every time, in any format: each repeat must answer the same
            clip, fmt = (long_clips[0], "json") if first else (rng.choice(long_clips), rng.choice(FORMATS))
            first = False
            latency, error, error_kind, body = soak_request(client, clip, fmt, fresh=False)
            if error is None and not stats.same_as_first((clip.id, fmt), body):
                error, error_kind = f"{clip.id} in {fmt}: not the bytes of its first answer", "not_repeatable"
        stats.request(level, kind, latency, error, error_kind)


def raw_request(url: str, audio: bytes, fields: dict) -> tuple[str, int, bytes]:
    """(host, port, the whole HTTP request) of a multipart POST, for sending it by hand."""
    prepared = requests.Request("POST", url + TRANSCRIPTIONS, data={"model": "whisper", **fields},
                                files={"file": ("chaos.wav", audio, "audio/wav")}).prepare()
    address = urlsplit(url)
    host, port = address.hostname, address.port or (443 if address.scheme == "https" else 80)
    head = f"POST {TRANSCRIPTIONS} HTTP/1.1\r\nHost: {address.netloc}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in prepared.headers.items()) + "Connection: close\r\n\r\n"
    return host, port, head.encode() + prepared.body


def chaos(client: Client, clips: list[Clip], reference: Clip, stop: threading.Event,
          rng: random.Random, mean_interval_s: float, stats: SoakStats) -> None:
    """At random moments, one of CHAOS_ACTIONS; every action in a shuffled round, so each kind runs."""
    # the cheap bad uploads and fields: here they are noise around the workers, not a test of their own
    malformed = {name: (audio, {}) for name, (audio, _) in bad_uploads(reference, None).items()}
    malformed.update({name: (reference.wav(), fields) for name, (fields, _) in BAD_FIELDS.items()})
    names = sorted(malformed)
    round_ = []
    while not stop.wait(rng.expovariate(1.0 / mean_interval_s)):
        if not round_:
            round_ = list(CHAOS_ACTIONS)
            rng.shuffle(round_)
        action = round_.pop()
        clip = rng.choice(clips)
        try:
            if action == "malformed_upload":
                name = rng.choice(names)
                audio, fields = malformed[name]
                resp = requests.post(client.url + TRANSCRIPTIONS, data={"model": "whisper", **fields},
                                     files={"file": ("chaos.wav", audio, "audio/wav")}, timeout=client.timeout_s)
                problem = envelope_problem(resp, None, check_param=False)
                stats.chaos_action(action, name if problem is None else "failed",
                                   None if problem is None else f"{name}: {problem}")
            elif action == "cancel_stream":
                with requests.post(client.url + TRANSCRIPTIONS, data={"model": "whisper", "stream": "true"},
                                   files={"file": ("chaos.wav", clip.wav(next_variant()), "audio/wav")},
                                   stream=True, timeout=client.timeout_s) as resp:
                    if resp.status_code != 200:
                        stats.chaos_action(action, "failed", f"HTTP {resp.status_code}: {resp.text[:200]}")
                        continue
                    deltas, done, error = read_stream(resp, stop_after=rng.randint(1, 3))
                stats.chaos_action(action, "hung_up" if done is None else "finished_first",
                                   None if error is None else f"stream error event: {error}")
            else:
                host, port, request = raw_request(client.url, clip.wav(next_variant()),
                                                  {"response_format": rng.choice(FORMATS)})
                with socket.create_connection((host, port), timeout=30) as sock:
                    if action == "disconnect_mid_upload":
                        sock.sendall(request[: rng.randint(200, len(request) - 1)])
                        time.sleep(rng.uniform(0.0, 0.5))
                        stats.chaos_action(action, "dropped")
                    else:
                        sock.sendall(request)
                        sock.settimeout(rng.uniform(0.2, 2.0))  # hang up before the answer (usually)
                        try:
                            answered = bool(sock.recv(1))
                        except socket.timeout:
                            answered = False
                        stats.chaos_action(action, "answered_first" if answered else "dropped")
        except (requests.RequestException, OSError, ValueError) as exc:
            stats.chaos_action(action, "failed", f"{type(exc).__name__}: {exc}")


def soak(client: Client, clips: list[Clip], long_clips: list[Clip], reference: Clip, levels: tuple[int, ...],
         duration_s: float, seed: int, chaos_interval_s: float) -> dict:
    stats = SoakStats()
    per_level = duration_s / len(levels)
    stop = threading.Event()
    chaos_thread = threading.Thread(
        target=chaos, name="chaos", daemon=True,
        args=(client, clips, reference, stop, random.Random(seed), chaos_interval_s, stats))
    walls = {}
    started = time.monotonic()
    chaos_thread.start()
    with tqdm(total=round(duration_s), unit="s", desc="soak", file=sys.stderr, dynamic_ncols=True) as bar:
        for level in levels:
            level_start = time.monotonic()
            deadline = level_start + per_level
            threads = [threading.Thread(target=worker, name=f"soak-c{level}-{i}", daemon=True,
                                        args=(client, clips, long_clips, level, deadline,
                                              random.Random(f"{seed}-{level}-{i}"), stats, i == 0))
                       for i in range(level)]
            for thread in threads:
                thread.start()
            # requests started before the deadline run to the end: a level ends when its last answer is in
            while any(thread.is_alive() for thread in threads):
                time.sleep(0.5)
                n, errors, actions = stats.totals()
                bar.n = min(round(time.monotonic() - started), bar.total)
                bar.set_postfix(c=level, requests=n, errors=errors, chaos=actions, refresh=False)
                bar.refresh()
            walls[level] = time.monotonic() - level_start
    stop.set()
    chaos_thread.join(timeout=client.timeout_s)
    rows = []
    for level in levels:
        lat = stats.latencies.get(level, [])
        rows.append({"concurrency": level, "wall_s": round(walls[level], 1), "requests": stats.requests.get(level, 0),
                     "errors": stats.errors.get(level, 0),
                     "req_per_s": round(len(lat) / walls[level], 3) if walls[level] else None, **percentiles(lat)})
    all_latencies = [x for level in levels for x in stats.latencies.get(level, [])]
    n, errors, actions = stats.totals()
    return {
        "ok": errors == 0 and n > 0 and all(row["requests"] > 0 for row in rows),
        "duration_s": duration_s,
        "wall_s": round(time.monotonic() - started, 1),
        "seed": seed,
        "requests": n,
        "errors": sum(stats.errors.values()),
        "error_kinds": stats.error_kinds,
        "latency": percentiles(all_latencies),
        "kinds": stats.kinds,
        "long_files": {"files": [c.id for c in long_clips], "seconds": [round(c.duration, 1) for c in long_clips],
                       "sent": {f"{f}:{fmt}": n for (f, fmt), n in sorted(stats.long_sent.items())},
                       "repeated": sum(n > 1 for n in stats.long_sent.values())},
        "levels": rows,
        "chaos": {"actions": sum(stats.chaos.values()), "by_action": stats.chaos, "outcomes": stats.chaos_outcomes,
                  "errors": stats.chaos_errors, "mean_interval_s": chaos_interval_s},
        "error_samples": stats.error_samples,
    }


# ---------------------------------------------------------------------------- KV pool and health


class KvProbe:
    """The KV pool's free count after the probe clip, sent alone, leaves the decode worker."""

    def __init__(self, client: Client, log_file: Path | None, clip: Clip):
        self.client, self.log_file, self.clip = client, log_file, clip

    def finish_lines(self) -> list[tuple]:
        """(rid, kv_free, ids) of every request that left the worker so far."""
        text = self.log_file.read_text(errors="replace")
        out = []
        for m in FINISH_LINE.finditer(" ".join(text.split())):  # rich may wrap long lines
            ids = None if m.group(6) is None else [int(t) for t in m.group(6).replace(" ", "").split(",") if t]
            out.append((m.group(1), int(m.group(5)), ids))
        return out

    def measure(self, expected_ids: list[int] | None = None) -> tuple[int | None, list[int] | None, str]:
        """(kv_free, token ids, detail) of one probe request; None when it cannot be read."""
        if self.log_file is None or not self.log_file.is_file():
            return None, None, "no server log to read kv_free from (pass --server-log with --url)"
        before = len(self.finish_lines())
        resp = self.client.post(self.clip.wav(), name="kv-probe.wav", response_format="json")
        if resp.status_code != 200:
            return None, None, f"probe HTTP {resp.status_code}: {resp.text[:200]}"
        deadline = time.monotonic() + 15  # the worker logs right after it answers; the log may lag
        while time.monotonic() < deadline:
            new = [line for line in self.finish_lines()[before:] if line[2]]
            if new:  # the server is idle: the probe is the only request that finished since `before`
                rid, free, ids = new[-1]
                same = expected_ids is None or ids == expected_ids
                return free, ids, f"(rid {rid}{'' if same else '; its token ids differ from the first probe'})"
            time.sleep(0.5)
        return None, None, "no finish line with kv_free for the probe in the server log"


def idle_worker(client: Client, wait_s: float) -> tuple[dict | None, str]:
    """Wait (at most `wait_s`) for the speculative worker to hold no request; its stats totals."""
    deadline = time.monotonic() + wait_s
    totals, detail = None, ""
    while True:
        try:
            totals = client.get_json("/whisper-flash/stats")["totals"]
            if totals.get("active_requests") == 0:
                return totals, ""
            detail = f"{totals.get('active_requests')} requests still in the speculative worker"
        except (requests.RequestException, ValueError, KeyError) as exc:
            detail = f"/whisper-flash/stats: {type(exc).__name__}: {exc} (is this a speculative server?)"
        if time.monotonic() >= deadline:
            return totals, detail
        time.sleep(1.0)


# ---------------------------------------------------------------------------- server


def start_server(args: argparse.Namespace, log_file: Path):
    from sglang_omni_flash.serving.launch import Server, ServeOptions

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = ServeOptions(model=args.model, port=port, log_file=log_file, dtype=args.dtype,
                           extra_args=("--asr.speculative", "whisper-flash"),
                           startup_timeout_s=args.startup_timeout)
    server = Server(options)
    server.start()
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def log_tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# ---------------------------------------------------------------------------- main


def build_clips(clips: list[Clip]) -> dict[str, Clip]:
    real = [c for c in clips if c.real] or clips  # the LibriVox lines: real speech
    by_length = sorted(clips, key=lambda c: c.duration)
    return {
        "formats": by_length[len(by_length) * 2 // 3],  # a longish clip: several subtitle cues
        "cancel": by_length[-1],  # the longest: time to hang up mid-decode
        "clip_29.9s": joined_clip("joined-29.9s", real, WINDOW_S - 0.1, trim=True),
        "clip_30.1s": joined_clip("joined-30.1s", real, WINDOW_S + 0.1, trim=True),
        "clip_long": joined_clip("joined-long", real, 65.0, trim=False),
    }


def run(args: argparse.Namespace, levels: tuple[int, ...]) -> dict:
    result: dict = {
        "benchmark": "asr_stability",
        "started_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "options": {"duration_s": args.duration, "concurrency": list(levels), "seed": args.seed,
                    "chaos_interval_s": args.chaos_interval, "idle_wait_s": args.idle_wait,
                    "max_audio_s": args.max_audio_s, "model": None if args.url else args.model,
                    "dtype": None if args.url else args.dtype},
        "ok": False,
    }
    clips = load_test_clips(args.manifest)
    built = build_clips(clips)
    server = None
    log_file = args.server_log
    if args.url:
        result["server"] = {"url": args.url, "started_here": False, "log_file": str(log_file) if log_file else None}
    else:
        if log_file is None:
            log_file = Path(tempfile.mkdtemp(prefix="asr-stability-")) / "server.log"
        print(f"starting a speculative server ({args.model}); log: {log_file}", file=sys.stderr)
        t0 = time.monotonic()
        try:
            server = start_server(args, log_file)
        except Exception as exc:  # a failed start is the result, not a crash of the benchmark
            result["server"] = {"started_here": True, "error": f"{type(exc).__name__}: {exc}",
                                "log_file": str(log_file), "log_tail": log_tail(log_file)}
            print(f"error: the server did not start: {exc}\n{log_tail(log_file)}", file=sys.stderr)
            return result
        result["server"] = {"url": server.url, "started_here": True, "startup_s": round(time.monotonic() - t0, 1),
                            "log_file": str(log_file), "extra_args": list(server.options.extra_args)}
        print(f"healthy at {server.url} after {result['server']['startup_s']} s", file=sys.stderr)
    client = Client(server.url if server else args.url, args.timeout)
    try:
        try:
            client.session.get(client.url + "/health", timeout=30)
        except requests.RequestException as exc:
            result["server"]["error"] = f"{client.url}/health: {type(exc).__name__}: {exc}"
            print(f"error: {client.url} does not answer ({type(exc).__name__}); is the server running?",
                  file=sys.stderr)
            return result
        probe = KvProbe(client, log_file, clips[0])
        idle_free, probe_ids, probe_detail = probe.measure()
        print(f"KV pool free slots when idle: {idle_free} ({probe_detail})", file=sys.stderr)

        print("functional checks", file=sys.stderr)
        functional = functional_checks(client, clips, built)
        result["functional"] = {"ok": all(c.ok for c in functional), "checks": [c.as_json() for c in functional]}
        print("bad inputs", file=sys.stderr)
        bad = bad_input_checks(client, built["formats"], built["clip_30.1s"], args.max_audio_s)
        result["bad_inputs"] = {"ok": all(c.ok for c in bad), "checks": [c.as_json() for c in bad]}

        print(f"soak: {args.duration:g} s over concurrency {','.join(map(str, levels))}, seed {args.seed}",
              file=sys.stderr)
        long_clips = load_test_clips(args.long_manifest) if args.long_manifest else [built["clip_long"]]
        result["soak"] = soak(client, clips, long_clips, built["formats"], levels, args.duration, args.seed,
                              args.chaos_interval)

        time.sleep(min(args.idle_wait, 5.0))
        totals, idle_detail = idle_worker(client, args.idle_wait)
        after_free, _, after_detail = probe.measure(probe_ids) if idle_free is not None else (None, None, "")
        checks = [Check("worker_idle", totals is not None and not idle_detail, idle_detail or "no active requests",
                        extra={"stats_totals": totals})]
        if idle_free is None:
            checks.append(Check("kv_pool_returns_to_idle", False, f"not measured: {probe_detail}"))
        else:
            checks.append(Check("kv_pool_returns_to_idle", after_free == idle_free,
                                f"kv_free idle {idle_free}, after the soak {after_free} {after_detail}".strip(),
                                extra={"idle_free": idle_free, "after_free": after_free}))
        try:
            resp = client.session.get(client.url + "/health", timeout=30)
            checks.append(Check("health_after", resp.status_code == 200, resp.text[:200], resp.status_code))
        except requests.RequestException as exc:
            checks.append(Check("health_after", False, f"{type(exc).__name__}: {exc}"))
        if server is not None:
            code = server.process.poll()
            checks.append(Check("server_alive", code is None, "running" if code is None else f"exited with {code}"))
        for check in checks:
            print(f"  {'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}", file=sys.stderr)
        result["after_soak"] = {"ok": all(c.ok for c in checks), "checks": [c.as_json() for c in checks]}
        try:  # not a check: how often temperature fallback decoded a window again during the run
            fallback = client.get_json("/whisper-flash/stats").get("fallback") or {}
            result["after_soak"]["fallback"] = {k: v for k, v in fallback.items() if k != "recent"}
        except (requests.RequestException, ValueError):
            pass
        if log_file is not None and log_file.is_file():
            # not a check (a client hanging up may be logged with one), but worth reading when it grows
            result["after_soak"]["server_log_tracebacks"] = log_file.read_text(errors="replace").count("Traceback")
    finally:
        if server is not None:
            server.stop()
    sections = ("functional", "bad_inputs", "soak", "after_soak")
    result["ok"] = all(result.get(s, {}).get("ok", False) for s in sections)
    result["summary"] = {s: result[s]["ok"] for s in sections}
    result["finished_utc"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return result


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, tuple[int, ...]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--url", default=None, help="a running speculative server (default: start one)")
    parser.add_argument("--server-log", type=Path, default=None,
                        help="with --url: that server's log (for the KV pool check); without: where the "
                             "started server logs (default: a temporary file)")
    parser.add_argument("--model", default="base", help="embedded model name or Whisper directory (own server)")
    parser.add_argument("--dtype", default="auto", help="ASR stage dtype of the own server (default auto)")
    parser.add_argument("--manifest", type=Path, default=None,
                        help="JSONL manifest of 16 kHz clips (default: the test set, built on first use)")
    parser.add_argument("--long-manifest", type=Path, default=None,
                        help="long files for the soak (e.g. `whisper-flash corpus long-form`'s manifest; "
                             "default: the 65 s joined reading)")
    parser.add_argument("--duration", type=float, default=300.0, help="soak seconds over all levels (default 300)")
    parser.add_argument("--concurrency", default="1,4,16", help="comma list of soak levels (default 1,4,16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workers' choices and of the chaos")
    parser.add_argument("--chaos-interval", type=float, default=4.0,
                        help="mean seconds between chaos actions (default 4)")
    parser.add_argument("--idle-wait", type=float, default=60.0,
                        help="after the soak, seconds to wait at most for the worker to be idle (default 60)")
    parser.add_argument("--max-audio-s", type=float, default=DEFAULT_MAX_AUDIO_S,
                        help="the server's audio_chunking.max_total_audio_s (default sglang-omni's 3600)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the own server to start")
    parser.add_argument("--out", type=Path, default=None, help="JSON result file (default: print it)")
    args = parser.parse_args(argv)
    try:
        levels = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    except ValueError:
        parser.error(f"--concurrency: {args.concurrency!r} is not a comma list of whole numbers (e.g. 1,4,16)")
    if not levels or any(c < 1 for c in levels):
        parser.error(f"--concurrency: {args.concurrency!r}: give one or more levels, each at least 1")
    if len(set(levels)) != len(levels):
        parser.error(f"--concurrency: {args.concurrency!r} repeats a level")
    if not args.duration > 0:
        parser.error(f"--duration must be positive, got {args.duration:g}")
    if args.duration / len(levels) < 1:
        parser.error(f"--duration {args.duration:g} s is under one second per concurrency level")
    for name in ("chaos_interval", "timeout", "startup_timeout", "max_audio_s"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name):g}")
    if args.idle_wait < 0:
        parser.error(f"--idle-wait must not be negative, got {args.idle_wait:g}")
    if args.url is not None:
        if not re.match(r"^https?://[^/\s]+/?$", args.url):
            parser.error(f"--url: {args.url!r} is not a server address such as http://127.0.0.1:8000")
        args.url = args.url.rstrip("/")
        if args.server_log is not None and not args.server_log.is_file():
            parser.error(f"--server-log: {args.server_log} is not a file")
    for name in ("manifest", "long_manifest"):
        if getattr(args, name) is not None and not getattr(args, name).is_file():
            parser.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is not a file")
    if args.out is not None and args.out.parent and not args.out.parent.is_dir():
        parser.error(f"--out: folder {args.out.parent} does not exist")
    return args, levels


def main(argv: list[str] | None = None) -> int:
    args, levels = parse_args(argv)
    if args.url is None:
        from sglang_omni_flash.errors import UserError

        try:  # an unknown model or a missing sgl-omni is the user's to fix: one line, no traceback
            from sglang_omni_flash.models.embedded import resolve_model

            args.model = str(resolve_model(args.model))
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    result = run(args, levels)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
        print(f"result in {args.out}", file=sys.stderr)
    else:
        print(text)
    soak_row = result.get("soak", {})
    print(f"{'OK' if result['ok'] else 'FAILED'}: {result.get('summary', {})}; soak {soak_row.get('requests', 0)} "
          f"requests, {soak_row.get('errors', 0)} errors, {soak_row.get('chaos', {}).get('actions', 0)} chaos actions",
          file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    from sglang_omni_flash.errors import run_command

    sys.exit(run_command(main, "asr_stability.py"))
