"""Temperature fallback on the real `sgl-omni serve` (CPU, converted tiny.en), with the shipped
drafter and without speculation.

Each server runs with ``--asr.logprob_threshold 0``: every window is "unsure", so each climbs
openai-whisper's whole ladder (0.2 .. 1.0) (under speculation: through the worker's rejection rule), and
a window is silence as soon as its <|nospeech|> probability is above 0.6. Clean speech at the
default thresholds: no retry and transformers' greedy text (tests/test_serve_e2e.py), scores equal
to the engine's (tests/test_integration_spec_server.py).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import requests

from conftest import free_port, started_server
from sglang_omni_flash.flash.fallback import LADDER
from sglang_omni_flash.serving.launch import ServeOptions

pytestmark = pytest.mark.server


@pytest.fixture(scope="module", params=["flash", "plain"])
def server(request, tiny_en_model_dir, tmp_path_factory):
    """The speculative worker (retries through the rejection rule) and the plain one."""
    log = tmp_path_factory.mktemp(f"fallback-{request.param}") / "sgl-omni.log"
    srv = started_server(ServeOptions(dtype="float32", model=str(tiny_en_model_dir), port=free_port(), log_file=log,
                                      speculative="on" if request.param == "flash" else "off",
                                      extra_args=("--asr.logprob_threshold", "0")))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def clip(test_clips):
    return sorted((c for c in test_clips if c.duration > 5), key=lambda c: c.duration)[0]


def post(server, data: bytes, **form):
    resp = requests.post(f"{server.url}/v1/audio/transcriptions", data={"model": "whisper-1", **form},
                         files={"file": ("a.wav", data, "audio/wav")}, timeout=600)
    assert resp.status_code == 200, resp.text[:500]
    return resp


def fallback_stats(server) -> dict:
    return requests.get(f"{server.url}/whisper-flash/stats", timeout=30).json()["fallback"]


def proposed_tokens(server) -> int | None:
    totals = requests.get(f"{server.url}/whisper-flash/stats", timeout=30).json().get("totals")
    return None if totals is None else totals["proposed_tokens"]


def before_at(stats: dict) -> float:
    return max((w["at"] for w in stats["recent"]), default=0.0)


def noise_wav(seconds: float = 5.0) -> bytes:
    import soundfile as sf

    noise = (0.05 * np.random.default_rng(0).standard_normal(int(16000 * seconds))).astype("float32")
    buf = io.BytesIO()
    sf.write(buf, noise, 16000, format="WAV")
    return buf.getvalue()


def test_an_unsure_window_climbs_the_whole_ladder(server, clip):
    """verbose_json: the kept decode is the last rung's (temperature 1.0, OpenAI's segment fields
    filled); the stage counted one retry per rung for this window."""
    before, proposed = fallback_stats(server), proposed_tokens(server)
    body = post(server, clip.audio.read_bytes(), response_format="verbose_json").json()
    after = fallback_stats(server)
    if proposed is not None:  # the speculative worker drafted for these (sampled) decodes
        assert proposed_tokens(server) > proposed
    assert body["segments"] and body["text"].strip()
    for seg in body["segments"]:
        assert seg["temperature"] == LADDER[-1]
        assert seg["avg_logprob"] < 0 and 0 <= seg["no_speech_prob"] < 0.6 and seg["compression_ratio"] > 0
    # 1 window, or more where a decode stopped early and its tail was decoded again (a tail judged silence is not retried)
    windows = after["windows"] - before["windows"] - (after["silent_windows"] - before["silent_windows"])
    assert windows >= 1
    for temperature in LADDER:
        key = f"{temperature:.1f}"
        assert after["retries_by_temperature"].get(key, 0) - before["retries_by_temperature"].get(key, 0) == windows
    first = next(w for w in after["recent"] if w["attempt"] > 0 and w["at"] > before_at(before))
    ladder = [w for w in after["recent"] if w["rid"].startswith(first["rid"].rsplit("-fallback", 1)[0])]
    assert [w["temperature"] for w in ladder] == [0.0, *LADDER] and all(w["verdict"] == "retry" for w in ladder)


def test_json_and_text_fall_back_too_and_the_metrics_count_it(server, clip):
    before = fallback_stats(server)
    assert post(server, clip.audio.read_bytes(), response_format="json").json()["text"].strip()
    assert post(server, clip.audio.read_bytes(), response_format="text").text.strip()
    after = fallback_stats(server)
    assert after["retries"] == before["retries"] + 2 * len(LADDER)
    metrics = requests.get(f"{server.url}/whisper-flash/metrics", timeout=30).text
    assert 'whisper_flash_fallback_retries_total{temperature="1.0"}' in metrics


def test_an_explicit_temperature_is_kept_without_fallback(server, clip):
    before = fallback_stats(server)
    body = post(server, clip.audio.read_bytes(), response_format="verbose_json", temperature="0.4").json()
    assert body["segments"] and all(seg["temperature"] == 0.4 for seg in body["segments"])
    assert fallback_stats(server)["retries"] == before["retries"]


@pytest.mark.parametrize("fmt", ["json", "text", "verbose_json", "srt"])
def test_noise_is_silence_not_a_hallucination(server, fmt):
    """5 s of white noise (loud enough to pass the chunker's silence gate): Whisper's <|nospeech|>
    probability is high and it is unsure, so the window is silence: empty text, no segments."""
    before = fallback_stats(server)
    resp = post(server, noise_wav(), response_format=fmt)
    if fmt in ("json", "verbose_json"):
        body = resp.json()
        assert body["text"] == ""
        assert body.get("segments", []) == []
    else:
        assert resp.text.strip() == ""
    after = fallback_stats(server)
    assert after["silent_windows"] == before["silent_windows"] + 1 and after["retries"] == before["retries"]
