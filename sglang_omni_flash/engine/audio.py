"""Audio in, log-mel out: read a file (soundfile), mix to mono, resample to 16 kHz, and compute
Whisper's log-mel with transformers' `WhisperFeatureExtractor` over the 30 s window (the same
features transformers `generate()` sees; longer audio is cut at 30 s)."""

from __future__ import annotations

from math import gcd
from pathlib import Path

import numpy as np
import torch

from sglang_omni_flash.errors import UserError

SAMPLE_RATE = 16000


def load_audio(path: str | Path) -> np.ndarray:
    """float32 mono samples at 16 kHz."""
    import soundfile

    path = Path(path)
    if not path.is_file():
        raise UserError(f"audio file not found: {path}")
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises its own LibsndfileError / RuntimeError types
        raise UserError(f"cannot read audio {path}: {exc}") from None
    if data.size == 0:
        raise UserError(f"audio file {path} has no samples")
    return resample(data.mean(axis=1), rate)


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """Polyphase resampling to 16 kHz (scipy), float32."""
    samples = np.asarray(samples, dtype=np.float32)
    if rate == SAMPLE_RATE:
        return samples
    from scipy.signal import resample_poly

    g = gcd(int(rate), SAMPLE_RATE)
    return resample_poly(samples, SAMPLE_RATE // g, int(rate) // g).astype(np.float32)


class LogMel:
    """Waveforms -> log-mel [B, n_mels, 3000] (padded/truncated to 30 s)."""

    def __init__(self, model_dir: str | Path | None, n_mels: int):
        from transformers import WhisperFeatureExtractor

        try:
            self.extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        except (OSError, ValueError, TypeError):
            self.extractor = WhisperFeatureExtractor(feature_size=n_mels)
        if self.extractor.feature_size != n_mels:
            self.extractor = WhisperFeatureExtractor(feature_size=n_mels)

    def __call__(self, waveforms: list[np.ndarray]) -> torch.Tensor:
        out = self.extractor(list(waveforms), sampling_rate=SAMPLE_RATE, return_tensors="pt")
        return out.input_features
