"""Shared fixtures: the embedded models and the test audio, built once into the user cache."""

from __future__ import annotations

import ctypes
import gc
import socket
import sys
from pathlib import Path

import pytest

from sglang_omni_flash.paths import audio_dir


@pytest.fixture(scope="session")
def base_model_dir() -> Path:
    from sglang_omni_flash.models.embedded import resolve_model

    return resolve_model("base")


@pytest.fixture(scope="session")
def tiny_en_model_dir() -> Path:
    from sglang_omni_flash.models.embedded import resolve_model

    return resolve_model("tiny.en")


@pytest.fixture(scope="session")
def test_set_paths():
    """Manifests of the default test set: synthetic voices + real LibriVox lines."""
    from sglang_omni_flash.corpus.synth import build_test_set

    return build_test_set(audio_dir(), progress=False)


@pytest.fixture(scope="session")
def test_clips(test_set_paths):
    """Every clip of the test set (synthetic and real), as manifest Utterances."""
    from sglang_omni_flash.corpus.manifest import read_manifest

    return read_manifest(test_set_paths.combined)


@pytest.fixture(scope="module", autouse=True)
def return_freed_memory():
    """After each module (its own fixtures are gone by then): hand the memory its engines freed back
    to the system. glibc keeps freed heap pages in the process: after the exactness module the test
    process held 9.8 GB, 1.2 GB once trimmed; left there, it starved the servers of later modules
    (three of them and this process exhausted a 24 GB machine, and CI timed out)."""
    yield
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


def torch_threads(n: int):
    """A module-scoped autouse fixture that runs the module's tests on n torch threads."""

    @pytest.fixture(scope="module", autouse=True)
    def threads():
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(n)
        yield
        torch.set_num_threads(before)

    return threads


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_en_plain_server(tiny_en_model_dir, tmp_path_factory):
    """A plain tiny.en fp32 server (the stock options) for a module that only reads from it
    (english-only prompts, the OpenAI error envelope). One per module, not one per session: a
    session server stays up beside every later module's servers (a 24 GB machine ran out of
    memory with three servers and the test process up)."""
    from sglang_omni_flash.serving.launch import ServeOptions

    log = tmp_path_factory.mktemp("tiny-en-plain") / "sgl-omni.log"
    srv = started_server(ServeOptions(dtype="float32", model=str(tiny_en_model_dir), port=free_port(), log_file=log))
    yield srv
    srv.stop()


def started_server(options):
    """A started, healthy `Server` (stop it when done); if it fails to start, the tail of its log
    is printed (pytest shows it with the failure) and the error re-raised."""
    from sglang_omni_flash.serving.launch import Server

    srv = Server(options)
    try:
        srv.__enter__()  # start, wait until healthy, stop again on failure
    except Exception:
        if options.log_file is not None and options.log_file.is_file():
            print(options.log_file.read_text(errors="replace")[-5000:])
        raise
    return srv


def transformers_transcripts(model_dir: Path, clips, **generate_kwargs) -> dict[str, str]:
    """transformers `generate()` text per clip id (fp32, SDPA, greedy): the servers' reference."""
    import soundfile as sf
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    texts = {}
    with torch.inference_mode():
        for clip in clips:
            audio, sr = sf.read(clip.audio, dtype="float32")
            assert sr == 16000, clip.audio
            features = processor(audio, sampling_rate=sr, return_tensors="pt").input_features
            ids = model.generate(features, max_new_tokens=440, **generate_kwargs)
            texts[clip.id] = processor.batch_decode(ids, skip_special_tokens=True)[0].strip()
    return texts
