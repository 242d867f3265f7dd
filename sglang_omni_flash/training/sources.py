"""Where teacher extraction reads its audio from: one list of `Clip`s, whatever the input.

* a JSONL manifest of this project (corpus/manifest.py): `--manifest FILE`
* a LibriSpeech directory tree (`<speaker>/<chapter>/<speaker>-<chapter>.trans.txt` beside the
  `.flac` files, e.g. train-clean-100/): `--librispeech DIR`
* a local Hugging Face `datasets` folder written by `save_to_disk` (an "audio" column and a
  "text" / "sentence" / "transcription" column; no hub access): `--dataset DIR`

Audio is read lazily (`Clip.load()`), so listing a 100 h tree costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sglang_omni_flash.errors import UserError

SAMPLE_RATE = 16000
TEXT_COLUMNS = ("text", "sentence", "transcription", "transcript", "normalized_text")


@dataclass(frozen=True)
class Clip:
    id: str
    text: str  # reference text (only a hint for extraction: labels are the target's own greedy output)
    speaker: str  # voice / speaker: what train/validation splits are disjoint by
    duration: float  # seconds (0 if unknown until loaded)
    loader: Callable[[], np.ndarray]  # -> 16 kHz mono float32
    path: str = ""  # the audio file, when there is one: training re-reads it instead of a stored encoder output

    def load(self) -> np.ndarray:
        return self.loader()


def _read_file(path: Path) -> np.ndarray:
    from sglang_omni_flash.engine.audio import load_audio

    return load_audio(path)


def from_manifest(path: str | Path) -> list[Clip]:
    from sglang_omni_flash.corpus.manifest import read_manifest

    return [
        Clip(u.id, u.text, u.voice, u.duration, lambda p=u.audio: _read_file(p), str(u.audio))
        for u in read_manifest(Path(path))
    ]


def from_librispeech(root: str | Path) -> list[Clip]:
    root = Path(root)
    transcripts = sorted(root.rglob("*.trans.txt"))
    if not transcripts:
        raise UserError(f"{root}: no LibriSpeech *.trans.txt files found")
    clips = []
    for trans in transcripts:
        for line in trans.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            uid, _, text = line.partition(" ")
            audio = trans.parent / f"{uid}.flac"
            if not audio.is_file():
                raise UserError(f"{trans}: {audio.name} is missing")
            speaker = uid.split("-")[0]
            clips.append(Clip(uid, text.strip(), f"librispeech:{speaker}", 0.0, lambda p=audio: _read_file(p), str(audio)))
    return clips


def from_dataset(folder: str | Path) -> list[Clip]:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is in the lock
        raise UserError("reading a datasets folder needs the `datasets` package") from exc
    folder = Path(folder)
    try:
        ds = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(f"{folder}: not a datasets folder written by save_to_disk ({exc})") from exc
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[next(iter(ds))]
    if "audio" not in ds.column_names:
        raise UserError(f"{folder}: no 'audio' column (columns: {ds.column_names})")
    text_col = next((c for c in TEXT_COLUMNS if c in ds.column_names), None)
    speaker_col = next((c for c in ("speaker_id", "speaker", "client_id") if c in ds.column_names), None)
    clips = []
    for i in range(len(ds)):
        def load(i: int = i) -> np.ndarray:
            audio = ds[i]["audio"]
            samples = np.asarray(audio["array"], dtype=np.float32)
            if samples.ndim > 1:
                samples = samples.mean(axis=-1)
            if audio["sampling_rate"] != SAMPLE_RATE:
                from sglang_omni_flash.engine.audio import resample

                samples = resample(samples, audio["sampling_rate"])
            return samples

        row_id = str(ds[i]["id"]) if "id" in ds.column_names else f"{folder.name}-{i:06d}"
        text = str(ds[i][text_col]) if text_col else ""
        speaker = f"dataset:{ds[i][speaker_col]}" if speaker_col else f"dataset:{folder.name}"
        clips.append(Clip(row_id, text, speaker, 0.0, load))
    return clips


def read_sources(manifests=(), librispeech=(), datasets_dirs=()) -> list[Clip]:
    clips = [c for m in manifests for c in from_manifest(m)]
    clips += [c for r in librispeech for c in from_librispeech(r)]
    clips += [c for d in datasets_dirs for c in from_dataset(d)]
    if not clips:
        raise UserError("no input clips: pass --manifest, --librispeech or --dataset")
    seen: set[str] = set()
    for clip in clips:
        if clip.id in seen:
            raise UserError(f"clip id {clip.id!r} appears twice in the inputs")
        seen.add(clip.id)
    return clips
