"""Accept rules on hand-built logits: greedy prefix, corrections, bonus, EOS, budget, sampling."""

from __future__ import annotations

import pytest
import torch

from sglang_omni_flash.flash.accept import (
    confident_length,
    greedy_accept,
    probs_from_logits,
    residual_distribution,
    sample_tokens,
    speculative_sample,
)

V = 10
EOS = 9


def one_hot_logits(tokens: list[list[int]]) -> torch.Tensor:
    """Target logits [B, K+1, V] whose argmax in row i is tokens[b][i]."""
    t = torch.tensor(tokens)
    logits = torch.randn(*t.shape, V, generator=torch.Generator().manual_seed(0))
    return logits.scatter(2, t[..., None], 10.0)


def accept(candidates, target_tokens, num_proposed):
    c = torch.tensor(candidates)
    n = torch.tensor(num_proposed)
    by_logits = greedy_accept(c, one_hot_logits(target_tokens), n, EOS)
    by_tokens = greedy_accept(c, torch.tensor(target_tokens), n, EOS)
    for a, b in zip(by_logits, by_tokens):
        assert torch.equal(a, b)
    return [x.tolist() for x in by_logits]


# ------------------------------------------------------------------------------------ greedy


def test_all_candidates_accepted_then_bonus():
    assert accept([[1, 2, 3]], [[1, 2, 3, 4]], [3]) == [[3], [4], [False]]


def test_first_candidate_rejected_gives_correction():
    assert accept([[5, 2, 3]], [[1, 2, 3, 4]], [3]) == [[0], [1], [False]]


def test_mismatch_at_position_j_keeps_prefix_and_corrects():
    # later agreement (position 2) must not count after the mismatch at position 1
    assert accept([[1, 7, 3, 4]], [[1, 2, 3, 4, 5]], [4]) == [[1], [2], [False]]


def test_eos_accepted_mid_block_ends_without_bonus():
    result = accept([[1, EOS, 3, 4]], [[1, EOS, 3, 4, 5]], [4])
    assert result == [[2], [EOS], [True]]


def test_eos_as_correction_is_just_the_next_token():
    assert accept([[1, 2]], [[1, EOS, 3]], [2]) == [[1], [EOS], [False]]


def test_eos_proposed_but_rejected_is_not_accepted():
    assert accept([[EOS, 2]], [[1, 2, 3]], [2]) == [[0], [1], [False]]


def test_budget_ignores_candidates_beyond_num_proposed():
    # candidate 2 would have matched, but only 2 were proposed: bonus is target row 2
    assert accept([[1, 2, 3]], [[1, 2, 3, 4]], [2]) == [[2], [3], [False]]
    # a trailing EOS beyond the budget is not accepted either
    assert accept([[1, EOS]], [[1, EOS, 3]], [1]) == [[1], [EOS], [False]]


def test_empty_proposal_emits_target_row_zero():
    assert accept([[1, 2, 3]], [[6, 2, 3, 4]], [0]) == [[0], [6], [False]]


def test_several_sequences_in_one_batch():
    candidates = [[1, 2, 3], [5, 2, 3], [1, 7, 3], [1, EOS, 3], [1, 2, 3], [1, 2, 3]]
    targets = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, EOS, 0, 0], [1, 2, 3, 4], [8, 2, 3, 4]]
    proposed = [3, 3, 3, 3, 1, 0]
    accepted, next_token, eos = accept(candidates, targets, proposed)
    assert accepted == [3, 0, 1, 2, 1, 0]
    assert next_token == [4, 1, 2, EOS, 2, 8]
    assert eos == [False, False, False, True, False, False]


def test_greedy_output_equals_plain_greedy_decoding():
    """Driving a toy deterministic 'target' with random drafts reproduces its greedy sequence."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(V, V, generator=g)  # next-token logits given the previous token
    table[:, EOS] -= 2.0

    def greedy_reference(start: int, n: int) -> list[int]:
        out, tok = [], start
        for _ in range(n):
            tok = int(table[tok].argmax())
            out.append(tok)
            if tok == EOS:
                break
        return out

    for trial in range(20):
        start, budget, K = trial % V, 12, 4
        emitted, anchor = [], int(table[start].argmax())
        emitted.append(anchor)
        while emitted[-1] != EOS and len(emitted) < budget:
            left = budget - len(emitted)
            cand = torch.randint(0, V, (1, K), generator=g)
            if trial % 2:  # half the trials: drafts that are mostly right
                prev = anchor
                for i in range(K):
                    prev = int(table[prev].argmax()) if torch.rand(1, generator=g) < 0.7 else int(cand[0, i])
                    cand[0, i] = prev
            prefix = torch.cat((torch.tensor([[anchor]]), cand), dim=1)[0]
            target_logits = table[prefix][None]  # [1, K+1, V]
            r = greedy_accept(cand, target_logits, torch.tensor([min(K, left - 1)]), EOS)
            a = int(r.accepted)
            emitted += cand[0, :a].tolist()
            if bool(r.eos_accepted):
                break
            anchor = int(r.next_token)
            emitted.append(anchor)
        assert emitted == greedy_reference(start, budget)


# ---------------------------------------------------------------------------------- sampling


def test_probs_from_logits_suppressed_tokens_are_exactly_zero():
    logits = torch.tensor([[1.0, float("-inf"), 2.0, float("-inf")]], dtype=torch.float16)
    p = probs_from_logits(logits, 0.7)
    assert p.dtype == torch.float32
    assert p[0, 1] == 0 and p[0, 3] == 0
    assert torch.allclose(p.sum(-1), torch.ones(1))
    assert torch.allclose(p[0, [0, 2]], torch.softmax(torch.tensor([1.0, 2.0]) / 0.7, -1))


def test_residual_distribution_math():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.4, 0.1, 0.3])
    r = residual_distribution(p, q)
    assert torch.allclose(r, torch.tensor([0.3, 0.0, 0.1, 0.0]) / 0.4)
    # p == q: nothing left over -> fall back to p
    assert torch.equal(residual_distribution(p, p), p)
    # emitted-token law: q(v) min(1, p/q) + (1 - sum min(p, q)) r(v) == p(v)
    accept_mass = torch.minimum(p, q)
    assert torch.allclose(accept_mass + (1 - accept_mass.sum()) * r, p)


def test_speculative_sample_edge_cases():
    V6 = 6
    p = torch.zeros(1, 3, V6)
    p[0, :, 2] = 1.0  # the target always says 2
    q = torch.full((1, 2, V6), 1 / V6)
    r = speculative_sample(torch.tensor([[2, 2]]), q, p, torch.tensor([2]), eos_id=5)
    assert (r.accepted.item(), r.next_token.item(), r.eos_accepted.item()) == (2, 2, False)  # bonus
    r = speculative_sample(torch.tensor([[3, 2]]), q, p, torch.tensor([2]), eos_id=5)
    assert (r.accepted.item(), r.next_token.item()) == (0, 2)  # p(3) == 0: always rejected
    r = speculative_sample(torch.tensor([[2, 2]]), q, p, torch.tensor([0]), eos_id=5)
    assert (r.accepted.item(), r.next_token.item()) == (0, 2)  # empty proposal: draw from p_0
    p[0, :, :] = 0
    p[0, :, 5] = 1.0
    r = speculative_sample(torch.tensor([[5, 5]]), q, p, torch.tensor([2]), eos_id=5)
    assert (r.accepted.item(), r.next_token.item(), r.eos_accepted.item()) == (1, 5, True)


def test_speculative_sample_is_reproducible_with_a_seeded_generator():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(64, 4, 6, generator=g), -1)
    q = torch.softmax(torch.randn(64, 3, 6, generator=g), -1)
    c = sample_tokens(q, g)
    n = torch.full((64,), 3)
    a = speculative_sample(c, q, p, n, 5, torch.Generator().manual_seed(7))
    b = speculative_sample(c, q, p, n, 5, torch.Generator().manual_seed(7))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# A toy target over 6 tokens: a Markov chain p(next | previous), token 4 suppressed (p == 0 everywhere)
# and token 5 = EOS. The drafter's q is deliberately different and puts mass on the suppressed token.
SV, SEOS, SUPPRESSED, END = 6, 5, 4, 6


def toy_target() -> torch.Tensor:
    logits = torch.tensor(
        [
            [2.0, 0.5, 0.1, 1.0, -1e9, -1.0],
            [0.1, 2.0, 1.0, 0.3, -1e9, 0.0],
            [1.5, 0.2, 0.1, 2.0, -1e9, -0.5],
            [0.3, 1.0, 2.5, 0.1, -1e9, 0.5],
            [0.0, 0.0, 0.0, 0.0, -1e9, 0.0],
            [0.0, 0.0, 0.0, 0.0, -1e9, 0.0],
        ]
    )
    logits[:, SUPPRESSED] = float("-inf")
    return probs_from_logits(logits, 1.0)  # [prev, next]


def toy_draft(K: int) -> torch.Tensor:
    """q_i for each block position, independent of earlier candidates (as in the drafter)."""
    base = torch.tensor(
        [[0.05, 0.3, 0.1, 0.05, 0.3, 0.2], [0.4, 0.05, 0.05, 0.1, 0.2, 0.2], [0.1, 0.1, 0.5, 0.1, 0.1, 0.1]]
    )
    return base[:K]


def sample_first_two(n: int, K: int, seed: int) -> torch.Tensor:
    """Run speculative rounds for n independent transcripts from anchor 0 until each has 2 tokens
    (or ended). Returns codes first * 7 + second, with second = END after an EOS."""
    P, q_block = toy_target(), toy_draft(K)
    g = torch.Generator().manual_seed(seed)
    first = torch.full((n,), -1)
    second = torch.full((n,), -1)
    anchor = torch.zeros(n, dtype=torch.long)  # the prompt's last token; the target has not seen it
    active = torch.ones(n, dtype=torch.bool)
    while active.any():
        q = q_block.expand(n, K, SV)
        cand = sample_tokens(q, g)  # [n, K]
        prev = torch.cat((anchor[:, None], cand), dim=1)  # row i conditions on anchor + cand[:i]
        res = speculative_sample(cand, q, P[prev], torch.full((n,), K), SEOS, g)
        # this round emits cand[:a] and then next_token (unless an EOS was accepted)
        seq = torch.cat((cand, cand[:, :1]), dim=1).scatter(1, res.accepted[:, None], res.next_token[:, None])
        count = res.accepted + (~res.eos_accepted).long()
        for i in range(K + 1):
            emit = active & (i < count)
            to_first = emit & (first == -1)
            to_second = emit & ~to_first & (second == -1)
            first[to_first] = seq[to_first, i]
            second[to_second] = seq[to_second, i]
        second[active & (first == SEOS)] = END
        active = active & (second == -1)
        anchor = res.next_token
    return first * (END + 1) + second


def expected_joint() -> torch.Tensor:
    P = toy_target()
    joint = torch.zeros(SV, END + 1)
    for x in range(SV):
        if x == SEOS:
            joint[x, END] = P[0, x]
        else:
            joint[x, :SV] = P[0, x] * P[x]
    return joint.flatten()


def tv(codes: torch.Tensor, expected: torch.Tensor) -> float:
    empirical = torch.bincount(codes, minlength=expected.numel()).float() / codes.numel()
    return 0.5 * float((empirical - expected).abs().sum())


@pytest.mark.parametrize("K", [1, 3])
def test_speculative_sampling_reproduces_target_distribution(K):
    expected = expected_joint()
    # the draft alone is far from the target, so agreement is not an accident
    assert 0.5 * float((toy_draft(1)[0] - toy_target()[0]).abs().sum()) > 0.3

    small = sample_first_two(2_000, K, seed=11)
    large = sample_first_two(50_000, K, seed=12)
    for codes in (small, large):
        tokens = torch.stack((codes // (END + 1), codes % (END + 1)))
        assert not (tokens == SUPPRESSED).any(), "a suppressed token was emitted"
        assert (tokens >= 0).all()

    tv_small, tv_large = tv(small, expected), tv(large, expected)
    assert tv_small < 0.08
    assert tv_large < 0.02
    assert tv_large < tv_small

    # the marginals of the first and of the second emitted token
    joint = expected.view(SV, END + 1)
    for axis, marginal in ((0, joint.sum(1)), (1, joint.sum(0))):
        axis_codes = large // (END + 1) if axis == 0 else large % (END + 1)
        assert tv(axis_codes, marginal) < 0.015


def test_confident_length_counts_leading_confident_positions():
    conf = torch.tensor([[0.9, 0.6, 0.1, 0.95], [0.1, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5]])
    assert confident_length(conf, 0.5).tolist() == [2, 0, 4]  # stops at the first doubt, even if later ones are sure
    assert confident_length(conf, 0.5, minimum=1).tolist() == [2, 1, 4]
    assert confident_length(conf, 0.0).tolist() == [4, 4, 4]  # threshold 0: every candidate
    assert confident_length(conf, 1.0).tolist() == [0, 0, 0]
