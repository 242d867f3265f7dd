"""Temperature fallback, as openai-whisper and faster-whisper do it: pure functions over one decode.

A window is decoded greedily first. If its text is too repetitive (gzip compression ratio above
2.4: Whisper's hallucinated loops) or the target was too unsure of it (average log-probability of
its tokens, EOS included, below -1.0), it is decoded again at the next temperature of the ladder
(0.2, 0.4, ... 1.0); the last attempt is kept. A window whose <|nospeech|> probability (at the
<|startoftranscript|> position) is above 0.6 while its average log-probability is below the threshold
is silence: no retry, and its text is empty. Log-probabilities are those of the rule-shaped logits
before any temperature, as in openai-whisper. Under speculation the greedy attempt is token-identical
to plain greedy and the sampled retries keep Whisper's distribution (the rejection rule).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

LADDER = (0.2, 0.4, 0.6, 0.8, 1.0)  # openai-whisper's temperatures after 0


@dataclass(frozen=True)
class Verdict:
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float | None
    silence: bool  # judged silent: empty text, no retry
    retry: bool  # too repetitive or too unsure: decode again at the next temperature (if any is left)


def compression_ratio(text: str) -> float:
    """len(utf-8 bytes) / len(zlib-compressed bytes); repetitive text compresses well (openai-whisper)."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def average_logprob(sum_logprob: float, n_tokens: int) -> float:
    """openai-whisper's avg_logprob: the sum over generated tokens, EOS included, by their count."""
    return sum_logprob / max(1, n_tokens)


def judge(text: str, sum_logprob: float, n_tokens: int, no_speech_prob: float | None,
          compression_ratio_threshold: float | None = 2.4, logprob_threshold: float | None = -1.0,
          no_speech_threshold: float | None = 0.6) -> Verdict:
    """The fallback decision for one attempt; a None threshold switches its check off."""
    avg = average_logprob(sum_logprob, n_tokens)
    ratio = compression_ratio(text)
    unsure = logprob_threshold is not None and avg < logprob_threshold
    silence = (no_speech_threshold is not None and no_speech_prob is not None
               and no_speech_prob > no_speech_threshold and unsure)
    repetitive = compression_ratio_threshold is not None and ratio > compression_ratio_threshold
    return Verdict(avg, ratio, no_speech_prob, silence, retry=not silence and (repetitive or unsure))


@dataclass(frozen=True)
class FallbackPolicy:
    """The ASR stage's temperature fallback: openai-whisper's defaults, which its `--asr.` fields take
    (``integration/serve/config.py``); a None threshold is off."""

    enabled: bool = True  # False: every window is answered as first decoded (no retry, no silence)
    temperatures: tuple[float, ...] = LADDER  # after 0, in order
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6

    def next_temperature(self, temperature: float) -> float | None:
        return next((t for t in self.temperatures if t > temperature + 1e-6), None)
