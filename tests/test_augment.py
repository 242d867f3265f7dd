"""Augmented copies (corpus/augment.py): deterministic from a seed, and each effect does what it says."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from sglang_omni_flash.corpus import augment
from sglang_omni_flash.corpus.manifest import read_manifest


@pytest.fixture(scope="module")
def speech(test_set_paths):
    clip = read_manifest(test_set_paths.librivox)[1]
    samples, rate = sf.read(str(clip.audio), dtype="float32")
    assert rate == 16000
    return clip, samples


def test_spec_is_a_function_of_seed_copy_and_clip_alone():
    assert augment.draw_spec(3, 1, "clip-a") == augment.draw_spec(3, 1, "clip-a")
    specs = {augment.draw_spec(seed, copy, cid) for seed in (0, 1) for copy in (0, 1) for cid in ("a", "b", "c")}
    assert len(specs) == 12  # every (seed, copy, clip) draws its own
    many = [augment.draw_spec(0, c, "x") for c in range(200)]
    lo, hi = augment.TEMPO_RANGE
    assert all(s.tempo == 1.0 or lo <= s.tempo <= hi for s in many)
    assert all(abs(s.pitch_cents) <= augment.PITCH_CENTS for s in many)
    # every effect is drawn sometimes, and sometimes not
    for used in (lambda s: s.tempo != 1.0, lambda s: s.pitch_cents != 0, lambda s: s.rt60 > 0, lambda s: s.snr_db is not None):
        assert 20 < sum(map(used, many)) < 180


def test_same_spec_gives_the_same_samples(speech):
    _, samples = speech
    spec = augment.AugmentSpec(tempo=1.08, pitch_cents=-150, rt60=0.5, wet=0.4, snr_db=12.0, colour="pink", seed=7)
    a, b = augment.apply(samples, spec), augment.apply(samples, spec)
    assert np.array_equal(a, b)
    other = augment.apply(samples, augment.AugmentSpec(1.08, -150, 0.5, 0.4, 12.0, "pink", seed=8))
    assert not np.array_equal(a, other)  # the seed draws the room and the noise
    assert abs(np.max(np.abs(a)) - augment.PEAK) < 1e-6


def test_each_effect_changes_what_it_should(speech):
    _, x = speech
    dry = augment.AugmentSpec(1.0, 0, 0.0, 0.0, None, "white", 0)
    np.testing.assert_allclose(augment.apply(x, dry), x * (augment.PEAK / np.max(np.abs(x))), rtol=1e-5, atol=1e-6)
    slower = augment.apply(x, augment.AugmentSpec(0.92, 0, 0.0, 0.0, None, "white", 0))
    assert abs(len(slower) / len(x) - 1 / 0.92) < 0.01
    pitched = augment.apply(x, augment.AugmentSpec(1.0, 200, 0.0, 0.0, None, "white", 0))
    assert abs(len(pitched) - len(x)) < 0.01 * len(x)  # pitch keeps the duration ...
    assert not np.allclose(pitched[: len(x)], x[: len(pitched)], atol=1e-2)  # ... and changes the samples
    noisy = augment.apply(x, augment.AugmentSpec(1.0, 0, 0.0, 0.0, 10.0, "white", 0))
    x64, n64 = x.astype(np.float64), noisy.astype(np.float64)
    scale = np.dot(n64, x64) / np.dot(x64, x64)  # the peak normalisation's gain
    ratio = 10 * np.log10(np.mean((scale * x64) ** 2) / np.mean((n64 - scale * x64) ** 2))  # noise 10 dB under
    assert 7 < ratio < 13, ratio
    impulse = augment.room_impulse(0.5, np.random.default_rng(0))
    energy = np.cumsum(impulse[::-1] ** 2)[::-1]  # Schroeder decay: ~-60 dB after rt60
    at_rt60 = 10 * np.log10(energy[int(0.5 * 16000) - 400] / energy[0])
    assert -70 < at_rt60 < -45, at_rt60


def test_augment_corpus_is_deterministic_and_resumable(test_set_paths, tmp_path):
    clips = read_manifest(test_set_paths.librivox)[:3]
    from sglang_omni_flash.corpus.manifest import write_manifest

    source = write_manifest(tmp_path / "source.jsonl", clips)
    first = augment.augment_corpus(source, tmp_path / "a", copies=2, seed=5, progress=False)
    second = augment.augment_corpus(source, tmp_path / "b", copies=2, seed=5, progress=False)
    made = read_manifest(first)
    assert [u.id for u in made] == [f"{c.id}-aug{k}" for k in range(2) for c in clips]
    assert all(u.voice == "librivox:real" and u.meta["augment_of"] for u in made)  # same speaker: splits stay valid
    for u, v in zip(made, read_manifest(second)):
        assert u.audio.read_bytes() == v.audio.read_bytes()
    made[0].audio.unlink()  # an interrupted run: the missing copy is made again, the same
    again = read_manifest(augment.augment_corpus(source, tmp_path / "a", copies=2, seed=5, progress=False))
    assert again[0].audio.read_bytes() == read_manifest(second)[0].audio.read_bytes()
