"""merge.py: weight interpolation between a warm start and its fine-tune, and the worst-set selection rule."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_omni_flash.training.merge import interpolate, mean_gain, worst_gain


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


def test_a_tie_of_worst_gain_is_broken_by_the_mean_gain():
    """The base recipe's merge weights 0.25 and 0.5 were both held back by the same synthetic set
    (-0.009): 0.5 gained more on the others, and the merge keeps the better of the two."""
    baseline = {"librispeech": 3.29, "cathy": 3.23, "synthetic": 3.49}
    quarter = {"librispeech": 3.35, "cathy": 3.25, "synthetic": 3.48}
    half = {"librispeech": 3.43, "cathy": 3.29, "synthetic": 3.48}
    assert worst_gain(quarter, baseline) == pytest.approx(worst_gain(half, baseline))
    assert mean_gain(half, baseline) > mean_gain(quarter, baseline)
    rank = lambda sets: (worst_gain(sets, baseline), mean_gain(sets, baseline))  # noqa: E731 - train.merge_with_start's order
    assert max([quarter, half], key=rank) is half
    assert math.isnan(mean_gain({}, baseline))
