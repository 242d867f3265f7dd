"""`--asr.speculative whisper-flash` on the real `sgl-omni serve` (CPU, converted base model).

One plain server and one speculative server (the shipped trained drafter for base, found with
no flag: it proposes, the target accepts some candidates and rejects the rest, so every code
path of a step runs -- propose, verify, accept, free the rejected slots, fall back) answer the
same clips; the output must be identical. (An untrained drafter, which the target rejects almost
always, gave 63/63 identical bodies here too; the engine tests cover garbage proposers.) The servers
are module-scoped and run one after the other.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import free_port, started_server
from sglang_omni_flash.serving.launch import ServeOptions

pytestmark = pytest.mark.server

N_CLIPS = 14  # + one > 30 s clip made by concatenation + the 53 s LibriVox reading
FORMATS = ("json", "verbose_json", "srt", "vtt")
TIMESTAMPED = ("verbose_json", "srt", "vtt")
# srt and vtt render verbose_json's segments (tests/test_segments.py): every clip is decoded with
# timestamps in verbose_json, and the subtitle formats take the first N_SUBTITLE_CLIPS and both long files
SUBTITLES = ("srt", "vtt")
N_SUBTITLE_CLIPS = 6
# The other request options, each on the first N_OPTION_CLIPS clips: (endpoint, form).
OPTION_REQUESTS = {
    "text": ("transcriptions", {"response_format": "text"}),
    "language": ("transcriptions", {"response_format": "json", "language": "en"}),
    "prompt": ("transcriptions", {"response_format": "json",
                                  "prompt": "Botchan, Red Shirt, Porcupine and the Madonna."}),
    "translation": ("translations", {"response_format": "json"}),
    "translation-text": ("translations", {"response_format": "text"}),
    "translation-srt": ("translations", {"response_format": "srt"}),
}
N_OPTION_CLIPS = 4
NO_PACER = ("--asr.speculative_pace", "false")  # see spec_server
# Temperature fallback's retries are draws: two servers agree on them in distribution, not draw by
# draw, and some of these windows are unsure enough to retry (a 3 s sonnet line in timestamp mode).
# The servers here compare greedy decodes; the verdicts are still scored and served. Fallback
# itself: tests/test_integration_fallback.py.
NO_FALLBACK = ("--asr.temperature_fallback", "false")
FINISH_LINE = re.compile(r"whisper-flash (\S+): proposed=(\d+) accepted=(\d+) \(\d+%\) target_calls=(\d+) "
                         r"kv_free=(\d+)(?: ids=\[([\d, ]*)\])?")


@pytest.fixture(scope="module")
def clips(test_clips, tmp_path_factory):
    """14 clips spread over synthetic voices and real lines, one > 30 s concatenation and the
    whole 53 s LibriVox reading the real lines were cut from (two chunks)."""
    import numpy as np
    import soundfile as sf

    synthetic = [c for c in test_clips if not c.voice.startswith("librivox")]
    real = [c for c in test_clips if c.voice.startswith("librivox")]
    picked = synthetic[:: max(1, len(synthetic) // 8)][:8] + real[:6]
    assert len(picked) == N_CLIPS
    parts, total = [], 0.0
    for clip in sorted(real, key=lambda c: -c.duration):
        audio, sr = sf.read(clip.audio, dtype="float32")
        parts += [audio, np.zeros(sr // 2, dtype="float32")]
        total += len(audio) / sr + 0.5
        if total > 34:
            break
    long_wav = tmp_path_factory.mktemp("long") / "long.wav"
    sf.write(long_wav, np.concatenate(parts), sr)
    assert total > 30
    long_clip = type("Clip", (), {"id": "long-concat", "audio": long_wav, "duration": total})()
    return [*picked, long_clip, reading_clip()]


def reading_clip():
    from sglang_omni_flash.corpus.sources import LIBRIVOX_AUDIO, sdist_member
    from sglang_omni_flash.paths import audio_dir

    import soundfile as sf

    path = sdist_member(LIBRIVOX_AUDIO, audio_dir() / "sources")
    return type("Clip", (), {"id": "reading-53s", "audio": path, "duration": sf.info(str(path)).duration})()


def transcribe(server, clip, endpoint="transcriptions", **form):
    with open(clip.audio, "rb") as fh:
        return requests.post(f"{server.url}/v1/audio/{endpoint}", data={"model": "whisper", **form},
                             files={"file": (clip.audio.name, fh, "audio/wav")}, timeout=600)


def body_of(resp, fmt):
    assert resp.status_code == 200, resp.text[:500]
    return resp.json() if fmt.endswith("json") else resp.text


def answer(resp, fmt):
    """(status, body); a 4xx is compared too."""
    return resp.status_code, (resp.json() if fmt.endswith("json") or resp.status_code != 200 else resp.text)


def clips_in(fmt: str, clips) -> list:
    """The clips each format is requested for (see SUBTITLES)."""
    return [*clips[:N_SUBTITLE_CLIPS], *clips[N_CLIPS:]] if fmt in SUBTITLES else clips


def all_formats(server, clips) -> dict[str, dict[str, object]]:
    """Every clip in every format, 4 requests at a time (json first: it fills the encoder cache),
    then the other request options on the first clips."""
    out = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        for fmt in FORMATS:
            some = clips_in(fmt, clips)
            answers = pool.map(lambda c: answer(transcribe(server, c, response_format=fmt), fmt), some)
            out[fmt] = dict(zip((c.id for c in some), answers))
        for name, (endpoint, form) in OPTION_REQUESTS.items():
            fmt = form.get("response_format", "json")
            answers = pool.map(lambda c: answer(transcribe(server, c, endpoint=endpoint, **form), fmt),
                               clips[:N_OPTION_CLIPS])
            out[name] = dict(zip((c.id for c in clips), answers))
    assert all(status == 200 for status, _ in out["json"].values()), out["json"]
    return out


@pytest.fixture(scope="module")
def plain_results(base_model_dir, clips, tmp_path_factory):
    log = tmp_path_factory.mktemp("plain") / "sgl-omni.log"
    srv = started_server(ServeOptions(dtype="float32", model=str(base_model_dir), port=free_port(), log_file=log,
                                      extra_args=NO_FALLBACK))
    try:
        return all_formats(srv, clips)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def spec_server(base_model_dir, plain_results, tmp_path_factory):
    """Starts after the plain server is gone (plain_results), so the two never share the cores.

    The pacer is off here and in the chain server: this module checks that every speculative path
    of the worker (trees, chains, timestamp rows) is exact and accepted, and with the pacer on how
    many steps speculate depends on this CPU's timings (on a CPU where fp32 rounds at batch 4 do
    not pay, it rightly steps aside, and a tree-vs-chain count or a "timestamped traffic
    speculated" check measures the pacer instead). The pacer itself: tests/test_pacing.py."""
    log = tmp_path_factory.mktemp("spec") / "sgl-omni.log"
    srv = started_server(ServeOptions(dtype="float32", model=str(base_model_dir), port=free_port(), log_file=log,
                             extra_args=("--asr.speculative", "whisper-flash", *NO_PACER, *NO_FALLBACK)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec_results(spec_server, clips):
    return all_formats(spec_server, clips)


def finish_lines(server) -> list[tuple]:
    """(rid, proposed, accepted, target_calls, kv_free, ids) of every finished/aborted request so far."""
    text = server.options.log_file.read_text(errors="replace")
    out = []
    for m in FINISH_LINE.finditer(" ".join(text.split())):  # rich may wrap long lines
        ids = None if m.group(6) is None else [int(t) for t in m.group(6).replace(" ", "").split(",") if t]
        out.append((m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)), ids))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_speculative_output_is_identical_to_plain(plain_results, spec_results, clips, fmt):
    """Every byte, the verbose_json window scores (avg_logprob, no_speech_prob) included: the verify
    rows have the bits of plain steps, and a round adds its tokens' scores one at a time as steps do."""
    some = clips_in(fmt, clips)
    assert sum(status == 200 for status, _ in spec_results[fmt].values()) >= len(some) - 2
    different = [c.id for c in some if spec_results[fmt][c.id] != plain_results[fmt][c.id]]
    assert not different, {cid: (plain_results[fmt][cid], spec_results[fmt][cid]) for cid in different[:3]}


def test_window_scores_are_the_engines(spec_server, plain_results, spec_results, clips, base_model_dir):
    """verbose_json's avg_logprob and no_speech_prob (scored by the plain worker and, token by token
    from its verify rows, by the speculative one) equal the engine's greedy decode of the same
    window; with fallback off every window is judged and counted, none retried."""
    import soundfile as sf

    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.flash.fallback import average_logprob
    from sglang_omni_flash.engine.options import EngineOptions

    engine = WhisperFlashEngine(EngineOptions(model=str(base_model_dir), dtype="float32", speculative=False,
                                              timestamps=True))
    short = [c for c in clips[:N_CLIPS] if c.duration < 29][:6]
    for clip in short:
        result = engine.transcribe([sf.read(clip.audio, dtype="float32")[0]])[0]
        want = [average_logprob(result.sum_logprob, len(result.tokens)), result.no_speech_prob]
        for results in (plain_results, spec_results):
            segments = results["verbose_json"][clip.id][1]["segments"]
            assert segments, clip.id
            for seg in segments:
                assert [seg["avg_logprob"], seg["no_speech_prob"]] == pytest.approx(want, abs=2e-3), clip.id
    fallback = requests.get(f"{spec_server.url}/whisper-flash/stats", timeout=30).json()["fallback"]
    assert fallback["windows"] >= 4 * N_CLIPS and fallback["retries"] == 0, {k: v for k, v in fallback.items()
                                                                               if k != "recent"}


@pytest.mark.parametrize("option", sorted(OPTION_REQUESTS))
def test_request_options_are_identical_to_plain(plain_results, spec_results, clips, option):
    """text / vtt formats, language, prompt and /v1/audio/translations under speculation."""
    for clip in clips[:N_OPTION_CLIPS]:
        status, body = spec_results[option][clip.id]
        assert status == 200, (option, clip.id, body)
        assert (status, body) == plain_results[option][clip.id], (option, clip.id)
    assert any(str(body).strip() for _, body in spec_results[option].values())


def test_long_audio_goes_through_chunking_identically(plain_results, spec_results):
    text = spec_results["json"]["long-concat"][1]["text"]
    assert len(text.split()) > 40, text
    assert text == plain_results["json"]["long-concat"][1]["text"]


def test_speculative_server_really_speculates_and_keeps_token_ids(spec_server, spec_results, base_model_dir):
    """Every request was decoded by the worker (drafts proposed); its ids decode to the served text."""
    from transformers import WhisperTokenizer

    tokenizer = WhisperTokenizer.from_pretrained(base_model_dir)
    lines = [line for line in finish_lines(spec_server) if line[5] is not None]
    assert len(lines) >= 3 * N_CLIPS
    assert sum(line[1] for line in lines) > 0  # candidates were proposed and verified
    assert sum(line[2] for line in lines) > 0  # ... and some accepted: the accept / commit path ran
    texts = {json.dumps(body["text"]) for _, body in spec_results["json"].values()}
    decoded = {json.dumps(tokenizer.decode(line[5], skip_special_tokens=True).strip()) for line in lines}
    short = {t for t in texts if "long" not in t}
    assert short & decoded  # the logged ids are the transcripts' ids


def test_token_ids_equal_transformers_greedy(spec_server, spec_results, clips, base_model_dir):
    """The worker's token ids for the first clips equal transformers generate() (greedy, fp32)."""
    import soundfile as sf
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(base_model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(base_model_dir, torch_dtype=torch.float32).eval()
    logged = {}
    for line in finish_lines(spec_server):
        if line[5] is not None:
            logged.setdefault(processor.tokenizer.decode(line[5], skip_special_tokens=True).strip(), line[5])
    for clip in clips[:4]:
        audio, sr = sf.read(clip.audio, dtype="float32")
        features = processor(audio, sampling_rate=sr, return_tensors="pt").input_features
        with torch.inference_mode():
            ref = model.generate(features, max_new_tokens=440, language="en", task="transcribe")[0].tolist()
        text = spec_results["json"][clip.id][1]["text"]
        assert text in logged, text
        eos = processor.tokenizer.eos_token_id
        ids = [t for t in logged[text] if t != eos]  # sglang keeps the EOS in output_ids
        ref = [t for t in ref if t != eos]
        assert ref[-len(ids):] == ids, (clip.id, ref, ids)


def test_eight_concurrent_requests_equal_sequential(spec_server, spec_results, clips):
    batch = clips[:8]
    sequential = [body_of(transcribe(spec_server, c, response_format="json"), "json") for c in batch]
    with ThreadPoolExecutor(max_workers=8) as pool:
        bodies = list(pool.map(lambda c: body_of(transcribe(spec_server, c, response_format="json"), "json"), batch))
    for clip, one, body in zip(batch, sequential, bodies):
        assert body["text"] == one["text"] == spec_results["json"][clip.id][1]["text"], clip.id


def stream_deltas(server, clip, stop_after: int | None = None):
    with open(clip.audio, "rb") as fh:
        resp = requests.post(f"{server.url}/v1/audio/transcriptions", data={"model": "whisper", "stream": "true"},
                             files={"file": (clip.audio.name, fh, "audio/wav")}, stream=True, timeout=600)
    assert resp.status_code == 200
    deltas, done = [], None
    try:
        for line in resp.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if event["type"] == "transcript.text.delta":
                deltas.append(event["delta"])
                if stop_after is not None and len(deltas) >= stop_after:
                    break
            elif event["type"] == "transcript.text.done":
                done = event["text"]
    finally:
        resp.close()
    return deltas, done


def test_streamed_deltas_concatenate_to_the_final_text(spec_server, spec_results, clips):
    clip = max(clips[:N_CLIPS], key=lambda c: c.duration)
    deltas, done = stream_deltas(spec_server, clip)
    assert done is not None
    assert "".join(deltas).strip() == done.strip() == spec_results["json"][clip.id][1]["text"].strip()
    assert len(deltas) > 1


def test_aborted_stream_returns_the_kv_pool_to_baseline(spec_server, spec_results, clips):
    """The free count logged when a request finishes (its own slots are still in sglang's free
    group then) is the same for the same clip before and after an aborted stream."""
    def alone():
        body = body_of(transcribe(spec_server, clips[0], response_format="json"), "json")
        assert body["text"] == spec_results["json"][clips[0].id][1]["text"]
        return finish_lines(spec_server)[-1][4]

    baseline = alone()
    clip = max(clips[:N_CLIPS], key=lambda c: c.duration)
    deltas, done = stream_deltas(spec_server, clip, stop_after=1)  # then hang up mid-decode
    assert deltas and done is None
    time.sleep(3)
    assert alone() == baseline


def test_temperature_sampling_goes_through_the_rejection_rule(spec_server, clips):
    """T > 0: candidates are drafted and tested by speculative_sample; the request completes normally."""
    before = len(finish_lines(spec_server))
    body = body_of(transcribe(spec_server, clips[1], response_format="json", temperature="0.4"), "json")
    assert body["text"].strip()
    new = finish_lines(spec_server)[before:]
    assert any(line[5] for line in new)  # finished with ids
    assert sum(line[1] for line in new) > 0  # drafts were proposed under sampling


def test_acceptance_metrics_are_exported_by_the_stage(spec_server, spec_results):
    """GET /whisper-flash/metrics (Prometheus) and /whisper-flash/stats (JSON), served by the ASR
    stage's own process through sglang-omni's stage routes, agree with the worker's log lines."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = requests.get(f"{spec_server.url}/whisper-flash/metrics", timeout=30)
    assert resp.status_code == 200, resp.text[:500]
    assert resp.headers["content-type"].startswith("text/plain")
    samples = {s.name: s.value for family in text_string_to_metric_families(resp.text)
               for s in family.samples if not s.labels}
    stats = requests.get(f"{spec_server.url}/whisper-flash/stats", timeout=30).json()
    totals = stats["totals"]
    lines = finish_lines(spec_server)
    left = [line for line in lines if line[5] is not None]
    assert totals["requests"] >= len(left) >= 3 * N_CLIPS
    assert samples["whisper_flash_requests_total"] == totals["requests"]
    assert samples["whisper_flash_accepted_tokens_total"] == totals["accepted_tokens"] > 0
    assert samples["whisper_flash_proposed_tokens_total"] == totals["proposed_tokens"] >= totals["accepted_tokens"]
    assert samples["whisper_flash_num_draft_tokens"] == 8
    assert totals["output_tokens"] >= sum(len(line[5]) for line in left)
    by_rid = {line[0]: line for line in left}
    recent = [r for r in stats["recent"] if r["rid"] in by_rid]
    assert recent
    for r in recent:  # the exported per-request figures are the logged ones
        rid, proposed, accepted, calls, _, ids = by_rid[r["rid"]]
        assert (r["proposed"], r["accepted"], r["target_calls"], r["output_tokens"]) == (
            proposed, accepted, calls, len(ids))
    assert 0 < stats["recent_tokens_per_target_call"] < 9


@pytest.fixture(scope="module")
def chain_server(base_model_dir, spec_results, tmp_path_factory):
    """The worker with draft trees off (`--asr.speculative_tree_nodes 0`: the paper's chain of
    candidates, cut where the drafter doubts); starts after the speculative clips are done."""
    log = tmp_path_factory.mktemp("chain") / "sgl-omni.log"
    srv = started_server(ServeOptions(dtype="float32", model=str(base_model_dir), port=free_port(), log_file=log,
                         extra_args=("--asr.speculative", "whisper-flash", "--asr.speculative_tree_nodes", "0", *NO_PACER,
                                         *NO_FALLBACK)))
    yield srv
    srv.stop()


def test_chain_worker_is_identical_to_plain_and_the_tree_needs_fewer_target_calls(
        chain_server, spec_server, plain_results, clips):
    """Every clip through the chain worker (json, 4 at a time): the same bodies as the plain server.
    Then a few clips one at a time to both workers: the default (tree) worker makes fewer target
    calls per generated token, as trees verify several continuations in each pass. (One at a time:
    a busier batch prunes its trees to the likeliest nodes, flash.pacing.batch_min_path_prob, and at
    4 requests a tree is about a chain.)"""
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = dict(zip((c.id for c in clips),
                           pool.map(lambda c: answer(transcribe(chain_server, c, response_format="json"), "json"),
                                    clips)))
    different = [cid for cid, got in answers.items() if got != plain_results["json"][cid]]
    assert not different, {cid: (plain_results["json"][cid], answers[cid]) for cid in different[:3]}

    alone = clips[:5]

    def calls_per_token(server):
        for clip in alone:
            body_of(transcribe(server, clip, response_format="json"), "json")
        lines = [line for line in finish_lines(server) if line[5]][-len(alone):]  # these requests finished last
        assert len(lines) == len(alone)
        return sum(line[3] for line in lines) / sum(len(line[5]) for line in lines)

    assert calls_per_token(spec_server) < calls_per_token(chain_server)


# ------------------------------------------------------------------ timestamps and the OpenAI client

def cue_times(body: str) -> list[tuple[float, float]]:
    """(start, end) of every srt / vtt cue."""
    def seconds(stamp: str) -> float:
        parts = stamp.strip().replace(",", ".").split(":")
        return sum(float(p) * 60 ** i for i, p in enumerate(reversed(parts)))

    return [tuple(seconds(t) for t in line.split(" --> ")) for line in body.splitlines() if " --> " in line]


def timeline(fmt: str, body) -> list[tuple[float, float]]:
    return [(s["start"], s["end"]) for s in body["segments"]] if fmt == "verbose_json" else cue_times(body)


@pytest.mark.parametrize("fmt", TIMESTAMPED)
def test_timestamped_answers_are_monotonic_and_cover_the_audio(plain_results, spec_results, clips, fmt):
    """srt, vtt and verbose_json of every clip (the 53 s reading and the > 30 s concatenation
    included) are 200, their cues never go back in time, stay inside the audio and cover it."""
    for results in (plain_results, spec_results):
        for clip in clips_in(fmt, clips):
            status, body = results[fmt][clip.id]
            assert status == 200, (fmt, clip.id, body)
            times = timeline(fmt, body)
            assert times, (fmt, clip.id, body)
            assert all(0 <= start <= end <= clip.duration + 0.01 for start, end in times), (clip.id, times)
            assert all(a[1] <= b[0] + 1e-6 for a, b in zip(times, times[1:])), (clip.id, times)
            covered = sum(end - start for start, end in times)
            assert times[0][0] <= 1.5 and covered >= 0.6 * clip.duration, (clip.id, clip.duration, times)
    reading = timeline(fmt, spec_results[fmt]["reading-53s"][1])
    # no sentence dropped: a window that stopped early was decoded again from its last timestamp
    assert max(b[0] - a[1] for a, b in zip(reading, reading[1:])) < 3.0, reading
    assert reading[-1][1] > 48.0, reading


def test_verbose_json_text_is_its_segments_and_the_subtitles_show_them(spec_results, clips):
    from sglang_omni.serve.transcription_chunking import join_transcript_parts

    for clip in clips:
        body = spec_results["verbose_json"][clip.id][1]
        segments = body["segments"]
        assert body["text"] == join_transcript_parts(s["text"] for s in segments)
        assert [s["id"] for s in segments] == list(range(len(segments)))
        assert body["task"] == "transcribe" and abs(body["duration"] - clip.duration) < 0.01
        for s in segments:  # OpenAI's segment fields
            assert {"seek", "tokens", "temperature", "compression_ratio"} <= set(s), s
            assert s["tokens"] and s["temperature"] == 0.0
        if clip.id not in spec_results["srt"]:
            continue
        srt_cues = [block.split("\n", 2)[2].strip() for block in spec_results["srt"][clip.id][1].strip().split("\n\n")]
        assert srt_cues == [s["text"] for s in segments]
        assert cue_times(spec_results["srt"][clip.id][1]) == cue_times(spec_results["vtt"][clip.id][1]) == [
            (round(s["start"], 3), round(s["end"], 3)) for s in segments]


def test_long_segments_are_the_engines_decode_of_each_chunk_offset_by_its_start(spec_results, clips, base_model_dir):
    """The 53 s reading: sglang-omni's chunk plan of the upload, each chunk (and each tail decoded
    again after an early stop) decoded by the standalone engine with timestamps; its segments
    shifted by the chunk's start are the server's, text and times."""
    import numpy as np
    from sglang_omni.models.whisper_asr.request_builders import render_timestamped_text
    from sglang_omni.serve.transcription_chunking import plan_audio_chunks

    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.engine.options import EngineOptions
    from sglang_omni_flash.integration.serve.config import WhisperFlashASRPipelineConfig
    from sglang_omni_flash.integration.routes.segments import verbose_segments
    from sglang_omni_flash.integration.routes.transcriptions import MAX_RESUMES, Piece, resume_at

    clip = next(c for c in clips if c.id == "reading-53s")
    chunking = WhisperFlashASRPipelineConfig(model_path=str(base_model_dir)).resolved_audio_chunking
    plan = plan_audio_chunks(clip.audio.read_bytes(), chunking)
    assert plan is not None and len(plan.spans) >= 2
    engine = WhisperFlashEngine(EngineOptions(model=str(base_model_dir), dtype="float32", speculative=False,
                                              timestamps=True, language="en"))
    tokenizer = engine.tokenizer
    begin = tokenizer.convert_tokens_to_ids("<|notimestamps|>") + 1

    def decode(start: int, end: int) -> Piece:
        tokens = engine.transcribe([np.ascontiguousarray(plan.waveform[start:end])])[0].tokens
        text = render_timestamped_text(tokenizer, [t for t in tokens if t != tokenizer.eos_token_id],
                                       timestamp_begin_id=begin)
        return Piece(start / 16000, (end - start) / 16000, text, start, end)

    pieces = [decode(s.start_sample, s.end_sample) for s in plan.spans]
    for _ in range(MAX_RESUMES):
        resumed = False
        for i, piece in enumerate(list(pieces)):
            at = resume_at(piece, plan.waveform)
            if at is not None:
                resumed = True
                pieces[i] = Piece(piece.start_s, (at - piece.start_sample) / 16000, piece.rendered,
                                  piece.start_sample, at)
                pieces.append(decode(at, piece.end_sample))
        pieces.sort(key=lambda p: p.start_sample)
        if not resumed:
            break
    expected = verbose_segments([(p.start_s, p.duration_s, p.rendered, None) for p in pieces], temperature=0.0)
    served = spec_results["verbose_json"][clip.id][1]["segments"]
    assert [(s["text"], s["start"], s["end"], s["seek"]) for s in served] == [
        (s["text"], s["start"], s["end"], s["seek"]) for s in expected]
    assert any(s["start"] >= plan.spans[1].start_s for s in served)  # the second chunk's segments are offset


def flash_totals(server) -> dict:
    return requests.get(f"{server.url}/whisper-flash/stats", timeout=30).json()["totals"]


def test_timestamp_only_traffic_speculates(spec_server, spec_results, clips):
    """srt requests alone: the worker drafts and verifies under the timestamp rules (stats move),
    and the drafter's candidates are accepted there too; the answers are the same as before."""
    before = flash_totals(spec_server)
    for clip in clips[:N_SUBTITLE_CLIPS]:
        assert answer(transcribe(spec_server, clip, response_format="srt"), "srt") == spec_results["srt"][clip.id]
    after = flash_totals(spec_server)
    assert after["speculative_steps"] > before["speculative_steps"]
    assert after["proposed_tokens"] > before["proposed_tokens"]
    assert after["accepted_tokens"] > before["accepted_tokens"]


def test_the_official_openai_client_on_both_routes(spec_server, spec_results, clips):
    """openai 2.x as a user runs it, model="whisper-1": every format on /v1/audio/transcriptions
    (stream too) and /v1/audio/translations on a short clip; the 53 s reading (two windows) in the
    json, timestamped and subtitle shapes of each route. The answers are the ones the same server
    gave to plain multipart requests."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    short = clips[0]
    reading = next(c for c in clips if c.id == "reading-53s")
    every = ("json", "text", "verbose_json", "srt", "vtt")
    for clip, transcription_formats, translation_formats in ((short, every, every),
                                                             (reading, ("json", "verbose_json", "srt"), ("json", "srt"))):
        for fmt in transcription_formats:
            with open(clip.audio, "rb") as fh:
                got = client.audio.transcriptions.create(model="whisper-1", file=fh, response_format=fmt)
            if fmt in ("srt", "vtt", "text"):
                expected = transcribe(spec_server, clip, response_format="text").text if fmt == "text" else \
                    spec_results[fmt][clip.id][1]
                assert got.strip() == expected.strip(), (clip.id, fmt)
            elif fmt == "json":
                assert got.text == spec_results["json"][clip.id][1]["text"]
            else:
                assert got.text == spec_results["verbose_json"][clip.id][1]["text"]
                assert [(s.start, s.end, s.text) for s in got.segments] == [
                    (s["start"], s["end"], s["text"]) for s in spec_results["verbose_json"][clip.id][1]["segments"]]
        for fmt in translation_formats:
            with open(clip.audio, "rb") as fh:
                got = client.audio.translations.create(model="whisper-1", file=fh, response_format=fmt)
            text = got if isinstance(got, str) else got.text
            assert text.strip(), (clip.id, fmt)
            if fmt in ("srt", "vtt"):
                times = cue_times(got)
                assert times and all(a[1] <= b[0] + 1e-6 for a, b in zip(times, times[1:])), (clip.id, fmt)
                assert times[-1][1] <= clip.duration + 0.01
            if fmt == "verbose_json":
                assert got.task == "translate" and got.segments
    with open(short.audio, "rb") as fh:
        events = list(client.audio.transcriptions.create(model="whisper-1", file=fh, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    done = [e.text for e in events if e.type == "transcript.text.done"]
    assert done and deltas.strip() == done[0].strip() == spec_results["json"][short.id][1]["text"].strip()
