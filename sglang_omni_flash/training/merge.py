"""Weight-space interpolation between a warm start and its fine-tune, and the rule that picks one.

Fine-tuning the synthetic-voice drafter on one real speaker gains on that speaker and forgets the
voices it no longer sees (docs/training.md, "What was tried and measured"). Interpolating the weights,
theta(a) = theta_start + a * (theta_tuned - theta_start), trades the two continuously (WiSE-FT,
Wortsman et al. 2022); validation on every held-out set picks the `a` whose WORST set gains most over
the warm start, since a drafter ships only if it beats the old one on real AND synthetic speech.
Pure functions of state dicts and metric dicts; the trainer (train.py) calls them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Buffers that are indices, not weights: a fine-tune may widen the draft vocabulary, and the tuned
# run's ids (a superset of the warm start's) are kept as they are.
NOT_INTERPOLATED = ("draft_vocab",)


def interpolate(start: dict[str, Tensor], tuned: dict[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """theta_start + alpha * (theta_tuned - theta_start) for every floating weight; alpha 1 is `tuned`."""
    if set(start) - set(NOT_INTERPOLATED) != set(tuned) - set(NOT_INTERPOLATED):
        raise ValueError("the two state dicts hold different weights")
    out = {}
    for name, value in tuned.items():
        if name in NOT_INTERPOLATED or not value.is_floating_point():
            out[name] = value.clone()
            continue
        base = start[name].to(value.device, value.dtype)
        if base.shape != value.shape:
            raise ValueError(f"{name}: shape {tuple(base.shape)} against {tuple(value.shape)}")
        out[name] = torch.lerp(base, value, alpha)
    return out


def worst_gain(per_set: dict[str, float], baseline: dict[str, float]) -> float:
    """The smallest gain over the baseline across validation sets (each set's figure minus the baseline's;
    a set the baseline lacks counts from 0). One number that is high only if every set improved."""
    if not per_set:
        return math.nan
    return min(value - baseline.get(name, 0.0) for name, value in per_set.items())


def mean_gain(per_set: dict[str, float], baseline: dict[str, float]) -> float:
    """The mean gain over the baseline across validation sets: what breaks a tie of `worst_gain`
    (two merge weights held back by the same set can differ on every other one)."""
    if not per_set:
        return math.nan
    return sum(value - baseline.get(name, 0.0) for name, value in per_set.items()) / len(per_set)
