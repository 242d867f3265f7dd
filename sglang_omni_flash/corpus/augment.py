"""Augmented copies of a corpus: tempo, pitch, room reverb and background noise, deterministic from a seed.

A drafter learns the target's own greedy continuation, so a recording heard through another room, at
another pace or pitch, is new training data as long as Whisper still transcribes it. Each copy of a
clip draws one `AugmentSpec` from (seed, copy, clip id) alone, so the same call gives the same samples
on every machine with the same sox:

* tempo and pitch: sox's `tempo -s` (WSOLA tuned for speech) and `pitch` (tempo + resampling), on
  float samples, so there is no dithering and nothing random in sox itself;
* reverb: the clip convolved with a synthetic room impulse response (a direct path, then exponentially
  decaying noise with the drawn RT60), mixed wet/dry;
* noise: coloured Gaussian noise (white, pink or brown) at the drawn SNR.
The copy is peak-normalised to -1 dBFS, as synthetic clips are.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
from scipy.signal import fftconvolve, lfilter
from tqdm import tqdm

from sglang_omni_flash.corpus.manifest import Utterance, read_manifest, write_manifest
from sglang_omni_flash.errors import UserError

SAMPLE_RATE = 16_000
PEAK = 10 ** (-1 / 20)  # -1 dBFS
MAX_SECONDS = 30.0  # one Whisper window: a copy stretched past it would be cut by the encoder

TEMPO_RANGE = (0.92, 1.12)  # faster speech makes Whisper hallucinate; slower stretches past the window
PITCH_CENTS = 300  # +- up to 3 semitones
RT60_RANGE = (0.15, 0.8)  # seconds: a small office to a large hall
SNR_RANGE_DB = (8.0, 30.0)
NOISE_COLOURS = ("white", "pink", "brown")


@dataclass(frozen=True)
class AugmentSpec:
    tempo: float  # 1.0 = unchanged duration
    pitch_cents: int  # 0 = unchanged
    rt60: float  # 0 = dry
    wet: float  # reverb mix
    snr_db: float | None  # None = no added noise
    colour: str
    seed: int  # the noise and the impulse response

    @property
    def changes_timing(self) -> bool:
        return self.tempo != 1.0


def draw_spec(seed: int, copy: int, clip_id: str) -> AugmentSpec:
    """One clip's augmentation: a pure function of (seed, copy, clip id)."""
    digest = hashlib.sha256(f"{seed}/{copy}/{clip_id}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    tempo = round(float(rng.uniform(*TEMPO_RANGE)), 3) if rng.random() < 0.7 else 1.0
    pitch = int(rng.integers(-PITCH_CENTS, PITCH_CENTS + 1)) if rng.random() < 0.6 else 0
    reverb = rng.random() < 0.6
    rt60 = round(float(rng.uniform(*RT60_RANGE)), 3) if reverb else 0.0
    wet = round(float(rng.uniform(0.2, 0.6)), 3) if reverb else 0.0
    snr = round(float(rng.uniform(*SNR_RANGE_DB)), 1) if rng.random() < 0.7 else None
    colour = NOISE_COLOURS[int(rng.integers(len(NOISE_COLOURS)))]
    return AugmentSpec(tempo, pitch, rt60, wet, snr, colour, int(rng.integers(2**31)))


def require_sox() -> str:
    sox = shutil.which("sox")
    if sox is None:
        raise UserError("augmentation needs sox (Debian package `sox`, listed in configs/apt.txt; `make setup` installs it)")
    return sox


def tempo_pitch(samples: np.ndarray, tempo: float, pitch_cents: int) -> np.ndarray:
    """sox tempo/pitch on float32 16 kHz mono samples."""
    if tempo == 1.0 and pitch_cents == 0:
        return samples
    effects = []
    if tempo != 1.0:
        effects += ["tempo", "-s", f"{tempo}"]
    if pitch_cents:
        effects += ["pitch", f"{pitch_cents}"]
    raw = ["-t", "raw", "-r", str(SAMPLE_RATE), "-e", "floating-point", "-b", "32", "-c", "1"]
    cmd = [require_sox(), "-V1", "-D", *raw, "-", *raw, "-", *effects, "rate", str(SAMPLE_RATE)]
    done = subprocess.run(cmd, input=np.ascontiguousarray(samples, dtype="<f4").tobytes(),
                          capture_output=True, check=False)
    if done.returncode != 0:
        raise UserError(f"sox failed ({' '.join(effects)}): {done.stderr.decode(errors='replace').strip()}")
    return np.frombuffer(done.stdout, dtype="<f4").astype(np.float32)


def room_impulse(rt60: float, rng: np.random.Generator) -> np.ndarray:
    """A direct path followed by exponentially decaying noise: -60 dB after rt60 seconds."""
    n = int(rt60 * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    tail = rng.standard_normal(n) * np.exp(-6.9078 * t / rt60)  # ln(1000) = 6.9078: 60 dB in amplitude
    tail[: int(0.002 * SAMPLE_RATE)] = 0.0  # first reflections arrive a few ms after the direct sound
    impulse = np.concatenate(([1.0], tail * 0.25))
    return impulse / np.sqrt(np.sum(impulse**2))


def coloured_noise(n: int, colour: str, rng: np.random.Generator) -> np.ndarray:
    white = rng.standard_normal(n)
    if colour == "white":
        return white
    if colour == "brown":
        return lfilter([1.0], [1.0, -0.995], white)
    # pink: Paul Kellet's economy filter (three poles), within 0.5 dB of 1/f over the speech band
    return lfilter([0.049922035, -0.095993537, 0.050612699, -0.004408786],
                   [1.0, -2.494956002, 2.017265875, -0.522189400], white)


def apply(samples: np.ndarray, spec: AugmentSpec) -> np.ndarray:
    """The augmented copy of `samples` (float32, 16 kHz mono), peak-normalised to -1 dBFS."""
    rng = np.random.default_rng(spec.seed)
    out = tempo_pitch(np.asarray(samples, dtype=np.float32), spec.tempo, spec.pitch_cents).astype(np.float64)
    if spec.rt60 > 0:
        wet = fftconvolve(out, room_impulse(spec.rt60, rng))[: len(out)]
        out = (1 - spec.wet) * out + spec.wet * wet
    if spec.snr_db is not None:
        noise = coloured_noise(len(out), spec.colour, rng)
        speech_power = np.mean(out**2)
        noise *= np.sqrt(speech_power / (np.mean(noise**2) * 10 ** (spec.snr_db / 10) + 1e-20))
        out = out + noise
    peak = np.max(np.abs(out)) if len(out) else 0.0
    if peak > 0:
        out = out * (PEAK / peak)
    return out.astype(np.float32)


def augment_corpus(manifest: Path, out: Path, copies: int, seed: int, progress: bool = True) -> Path:
    """`copies` augmented copies of every clip of `manifest`, under `out` (wav/ + manifest.jsonl).

    Resumable: a copy whose WAV exists is not made again. A copy's voice is its source's voice (it is
    the same speaker: splits by speaker stay valid); its spec is in `meta.augment`."""
    if copies < 1:
        raise UserError(f"augmentation copies must be at least 1, got {copies}")
    clips = read_manifest(Path(manifest))
    if not clips:
        raise UserError(f"{manifest} lists no clips")
    wav_dir = out / "wav"
    wav_dir.mkdir(parents=True, exist_ok=True)
    made: list[Utterance] = []
    work = [(copy, clip) for copy in range(copies) for clip in clips]
    for copy, clip in tqdm(work, desc="augment", unit="clip", disable=not progress, dynamic_ncols=True):
        spec = draw_spec(seed, copy, clip.id)
        clip_id = f"{clip.id}-aug{copy}"
        wav = wav_dir / f"{clip_id}.wav"
        if wav.exists():
            duration = sf.info(str(wav)).duration
        else:
            samples, rate = sf.read(str(clip.audio), dtype="float32", always_2d=False)
            if rate != SAMPLE_RATE or samples.ndim != 1:
                raise UserError(f"{clip.audio}: expected 16 kHz mono audio, got {rate} Hz with shape {samples.shape}")
            copy_samples = apply(samples, spec)
            duration = len(copy_samples) / SAMPLE_RATE
            if duration > MAX_SECONDS:
                raise UserError(f"{clip.id}: tempo {spec.tempo} stretches it to {duration:.1f} s, past one "
                                f"Whisper window; pack to at most {MAX_SECONDS * TEMPO_RANGE[0]:.0f} s before augmenting")
            tmp = wav.with_suffix(".tmp.wav")
            sf.write(str(tmp), copy_samples, SAMPLE_RATE, subtype="PCM_16", format="WAV")
            tmp.replace(wav)
        made.append(Utterance(id=clip_id, audio=wav, text=clip.text, duration=round(duration, 4), voice=clip.voice,
                              split=clip.split, source=clip.source,
                              meta={"augment_of": clip.id, "augment": asdict(spec)}))
    return write_manifest(out / "manifest.jsonl", made)
