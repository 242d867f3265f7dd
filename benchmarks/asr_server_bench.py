"""Throughput, latency and accuracy of `/v1/audio/transcriptions` servers at several concurrencies.

    .venv/bin/python benchmarks/asr_server_bench.py                       # plain vs flash, base, all clips
    .venv/bin/python benchmarks/asr_server_bench.py --quick               # 6 clips, concurrency 1,2
    .venv/bin/python benchmarks/asr_server_bench.py --url plain=http://127.0.0.1:8000 \\
        --url flash=http://127.0.0.1:8001                                 # servers you started yourself

A benchmark_asr_seedtts-style client: for every concurrency level C and every server, each
repeat ("pass") sends every clip of a JSONL manifest once through C worker threads and
measures wall time and per-request latency. The first server is the baseline: the others'
texts are compared with its texts, and their throughput and p95 latency are divided by its.

Without `--url` the script starts the servers itself with `sglang_omni_flash.serving`
(`Server(ServeOptions(...))`, 127.0.0.1, free ports): "plain" (stock decoding) and "flash"
(`--asr.speculative whisper-flash [--asr.speculative_draft_model_path DIR]`). A server that
fails to start is reported as such (with its log tail) and the others are still measured.

Servers are measured interleaved (C=1 on each server, then C=2, ...) so a change of load on
the machine hits all of them alike. sglang-omni caches encoder outputs by audio, so by
default every pass sends its own variant of each clip (first PCM sample shifted by a few
LSB: inaudible, but a different fingerprint); all servers get the same variant in the same
pass, so their texts stay comparable. `--no-cache-busting` sends the original files.

Metrics per server and concurrency (over all repeats):
  req/s, audio s/s   requests and seconds of audio per wall-clock second of the passes
  mean / p95 latency seconds from sending a request to its full response
  RTF                mean over requests of latency / audio duration (lower is faster)
  WER                corpus WER against the manifest text after Whisper's English normaliser
  identical          requests whose whole response equals the baseline server's for the same variant
                     (`--response-format srt|vtt|verbose_json`: timestamps included)

With `--faster-whisper` (default where the model has a CTranslate2 export: base, tiny.en) the
peer a CPU user would run instead is measured on the same files after the servers stopped:
faster-whisper's int8 `BatchedInferencePipeline` (Silero VAD, batch 8, 2 threads, greedy, English,
no timestamps), in this process, one file at a time (the pipeline batches a file's windows). Its
row sits at C=1 and every server row gets `x fw` = its audio s/s over the peer's.

Long-form audio: `whisper-flash corpus long-form --manifest .../librispeech-mini/manifest.jsonl
--split val --out DIR` joins each val speaker's utterances into 60-120 s files; pass DIR's
manifest.jsonl here.

Writes results.json, results.md and results.png (needs matplotlib; skipped with a warning
if it is not installed) into --out, and prints the markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import platform
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import requests
import soundfile as sf
from tqdm import tqdm

from sglang_omni_flash.corpus.manifest import Utterance, read_manifest

DEFAULT_MANIFEST = Path("~/.cache/sglang-omni-flash/audio/test-set/manifest.jsonl").expanduser()
ENDPOINT = "/v1/audio/transcriptions"
WARMUP_PASS = 1_000_000  # pass ids at and above this are warm-up variants, never timed


# ---------------------------------------------------------------------------- options


@dataclass(frozen=True)
class BenchOptions:
    manifest: Path
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    repeats: int = 2  # passes per server and concurrency
    warmup: int = 2  # untimed requests per server before the first pass
    limit: int = 0  # clips used (evenly spaced over the manifest); 0: all
    cache_busting: bool = True  # a fresh variant of every clip in every pass
    response_format: str = "json"
    language: str | None = "en"  # None: let the server decide
    timeout_s: float = 600.0  # per request
    faster_whisper: str | None = None  # the model's CTranslate2 folder: measure the faster-whisper peer
    english_only: bool = False  # the model is English-only (faster-whisper is then given no language)


@dataclass
class Target:
    """One server under test: given by URL, or started (and stopped) by this script."""

    name: str
    url: str | None = None
    status: str = "pending"  # "up", "failed to start", "given", "unreachable"
    error: str | None = None
    startup_s: float | None = None
    extra_args: tuple[str, ...] = ()
    log_file: str | None = None
    server: object | None = field(default=None, repr=False)


@dataclass
class RequestRecord:
    server: str
    concurrency: int
    pass_id: int
    clip_id: str
    duration: float
    latency_s: float | None
    text: str | None  # the transcript (subtitle cue texts for srt / vtt): what WER reads
    error: str | None = None
    body: str | None = None  # the whole response: what "identical" compares (timestamps included)


# ---------------------------------------------------------------------------- audio


def clip_variant(clip: Utterance, pass_id: int, cache_busting: bool) -> bytes:
    """The WAV bytes sent for `clip` in pass `pass_id` (identical for every server).

    With cache busting, pass_id + 1 is written two bits per sample into the first 12 PCM
    samples of every second (each moves by at most 3 LSB, towards zero), so every pass has its
    own audio fingerprint on the server, in every 30 s window of a long file: the stage caches
    encoder outputs per window, and a mark in the first window only let the later windows of a
    long file hit the cache on every pass after the first.
    """
    if not cache_busting:
        return clip.audio.read_bytes()
    audio, rate = sf.read(clip.audio, dtype="int16", always_2d=True)
    audio = audio.astype(np.int32)
    code = pass_id + 1
    for start in range(0, max(len(audio) - 12, 1), rate):
        for j in range(min(12, len(audio) - start)):
            step = (code >> (2 * j)) & 3
            audio[start + j, 0] += -step if audio[start + j, 0] > 0 else step
    buffer = io.BytesIO()
    sf.write(buffer, audio.astype(np.int16), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


# ---------------------------------------------------------------------------- text


def load_normalizer(spelling_json: Path | None, model_dirs: list[Path]):
    """Whisper's English normaliser and where its British->American spelling table came from."""
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    candidates = [spelling_json] if spelling_json else []
    candidates += [d / "normalizer.json" for d in model_dirs]
    # the same table ships in openai-whisper and in the pure-Python whisper-normalizer wheel
    for module in ("whisper_normalizer", "whisper"):
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations:
            candidates += [Path(loc) / "normalizers" / "english.json" for loc in spec.submodule_search_locations]
    for path in candidates:
        if path is not None and path.is_file():
            return EnglishTextNormalizer(json.loads(path.read_text(encoding="utf-8"))), str(path)
    print("warning: no English spelling table found (normalizer.json, english.json of whisper-normalizer"
          " or openai-whisper);"
          " WER uses Whisper's English normaliser without British->American spelling mapping"
          " (pass --spelling-json FILE to add it)", file=sys.stderr)
    return EnglishTextNormalizer({}), "none"


def corpus_wer(normalizer, references: list[str], hypotheses: list[str]) -> float | None:
    import jiwer

    pairs = [(normalizer(r), normalizer(h or "")) for r, h in zip(references, hypotheses)]
    pairs = [(r, h) for r, h in pairs if r.strip()]
    if not pairs:
        return None
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))


# ---------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: str | None, lines: int = 15) -> str:
    if not path or not Path(path).is_file():
        return ""
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def start_target(target: Target, model: str, out_dir: Path, startup_timeout_s: float) -> None:
    from sglang_omni_flash.serving.launch import Server, ServeOptions

    target.log_file = str(out_dir / f"server-{target.name}.log")
    t0 = time.monotonic()
    try:
        server = Server(ServeOptions(model=model, port=free_port(), log_file=Path(target.log_file),
                                     extra_args=target.extra_args, startup_timeout_s=startup_timeout_s))
        target.server = server
        server.start()
        server.wait_ready()
    except Exception as exc:  # a failed start is a result, not a crash of the benchmark
        target.status, target.error = "failed to start", f"{type(exc).__name__}: {exc}"
        tail = log_tail(target.log_file)
        if tail:
            target.error += "\n--- log tail ---\n" + tail
        stop_target(target)
        print(f"[{target.name}] failed to start: {target.error}", file=sys.stderr)
        return
    target.url, target.status, target.startup_s = server.url, "up", round(time.monotonic() - t0, 1)
    print(f"[{target.name}] healthy at {server.url} after {target.startup_s} s", file=sys.stderr)


def check_given(target: Target) -> None:
    try:
        healthy = requests.get(target.url + "/health", timeout=10).status_code == 200
    except requests.RequestException as exc:
        healthy, target.error = False, f"{type(exc).__name__}: {exc}"
    target.status = "given" if healthy else "unreachable"
    if not healthy:
        print(f"[{target.name}] {target.url}/health does not answer 200: left out", file=sys.stderr)


def stop_target(target: Target) -> None:
    if target.server is not None:
        target.server.stop()
        target.server = None


# ---------------------------------------------------------------------------- requests

_sessions = threading.local()


def transcript_of(body: str, response_format: str) -> str:
    """The words of a response: json / verbose_json text, plain text, or the cue lines of srt / vtt."""
    if response_format in ("json", "verbose_json"):
        return json.loads(body)["text"].strip()
    if response_format == "text":
        return body.strip()
    lines = [line.strip() for line in body.splitlines()]
    return " ".join(line for line in lines if line and "-->" not in line and not line.isdigit() and line != "WEBVTT")


def transcribe(url: str, audio: bytes, name: str, options: BenchOptions) -> tuple[float, str, str]:
    session = getattr(_sessions, "session", None)
    if session is None:
        session = _sessions.session = requests.Session()
    data = {"response_format": options.response_format}
    if options.language:
        data["language"] = options.language
    start = time.perf_counter()
    resp = session.post(url + ENDPOINT, data=data, files={"file": (name, audio, "audio/wav")},
                        timeout=options.timeout_s)
    latency = time.perf_counter() - start
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
    return latency, transcript_of(resp.text, options.response_format), resp.text


def run_pass(target: Target, clips: list[Utterance], variants: list[bytes], concurrency: int,
             pass_id: int, options: BenchOptions) -> tuple[float, list[RequestRecord], tuple[float, float]]:
    """Every clip once through `concurrency` workers; returns wall seconds, records, load avg."""
    records: list[RequestRecord] = []
    load_before = os.getloadavg()[0]
    desc = f"{target.name} c={concurrency} pass {pass_id}"
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool, \
            tqdm(total=len(clips), desc=desc, file=sys.stderr, leave=False) as bar:
        futures = {pool.submit(transcribe, target.url, audio, f"{clip.id}.wav", options): clip
                   for clip, audio in zip(clips, variants)}
        for future in as_completed(futures):
            clip = futures[future]
            try:
                latency, text, body = future.result()
                records.append(RequestRecord(target.name, concurrency, pass_id, clip.id, clip.duration,
                                             latency, text, body=body))
            except Exception as exc:
                records.append(RequestRecord(target.name, concurrency, pass_id, clip.id, clip.duration,
                                             None, None, error=f"{type(exc).__name__}: {exc}"[:400]))
            bar.update(1)
    wall = time.perf_counter() - start
    return wall, records, (load_before, os.getloadavg()[0])


def warm_up(target: Target, clips: list[Utterance], options: BenchOptions) -> None:
    for i in range(options.warmup):
        clip = clips[i % len(clips)]
        try:
            transcribe(target.url, clip_variant(clip, WARMUP_PASS + i, True), f"warmup-{i}.wav", options)
        except Exception as exc:
            print(f"[{target.name}] warm-up request failed: {exc}", file=sys.stderr)


# ---------------------------------------------------------------------------- summary


def summarise(records: list[RequestRecord], wall_s: float, loads: list[tuple[float, float]],
              normalizer, references: dict[str, str], baseline: dict[tuple[int, str], str] | None) -> dict:
    ok = [r for r in records if r.error is None]
    latencies = np.array([r.latency_s for r in ok])
    audio_s = sum(r.duration for r in ok)
    identical = None
    if baseline is not None:
        identical = sum(1 for r in ok if baseline.get((r.pass_id, r.clip_id)) == r.body)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "wall_s": round(wall_s, 3),
        "audio_s": round(audio_s, 2),
        "req_per_s": round(len(ok) / wall_s, 4) if wall_s else None,
        "audio_s_per_s": round(audio_s / wall_s, 4) if wall_s else None,
        "latency_mean_s": round(float(np.mean(latencies)), 4) if ok else None,
        "latency_p95_s": round(float(np.percentile(latencies, 95)), 4) if ok else None,
        "rtf": round(float(np.mean([r.latency_s / r.duration for r in ok])), 4) if ok else None,
        "wer": corpus_wer(normalizer, [references[r.clip_id] for r in ok], [r.text for r in ok]),
        "identical_to_baseline": identical,
        "loadavg_1m": [round(loads[0][0], 2), round(loads[-1][1], 2)] if loads else None,  # first start, last end
    }


FASTER_WHISPER = "faster-whisper int8 batched"


def measure_faster_whisper(clips: list[Utterance], options: BenchOptions, normalizer,
                           references: dict[str, str]) -> dict:
    """The peer's row: every file once per repeat, one after another (its pipeline batches the
    30 s windows of a file, 8 at a time); the median pass."""
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    model = WhisperModel(options.faster_whisper, device="cpu", compute_type="int8", cpu_threads=2)
    pipeline = BatchedInferencePipeline(model)
    settings = dict(language=None if options.english_only else "en", beam_size=1, temperature=0.0, batch_size=8,
                    without_timestamps=True, condition_on_previous_text=False)
    waves = [sf.read(str(c.audio), dtype="float32")[0] for c in clips]

    def decode(wave) -> tuple[float, str]:
        start = time.perf_counter()
        segments, _ = pipeline.transcribe(wave, **settings)
        text = "".join(s.text for s in segments).strip()
        return time.perf_counter() - start, text

    decode(waves[0])  # warm-up
    passes = []
    for _ in range(options.repeats):
        passes.append([decode(w) for w in tqdm(waves, desc=FASTER_WHISPER, file=sys.stderr, leave=False)])
    walls = [sum(t for t, _ in p) for p in passes]
    median = passes[walls.index(sorted(walls)[len(walls) // 2])]
    latencies = np.array([t for t, _ in median])
    audio_s = sum(c.duration for c in clips)
    wall = float(latencies.sum())
    return {"server": FASTER_WHISPER, "concurrency": 1, "requests": len(clips), "errors": 0,
            "wall_s": round(wall, 3), "audio_s": round(audio_s, 2), "req_per_s": round(len(clips) / wall, 4),
            "audio_s_per_s": round(audio_s / wall, 4), "latency_mean_s": round(float(latencies.mean()), 4),
            "latency_p95_s": round(float(np.percentile(latencies, 95)), 4),
            "rtf": round(float(np.mean([t / c.duration for (t, _), c in zip(median, clips)])), 4),
            "wer": corpus_wer(normalizer, [references[c.id] for c in clips], [t for _, t in median]),
            "identical_to_baseline": None, "loadavg_1m": None}


def add_speedups(rows: list[dict], baseline_name: str) -> None:
    base = {row["concurrency"]: row for row in rows if row["server"] == baseline_name}
    for row in rows:
        ref = base.get(row["concurrency"])
        if ref is None or row["server"] == baseline_name:
            continue
        row["speedup_audio_s_per_s"] = _ratio(row["audio_s_per_s"], ref["audio_s_per_s"])
        row["speedup_latency_mean"] = _ratio(ref["latency_mean_s"], row["latency_mean_s"])
        row["speedup_latency_p95"] = _ratio(ref["latency_p95_s"], row["latency_p95_s"])
    peer = next((row for row in rows if row["server"] == FASTER_WHISPER), None)
    if peer is not None:
        for row in rows:
            if row is not peer:
                row["x_faster_whisper"] = _ratio(row["audio_s_per_s"], peer["audio_s_per_s"])


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def markdown(result: dict) -> str:
    servers = [t for t in result["servers"]]
    lines = [f"clips: {result['clips']} ({result['audio_s_per_pass']:.1f} s of audio per pass), "
             f"repeats: {result['options']['repeats']}, cache busting: {result['options']['cache_busting']}, "
             f"baseline: {result['baseline']}", ""]
    for target in servers:
        if target["status"] in ("failed to start", "unreachable"):
            first = (target["error"] or "").splitlines()[0] if target["error"] else ""
            lines.append(f"- **{target['name']}**: {target['status']} ({first})")
    if lines[-1] != "":
        lines.append("")
    names = [t["name"] for t in servers if t["status"] in ("up", "given")]
    others = [n for n in names if n != result["baseline"]]
    header = ["C", "server", "req/s", "audio s/s", "mean lat (s)", "p95 lat (s)", "RTF", "WER",
              "identical", "errors", "load 1m"]
    if others:
        header += ["x audio s/s", "x p95"]
    peer = any(row["server"] == FASTER_WHISPER for row in result["rows"])
    if peer:
        header += ["x fw"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in result["rows"]:
        n_ok = row["requests"] - row["errors"]
        ident = "-" if row["identical_to_baseline"] is None else f"{row['identical_to_baseline']}/{n_ok}"
        wer = "-" if row["wer"] is None else f"{100 * row['wer']:.2f}%"
        load = "-" if not row["loadavg_1m"] else f"{row['loadavg_1m'][0]:.1f}-{row['loadavg_1m'][1]:.1f}"
        cells = [row["concurrency"], row["server"], row["req_per_s"], row["audio_s_per_s"], row["latency_mean_s"],
                 row["latency_p95_s"], row["rtf"], wer, ident, row["errors"], load]
        cells = ["-" if c is None else c for c in cells]
        if others:
            cells += [row.get("speedup_audio_s_per_s", "-") or "-", row.get("speedup_latency_p95", "-") or "-"]
        if peer:
            cells += [row.get("x_faster_whisper", "-") or "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed; no PNG plot written", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in dict.fromkeys(row["server"] for row in result["rows"]):
        rows = [r for r in result["rows"] if r["server"] == name]
        xs = [r["concurrency"] for r in rows]
        for ax, key in zip(axes, ("audio_s_per_s", "latency_p95_s", "latency_mean_s")):
            ax.plot(xs, [r[key] for r in rows], marker="o", label=name)
    for ax, title in zip(axes, ("throughput (audio s / s)", "p95 latency (s)", "mean latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(result["options"]["concurrency"]))
        ax.set_xticklabels([str(c) for c in result["options"]["concurrency"]])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{ENDPOINT}: {result['clips']} clips, {result['started_utc']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------- main


def pick_clips(clips: list[Utterance], limit: int) -> list[Utterance]:
    if not limit or limit >= len(clips):
        return clips
    step = len(clips) / limit
    return [clips[int(i * step)] for i in range(limit)]


def run(options: BenchOptions, targets: list[Target], out_dir: Path, normalizer, spelling_source: str,
        model: str | None, startup_timeout_s: float) -> dict:
    clips = pick_clips(read_manifest(options.manifest), options.limit)
    references = {c.id: c.text for c in clips}
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        for target in targets:
            if target.url is None:
                start_target(target, model, out_dir, startup_timeout_s)
            else:
                check_given(target)
        live = [t for t in targets if t.status in ("up", "given")]
        for target in live:
            warm_up(target, clips, options)
        records: list[RequestRecord] = []
        walls: dict[tuple[str, int], float] = {}
        loads: dict[tuple[str, int], list] = {}
        pass_id = 0
        for concurrency in options.concurrency:
            for _ in range(options.repeats):
                variants = [clip_variant(c, pass_id, options.cache_busting) for c in clips]
                for target in live:
                    wall, recs, load = run_pass(target, clips, variants, concurrency, pass_id, options)
                    records += recs
                    walls[target.name, concurrency] = walls.get((target.name, concurrency), 0.0) + wall
                    loads.setdefault((target.name, concurrency), []).append(load)
                    ok = [r for r in recs if r.error is None]
                    print(f"[{target.name}] c={concurrency} pass {pass_id}: {len(ok)}/{len(recs)} ok, "
                          f"{sum(r.duration for r in ok) / wall:.2f} audio s/s, load {load[0]:.1f}->{load[1]:.1f}",
                          file=sys.stderr)
                pass_id += 1
    finally:
        for target in targets:
            stop_target(target)

    baseline_name = live[0].name if live else None
    baseline_texts = {(r.pass_id, r.clip_id): r.body for r in records
                      if r.server == baseline_name and r.error is None}
    rows = []
    for concurrency in options.concurrency:
        for target in live:
            recs = [r for r in records if r.server == target.name and r.concurrency == concurrency]
            row = {"server": target.name, "concurrency": concurrency}
            row.update(summarise(recs, walls[target.name, concurrency], loads[target.name, concurrency],
                                 normalizer, references,
                                 None if target.name == baseline_name else baseline_texts))
            rows.append(row)
    if options.faster_whisper:
        rows.append(measure_faster_whisper(clips, options, normalizer, references))
    add_speedups(rows, baseline_name)
    options_json = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()}
    return {
        "started_utc": started,
        "finished_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "options": options_json,
        "model": model,
        "clips": len(clips),
        "audio_s_per_pass": round(sum(c.duration for c in clips), 2),
        "normalizer_spelling_mapping": spelling_source,
        "baseline": baseline_name,
        "servers": [{k: v for k, v in asdict(t).items() if k != "server"} for t in targets],
        "rows": rows,
        "requests": [asdict(r) for r in records],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    parser.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                        help="a running server (repeatable; the first is the baseline). "
                             "Without --url the script starts its own servers (--servers)")
    parser.add_argument("--servers", default="plain,flash",
                        help="servers to start without --url: comma list of plain, flash, or NAME:plain / "
                             "NAME:flash to start several of one kind, NAME:flash:KEY=VALUE[+KEY=VALUE] to "
                             "add --asr.speculative_KEY VALUE (e.g. cut:flash:min_draft_prob=0.2; "
                             "default: plain,flash)")
    parser.add_argument("--model", default="base", help="embedded model name or Whisper directory to serve")
    parser.add_argument("--draft-model-path", type=Path, default=None,
                        help="flash server: --asr.speculative_draft_model_path (default: the shipped drafter)")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="comma list (default 1,2,4,8,16)")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per server and concurrency")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests per server first")
    parser.add_argument("--limit", type=int, default=0, help="use N clips spread over the manifest (0: all)")
    parser.add_argument("--quick", action="store_true", help="6 clips, concurrency 1,2, 1 repeat, 1 warm-up")
    parser.add_argument("--no-cache-busting", action="store_true",
                        help="send the original files every pass (then the server's encoder cache is measured)")
    parser.add_argument("--response-format", default="json", choices=("json", "text", "verbose_json", "srt", "vtt"),
                        help="srt, vtt and verbose_json are timestamped decodes (segment times); identity "
                             "compares whole responses")
    parser.add_argument("--language", default="en", help="language field sent ('' to send none)")
    parser.add_argument("--spelling-json", type=Path, default=None,
                        help="Whisper's english.json / normalizer.json (British->American spellings) for WER")
    parser.add_argument("--faster-whisper", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure faster-whisper's int8 BatchedInferencePipeline on the same files "
                             "(default: on where --model has a CTranslate2 export)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--from-json", type=Path, default=None, metavar="RESULTS_JSON",
                        help="measure nothing: rewrite results.md / results.png next to an earlier results.json")
    parser.add_argument("--out", type=Path, default=None,
                        help="result folder (default out/asr-server-bench-<UTC time>)")
    return parser.parse_args(argv)


def targets_from_args(args: argparse.Namespace) -> list[Target]:
    if args.url:
        targets = []
        for item in args.url:
            name, sep, url = item.partition("=")
            if not sep:
                name, url = f"server{len(targets)}", item
            targets.append(Target(name=name, url=url.rstrip("/")))
        return targets
    targets = []
    for item in args.servers.split(","):
        name, _, rest = item.strip().partition(":")
        kind, _, settings = rest.partition(":")
        kind = kind or name
        if kind not in ("plain", "flash"):
            raise SystemExit(f"--servers: unknown kind {kind!r} (plain or flash)")
        extra: tuple[str, ...] = ()
        if kind == "flash":
            extra = ("--asr.speculative", "whisper-flash")
            if args.draft_model_path:
                extra += ("--asr.speculative_draft_model_path", str(args.draft_model_path))
        for setting in filter(None, settings.split("+")):
            key, sep, value = setting.partition("=")
            if kind != "flash" or not sep or not key.isidentifier():
                raise SystemExit(f"--servers: {item!r}: settings are NAME:flash:KEY=VALUE[+KEY=VALUE]")
            extra += (f"--asr.speculative_{key}", value)
        targets.append(Target(name=name, extra_args=extra))
    if len({t.name for t in targets}) != len(targets):
        raise SystemExit("--servers: names must be unique (use NAME:plain)")
    return targets


def write_reports(result: dict, out_dir: Path) -> str:
    table = markdown(result)
    (out_dir / "results.md").write_text(table, encoding="utf-8")
    if result["rows"]:
        plot(result, out_dir / "results.png")
    return table


def faster_whisper_dir(args: argparse.Namespace) -> str | None:
    """The CTranslate2 export faster-whisper reads, or None (not asked for, or none exists)."""
    if args.faster_whisper is False:
        return None
    from sglang_omni_flash.models.embedded import ct2_dir

    folder = ct2_dir(args.model) if args.model in ("base", "tiny.en") else None
    if folder is None or not (folder / "model.bin").is_file():
        if args.faster_whisper:
            raise SystemExit(f"--faster-whisper: no CTranslate2 export of {args.model} "
                             f"(run `whisper-flash models fetch {args.model}`)")
        return None
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        print(write_reports(json.loads(args.from_json.read_text(encoding="utf-8")), args.from_json.parent))
        return 0
    concurrency = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    options = BenchOptions(
        manifest=args.manifest, concurrency=(1, 2) if args.quick else concurrency,
        repeats=1 if args.quick else args.repeats, warmup=1 if args.quick else args.warmup,
        limit=6 if args.quick and not args.limit else args.limit,
        cache_busting=not args.no_cache_busting, response_format=args.response_format,
        language=args.language or None, faster_whisper=faster_whisper_dir(args),
        english_only=args.model.endswith(".en"))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir = args.out or Path("out") / f"asr-server-bench-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = targets_from_args(args)

    model_dirs: list[Path] = []
    model = None
    if any(t.url is None for t in targets):
        from sglang_omni_flash.models.embedded import resolve_model

        model = str(resolve_model(args.model))
        model_dirs.append(Path(model))
    normalizer, spelling_source = load_normalizer(args.spelling_json, model_dirs)

    result = run(options, targets, out_dir, normalizer, spelling_source, model, args.startup_timeout)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    table = write_reports(result, out_dir)
    print(table)
    print(f"results in {out_dir}", file=sys.stderr)
    return 0 if result["rows"] else 1


if __name__ == "__main__":
    from sglang_omni_flash.errors import run_command

    sys.exit(run_command(main, "asr_server_bench.py"))
