"""The JSONL manifest every audio set in this project is described by.

One line per clip:

    {"id": "heldout-s0-00003", "audio": "wav/heldout-s0-00003.wav", "text": "...",
     "duration": 7.41, "voice": "flite:awb", "split": "heldout", "source": "Botchan, chapter X",
     "meta": {"rate": 1.05}}

`audio` is stored relative to the manifest's own folder (so a corpus folder can be moved
or copied as a whole) and is resolved to an absolute path when read. `meta` holds
whatever else the producer wants to keep (synthesis rate, seed, ...); readers ignore it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_omni_flash.errors import UserError

REQUIRED_FIELDS = ("id", "audio", "text", "duration", "voice", "split")


@dataclass(frozen=True)
class Utterance:
    id: str  # unique within a manifest
    audio: Path  # absolute path once read; 16 kHz mono 16-bit WAV
    text: str  # what is said, as plain text with punctuation
    duration: float  # seconds
    voice: str  # "espeak:en-us+m3", "flite:slt", "festival:kal", "piper:joe", "librivox:real"
    split: str  # "train" or "heldout"
    source: str = ""  # where the text comes from, e.g. "Botchan, chapter III"
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self, relative_to: Path) -> dict[str, Any]:
        audio = Path(os.path.relpath(self.audio, relative_to))
        return {
            "id": self.id,
            "audio": audio.as_posix(),
            "text": self.text,
            "duration": round(self.duration, 4),
            "voice": self.voice,
            "split": self.split,
            "source": self.source,
            "meta": self.meta,
        }

    @staticmethod
    def from_json(record: dict[str, Any], relative_to: Path) -> Utterance:
        missing = [name for name in REQUIRED_FIELDS if name not in record]
        if missing:
            raise ValueError(f"manifest record lacks {', '.join(missing)}")
        return Utterance(
            id=str(record["id"]),
            audio=(relative_to / record["audio"]).resolve(),
            text=str(record["text"]),
            duration=float(record["duration"]),
            voice=str(record["voice"]),
            split=str(record["split"]),
            source=str(record.get("source", "")),
            meta=dict(record.get("meta") or {}),
        )


def write_manifest(path: Path, utterances: Iterable[Utterance]) -> Path:
    """Write atomically (a reader never sees half a manifest); returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    base = path.parent.resolve()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for utt in utterances:
            f.write(json.dumps(utt.to_json(base), ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(path: Path) -> list[Utterance]:
    """Every utterance of a manifest, audio paths made absolute."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no manifest at {path} (run `whisper-flash corpus test-set`?)")
    base = path.parent.resolve()
    utterances = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                utterances.append(Utterance.from_json(json.loads(line), base))
            except (ValueError, TypeError) as exc:
                raise UserError(f"{path}:{number}: bad manifest line: {exc}") from exc
    return utterances


def read_manifests(paths: Iterable[Path]) -> list[Utterance]:
    return [utt for path in paths for utt in read_manifest(path)]
