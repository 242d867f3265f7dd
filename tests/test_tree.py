"""Draft trees (`flash.tree`) as pure functions: which nodes are chosen, the attention mask, the
greedy walk and the cache moves, on hand-made inputs whose answers are worked out in the comments.
Token-identity on real weights and audio is in tests/test_engine_exactness.py."""

from __future__ import annotations

import torch

from sglang_omni_flash.flash.tree import (
    ancestor_mask, build_tree, greedy_tree_accept, move_plan, tree_attention_mask, tree_positions,
)

V = 10


def dists(*rows):
    """probs [1, K, V] from per-position {token: prob}; the rest spread evenly."""
    out = torch.zeros(1, len(rows), V)
    for j, row in enumerate(rows):
        rest = (1.0 - sum(row.values())) / (V - len(row))
        out[0, j] = rest
        for tok, p in row.items():
            out[0, j, tok] = p
    return out


# q_1 = {3: .6, 4: .3}, q_2 = {5: .9}, q_3 = {6: .5, 7: .4}
PROBS = dists({3: 0.6, 4: 0.3}, {5: 0.9}, {6: 0.5, 7: 0.4})


def nodes_of(tree, b=0):
    return [(tree.token_lists[b][j], int(tree.parent[b, j]), int(tree.depth[b, j]))
            for j in range(tree.size) if tree.valid[b, j]]


def test_build_tree_is_best_first_by_path_probability():
    tree = build_tree(PROBS, [3], nodes=6, width=2)
    # scores: 3 .6 | 3-5 .54 | 4 .3 | 3-5-6 .27 | 4-5 .27 | 3-5-7 .216 | ...; ties by push order
    assert nodes_of(tree) == [(3, 0, 1), (5, 1, 2), (4, 0, 1), (6, 2, 3), (5, 3, 2), (7, 2, 3)]
    # parents come before their children, and siblings hold distinct tokens
    for tok, parent, depth in nodes_of(tree):
        assert parent == 0 or nodes_of(tree)[parent - 1][2] == depth - 1


def test_build_tree_respects_budget_threshold_and_pads_rows():
    probs = torch.cat([PROBS, PROBS])
    tree = build_tree(probs, [1, 3], nodes=5, width=2, min_path_prob=0.25)
    assert nodes_of(tree, 0) == [(3, 0, 1), (4, 0, 1)]  # depth <= 1: R-1 rule with R = 2
    assert nodes_of(tree, 1) == [(3, 0, 1), (5, 1, 2), (4, 0, 1), (6, 2, 3), (5, 3, 2)]
    assert tree.size == 5 and int(tree.valid[0].sum()) == 2  # request 0 padded with invalid nodes
    lonely = build_tree(probs[:1], [3], nodes=5, width=2, min_path_prob=0.99)
    assert nodes_of(lonely) == [(3, 0, 1)]  # at least one node, whatever the threshold


def test_ancestor_mask_and_attention_mask():
    tree = build_tree(PROBS, [3], nodes=4, width=2)  # rows: 1 = 3, 2 = 3-5, 3 = 4, 4 = 3-5-6
    anc = ancestor_mask(tree.parent)[0].int().tolist()
    assert anc == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 1, 0, 1]]
    anchor_pos = torch.tensor([3])
    mask = tree_attention_mask(tree.parent, anchor_pos, width=8)[0, 0].int().tolist()
    # slots 0-2 committed, slot 3 + r holds row r, slot 8+ not in view
    assert mask[4] == [1, 1, 1, 1, 1, 1, 0, 1]
    assert mask[3] == [1, 1, 1, 1, 0, 0, 1, 0]
    assert tree_positions(tree.depth, anchor_pos).tolist() == [[3, 4, 5, 4, 6]]


def test_greedy_walk_follows_the_target_through_second_choices():
    tree = build_tree(PROBS, [3], nodes=6, width=2)  # rows 1:3 2:3-5 3:4 4:3-5-6 5:4-5 6:3-5-7
    # the target says 4 after the anchor, then 5, then 9: path rows 3, 5; correction 9
    picks = [[4, 0, 0, 5, 0, 9, 0]]
    accepted, paths, nxt, eos = greedy_tree_accept(tree, picks, [3], eos_id=9)
    assert (accepted, paths, nxt, eos) == ([2], [[3, 5]], [9], [False])
    # same tree, EOS accepted at depth 3 (row 6 holds 7 = eos here): nothing after it
    picks = [[3, 5, 7, 0, 0, 0, 1]]
    accepted, paths, _, eos = greedy_tree_accept(tree, picks, [3], eos_id=7)
    assert (accepted, paths, eos) == ([3], [[1, 2, 6]], [True])
    # the budget stops the walk even where the tree goes deeper; the bonus is the target's pick
    accepted, paths, nxt, _ = greedy_tree_accept(tree, picks, [1], eos_id=7)
    assert (accepted, paths, nxt) == ([1], [[1]], [5])
    # first pick matches no child: the correction alone
    accepted, paths, nxt, _ = greedy_tree_accept(tree, [[8, 0, 0, 0, 0, 0, 0]], [3], eos_id=7)
    assert (accepted, paths, nxt) == ([0], [[]], [8])


def test_invalid_padding_nodes_are_never_accepted():
    probs = torch.cat([PROBS, PROBS])
    tree = build_tree(probs, [1, 3], nodes=5, width=2)
    pad = tree.token_lists[0][4]  # request 0 has 2 real nodes; row 5 is padding with token `pad`
    accepted, _, nxt, _ = greedy_tree_accept(tree, [[pad, 0, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0]], [1, 3], eos_id=9)
    assert accepted == [0, 0] and nxt == [pad, 8]


def test_move_plan():
    assert move_plan([5, 9], [[1, 2], []], 2) is None  # the first chain: already in place
    src, dst = move_plan([5, 9], [[3, 5], [1]], 2)
    assert dst == [[6, 7], [10, 11]]
    assert src == [[8, 10], [10, 11]]  # request 1: its one node is in place, the rest copies onto itself
