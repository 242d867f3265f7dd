"""Temperature fallback (flash/fallback.py) on converted base, the shipped drafter and real test audio:
the judgement, its decisions on clean speech / forced thresholds / silence, and exactness under speculation."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from sglang_omni_flash.engine.engine import WhisperFlashEngine
from sglang_omni_flash.flash.fallback import LADDER, compression_ratio, judge
from sglang_omni_flash.engine.options import EngineOptions
from sglang_omni_flash.flash.options import SpecOptions


def test_judgement_follows_openai_whisper():
    loop = "I am going home. " * 30
    assert compression_ratio(loop) > 2.4 > compression_ratio("Too bad, my friend. I am very sorry indeed for you.")
    assert judge(loop, -3.0, 10, 0.01).retry  # repetitive
    assert judge("fine words", -12.0, 10, 0.01).retry  # unsure: average -1.2 < -1.0
    assert not judge("fine words", -9.0, 10, 0.01).retry
    silent = judge("you", -12.0, 10, 0.9)  # <|nospeech|> likely AND unsure: silence, no retry
    assert silent.silence and not silent.retry
    assert not judge("you", -4.0, 10, 0.9).silence  # sure of its words: kept, as openai-whisper does
    assert not judge(loop, -30.0, 10, 0.9, compression_ratio_threshold=None, logprob_threshold=None).retry


@pytest.fixture(scope="module")
def engine(base_model_dir):
    return WhisperFlashEngine(EngineOptions(model="base", dtype="float32", batch_size=4, spec=SpecOptions(pace=False)))


@pytest.fixture(scope="module")
def encoded(engine, test_clips):
    clips = sorted(test_clips, key=lambda c: c.duration)[:6]
    return engine.encode(engine.features([c.audio for c in clips]))


def run(engine, encoded, speculative, **changes):
    other = WhisperFlashEngine(engine.options.with_(**changes), model=engine.model, drafter=engine.drafter)
    return other.decode(encoder_out=encoded, speculative=speculative)


def test_clean_speech_never_falls_back_and_equals_plain_greedy(engine, encoded):
    plain = run(engine, encoded, False)
    for speculative in (False, True):
        got = run(engine, encoded, speculative, temperature_fallback=LADDER)
        assert [r.tokens for r in got] == [r.tokens for r in plain]
        assert all(r.fallbacks == 0 and r.temperature == 0.0 and not r.no_speech for r in got)
        assert all(r.avg_logprob > -1.0 and r.compression_ratio < 2.4 for r in got)
        # the target's log-probabilities of the same tokens, whether verified in rounds or steps
        for a, b in zip(got, plain):
            assert a.sum_logprob == pytest.approx(b.sum_logprob, abs=1e-3)
            assert a.no_speech_prob == pytest.approx(b.no_speech_prob, abs=1e-4)
    assert sum(r.accepted for r in got) > 0  # the drafter really proposed and was accepted


def test_forced_thresholds_climb_the_ladder_and_keep_greedy_first_attempts_exact(engine, encoded):
    """logprob_threshold 0 makes every window "unsure": each is retried at every temperature; the
    greedy first attempt is the same with or without speculation (checked through a one-step ladder
    whose retry is never taken: a threshold nothing fails)."""
    forced = dict(temperature_fallback=(0.4, 1.0), logprob_threshold=0.0, no_speech_threshold=None, seed=5)
    for speculative in (False, True):
        got = run(engine, encoded, speculative, **forced)
        assert all(r.fallbacks == 2 and r.temperature == 1.0 for r in got)
        assert all(r.tokens and r.tokens[-1] == engine.special.eos or len(r.tokens) > 100 for r in got)
    again = run(engine, encoded, True, **forced)
    assert [r.tokens for r in again] == [r.tokens for r in run(engine, encoded, True, **forced)]  # seeded


def test_sampled_retries_keep_whispers_distribution_under_speculation(engine, encoded):
    """Many copies of one window, every one retried at T = 1: the tokens sampled after the prefill go
    through the rejection rule under speculation and are drawn directly without; their distributions
    agree (two-sample total variation per position, as the accept-level sampling test)."""
    copies = encoded[1:2].expand(160, -1, -1).contiguous()
    forced = dict(temperature_fallback=(1.0,), logprob_threshold=0.0, no_speech_threshold=None,
                  compression_ratio_threshold=None, max_new_tokens=4, batch_size=8, seed=9)
    spec = run(engine, copies, True, **forced)
    plain = run(engine, copies, False, **forced)
    assert all(r.temperature == 1.0 for r in spec + plain)
    assert sum(r.proposed for r in spec) > 0
    varied = 0
    for pos in range(1, 4):  # position 0 comes from the prefill, not from a round
        a = Counter(r.tokens[pos] for r in spec if len(r.tokens) > pos)
        b = Counter(r.tokens[pos] for r in plain if len(r.tokens) > pos)
        na, nb = sum(a.values()), sum(b.values())
        tv = 0.5 * sum(abs(a[t] / na - b[t] / nb) for t in set(a) | set(b))
        assert tv < 0.2, (pos, a.most_common(5), b.most_common(5))
        varied += len(set(a) | set(b)) > 1
    assert varied, "T = 1 sampled one token everywhere: the test would not see a wrong distribution"


def test_silence_returns_empty_text(engine):
    hiss = (np.random.default_rng(0).standard_normal(16000 * 5) * 0.01).astype(np.float32)
    for speculative in (False, True):
        other = WhisperFlashEngine(engine.options.with_(temperature_fallback=LADDER), model=engine.model,
                                   drafter=engine.drafter)
        (res,) = other.transcribe([hiss], speculative=speculative)
        assert res.no_speech and res.text == "" and res.no_speech_prob > 0.6 and res.avg_logprob < -1.0
        (without,) = WhisperFlashEngine(engine.options, model=engine.model, drafter=engine.drafter).transcribe(
            [hiss], speculative=speculative)
        assert without.text.strip()  # without fallback Whisper hallucinates words into the hiss


def test_bad_ladders_are_refused(engine):
    from sglang_omni_flash.errors import UserError

    for ladder in ((0.4, 0.2), (0.0, 0.5), (3.0,)):
        with pytest.raises(UserError, match="temperature_fallback"):
            WhisperFlashEngine(engine.options.with_(temperature_fallback=ladder), model=engine.model,
                               drafter=engine.drafter)
    assert torch.get_num_threads() >= 1
