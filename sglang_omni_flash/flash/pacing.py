"""Speculate only where it pays: the per-step choice between a Whisper-Flash round and a plain step.

A round over n live requests costs `round_s(n)` seconds and emits `gain(n)` tokens per request (the
accepted candidates plus the correction or bonus); a plain step costs `step_s(n)` and emits one.
So a round pays iff gain(n) * step_s(n) > round_s(n). All three are measured as decoding runs (an
exponential average per n: a round's price depends on the device, the dtype, the batch and the
tree, and its yield on the tree, which busy batches prune). Where rounds do not pay, the decoder
takes plain steps and looks again after 1, 2, 4 ... `max_backoff` of them (the acceptance of the
next words may differ: that round is a probe, whose acceptance updates the running gain). Either
way every token is the target's own greedy (or sampled) choice: the pacer changes the cost, never
the output.

Pure bookkeeping with no clock of its own: the decode loop measures and reports (tests feed it
made-up timings).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Pacer:
    margin: float = 0.02  # a round must beat plain steps by this fraction (timing noise)
    smoothing: float = 0.3  # weight of the newest measurement in the running yields
    # A price (round_s, step_s) is the median of the last `price_window` measurements at that size.
    # Single steps spike (a collection, an interrupt) and a 2-core EPYC's steps move 10-20% between
    # runs: an average weighting the newest 0.3 followed the last three steps, so a batch of 8 once
    # priced its step at 16.8 ms while its 154 steps took 14.9 on average, rounds costing 4.7 steps
    # looked like 4.2, and probes came every 17 steps instead of every 60 (bf16, base, long files:
    # Whisper-Flash 0.88x greedy's decode).
    price_window: int = 15
    max_backoff: int = 256  # most plain steps before a round is tried again (a probe that does not pay costs)
    # a probe may lose at most this share of the plain steps taken before it: where a round costs
    # far more than it brings (a full batch on a CPU), probes come rarely. The bound on what
    # stepping aside costs; max_backoff is set so as not to cut it short (at 64, a batch of 8 on a
    # 2-core EPYC, bf16, whose probe loses 2.8 steps, probed every 64 steps: 4.4%, not 2%)
    probe_budget: float = 0.02
    step_s: dict[int, float] = field(default_factory=dict)  # n -> seconds of a plain step
    round_s: dict[int, float] = field(default_factory=dict)  # n -> seconds of a round
    gain: float | None = None  # tokens per request per round, over all batch sizes (reports)
    # tokens per request per round at n requests: a busy batch verifies smaller trees
    # (`batch_min_path_prob`), so a round yields less there. Measured on a 2-core EPYC, bf16, base:
    # 4.1-4.5 tokens at 8 requests, 4.5-5.8 at 1; one average for all made the tail's rounds vouch
    # for full batches' rounds, which then lost (0.95x greedy at batch 8).
    gains: dict[int, float] = field(default_factory=dict)
    # one-off seconds per request before a batch's first round (the drafter's acoustic K/V): a probe
    # into a batch that has not paid them yet must also earn them back
    setup_s: float | None = None
    # a batch that has not paid its set-up starts rounds only where their advantage earns it back
    # over this many rounds (a 28 s window holds ~90 tokens, ~20 rounds at 4.5 tokens a round).
    # Measured without it on a 2-core EPYC, fp32, base, batch 8: rounds at break-even paid 8 x 18 ms
    # of acoustic K/V per batch for nothing, flash at 0.97x greedy.
    setup_rounds: int = 12
    skip: int = 0  # plain steps left before the next round is considered
    backoff: int = 1
    rounds: int = 0  # decisions taken (for reports)
    steps: int = 0
    # A round right after plain steps runs on caches the steps filled (the drafter's weights and
    # memories evicted): on an AMX Xeon, base, bf16, batch 1, such a round took 50-60 ms against
    # ~35 ms for a round after a round, with plain steps at ~11 ms, so probes priced that way made
    # rounds that pay 1.4x look like a loss. A probe is therefore two rounds, and a round after a
    # step adds only its tokens to the averages, not its seconds (once a round has been measured).
    after_step: bool = False  # the last decision was a plain step
    second_probe: bool = False  # the next decision is the probe's measured round
    cold: bool = False  # the round just decided follows a plain step
    # The same holds the other way: a plain step right after a round runs on caches the drafter
    # filled. Priced from such steps alone, a step looked dearer than it is (a 2-core EPYC, base,
    # bf16, batch 8: rounds at 5.7 warm steps taken for 4.4 tokens, the decode 16% slower than
    # greedy). So a step's price comes from steps that follow steps: a batch size not stepped at
    # (nor one near it) is first decoded by two plain steps, and a step after a round is not priced
    # once a warm one has been.
    # Per batch size: a full batch after a run of small ones (a bench's batch 1 then 8, a server
    # whose load grows) once borrowed batch 1's cost ratio for good, its rounds never set against
    # its own steps (a 2-core EPYC, bf16, base: 82 rounds at 8 requests, no step, 0.95x greedy).
    cold_step: bool = False  # the step just decided follows a round
    warm_steps: set[int] = field(default_factory=set)  # batch sizes whose step was measured after a step
    _samples: dict[tuple[str, int], deque] = field(default_factory=dict, repr=False)

    def speculate(self, n: int, unready: int = 0) -> bool:
        """Take a round now (True) or a plain step (False) with n live requests, `unready` of which
        have not paid their one-off set-up (a round would pay it first)."""
        decision = self._decide(n, unready)
        if decision:
            self.rounds += 1
        else:
            self.steps += 1
        self.cold = decision and self.after_step
        self.cold_step = not decision and not self.after_step
        self.after_step = not decision
        return decision

    def _decide(self, n: int, unready: int) -> bool:
        if not self.round_s:
            return True  # measure a round first (speculation is the default)
        if not self.stepped_near(n):
            return False  # then plain steps at about this batch size: the price its rounds must beat
        ratio, gain = self.cost_ratio(n), self.gain_at(n)
        if ratio is None or gain is None:
            return False
        if self.second_probe:
            self.second_probe = False
            return True
        step = self.step_s.get(n)
        setup = self.setup_s * unready / step if unready and step and self.setup_s is not None else 0.0  # in steps
        # asked at every step, stepping aside or not: a batch whose requests finish often pays where
        # the full batch did not (its last requests decode alone), and must not wait out a skip
        # chosen for the full batch
        if gain >= (1.0 + self.margin) * ratio + setup / self.setup_rounds:
            self.backoff = 1
            self.skip = 0
            return True
        if self.skip > 0:  # stepping aside; the last of these steps is followed by a probe (two rounds)
            self.skip -= 1
            self.second_probe = self.skip == 0
            return self.skip == 0
        # plain steps a probe at this ratio and gain would lose: a probe is two rounds (measured on a
        # 2-core EPYC, base, batch 8: probes priced as one round cost 10% of the decode, not 5%)
        loss = 2.0 * (ratio - gain) + setup
        # a probe into a batch that has not paid its set-up pays it: such probes are not capped by
        # max_backoff (measured on a 2-core EPYC, bf16, base, batch 8: one capped probe per batch of
        # 28 s windows made flash 7% slower than greedy while taking 5 rounds in 150 decisions)
        cap = self.max_backoff if not setup else 8 * self.max_backoff
        self.skip = min(cap, max(self.backoff, math.ceil(loss / self.probe_budget)))
        self.backoff = min(self.max_backoff, 2 * self.backoff)
        return False

    def stepped_near(self, n: int) -> bool:
        """Whether a warm step was measured within a quarter of n requests (at least one) of n: a
        step's cost moves slowly with the batch, but batch 1's is no price for batch 8's."""
        return any(abs(m - n) <= max(1, n // 4) for m in self.warm_steps)

    def cost_ratio(self, n: int) -> float | None:
        """round_s / step_s at n requests, or at the nearest batch size where both were measured
        (a batch shrinks as its requests finish; the ratio moves slowly with n). Only warm step
        prices count: a size stepped at only right after a round (a server's batch changing
        size) has a cold price, dearer than its steps, that would make rounds look cheaper there."""
        m = _nearest([m for m in self.round_s if m in self.warm_steps], n)
        return None if m is None else self.round_s[m] / self.step_s[m]

    def gain_at(self, n: int) -> float | None:
        """Tokens per request per round at n requests, or at the nearest batch size measured."""
        m = _nearest(list(self.gains), n)
        return None if m is None else self.gains[m]

    def pays(self, n: int) -> float | None:
        """Expected speed of rounds over plain steps at n requests (None while unmeasured)."""
        ratio, gain = self.cost_ratio(n), self.gain_at(n)
        return None if ratio is None or gain is None else gain / ratio

    def record_round(self, n: int, seconds: float, tokens_per_request: float) -> None:
        if not (self.cold and n in self.round_s):
            self.round_s[n] = self._price("round", n, seconds)
        self.gains[n] = self._average(self.gains.get(n), tokens_per_request)
        self.gain = self._average(self.gain, tokens_per_request)

    def record_setup(self, n: int, seconds: float) -> None:
        self.setup_s = self._average(self.setup_s, seconds / n)

    def record_step(self, n: int, seconds: float) -> None:
        if self.cold_step and n in self.warm_steps:
            return
        first_warm = not self.cold_step and n not in self.warm_steps  # replaces the cold price, not averaged in
        self.step_s[n] = self._price("step", n, seconds, fresh=first_warm)
        if not self.cold_step:
            self.warm_steps.add(n)

    def _price(self, kind: str, n: int, seconds: float, fresh: bool = False) -> float:
        """The median of the last `price_window` prices of `kind` at n requests, `seconds` included
        (`fresh`: the first of a new series)."""
        recent = self._samples.get((kind, n))
        if recent is None or fresh:
            recent = self._samples[(kind, n)] = deque(maxlen=max(1, self.price_window))
        recent.append(seconds)
        return statistics.median(recent)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.smoothing) * old + self.smoothing * new


def _nearest(sizes: list[int], n: int) -> int | None:
    """The measured batch size closest to n (the larger one on a tie), None if none is."""
    return min(sizes, key=lambda m: (abs(m - n), -m)) if sizes else None


def round_price(seconds: float, tokens_per_request: float, history_s: float = 0.0,
                history_positions: float = 0.0) -> float:
    """What the pacer is told a round cost: its time, with the drafter's history projection inside
    it counted for the positions a run of rounds projects per round (the tokens it emitted), not for
    the backlog it caught up on. history_positions: positions projected per request in that call.

    A drafter projects the target's history states only when it next drafts, so a probe round after
    k plain steps also projects those k positions. Priced whole, every probe looks dearer than the
    rounds it stands for, the pacer steps aside again, and the next probe carries a longer backlog.
    (On an AMX Xeon, bf16, base, batch 1 this alone did not change the bench: 1.07x; pricing the
    cold first round of a probe apart, in `Pacer`, did: 1.47x.) Cost only, never output."""
    if history_positions <= tokens_per_request or history_s <= 0.0:
        return seconds
    return seconds - history_s + history_s * tokens_per_request / history_positions


def batch_min_path_prob(at_one: float, n: int) -> float:
    """The least path probability of a draft-tree node when n requests are verified together,
    from the threshold for one request (the device default, or the user's `tree_min_prob`).

    A node costs one verify row and earns its path probability p in expected tokens. A plain step
    over n requests costs about a + b n (b: one row, a: the rest) and emits n tokens, so a node
    pays iff p (a + b n) / n > b, i.e. p > r n / (1 + r n) with r = b / a. The threshold at one
    request fixes r = p1 / (1 - p1). On a CPU in fp32 (p1 = 0.05) that is 0.17 at 4 requests and
    0.30 at 8: busy batches verify the likely nodes only. Cost only, never output."""
    if n <= 1 or at_one <= 0.0:
        return at_one
    if at_one >= 1.0:
        return 1.0
    r = at_one / (1.0 - at_one)
    return r * n / (1.0 + r * n)


@dataclass
class Backoff:
    """One request's pause from drafting: after a round that accepted nothing, it drafts again only
    after 1, 2, 4 .. `max_backoff` plain steps (the drafter is lost on this stretch of speech); an
    accepted candidate resets it. Cost only, never output."""

    max_backoff: int = 8
    skip: int = 0  # steps left without drafting
    length: int = 0  # the length of the next pause

    def drafts_now(self) -> bool:
        """Whether the request drafts at this step (a step it sits out counts down the pause)."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def after_round(self, proposed: int, accepted: int) -> None:
        if proposed and not accepted and self.max_backoff:
            self.length = min(self.max_backoff, max(1, 2 * self.length))
            self.skip = self.length
        elif accepted:
            self.length = 0
