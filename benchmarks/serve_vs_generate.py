"""Plain CPU serving vs transformers generate(): audio seconds per second on the same clips.

    .venv/bin/python benchmarks/serve_vs_generate.py [--model base] [--manifest M] [--limit N] [--json OUT]

Both sides decode greedily in fp32 with the same English prompt. The server is started by
this script (127.0.0.1, a free port) and each clip is sent once at concurrency 1 after one
warm-up request on a clip outside the timed set: sglang-omni caches encoder outputs by
audio, so replaying a clip would time the cache, not the server. The machine's load is
logged next to the figures; compare the two numbers of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import requests
import soundfile as sf
import torch
from tqdm import tqdm

from sglang_omni_flash.corpus.manifest import read_manifest
from sglang_omni_flash.corpus.synth import build_test_set
from sglang_omni_flash.models.embedded import resolve_model
from sglang_omni_flash.paths import audio_dir
from sglang_omni_flash.serving.launch import Server, ServeOptions


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_generate(model_dir: Path, clips) -> tuple[float, dict[str, str]]:
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    texts = {}
    with torch.inference_mode():
        warm = sf.read(clips[0].audio, dtype="float32")[0]
        model.generate(processor(warm, sampling_rate=16000, return_tensors="pt").input_features,
                       language="en", task="transcribe")
        start = time.perf_counter()
        for clip in tqdm(clips, desc="transformers generate", file=sys.stderr):
            audio = sf.read(clip.audio, dtype="float32")[0]
            features = processor(audio, sampling_rate=16000, return_tensors="pt").input_features
            ids = model.generate(features, language="en", task="transcribe", max_new_tokens=440)
            texts[clip.id] = processor.batch_decode(ids, skip_special_tokens=True)[0].strip()
        elapsed = time.perf_counter() - start
    return elapsed, texts


def time_server(model: str, clips, warmup_clip, extra_args: tuple[str, ...]) -> tuple[float, dict[str, str], float]:
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_vs_generate-{os.getpid()}.log"
    server = Server(ServeOptions(model=model, port=free_port(), log_file=log, extra_args=extra_args))
    t0 = time.perf_counter()
    server.start()
    try:
        server.wait_ready()
        startup = time.perf_counter() - t0

        def post(clip):
            with open(clip.audio, "rb") as fh:
                resp = requests.post(f"{server.url}/v1/audio/transcriptions",
                                     data={"response_format": "json"},
                                     files={"file": (clip.audio.name, fh, "audio/wav")}, timeout=600)
            resp.raise_for_status()
            return resp.json()["text"].strip()

        post(warmup_clip)
        texts = {}
        start = time.perf_counter()
        for clip in tqdm(clips, desc="sgl-omni serve", file=sys.stderr):
            texts[clip.id] = post(clip)
        elapsed = time.perf_counter() - start
    finally:
        server.stop()
    return elapsed, texts, startup


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="base")
    parser.add_argument("--manifest", type=Path, default=None, help="default: the project test set")
    parser.add_argument("--limit", type=int, default=0, help="use the first N clips (0: all)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("sgl_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()

    manifest = args.manifest or build_test_set(audio_dir(), progress=True).combined
    clips = read_manifest(manifest)
    warmup, clips = clips[0], clips[1:]
    if args.limit:
        clips = clips[: args.limit]
    model_dir = resolve_model(args.model)
    audio_s = sum(c.duration for c in clips)
    load_before = os.getloadavg()[0]

    extra = tuple(a for a in args.sgl_args if a != "--")
    serve_s, serve_texts, startup = time_server(str(model_dir), clips, warmup, extra)
    gen_s, gen_texts = time_generate(model_dir, clips)
    same = sum(serve_texts[c.id] == gen_texts[c.id] for c in clips)
    result = {
        "model": str(model_dir), "clips": len(clips), "audio_s": round(audio_s, 2),
        "server_startup_s": round(startup, 1),
        "serve": {"seconds": round(serve_s, 2), "audio_s_per_s": round(audio_s / serve_s, 3),
                  "latency_mean_s": round(serve_s / len(clips), 3)},
        "generate": {"seconds": round(gen_s, 2), "audio_s_per_s": round(audio_s / gen_s, 3)},
        "serve_over_generate": round(gen_s / serve_s, 3),
        "identical_text": same, "torch_threads": torch.get_num_threads(),
        "loadavg_before": round(load_before, 2), "loadavg_after": round(os.getloadavg()[0], 2),
        "sgl_args": list(extra),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    from sglang_omni_flash.errors import run_command

    sys.exit(run_command(main, "serve_vs_generate.py"))
