"""`whisper-flash transcribe` and `whisper-flash bench`: the contract later checks rely on."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile

from sglang_omni_flash.cli import main


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """`--threads` sets torch's process-wide thread count: restore it for the other tests."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def two_clips(test_clips):
    """Two short real clips (the LibriVox lines are the shortest)."""
    clips = sorted(test_clips, key=lambda c: c.duration)[:2]
    return [str(c.audio) for c in clips]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_transcribe_json_has_tokens_and_says_which_drafter(capsys, tiny_en_model_dir, two_clips):
    code, out, err = run(
        capsys, "transcribe", *two_clips, "--model", "tiny.en", "--batch-size", "2", "--json", "--quiet", "--threads", "1"
    )
    assert code == 0
    data = json.loads(out)
    assert data["mode"] == "whisper-flash"
    assert data["drafter"]  # shipped path or "untrained (initialised from the target)"
    assert len(data["results"]) == 2
    for item in data["results"]:
        assert item["tokens"][-1] == 50256  # tiny.en EOS
        assert item["text"].strip()
        # fallback is on by default; clean speech keeps its greedy attempt
        assert item["temperature"] == 0.0 and item["avg_logprob"] > -1.0 and 0 < item["compression_ratio"] < 2.4


def test_transcribe_greedy_and_flash_print_the_same_text(capsys, tiny_en_model_dir, two_clips):
    code, flash, err = run(capsys, "transcribe", *two_clips, "--model", "tiny.en", "--quiet", "--threads", "1")
    assert code == 0 and "drafter" in err
    code, greedy, _ = run(capsys, "transcribe", *two_clips, "--model", "tiny.en", "--greedy", "--quiet", "--threads", "1")
    assert code == 0
    assert flash == greedy
    assert len(flash.strip().splitlines()) == 2


def test_bench_writes_the_schema_and_outputs_match(capsys, tmp_path, tiny_en_model_dir, two_clips):
    out = tmp_path / "bench.json"
    code, table, err = run(
        capsys, "bench", "--model", "tiny.en", "--audio", *two_clips, "--batch-sizes", "1,2", "--repeats", "1",
        "--json", str(out), "--quiet", "--threads", "1",
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert {"model", "drafter", "device", "torch_threads", "results"} <= set(report)
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert {"batch_size", "greedy", "flash", "speedup", "identical", "total"} <= set(r)
        assert {"audio_s_per_s", "tok_per_s", "encoder_share"} <= set(r["greedy"])
        assert {"audio_s_per_s", "tok_per_s", "alpha", "tau", "first_accept", "encoder_share"} <= set(r["flash"])
        assert r["identical"] == r["total"] == 2
        assert r["speedup"] > 0
    assert "speedup" in table and "identical" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["transcribe", "/nonexistent/clip.wav"], "not found"),
        (["transcribe", "{bad}", "--model", "tiny.en"], "cannot read audio"),
        (["transcribe", "{good}", "--model", "no-such-model"], "unknown model"),
        (["transcribe", "{good}", "--batch-size", "0"], "batch size"),
        (["transcribe", "{good}", "--temperature", "-1"], "temperature"),
        (["bench", "--audio", "{good}", "--batch-sizes", "1,x", "--json", "{out}"], "batch-sizes"),
        (["bench", "--manifest", "/nonexistent/m.jsonl", "--json", "{out}"], "manifest"),
        (["train", "--teacher", "/nonexistent/t", "--out", "{out}", "--onpolicy", "1.5"], "--onpolicy"),
        (["train", "--teacher", "/nonexistent/t", "--out", "{out}"], "not a teacher extraction"),
    ],
    ids=["missing-file", "unreadable-audio", "unknown-model", "batch-size-0", "negative-temperature", "bad-batch-sizes",
         "missing-manifest", "onpolicy-out-of-range", "missing-teacher"],
)
def test_bad_input_is_one_line_error_exit_2(capsys, tmp_path, two_clips, argv, message):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00junk, not audio")
    subs = {"{bad}": str(bad), "{good}": two_clips[0], "{out}": str(tmp_path / "o.json")}
    code, out, err = run(capsys, *[subs.get(a, a) for a in argv])
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "error" in lines[0] and message in lines[0], err
    assert "Traceback" not in err


def test_resampled_stereo_input_transcribes(capsys, tmp_path, tiny_en_model_dir, two_clips):
    samples, rate = soundfile.read(two_clips[0], dtype="float32")
    from scipy.signal import resample_poly

    stereo = np.stack([resample_poly(samples, 441, 160)] * 2, axis=1)  # 44.1 kHz, 2 channels
    path = tmp_path / "stereo.wav"
    soundfile.write(str(path), stereo, 44100)
    code, out, _ = run(capsys, "transcribe", str(path), "--model", "tiny.en", "--greedy", "--quiet", "--threads", "1")
    assert code == 0 and out.strip()
