"""Pack short clips of one voice into longer ones: up to a Whisper window, or long-form files.

Whisper's encoder always runs a full 30 s window, so a 10 s clip costs as much encoder time as a
28 s one. For teacher extraction (drafter training) that makes the encoder the bottleneck; packing
the clips of one voice back to back, with a short pause between them, gives about 2-3x the target
tokens per encoder pass. The packed clip's text is the parts' texts joined by a space, and its
`meta.parts` lists the ids it was made from, so the packing can be traced and repeated.

Long-form files (`long_form_corpus`) are what a transcription server is sent: one speaker's
utterances joined, with short pauses, into recordings of 60-120 s that the server splits into
several windows. Made from the same utterances as the 28 s packs, they let the benchmarks compare
the server on long audio with the engine on windows of the same speech.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import soundfile as sf
from tqdm import tqdm

from sglang_omni_flash.corpus.manifest import Utterance, read_manifests, write_manifest
from sglang_omni_flash.errors import UserError

SAMPLE_RATE = 16_000


def plan_packs(clips: Sequence[Utterance], max_seconds: float,
               gap_seconds: float) -> list[list[Utterance]]:
    """Greedy, order-preserving packing per voice: a pack is closed when the next clip of its voice
    would push it past `max_seconds`. A clip longer than `max_seconds` on its own stays alone."""
    open_packs: dict[str, list[Utterance]] = {}
    packs: list[list[Utterance]] = []
    for clip in clips:
        pack = open_packs.get(clip.voice)
        if pack is not None and _seconds(pack, gap_seconds) + gap_seconds + clip.duration > max_seconds:
            packs.append(pack)
            pack = None
        if pack is None:
            pack = open_packs[clip.voice] = []
        pack.append(clip)
    packs.extend(p for p in open_packs.values() if p)
    return packs


def plan_long_files(clips: Sequence[Utterance], min_seconds: float, max_seconds: float,
                    gap_seconds: float) -> list[list[Utterance]]:
    """Per voice, in manifest order: files of at most `max_seconds`, each closed when the next clip
    would push it past. A file shorter than `min_seconds` (a voice's remainder) is left out, so every
    file is long-form, never a short clip in disguise."""
    by_voice: dict[str, list[list[Utterance]]] = {}
    for clip in clips:
        files = by_voice.setdefault(clip.voice, [[]])
        if files[-1] and _seconds(files[-1], gap_seconds) + gap_seconds + clip.duration > max_seconds:
            files.append([])
        files[-1].append(clip)
    return [f for files in by_voice.values() for f in files if _seconds(f, gap_seconds) >= min_seconds]


def _seconds(pack: Sequence[Utterance], gap_seconds: float) -> float:
    return sum(c.duration for c in pack) + gap_seconds * (len(pack) - 1)


def _joined_audio(pack: Sequence[Utterance], gap_seconds: float) -> np.ndarray:
    pause = np.zeros(int(round(gap_seconds * SAMPLE_RATE)), dtype=np.float32)
    pieces: list[np.ndarray] = []
    for i, clip in enumerate(pack):
        samples, rate = sf.read(str(clip.audio), dtype="float32", always_2d=False)
        if rate != SAMPLE_RATE or samples.ndim != 1:
            raise UserError(f"{clip.audio}: expected 16 kHz mono audio, got {rate} Hz "
                            f"with shape {samples.shape}")
        if i:
            pieces.append(pause)
        pieces.append(samples)
    return np.concatenate(pieces)


def pack_corpus(manifests: Sequence[Path], out: Path, max_seconds: float = 28.0,
                gap_seconds: float = 0.4, progress: bool = True, split: str | None = None) -> Path:
    """Write the packed clips and their manifest under `out`; returns the manifest path.
    Resumable: a packed WAV that already exists is not written again."""
    if not 1.0 <= max_seconds <= 30.0:
        raise UserError(f"--max-seconds must be within 1..30 (one Whisper window), got {max_seconds}")
    clips = _clips_of(manifests, split, gap_seconds)
    return _write_corpus(plan_packs(clips, max_seconds, gap_seconds), out, gap_seconds, progress, "packed")


def long_form_corpus(manifests: Sequence[Path], out: Path, split: str | None = None,
                     min_seconds: float = 60.0, max_seconds: float = 120.0, gap_seconds: float = 0.6,
                     progress: bool = True) -> Path:
    """Long-form files (`plan_long_files`) of the clips of `split` (None: all) and their manifest
    under `out`; returns the manifest path. Resumable like `pack_corpus`."""
    if not 30.0 < min_seconds <= max_seconds <= 3600.0:
        raise UserError(f"long-form files need 30 < --min-seconds <= --max-seconds <= 3600, "
                        f"got {min_seconds} and {max_seconds}")
    files = plan_long_files(_clips_of(manifests, split, gap_seconds), min_seconds, max_seconds, gap_seconds)
    if not files:
        raise UserError(f"no voice has {min_seconds:g} s of speech to join")
    return _write_corpus(files, out, gap_seconds, progress, "long")


def _clips_of(manifests: Sequence[Path], split: str | None, gap_seconds: float) -> list[Utterance]:
    """The manifests' clips of `split` (None: all), after checking the pause between parts."""
    if not 0.0 <= gap_seconds <= 2.0:
        raise UserError(f"--gap-seconds must be within 0..2, got {gap_seconds}")
    clips = [c for c in read_manifests(manifests) if split is None or c.split == split]
    if not clips:
        raise UserError(f"the manifests list no clips{f' of split {split!r}' if split else ''}")
    return clips


def _write_corpus(groups: list[list[Utterance]], out: Path, gap_seconds: float, progress: bool,
                  prefix: str) -> Path:
    """Each group joined into out/wav/PREFIX-NNNNN.wav, and their manifest; returns its path."""
    wav_dir = out / "wav"
    wav_dir.mkdir(parents=True, exist_ok=True)
    joined = list(_write_packs(groups, wav_dir, gap_seconds, progress, prefix))
    return write_manifest(out / "manifest.jsonl", joined)


def _write_packs(packs: list[list[Utterance]], wav_dir: Path, gap_seconds: float,
                 progress: bool, prefix: str) -> Iterator[Utterance]:
    for index, pack in enumerate(tqdm(packs, desc=prefix, unit="file", disable=not progress)):
        clip_id = f"{prefix}-{index:05d}"
        wav = wav_dir / f"{clip_id}.wav"
        if not wav.exists():
            samples = _joined_audio(pack, gap_seconds)
            tmp = wav.with_suffix(".tmp.wav")
            sf.write(str(tmp), samples, SAMPLE_RATE, subtype="PCM_16", format="WAV")
            tmp.replace(wav)  # a killed run never leaves a half-written clip under the final name
        yield Utterance(
            id=clip_id, audio=wav, text=" ".join(c.text for c in pack),
            duration=_seconds(pack, gap_seconds), voice=pack[0].voice, split=pack[0].split,
            source="; ".join(dict.fromkeys(c.source for c in pack if c.source)),
            meta={"parts": [c.id for c in pack], "gap_seconds": gap_seconds},
        )
