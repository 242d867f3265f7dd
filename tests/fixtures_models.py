"""Fixtures for the model tests: the embedded models (fetched once, into the real cache) and
short English speech clips synthesized with espeak-ng.

Converting is deterministic and the real cache is where `whisper-flash` keeps them anyway, so a
session reuses what an earlier session (or `whisper-flash models fetch`) left there.
"""

from __future__ import annotations

import io
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

SAMPLE_RATE = 16000

# Opening lines of public-domain books, read by different espeak-ng voices: 4-9 s of speech each.
# espeak-ng's default rate of 175 words/min is on the fast side for Whisper; 145-160 is clearer.
_SENTENCES = (
    ("en-us", 150, "It is a truth universally acknowledged, that a single man in possession of a good "
     "fortune, must be in want of a wife."),
    ("en-us+m3", 155, "Call me Ishmael. Some years ago, never mind how long precisely, having little or "
     "no money in my purse, I thought I would sail about a little."),
    ("en+f3", 150, "It was the best of times, it was the worst of times, it was the age of wisdom, it "
     "was the age of foolishness."),
    ("en-us+m7", 145, "Happy families are all alike; every unhappy family is unhappy in its own way."),
    ("en+m2", 150, "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
     "having nothing to do."),
    ("en-us+f2", 155, "The Mole had been working very hard all the morning, spring-cleaning his little "
     "home."),
)  # fmt: skip


@dataclass(frozen=True)
class SpeechClip:
    text: str
    voice: str
    audio: np.ndarray  # float32 mono at 16 kHz

    @property
    def seconds(self) -> float:
        return len(self.audio) / SAMPLE_RATE


@pytest.fixture(scope="session")
def embedded_models() -> dict[str, Path]:
    """name -> converted transformers directory, for every embedded model."""
    from sglang_omni_flash.models.embedded import EMBEDDED_MODELS, fetch

    return {name: fetch(name) for name in EMBEDDED_MODELS}


@pytest.fixture(scope="session")
def speech_clips() -> list[SpeechClip]:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng)")
    return [_synthesize(text, voice, rate) for voice, rate, text in _SENTENCES]


def _synthesize(text: str, voice: str, rate: int) -> SpeechClip:
    import soundfile
    from scipy.signal import resample_poly

    wav = subprocess.run(
        ["espeak-ng", "-v", voice, "-s", str(rate), "--stdout", text], capture_output=True, check=True
    ).stdout
    audio, rate_in = soundfile.read(io.BytesIO(wav), dtype="float32")
    # espeak-ng speaks at 22050 Hz; Whisper listens at 16 kHz
    audio = resample_poly(audio, SAMPLE_RATE, rate_in).astype(np.float32)
    return SpeechClip(text=text, voice=voice, audio=audio)
