"""Token-tree verification: verify several drafts of one round in the same single target pass.

The drafter fills its K mask positions in one pass, so for every position j it gives a whole
distribution q_j, not only its argmax. The chain of argmaxes is one draft; the target would accept a
longer prefix, in a good share of rounds, had position j held q_j's second or third choice. A
*draft tree* holds several such continuations that share their common prefixes, and the target
checks every node in ONE causal pass: node x's row attends to the request's committed cache plus
x's own ancestors (a tree attention mask), at position t + depth(x).

Which nodes: best-first by the drafter's estimate of the probability that the target reaches them,

    score(c_1..c_d) = q_1(c_1) * q_2(c_2) * ... * q_d(c_d),

taking the top `width` tokens of each q_j as children, until `nodes` nodes are chosen or the best
remaining score falls below `min_path_prob`. A child never scores above its parent, so the chosen
set is a tree whose nodes are listed parents-first. On a CPU, where every verified row costs, the
tree spends rows where acceptance is likely; with nodes = K it has the chain's row count.

Greedy exactness (why output cannot change): row x of the verify pass is the target's next-token
logits after exactly prefix + path(x), so its argmax g(x) is what plain greedy decoding emits after
that path. Walking from the anchor, the accepted path follows, at each step, the child whose token is
g(current); the first time no child matches, g(current) is the correction (or the bonus at a leaf).
Every emitted token is therefore g(previous prefix): the target's own greedy sequence. Siblings
hold distinct tokens (the top-w of one distribution), so at most one child can match.

Layout of one verify block of T = 1 + N rows for request b with anchor at position t:
row 0 = anchor (slot t, position t), row r = node r (slot t + r, position t + depth(r)).
After acceptance the K/V of the accepted nodes move from their slots to positions t+1..t+a, so the
cache is again "positions 0..len-1 in slots 0..len-1" (see `move_plan`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """Nodes of one round per request, rows 1..N of the verify block (row 0 is the anchor).

    tokens / parent / depth / valid: [n, N]. parent is a verify-row index (0 = the anchor), always
    smaller than the node's own row; padding nodes (requests with fewer nodes) are invalid and
    never accepted.
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    # host copies for the walk: per request {(parent row, token): child row} and the node tokens
    children: list[dict[tuple[int, int], int]]
    token_lists: list[list[int]]

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def build_tree(probs: torch.Tensor, num: list[int], nodes: int | list[int], width: int = 4,
               min_path_prob: float = 0.0, pad_token: int = 0) -> DraftTree:
    """probs [n, K, V] (the drafter's distributions after the logit rules) -> the draft tree of each
    request: at most `nodes` nodes (or nodes[b]), depth <= num[b] (the budget rule: R tokens left ->
    depth R-1), best-first by path score, at least one node per request with num[b] > 0."""
    n, k, _ = probs.shape
    nodes = [nodes] * n if isinstance(nodes, int) else list(nodes)
    w = min(width, probs.shape[-1])
    top_p, top_i = (x.tolist() for x in probs.float().topk(w, dim=-1))
    rows: list[list[tuple[int, int, int]]] = []  # per request: (token, parent row, depth)
    for b in range(n):
        chosen: list[tuple[int, int, int]] = []
        limit = min(num[b], k)
        if limit > 0:
            # heap of (-score, tie-break, token, parent row, depth)
            heap = [(-top_p[b][0][i], i, top_i[b][0][i], 0, 1) for i in range(w)]
            heapq.heapify(heap)
            tie = w
            while heap and len(chosen) < nodes[b]:
                neg, _, token, parent, depth = heapq.heappop(heap)
                if chosen and -neg < min_path_prob:
                    break
                chosen.append((token, parent, depth))
                row = len(chosen)
                if depth < limit:
                    for i in range(w):
                        heapq.heappush(heap, (neg * top_p[b][depth][i], tie, top_i[b][depth][i], row, depth + 1))
                        tie += 1
        rows.append(chosen)
    size = max(1, max(len(r) for r in rows))
    tokens = torch.full((n, size), pad_token, dtype=torch.long)
    parent = torch.zeros((n, size), dtype=torch.long)
    depth = torch.ones((n, size), dtype=torch.long)
    valid = torch.zeros((n, size), dtype=torch.bool)
    for b, chosen in enumerate(rows):
        for j, (token, par, d) in enumerate(chosen):
            tokens[b, j], parent[b, j], depth[b, j], valid[b, j] = token, par, d, True
    device = probs.device
    children = [{(par, token): j + 1 for j, (token, par, _) in enumerate(chosen)} for chosen in rows]
    return DraftTree(tokens.to(device), parent.to(device), depth.to(device), valid.to(device),
                     children, tokens.tolist())


def ancestor_mask(parent: torch.Tensor) -> torch.Tensor:
    """parent [n, N] (the verify row of each node's parent, a tree's `parent`) -> [n, T, T] bool,
    T = 1 + N: entry (r, s) = verify row s is row r itself or one of its ancestors (the anchor, row
    0, is an ancestor of every node)."""
    n, size = parent.shape
    t = size + 1
    anc = torch.eye(t, dtype=torch.bool, device=parent.device).expand(n, t, t).clone()
    batch = torch.arange(n, device=parent.device)
    for r in range(1, t):  # parents come first, so their rows are complete
        anc[:, r] |= anc[batch, parent[:, r - 1]]
    return anc


def tree_attention_mask(parent: torch.Tensor, anchor_pos: torch.Tensor, width: int) -> torch.Tensor:
    """The verify block's attention mask [n, 1, T, width] over cache slots 0..width-1 (parent [n, N]
    as in `ancestor_mask`): slot s is visible to row r when s < t (committed positions of the
    request) or s = t + r' with r' an ancestor-or-self of r."""
    anc = ancestor_mask(parent)
    n, t, _ = anc.shape
    key = torch.arange(width, device=anc.device)[None, :]  # [1, w]
    rel = key - anchor_pos[:, None]  # [n, w]: block row held by each slot
    in_block = (rel >= 0) & (rel < t)
    seen = anc.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(n, t, width))  # [n, T, w]
    mask = (rel < 0)[:, None, :] | (in_block[:, None, :] & seen)
    return mask[:, None]


def tree_positions(depth: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
    """Positions [n, T] of the verify block (depth [n, N] of the nodes): the anchor at t, node r at
    t + depth(r)."""
    zero = torch.zeros_like(depth[:, :1])
    return anchor_pos[:, None] + torch.cat([zero, depth], 1)


def greedy_tree_accept(tree: DraftTree, picks: list[list[int]], num: list[int], eos_id: int):
    """picks[b][r]: the target's greedy token after verify row r of request b (after the logit rules).

    Returns (accepted [n], path [n] (verify rows of the accepted nodes, in order), next_token [n]
    (correction or bonus; meaningless where EOS was accepted), eos_accepted [n]), as host lists:
    the walk is a few dictionary steps, far cheaper on the host than as tensor ops.
    Walk: cur = anchor; while a valid child c of cur with token(c) = picks[cur] exists, within the
    budget num and not past an accepted EOS: accept c, cur = c. next_token = picks[cur].
    """
    accepted, paths, next_token, eos_accepted = [], [], [], []
    for b, children in enumerate(tree.children):
        cur, path, eos = 0, [], False
        while len(path) < num[b]:
            want = picks[b][cur]  # the target's token after the current node
            child = children.get((cur, want))  # siblings hold distinct tokens: one match at most
            if child is None:
                break
            path.append(child)
            cur = child
            if want == eos_id:
                eos = True
                break
        accepted.append(len(path))
        paths.append(path)
        next_token.append(picks[b][cur])
        eos_accepted.append(eos)
    return accepted, paths, next_token, eos_accepted


def move_plan(anchor_pos: list[int], paths: list[list[int]], width: int):
    """Cache slots to move after acceptance: (src, dst) as [n, width] long lists, or None when every
    accepted node already sits at its position (its row equals its depth). The j-th accepted node of
    request b (verify row paths[b][j], slot t + row) goes to slot t + 1 + j; the other entries copy a
    slot onto itself, so one gather + scatter moves every request at once."""
    if all(row == j + 1 for path in paths for j, row in enumerate(path)):
        return None
    src, dst = [], []
    for t, path in zip(anchor_pos, paths):
        d = [t + 1 + j for j in range(width)]
        src.append([t + path[j] if j < len(path) else d[j] for j in range(width)])
        dst.append(d)
    return src, dst
