"""User mistakes on the audio endpoints get OpenAI's error envelope from a real `sgl-omni serve`.

The session's plain tiny.en server (conftest), started through `Server` like `make serve` does,
so the plugin's .pth hook (not this test) installs `integration.routes.openai_errors` in the
server process. Each bad request must answer 4xx with
`{"error": {"message", "type": "invalid_request_error", "param", "code"}}` naming the field,
without a traceback; afterwards a good request still transcribes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import requests


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from asr_stability import BAD_FIELDS  # noqa: E402  (one list of bad fields: this test and the stability benchmark)

pytest.importorskip("sglang_omni")
pytestmark = pytest.mark.server

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"


@pytest.fixture(scope="module")
def server(tiny_en_plain_server):
    return tiny_en_plain_server


@pytest.fixture(scope="module")
def wav_bytes(test_clips) -> bytes:
    return test_clips[0].audio.read_bytes()


def post(server, path: str, data: dict | None = None, file: tuple | None = None) -> requests.Response:
    files = {"file": file} if file is not None else None
    return requests.post(server.url + path, data=data or {}, files=files, timeout=120)


def assert_envelope(resp: requests.Response, *, param: str | None, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    assert "Traceback" not in resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    return error




@pytest.mark.parametrize("name", list(BAD_FIELDS))
def test_bad_field_on_transcriptions_is_refused_with_the_envelope(server, wav_bytes, name):
    data, param = BAD_FIELDS[name]
    assert_envelope(post(server, TRANSCRIPTIONS, data, ("clip.wav", wav_bytes, "audio/wav")), param=param)


def test_missing_file_is_refused(server):
    error = assert_envelope(post(server, TRANSCRIPTIONS, {"model": "whisper"}), param="file")
    assert error["code"] == "missing_required_parameter"


def test_json_body_instead_of_multipart_is_refused(server):
    resp = requests.post(server.url + TRANSCRIPTIONS, json={"file": "x"}, timeout=60)
    assert_envelope(resp, param="file")


def test_undecodable_file_is_refused(server):
    error = assert_envelope(post(server, TRANSCRIPTIONS, None, ("clip.wav", b"not audio at all", "audio/wav")),
                            param="file")
    assert error["code"] == "invalid_audio"


def test_empty_file_is_refused(server):
    error = assert_envelope(post(server, TRANSCRIPTIONS, None, ("clip.wav", b"", "audio/wav")), param="file")
    assert error["code"] == "empty_file"


def test_nan_samples_are_refused(server):
    """A float WAV may carry NaN samples; decoded, they give "!!!!" for a whole token budget."""
    import io

    import numpy as np
    import soundfile as sf

    samples = np.zeros(16000, dtype=np.float32)
    samples[100:200] = np.nan
    buf = io.BytesIO()
    sf.write(buf, samples, 16000, subtype="FLOAT", format="WAV")
    error = assert_envelope(post(server, TRANSCRIPTIONS, None, ("nan.wav", buf.getvalue(), "audio/wav")), param="file")
    assert error["code"] == "invalid_audio" and "NaN" in error["message"]


def test_translations_get_the_same_validation(server, wav_bytes):
    assert_envelope(post(server, TRANSLATIONS, {"temperature": "-1"}, ("clip.wav", wav_bytes, "audio/wav")),
                    param="temperature")
    assert_envelope(post(server, TRANSLATIONS, None, ("clip.wav", b"garbage", "audio/wav")), param="file")


def test_other_endpoints_keep_fastapi_errors(server):
    resp = requests.post(server.url + "/v1/chat/completions", json={}, timeout=60)
    assert resp.status_code == 422 and "detail" in resp.json()


def test_good_request_still_works_after_the_bad_ones(server, wav_bytes):
    resp = post(server, TRANSCRIPTIONS, {"response_format": "json", "temperature": "0", "language": "en"},
                ("clip.wav", wav_bytes, "audio/wav"))
    assert resp.status_code == 200, resp.text
    assert resp.json()["text"].strip()
    verbose = post(server, TRANSCRIPTIONS,
                   {"response_format": "verbose_json", "timestamp_granularities[]": "segment"},
                   ("clip.wav", wav_bytes, "audio/wav"))
    assert verbose.status_code == 200, verbose.text
    # verbose_json is a timestamped decode (its words may differ from json's notimestamps decode,
    # as in openai-whisper): its text is its segments' texts
    body = verbose.json()
    assert body["segments"] and body["text"].strip()
    from sglang_omni.serve.transcription_chunking import join_transcript_parts

    assert body["text"] == join_transcript_parts(s["text"] for s in body["segments"])
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
