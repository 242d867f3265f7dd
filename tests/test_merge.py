"""merge.py: weight interpolation between a warm start and its fine-tune, and the worst-set selection rule."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_omni_flash.training.merge import interpolate, worst_gain


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g),
            "draft_vocab": torch.arange(5 + seed), "steps": torch.tensor(seed)}


def test_interpolation_runs_straight_from_the_start_to_the_tune():
    start, tuned = _state(0), _state(1)
    assert torch.equal(interpolate(start, tuned, 0.0)["w"], start["w"])
    assert torch.equal(interpolate(start, tuned, 1.0)["w"], tuned["w"])
    half = interpolate(start, tuned, 0.25)
    assert torch.allclose(half["w"], 0.75 * start["w"] + 0.25 * tuned["w"], atol=1e-6)
    assert torch.allclose(half["b"], 0.75 * start["b"] + 0.25 * tuned["b"], atol=1e-6)
    # indices are not weights: the tune's (possibly wider) draft vocabulary and integer buffers stay its own
    assert torch.equal(half["draft_vocab"], tuned["draft_vocab"]) and half["steps"] == tuned["steps"]
    assert half["w"] is not tuned["w"]


def test_interpolation_refuses_state_dicts_of_other_shapes():
    start, tuned = _state(0), _state(1)
    with pytest.raises(ValueError, match="different weights"):
        interpolate({"w": start["w"]}, tuned, 0.5)
    with pytest.raises(ValueError, match="shape"):
        interpolate(dict(start, w=torch.zeros(4, 3)), tuned, 0.5)


def test_worst_gain_is_high_only_when_every_set_improved():
    baseline = {"real": 2.0, "synthetic": 3.0}
    assert worst_gain({"real": 2.5, "synthetic": 3.1}, baseline) == pytest.approx(0.1)
    assert worst_gain({"real": 2.9, "synthetic": 2.9}, baseline) == pytest.approx(-0.1)  # a big gain does not hide a loss
    assert worst_gain({"real": 2.5}, {}) == 2.5  # no baseline: the weakest set's own figure
    assert math.isnan(worst_gain({}, baseline))
