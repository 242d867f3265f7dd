"""Accept rules of speculative decoding: pure functions on tensors, independent of any engine.

Words, used the same way everywhere in this package:

* anchor      the latest emitted token y_t; the target has not processed it yet. A round feeds the
              target [anchor, candidates] and gets K + 1 prediction rows back.
* candidates  the drafter's K proposed tokens y^_{t+1..t+K}; only the first num_proposed[b] count
              (with R output tokens left an engine proposes at most R - 1, keeping a slot for the
              target's own token).
* accepted    the longest prefix of the candidates the target agrees with (greedy: equal to its
              argmax; sampling: passes the rejection test). An accepted EOS ends the prefix there.
* correction  the target's token at the first disagreement (greedy: its argmax there; sampling: a draw
              from the residual distribution).
* bonus       the target's token after all proposed candidates were accepted (row num_proposed).

Row i of the target output is its prediction after anchor + candidates[:i], so the next anchor is
always target row `accepted`: a correction when accepted < num_proposed, else a bonus. The engine
emits candidates[:accepted] and then next_token, unless eos_accepted (then the transcript ends with the
accepted EOS and next_token is meaningless; it is set to eos_id so a padded row stays a valid id).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class AcceptResult(NamedTuple):
    accepted: Tensor  # [B] long: candidates kept, 0..num_proposed[b]
    next_token: Tensor  # [B] long: correction or bonus = the next anchor; eos_id where eos_accepted
    eos_accepted: Tensor  # [B] bool: an accepted candidate was EOS; the transcript ends with it, no bonus


def _accepted_prefix(ok: Tensor, candidates: Tensor, num_proposed: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """ok [B, K] per-position verdicts -> (accepted [B], eos_accepted [B]).

    accepted = length of the longest prefix where ok holds, i < num_proposed, and no EOS was
    accepted at an earlier position (an accepted EOS is counted, then acceptance stops).
    """
    bsz, K = candidates.shape
    if K == 0:
        none = torch.zeros(bsz, dtype=torch.long, device=candidates.device)
        return none, none.bool()
    proposed = torch.arange(K, device=candidates.device) < num_proposed[:, None]  # [B, K]
    is_eos = candidates == eos_id
    after_eos = torch.zeros_like(is_eos)
    after_eos[:, 1:] = is_eos[:, :-1]  # position i follows an EOS candidate
    keep = (ok & proposed & ~after_eos).long().cumprod(dim=1)  # 1 while the prefix holds
    accepted = keep.sum(dim=1)
    last = candidates.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]
    eos_accepted = (accepted > 0) & (last == eos_id)
    return accepted, eos_accepted


def greedy_accept(candidates: Tensor, target: Tensor, num_proposed: Tensor, eos_id: int) -> AcceptResult:
    """Greedy verification: keep candidates while they equal the target's argmax.

    candidates [B, K] long; target: logits [B, K+1, V] (argmax taken here) or tokens [B, K+1] long;
    num_proposed [B] long (0 = empty proposal: next_token is target row 0).

        accepted a = max{ a : candidates[i] == argmax target[i] for all i < a }
        next_token = argmax target[a]     (correction if a < num_proposed, bonus if a == num_proposed)

    The output equals plain greedy decoding token for token, because every emitted token is the
    target's argmax after exactly the tokens emitted before it.
    """
    target_tokens = target.argmax(dim=-1) if target.is_floating_point() else target  # [B, K+1]
    K = candidates.shape[1]
    accepted, eos_accepted = _accepted_prefix(candidates == target_tokens[:, :K], candidates, num_proposed, eos_id)
    next_token = target_tokens.gather(1, accepted[:, None])[:, 0]
    next_token = torch.where(eos_accepted, torch.full_like(next_token, eos_id), next_token)
    return AcceptResult(accepted, next_token, eos_accepted)


def probs_from_logits(logits: Tensor, temperature: float) -> Tensor:
    """FP32 softmax(logits / T); suppressed (-inf) entries get probability exactly 0."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (use greedy_accept for T = 0)")
    return torch.softmax(logits.float() / temperature, dim=-1)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """normalize((p - q)+) over the last dim, in FP32; where p <= q everywhere (p == q), p itself.

    Drawing from it after a rejection makes the emitted token exactly p-distributed:
    P(emit v) = q(v) min(1, p(v)/q(v)) + (1 - sum_u min(p(u), q(u))) (p(v) - q(v))+ / Z = p(v),
    since Z = sum_u (p(u) - q(u))+ = 1 - sum_u min(p(u), q(u)).
    """
    p, q = p.float(), q.float()
    r = (p - q).clamp(min=0)
    z = r.sum(dim=-1, keepdim=True)
    return torch.where(z > 0, r / z.clamp(min=torch.finfo(torch.float32).tiny), p)


def sample_tokens(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One categorical draw per row: probs [..., V] -> tokens [...] long (e.g. the drafter's candidates)."""
    flat = probs.reshape(-1, probs.shape[-1]).float()
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def speculative_sample(
    candidates: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    num_proposed: Tensor,
    eos_id: int,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): emits tokens distributed as p.

    candidates [B, K] drawn from q; draft_probs q [B, K, V]; target_probs p [B, K+1, V] (row i given
    anchor + candidates[:i], same temperature and token suppression as q); num_proposed [B].

        accept c_i   with probability min(1, p_i(c_i) / q_i(c_i))      (tested as u_i q_i(c_i) < p_i(c_i))
        correction   ~ normalize((p_a - q_a)+) at the first rejection a (p_a if that is all zero)
        bonus        ~ p_n after all n = num_proposed[b] candidates were accepted

    All math in FP32. Draws from `generator` (on the tensors' device): K uniforms per row, then one
    categorical per row, always in that order, so a seeded generator makes the result reproducible.
    """
    bsz, K = candidates.shape
    p = target_probs.float()
    q = draft_probs.float()
    p_c = p[:, :K].gather(2, candidates[..., None])[..., 0]  # [B, K] p_i(c_i)
    q_c = q.gather(2, candidates[..., None])[..., 0]  # [B, K] q_i(c_i)
    u = torch.rand(bsz, K, generator=generator, device=p.device, dtype=torch.float32)
    ok = u * q_c < p_c  # u < p/q without dividing; p_c == 0 never passes
    accepted, eos_accepted = _accepted_prefix(ok, candidates, num_proposed, eos_id)

    # next token from row a = accepted: residual after a rejection, p itself for a bonus
    rows = accepted[:, None, None].expand(bsz, 1, p.shape[-1])
    p_a = p.gather(1, rows)[:, 0]  # [B, V]
    q_a = q.gather(1, rows.clamp(max=K - 1))[:, 0] if K > 0 else torch.zeros_like(p_a)
    rejected = (accepted < num_proposed)[:, None]
    dist = torch.where(rejected, residual_distribution(p_a, q_a), p_a)
    next_token = torch.multinomial(dist, 1, generator=generator)[:, 0]
    next_token = torch.where(eos_accepted, torch.full_like(next_token, eos_id), next_token)
    return AcceptResult(accepted, next_token, eos_accepted)


def confident_length(confidence: Tensor, threshold: float, minimum: int = 0) -> Tensor:
    """How many leading candidates to propose: confidence [B, K] -> [B] long.

    n_b = max(minimum, #{leading j : q_j(c_j) >= threshold}), where q_j(c_j) is the drafter's own
    probability of its candidate at position j (greedy: its max softmax; sampling: q at the draw).

    Why: a candidate after the first rejected one is never used, and the drafter's confidence
    predicts rejection well, while every proposed candidate is one more row in the target's verify
    pass (on a CPU that pass is compute-bound: its cost grows with the rows). Cutting the block
    changes only the cost, never the output: the target still decides every token (a shorter
    block just ends in a correction or bonus sooner). threshold 0 keeps every candidate.
    """
    keep = (confidence >= threshold).long().cumprod(dim=-1).sum(dim=-1)
    return keep.clamp(min=minimum) if minimum else keep
