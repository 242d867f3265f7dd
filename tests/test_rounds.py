"""flash/rounds.py on hand-made tensors: rounds that mix greedy and sampled requests, some of
which propose nothing this round (their back-off, their budget or the decoder window).

The ASR-stage worker puts whatever requests are running into one round: a temperature-fallback
retry (sampled) beside greedy requests. A sampled request with no candidate still settles through
the rejection rule's bonus draw, which needs its temperature: the stability benchmark found a
round where it was missing (HTTP 500 "'NoneType' object has no attribute 'view'").
"""

from __future__ import annotations

import pytest
import torch

from sglang_omni_flash.flash.logit_rules import LogitRules
from sglang_omni_flash.flash.options import SpecOptions
from sglang_omni_flash.flash.rounds import RoundRequest, draft_round, settle_round

V, K = 50, 4
OPTIONS = SpecOptions(min_draft_prob=0.0, tree_nodes=0).resolved("cpu", torch.float32)


def verify_logits(plan, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Random raw verify logits for the plan's blocks, laid out one block after another."""
    lengths = [len(b) for b in plan.blocks]
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    return torch.randn(sum(lengths), V, generator=torch.Generator().manual_seed(seed)), offsets


@pytest.mark.parametrize("sampled_num", [0, 3])
@pytest.mark.parametrize("greedy_num", [0, 2])
def test_a_round_mixing_greedy_and_sampled_requests_settles_each_by_its_rule(sampled_num, greedy_num):
    rules = LogitRules([])
    greedy = RoundRequest([7, 8], greedy_num, rules)
    sampled = RoundRequest([9], sampled_num, rules, temperature=0.4)
    drafts = torch.randn(2, K, V, generator=torch.Generator().manual_seed(1))
    plan = draft_round([greedy, sampled], OPTIONS, logits=drafts, generator=torch.Generator().manual_seed(2))
    assert [len(b) for b in plan.blocks] == [1 + greedy_num, 1 + sampled_num]

    logits, offsets = verify_logits(plan, seed=3)
    settled = settle_round(plan, logits, offsets, torch.Generator().manual_seed(4))

    # greedy: the drafter's argmax chain, kept while the target's argmax agrees, then the target's own
    target = logits[offsets[0]: offsets[0] + 1 + greedy_num].argmax(-1).tolist()
    chain = drafts[0, :greedy_num].argmax(-1).tolist()
    agree = next((j for j, (c, t) in enumerate(zip(chain, target)) if c != t), greedy_num)
    assert settled[0].emitted == chain[:agree] + [target[agree]]
    assert settled[0].rows == list(range(agree + 1)) and settled[0].accepted == agree
    # sampled: at most its candidates plus one token, each row a verify row of its block
    assert 1 <= len(settled[1].emitted) <= sampled_num + 1 and settled[1].proposed == sampled_num
    assert settled[1].rows == list(range(len(settled[1].emitted)))
    assert all(0 <= t < V for t in settled[1].emitted) and len(settled[1].logprobs) == len(settled[1].emitted)


def test_a_sampled_request_without_candidates_draws_from_its_tempered_row():
    """Its one token follows softmax(row / T): over many seeds, the draw frequencies match."""
    rules = LogitRules([])
    row = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4))
    temperature = 0.7
    counts = torch.zeros(V)
    draws = 3000
    for seed in range(draws):
        plan = draft_round([RoundRequest([5], 0, rules, temperature=temperature)], OPTIONS,
                           logits=torch.zeros(1, K, V))
        settled = settle_round(plan, row[None], [0], torch.Generator().manual_seed(seed))
        assert settled[0].accepted == 0 and settled[0].rows == [0]
        counts[settled[0].emitted[0]] += 1
    expected = torch.softmax(row / temperature, dim=-1)
    assert torch.allclose(counts / draws, expected, atol=0.03), (counts[:4] / draws, expected[:4])
