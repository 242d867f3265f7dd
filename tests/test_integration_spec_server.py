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

N_CLIPS = 20  # + one > 30 s clip made by concatenation
FORMATS = ("json", "verbose_json", "srt")
# The other request options, each on the first N_OPTION_CLIPS clips: (endpoint, form).
OPTION_REQUESTS = {
    "text": ("transcriptions", {"response_format": "text"}),
    "vtt": ("transcriptions", {"response_format": "vtt"}),
    "language": ("transcriptions", {"response_format": "json", "language": "en"}),
    "prompt": ("transcriptions", {"response_format": "json",
                                  "prompt": "Botchan, Red Shirt, Porcupine and the Madonna."}),
    "translation": ("translations", {"response_format": "json"}),
    "translation-text": ("translations", {"response_format": "text"}),
}
N_OPTION_CLIPS = 4
FINISH_LINE = re.compile(r"whisper-flash (\S+): proposed=(\d+) accepted=(\d+) \(\d+%\) target_calls=(\d+) "
                         r"kv_free=(\d+)(?: ids=\[([\d, ]*)\])?")


@pytest.fixture(scope="module")
def clips(test_clips, tmp_path_factory):
    """20 clips spread over synthetic voices and real lines, plus one > 30 s concatenation."""
    import numpy as np
    import soundfile as sf

    synthetic = [c for c in test_clips if not c.voice.startswith("librivox")]
    real = [c for c in test_clips if c.voice.startswith("librivox")]
    picked = synthetic[:: max(1, len(synthetic) // 12)][:12] + real[:8]
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
    return [*picked, long_clip]


def transcribe(server, clip, endpoint="transcriptions", **form):
    with open(clip.audio, "rb") as fh:
        return requests.post(f"{server.url}/v1/audio/{endpoint}", data={"model": "whisper", **form},
                             files={"file": (clip.audio.name, fh, "audio/wav")}, timeout=600)


def body_of(resp, fmt):
    assert resp.status_code == 200, resp.text[:500]
    return resp.json() if fmt.endswith("json") else resp.text


def answer(resp, fmt):
    """(status, body): srt of a chunked (> 30 s) clip is a 400 in sglang-omni, the same for both servers."""
    return resp.status_code, (resp.json() if fmt.endswith("json") or resp.status_code != 200 else resp.text)


def all_formats(server, clips) -> dict[str, dict[str, object]]:
    """Every clip in every format, 4 requests at a time (json first: it fills the encoder cache),
    then the other request options on the first clips."""
    out = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        for fmt in FORMATS:
            answers = pool.map(lambda c: answer(transcribe(server, c, response_format=fmt), fmt), clips)
            out[fmt] = dict(zip((c.id for c in clips), answers))
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
    srv = started_server(ServeOptions(dtype="float32", model=str(base_model_dir), port=free_port(), log_file=log))
    try:
        return all_formats(srv, clips)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def spec_server(base_model_dir, plain_results, tmp_path_factory):
    """Starts after the plain server is gone (plain_results), so the two never share the cores."""
    log = tmp_path_factory.mktemp("spec") / "sgl-omni.log"
    srv = started_server(ServeOptions(dtype="float32", model=str(base_model_dir), port=free_port(), log_file=log,
                             extra_args=("--asr.speculative", "whisper-flash")))
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
    assert sum(status == 200 for status, _ in spec_results[fmt].values()) >= N_CLIPS
    different = [c.id for c in clips if spec_results[fmt][c.id] != plain_results[fmt][c.id]]
    assert not different, {cid: (plain_results[fmt][cid], spec_results[fmt][cid]) for cid in different[:3]}


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
                         extra_args=("--asr.speculative", "whisper-flash", "--asr.speculative_tree_nodes", "0")))
    yield srv
    srv.stop()


def test_chain_worker_is_identical_to_plain_and_the_tree_needs_fewer_target_calls(
        chain_server, spec_server, plain_results, clips):
    """Every clip through the chain worker (json, 4 at a time): the same bodies as the plain server.
    The default (tree) server decoded the same json requests first: its target calls per generated
    token are fewer, as trees verify several continuations in each pass."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = dict(zip((c.id for c in clips),
                           pool.map(lambda c: answer(transcribe(chain_server, c, response_format="json"), "json"),
                                    clips)))
    different = [cid for cid, got in answers.items() if got != plain_results["json"][cid]]
    assert not different, {cid: (plain_results["json"][cid], answers[cid]) for cid in different[:3]}

    def calls_per_token(server):
        lines = [line for line in finish_lines(server) if line[5]][: len(clips)]  # the json pass came first
        assert len(lines) == len(clips)
        return sum(line[3] for line in lines) / sum(len(line[5]) for line in lines)

    assert calls_per_token(spec_server) < calls_per_token(chain_server)
