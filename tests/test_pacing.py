"""The pacer: rounds only where their measured cost is paid by the acceptance; output never changes."""

from __future__ import annotations

import pytest
import torch

from sglang_omni_flash.flash.pacing import Pacer, round_price


def test_first_a_round_then_a_step_then_by_cost():
    pacer = Pacer()
    assert pacer.speculate(4)  # nothing measured: speculate
    pacer.record_round(4, 0.030, tokens_per_request=3.0)
    assert not pacer.speculate(4)  # plain steps, to know what a round must beat
    pacer.record_step(4, 0.025)  # right after the round: on caches the drafter filled
    assert not pacer.speculate(4)  # so a second one, after a step, sets the price
    pacer.record_step(4, 0.015)
    assert pacer.pays(4) == pytest.approx(1.5)
    assert all(pacer.speculate(4) for _ in range(5))


def test_a_step_right_after_a_round_does_not_move_the_price_of_a_step():
    pacer = Pacer(smoothing=1.0, price_window=1)
    pacer.record_round(8, 0.060, tokens_per_request=4.0)
    pacer.record_step(8, 0.015)  # warm (no decision before it)
    pacer.gains[8], pacer.round_s[8] = 1.0, 0.100  # rounds stop paying: the pacer steps aside
    assert not pacer.speculate(8)
    pacer.after_step = False  # as if a round had just run
    pacer.speculate(8)
    pacer.cold_step = True
    pacer.record_step(8, 0.030)
    assert pacer.step_s[8] == 0.015


def test_rounds_that_do_not_pay_back_off_and_are_probed_again():
    pacer = Pacer(max_backoff=4, smoothing=1.0, price_window=1, probe_budget=1.0)  # the doubling alone
    pacer.record_round(2, 0.030, tokens_per_request=1.2)
    pacer.record_step(2, 0.015)  # a round costs 2 steps and brings 1.2 tokens
    gaps, plain = [], 0
    for _ in range(30):
        if pacer.speculate(2):
            gaps.append(plain)
            plain = 0
            pacer.record_round(2, 0.030, tokens_per_request=1.2)  # the probe did not pay either
        else:
            plain += 1
    # plain steps between probes, doubling, capped; a probe is two rounds (the first runs on caches
    # the plain steps filled, the second is measured)
    assert gaps[:10] == [2, 0, 2, 0, 4, 0, 4, 0, 4, 0]  # a probe loses 2 x 0.8 steps: 2 steps before the first
    pacer.record_round(2, 0.030, tokens_per_request=9.0)  # a probe that accepted a lot
    while pacer.skip:
        pacer.speculate(2)
    assert all(pacer.speculate(2) for _ in range(5))  # rounds pay again: back to speculating


def test_a_round_after_plain_steps_adds_its_tokens_but_not_its_seconds():
    pacer = Pacer(smoothing=1.0, price_window=1, probe_budget=100.0)
    pacer.record_round(1, 0.030, tokens_per_request=4.0)
    pacer.record_step(1, 0.010)
    assert pacer.speculate(1)  # pays: 4 tokens for 3 steps
    pacer.record_round(1, 0.031, tokens_per_request=4.0)
    assert pacer.round_s[1] == 0.031  # a round after a round: measured
    pacer.gains[1] = 2.0  # a stretch the drafter knows less well
    assert not pacer.speculate(1)  # steps aside
    pacer.record_step(1, 0.010)
    assert pacer.speculate(1)  # the probe's first round, on caches the step filled
    pacer.record_round(1, 0.055, tokens_per_request=4.0)
    assert pacer.round_s[1] == 0.031 and pacer.gains[1] == 4.0  # its tokens count, its seconds do not
    assert pacer.speculate(1)  # the probe's second round: measured
    pacer.record_round(1, 0.032, tokens_per_request=4.0)
    assert pacer.round_s[1] == 0.032


def test_an_unmeasured_batch_size_borrows_the_nearest_ratio():
    pacer = Pacer()
    pacer.record_round(8, 0.08, 2.0)
    pacer.record_step(8, 0.02)  # at 8 requests a round costs 4 steps
    assert pacer.cost_ratio(7) == pytest.approx(4.0)
    assert not pacer.speculate(7)
    pacer.record_round(1, 0.02, 2.0)
    pacer.cold_step = False  # measured after a step (warm)
    pacer.record_step(1, 0.015)
    assert pacer.cost_ratio(2) == pytest.approx(0.02 / 0.015)


def test_probes_are_rarer_where_a_round_costs_far_more_than_it_brings():
    pacer = Pacer(max_backoff=128, smoothing=1.0, price_window=1, probe_budget=0.05)
    pacer.record_round(8, 0.12, 2.0)
    pacer.record_step(8, 0.03)  # at 8 requests a round costs 4 steps and brings 2: a probe (two rounds) loses 4
    assert not pacer.speculate(8)
    assert pacer.skip == 80  # 4 steps lost in at most 5% of the plain steps before the probe
    pacer.record_round(1, 0.0205, 2.0)
    pacer.cold_step = False  # a step after a step
    pacer.record_step(1, 0.010)  # at 1 request a round costs 2.05 steps: a probe loses 0.05
    pacer.skip = 0
    assert not pacer.speculate(1)
    assert pacer.skip == 2  # the doubling back-off (1, 2, ...) is longer than the budget asks


# ------------------------------------------------------------------- in real decoding (tiny.en, fp32)


@pytest.fixture(scope="module")
def tiny(tiny_en_model_dir, test_clips):
    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.engine.options import EngineOptions
    from sglang_omni_flash.flash.options import SpecOptions

    torch.set_num_threads(1)
    engine = WhisperFlashEngine(EngineOptions(model="tiny.en", dtype="float32", batch_size=4, spec=SpecOptions(pace=True)))
    encoded = engine.encode(engine.features([c.audio for c in test_clips[:8]]))
    greedy = [r.tokens for r in engine.decode(encoder_out=encoded, speculative=False)]
    return engine, encoded, greedy


def test_a_probe_is_priced_without_the_history_backlog_it_catches_up_on():
    """A round costs 2 plain steps and emits 3 tokens, plus 1 ms of history projection per position.
    A probe after k plain steps projects k more positions; priced whole it would look like it does
    not pay, and each longer stretch of plain steps would make the next probe dearer still."""
    step, own, per_position, gain = 0.010, 0.017, 0.001, 3.0

    def probe(k: int) -> float:  # the round's seconds and the price the pacer is told
        history = per_position * (gain + k)
        return round_price(own + history, gain, history, gain + k)

    assert round_price(own + 0.003, gain, 0.003, gain) == own + 0.003  # a round after a round: as measured
    for k in (0, 8, 64):
        assert probe(k) == pytest.approx(own + per_position * gain)
    pacer = Pacer()
    pacer.record_step(1, step)
    pacer.record_round(1, (own + per_position * (gain + 64)), gain)  # priced whole: 8.1 ms over 2 steps' worth
    assert not pacer.speculate(1)
    fair = Pacer()
    fair.record_step(1, step)
    fair.record_round(1, probe(64), gain)
    assert fair.speculate(1)
    assert round_price(0.02, 3.0) == 0.02  # no history projected: unchanged


def test_paced_decoding_steps_aside_for_a_drafter_that_proposes_garbage(tiny):
    from sglang_omni_flash.engine.proposers import RandomProposer

    engine, encoded, greedy = tiny
    results = engine.decode(encoder_out=encoded, proposer=RandomProposer(engine.target.vocab_size, 8, seed=1))
    assert [r.tokens for r in results] == greedy
    assert engine.pacer.steps > 3 * engine.pacer.rounds  # rounds only as probes
    assert sum(r.rounds for r in results) < 0.3 * sum(r.target_calls for r in results)


def test_paced_decoding_keeps_speculating_where_everything_is_accepted(tiny):
    from sglang_omni_flash.engine.proposers import OracleProposer

    engine, encoded, greedy = tiny
    results = engine.decode(encoder_out=encoded, proposer=OracleProposer(greedy, 8))
    assert [r.tokens for r in results] == greedy
    assert engine.pacer.rounds > 2 * engine.pacer.steps


def test_paced_decoding_with_the_shipped_drafter_is_exact_at_every_batch_size(tiny):
    engine, encoded, greedy = tiny
    for batch in (1, 3, 4):
        engine.resize(batch)
        assert [r.tokens for r in engine.decode(encoder_out=encoded, speculative=True)] == greedy
    engine.resize(4)


def test_busier_batches_verify_only_likelier_tree_nodes():
    """batch_min_path_prob: the threshold at one request is the given one; it rises with the batch
    (a node's row costs the same while a token is worth less of a busier step) and stays below 1;
    0 (no threshold, e.g. CUDA) stays 0."""
    from sglang_omni_flash.flash.pacing import batch_min_path_prob

    assert batch_min_path_prob(0.05, 1) == 0.05
    thresholds = [batch_min_path_prob(0.05, n) for n in (1, 2, 4, 8, 16, 64)]
    assert thresholds == sorted(thresholds) and thresholds[-1] < 1.0
    # b / a = 0.05 / 0.95: at 4 requests a node must pay b per 4 b / (a + 4 b) of a token
    assert abs(batch_min_path_prob(0.05, 4) - (4 / 19) / (1 + 4 / 19)) < 1e-12
    assert batch_min_path_prob(0.0, 8) == 0.0


def test_a_batch_that_has_not_paid_its_setup_needs_rounds_that_earn_it_back():
    # rounds that beat steps by 5%: worth taking once the drafter's acoustic K/V exist, not worth
    # paying 8 x 18 ms of them for (10 plain steps of 15 ms, earned back at 0.2 steps a round)
    def pacer():
        p = Pacer(smoothing=1.0, price_window=1)
        p.record_round(8, 0.060, tokens_per_request=4.2)
        p.record_step(8, 0.015)
        p.record_setup(8, 8 * 0.018)
        return p

    assert pacer().pays(8) == pytest.approx(1.05)
    assert pacer().speculate(8, unready=0)
    assert not pacer().speculate(8, unready=8)
    rich = pacer()
    rich.record_round(8, 0.060, tokens_per_request=6.0)  # 1.5x: the set-up is earned in a round or two
    assert rich.speculate(8, unready=8)


def test_the_set_up_counts_only_the_requests_that_have_not_paid_it():
    # a server's batch: one new request among eight already drafting adds one request's set-up,
    # not eight (rounds 5% better than steps pay it back within the 12 rounds; eight do not)
    p = Pacer(smoothing=1.0, price_window=1)
    p.record_round(8, 0.060, tokens_per_request=4.2)
    p.record_step(8, 0.015)
    p.record_setup(1, 0.018)
    assert p.setup_s == pytest.approx(0.018)
    assert p.speculate(8, unready=1)
    q = Pacer(smoothing=1.0, price_window=1)
    q.record_round(8, 0.060, tokens_per_request=4.2)
    q.record_step(8, 0.015)
    q.record_setup(1, 0.018)
    assert not q.speculate(8, unready=8)


def test_a_shrinking_batch_takes_rounds_where_they_pay_without_waiting_out_its_skip():
    # rounds lose at 8 requests (5 steps' cost for 4.2 tokens) and pay at 2 (2.5 steps' cost)
    p = Pacer(smoothing=1.0, price_window=1)
    for n, round_s, step_s in ((8, 0.075, 0.015), (2, 0.020, 0.008)):
        p.record_round(n, round_s, tokens_per_request=4.2)
        p.record_step(n, step_s)
    assert not p.speculate(8)
    assert p.skip > 10  # a long skip for the full batch
    assert not p.speculate(8)
    assert p.speculate(2)  # six of its requests finished: rounds pay now
    assert p.skip == 0


def test_a_rounds_yield_is_kept_per_batch_size():
    # measured on a 2-core EPYC, bf16: a round yields ~5.5 tokens a request alone (a full tree) and
    # ~4.2 among 8 (pruned trees); at a cost of 5 steps the full batch must not borrow the tail's yield
    p = Pacer(smoothing=1.0, price_window=1)
    p.record_round(8, 0.075, tokens_per_request=4.2)
    p.record_step(8, 0.015)
    p.record_round(1, 0.015, tokens_per_request=5.5)
    p.record_step(1, 0.005)
    assert p.gain_at(8) == 4.2 and p.gain_at(1) == 5.5
    assert p.gain_at(3) == 5.5 and p.gain_at(6) == 4.2  # unmeasured sizes borrow the nearest
    assert p.gain == 5.5  # the overall running average (reports) follows the last round
    assert not p.speculate(8)
    assert p.speculate(1)


def test_a_batch_size_far_from_any_stepped_at_first_measures_its_own_steps():
    # a bench's batch 1, then batch 8 (or a server whose load grows): rounds paid at 1 request; at 8
    # they must be set against plain steps at 8, not borrow batch 1's ratio for good
    p = Pacer(smoothing=1.0, price_window=1)
    p.record_round(1, 0.015, tokens_per_request=5.0)
    p.record_step(1, 0.005)
    assert p.speculate(1)
    p.record_round(1, 0.015, tokens_per_request=5.0)
    assert p.stepped_near(2) and not p.stepped_near(3) and not p.stepped_near(8)
    assert not p.speculate(8)  # right after a round: cold, not the price
    p.record_step(8, 0.020)
    assert not p.speculate(8)
    p.record_step(8, 0.013)  # a step after a step: batch 8's price
    assert p.step_s[8] == 0.013 and 8 in p.warm_steps
    p.record_round(8, 0.070, tokens_per_request=4.2)  # a round at 8 costs 5.4 steps for 4.2 tokens
    assert not p.speculate(8) and not p.speculate(7)  # 7 borrows 8's price
    assert p.speculate(1)  # while one request alone still pays


def test_a_cold_step_price_never_sets_a_batch_sizes_ratio():
    # a server's batch changes size right after a round: its one step at the new size ran on the
    # drafter's caches (dearer); until a step after a step is measured there, a warm size sets the ratio
    p = Pacer(smoothing=1.0, price_window=1)
    p.record_round(4, 0.040, tokens_per_request=4.0)
    p.record_step(4, 0.010)  # warm: a round at 4 requests costs 4 steps for 4 tokens (no gain)
    p.cold_step = True  # a step right after a round, at a size not stepped at before
    p.record_step(5, 0.030)
    p.record_round(5, 0.050, tokens_per_request=4.0)
    assert p.step_s[5] == 0.030 and 5 not in p.warm_steps
    assert p.cost_ratio(5) == pytest.approx(4.0)  # not 0.050 / 0.030
    assert not p.speculate(5)
    p.cold_step = False
    p.record_step(5, 0.0125)  # a warm step at 5 replaces the cold price
    assert p.step_s[5] == 0.0125 and p.cost_ratio(5) == pytest.approx(4.0)


def test_where_rounds_never_pay_stepping_aside_costs_at_most_the_probe_budget():
    """The default pacer's bound, with the prices of a full batch on a 2-core EPYC (bf16, base, long
    files): a round costs 4.7 plain steps and brings 3.3 tokens. Over 3,000 decisions the probes lose
    at most ~2% of the time plain steps would have taken (max_backoff must not cut the budget short)."""
    step, round_, gain = 0.0149, 0.070, 3.3
    pacer = Pacer()
    pacer.record_round(8, round_, gain)
    pacer.cold_step = False
    pacer.record_step(8, step)
    spent, tokens = 0.0, 0.0
    for _ in range(3000):
        if pacer.speculate(8):
            pacer.record_round(8, round_, gain)
            spent, tokens = spent + round_, tokens + gain
        else:
            pacer.record_step(8, step)
            spent, tokens = spent + step, tokens + 1
    plain = tokens * step  # the same tokens by plain steps
    assert pacer.rounds >= 4  # it still probes now and then
    assert spent / plain - 1 <= 0.025, spent / plain
