"""Packed anchor blocks for training (paper 3.3, A.3), as pure functions over tensors.

One utterance is a token sequence S = prompt + the target's greedy continuation (EOS last), with the
target's history states at every position. An *anchor* t is a position of the continuation with at
least one token after it (prompt_len <= t <= L - 2). Its block is [S[t], m, ..., m] at positions
t..t+K; mask row j predicts the label S[t + j], which exists only while t + j <= L - 1 (so nothing
after EOS is ever a label: v_bj = 0 there, and for padded blocks).

Packing: all blocks of an utterance sit side by side in ONE row of the batch, after its history. Block
b's rows attend to history positions < t_b (strictly before its own anchor) and to the rows of block b
-- never to another block -- which is exactly what the unpacked drafter computes for each anchor alone
(`unpacked_loss` is that reference; the test checks both give the same loss).

Loss (paper eq. 3):  L = - sum_{b,j} v_bj w_j log q(S[t_b + j]) / sum_{b,j} v_bj w_j,  w_j = exp(-(j-1)/4).

Tree-aware loss (optional, `soft_weight` = lambda): (1 - lambda) * eq. 3 + lambda * the same weighted sum
of cross-entropies against the target's own next-token distribution at S[t_b + j] (its top-k, stored by
extraction, renormalised over the ids the draft vocabulary holds). A draft tree verifies the drafter's
second and third choices too; distillation teaches them where the target itself hesitates.

Rollout: greedy verification emits exactly the teacher's tokens, so the anchors real Whisper-Flash
decoding starts its rounds from follow from the drafter's accepted prefix at every anchor alone:
t_1 = prompt_len (the prefill emitted S[prompt_len]), t_{r+1} = t_r + a(t_r) + 1 (a accepted, one
correction or bonus), while t_r <= L - 2. These anchors sit right after a rejection, where drafting is
harder than at an evenly spaced anchor; `rollout` scores and samples them (validation, on-policy anchors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sglang_omni_flash.flash.drafter import WhisperFlashDrafter, rope_cos_sin


def position_weights(block_size: int, decay: float = 4.0) -> Tensor:
    """w_j = exp(-(j - 1) / decay), j = 1..K."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)


def sample_anchors(prompt_len: int, length: int, max_anchors: int, generator: torch.Generator) -> list[int]:
    """Up to `max_anchors` anchor positions in [prompt_len, length - 2], without replacement, ascending."""
    first, last = prompt_len, length - 2
    count = last - first + 1
    if count <= 0:
        return []
    if count <= max_anchors:
        return list(range(first, last + 1))
    picks = torch.randperm(count, generator=generator)[:max_anchors]
    return sorted(first + int(i) for i in picks)


@dataclass
class PackedBatch:
    """U utterances, each one packed row: history [Hmax] then A blocks of K+1 rows."""

    block_tokens: Tensor  # [U, A*(K+1)] anchor ids at block starts, 0 at mask rows (ignored there)
    block_pos: Tensor  # [U, A*(K+1)] text positions t_b + i
    is_anchor_row: Tensor  # [U, A*(K+1)] bool
    labels: Tensor  # [U, A, K] target ids, -100 = no label (v_bj = 0)
    history: Tensor | None  # [U, Hmax, n_hist, d] states at positions 0..Hmax-1 (zeros past an utterance)
    history_pos: Tensor  # [U, Hmax]
    attn_mask: Tensor  # [U, 1, A*(K+1), Hmax + A*(K+1)] True = attend
    anchors: list[list[int]]  # per utterance, its anchor positions
    soft_ids: Tensor | None = None  # [U, A, K, k] the target's top-k ids for each label (None: not extracted)
    soft_logprob: Tensor | None = None  # [U, A, K, k] their log-probabilities


def pack(utterances, anchors: list[list[int]], block_size: int, use_history: bool) -> PackedBatch:
    """Build the packed batch for `utterances` (objects with .tokens [L], .history [L, n_hist, d])."""
    K = block_size
    U = len(utterances)
    A = max(1, max(len(a) for a in anchors))
    Q = A * (K + 1)
    h_max = max(1, max((max(a) if a else 0) for a in anchors))  # history rows needed: positions < max anchor
    block_tokens = torch.zeros(U, Q, dtype=torch.long)
    block_pos = torch.zeros(U, Q, dtype=torch.long)
    is_anchor = torch.zeros(U, Q, dtype=torch.bool)
    labels = torch.full((U, A, K), -100, dtype=torch.long)
    block_id = torch.full((U, Q), -1, dtype=torch.long)
    limit = torch.zeros(U, Q, dtype=torch.long)  # history entries < limit are visible to the row
    first = utterances[0]
    top = getattr(first, "top_ids", None)
    soft_ids = soft_logprob = None
    if top is not None:
        k = top.shape[-1]
        soft_ids = torch.zeros(U, A, K, k, dtype=torch.long)
        soft_logprob = torch.full((U, A, K, k), -math.inf)
    history = None
    if use_history:
        history = torch.zeros(U, h_max, *first.history.shape[1:], dtype=first.history.dtype)
    offsets = torch.arange(K + 1)
    for u, (utt, picks) in enumerate(zip(utterances, anchors)):
        toks = utt.tokens
        L = toks.numel()
        if use_history:
            n = min(h_max, L)
            history[u, :n] = utt.history[:n]
        for b, t in enumerate(picks):
            rows = slice(b * (K + 1), (b + 1) * (K + 1))
            block_tokens[u, b * (K + 1)] = toks[t]
            block_pos[u, rows] = t + offsets
            is_anchor[u, b * (K + 1)] = True
            block_id[u, rows] = b
            limit[u, rows] = t
            n_lab = min(K, L - 1 - t)
            labels[u, b, :n_lab] = toks[t + 1 : t + 1 + n_lab]
            if soft_ids is not None:  # row p of the top-k is the distribution of the token at p + 1
                soft_ids[u, b, :n_lab] = utt.top_ids[t : t + n_lab]
                soft_logprob[u, b, :n_lab] = utt.top_logprob[t : t + n_lab].float()
        for b in range(len(picks), A):  # padded blocks: see only themselves, no labels
            block_id[u, b * (K + 1) : (b + 1) * (K + 1)] = b
    history_pos = torch.arange(h_max).expand(U, h_max)
    same_block = block_id[:, :, None] == block_id[:, None, :]  # [U, Q, Q]
    if use_history:
        seen = torch.arange(h_max)[None, None, :] < limit[:, :, None]  # [U, Q, Hmax]
        mask = torch.cat((seen, same_block), dim=2)
    else:
        mask = same_block
    return PackedBatch(block_tokens, block_pos, is_anchor, labels, history, history_pos, mask[:, None], anchors,
                       soft_ids, soft_logprob)


def packed_states(drafter: WhisperFlashDrafter, batch: PackedBatch, acoustic_kv) -> Tensor:
    """The drafter's final-LN states of every mask row, [U, A, K, d] (anchor rows dropped)."""
    cfg = drafter.config
    K = cfg.block_size
    dtype = drafter.mask.dtype
    embed = drafter._require_target().embed_tokens.weight.detach()
    anchor_emb = F.embedding(batch.block_tokens, embed).to(dtype) * cfg.embed_scale  # [U, Q, d]
    mask_rows = drafter.mask.to(dtype).expand_as(anchor_emb)
    block = torch.where(batch.is_anchor_row[..., None], anchor_emb, mask_rows)
    rope = rope_cos_sin(batch.block_pos, cfg.head_dim, cfg.rope_base)
    history_kv = None
    if cfg.use_history:
        projected = drafter.project_history(batch.history)  # [U, Hmax, d]
        history_kv = drafter.history_kv(projected, batch.history_pos)
    for i, layer in enumerate(drafter.layers):
        block = layer(
            block,
            rope,
            history_kv[i] if cfg.use_history else None,
            batch.attn_mask,
            acoustic_kv[i] if cfg.use_audio else None,
        )
    U, Q, d = block.shape
    blocks = block.view(U, Q // (K + 1), K + 1, d)[:, :, 1:]  # [U, A, K, d]
    return drafter.norm(blocks)


def weighted_loss(logits: Tensor, labels: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """logits [N, K, V'] over label ids already mapped to V' columns, labels [N, K] (-100 = none).

    -> (eq. 3 loss, number of labels)."""
    v = labels >= 0
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none").view_as(labels)
    w = weights.to(logits.device)[None, :] * v
    return (ce * w).sum() / w.sum().clamp(min=1e-12), v.sum()


def soft_weighted_loss(logits: Tensor, soft_ids: Tensor, soft_logprob: Tensor, labels: Tensor, weights: Tensor) -> Tensor:
    """logits [N, K, V'], soft_ids [N, K, k] already mapped to V' columns (-1 = not in the draft vocabulary),
    soft_logprob [N, K, k], labels [N, K] (-100 = no label): the eq. 3 weighting of the cross-entropy against
    the target's renormalised top-k distribution."""
    p = torch.where(soft_ids >= 0, soft_logprob.exp(), torch.zeros_like(soft_logprob))
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-12)
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, soft_ids.clamp(min=0))
    ce = -(p * logq).sum(-1)  # [N, K]
    w = weights.to(logits.device)[None, :] * (labels >= 0)
    return (ce * w).sum() / w.sum().clamp(min=1e-12)


def vocab_index(draft_vocab: Tensor | None, vocab_size: int) -> Tensor | None:
    """token id -> column of the draft vocabulary (-1 if absent); None without a draft vocabulary."""
    if draft_vocab is None:
        return None
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_vocab.device)
    index[draft_vocab] = torch.arange(draft_vocab.numel(), device=draft_vocab.device)
    return index


def map_labels(labels: Tensor, index: Tensor | None) -> Tensor:
    """Labels into draft-vocabulary columns; a label outside the draft vocabulary becomes no label."""
    if index is None:
        return labels
    mapped = index.to(labels.device)[labels.clamp(min=0)]
    return torch.where(labels >= 0, mapped, labels).clamp(min=-100)


def map_ids(ids: Tensor, index: Tensor | None) -> Tensor:
    """Token ids into draft-vocabulary columns, -1 where the draft vocabulary lacks the id."""
    return ids if index is None else index.to(ids.device)[ids]


def combined_loss(logits, labels, soft_ids, soft_logprob, weights, soft_weight: float) -> tuple[Tensor, Tensor]:
    loss, n = weighted_loss(logits, labels, weights)
    if soft_weight:
        if soft_ids is None:
            raise ValueError("soft_weight > 0 needs teacher data extracted with top-k log-probabilities")
        loss = (1 - soft_weight) * loss + soft_weight * soft_weighted_loss(logits, soft_ids, soft_logprob, labels, weights)
    return loss, n


def packed_loss(drafter, batch: PackedBatch, acoustic_kv, weights: Tensor, index: Tensor | None,
                soft_weight: float = 0.0):
    """-> (loss, n labels, logits of the labelled rows [N, K, V'], their labels [N, K])."""
    states = packed_states(drafter, batch, acoustic_kv)  # [U, A, K, d]
    labels = map_labels(batch.labels, index)
    keep = (labels >= 0).any(-1)  # blocks with at least one label
    logits = drafter.logits(states[keep], full=False)  # [N, K, V']
    soft_ids = map_ids(batch.soft_ids[keep], index) if batch.soft_ids is not None else None
    soft_logprob = batch.soft_logprob[keep] if batch.soft_logprob is not None else None
    loss, n = combined_loss(logits, labels[keep], soft_ids, soft_logprob, weights, soft_weight)
    return loss, n, logits, labels[keep]


def unpacked_loss(drafter, utterances, anchors, acoustic_per_utt, weights: Tensor, index: Tensor | None,
                  soft_weight: float = 0.0) -> Tensor:
    """Reference: the inference-time drafter forward, one anchor at a time (slow; for tests)."""
    cfg = drafter.config
    all_logits, all_labels, all_ids, all_logprob = [], [], [], []
    for u, (utt, picks) in enumerate(zip(utterances, anchors)):
        toks = utt.tokens
        L = toks.numel()
        history_kv = None
        if cfg.use_history:
            projected = drafter.project_history(utt.history[None])  # [1, L, d]
            history_kv = drafter.history_kv(projected, torch.arange(L)[None])
        for t in picks:
            anchor = toks[t : t + 1]
            pos = torch.tensor([t])
            hk = [(k[:, :, :t], v[:, :, :t]) for k, v in history_kv] if history_kv is not None else None
            h_len = torch.tensor([t]) if history_kv is not None else None
            full = drafter(anchor, pos, hk, h_len, acoustic_per_utt[u])  # [1, K, vocab]
            if index is not None:
                full = full[..., drafter.draft_vocab]
            lab = torch.full((cfg.block_size,), -100, dtype=torch.long)
            n_lab = min(cfg.block_size, L - 1 - t)
            lab[:n_lab] = toks[t + 1 : t + 1 + n_lab]
            all_logits.append(full[0])
            all_labels.append(map_labels(lab, index))
            if soft_weight:
                ids = torch.zeros(cfg.block_size, utt.top_ids.shape[-1], dtype=torch.long)
                logprob = torch.full(ids.shape, -math.inf)
                for j in range(n_lab):  # label j is the token at t + 1 + j: the top-k row of position t + j
                    ids[j] = utt.top_ids[t + j]
                    logprob[j] = utt.top_logprob[t + j].float()
                all_ids.append(map_ids(ids, index))
                all_logprob.append(logprob)
    soft = (torch.stack(all_ids), torch.stack(all_logprob)) if soft_weight else (None, None)
    loss, _ = combined_loss(torch.stack(all_logits), torch.stack(all_labels), *soft, weights, soft_weight)
    return loss


def accepted_prefix(logits: Tensor, labels: Tensor) -> Tensor:
    """Greedy accepted-prefix length per block: leading positions where argmax == label. [N]"""
    hit = (logits.argmax(-1) == labels) & (labels >= 0)
    return hit.long().cumprod(-1).sum(-1)


def rollout(prefix_at: Tensor, prompt_len: int, length: int) -> list[int]:
    """The anchors greedy decoding visits, given the accepted prefix at every anchor.

    prefix_at[i] is the accepted-prefix length at anchor prompt_len + i (i = 0 .. length - prompt_len - 2).
    """
    visited, t = [], prompt_len
    while t <= length - 2:
        visited.append(t)
        t += int(prefix_at[t - prompt_len]) + 1
    return visited


def mix_anchors(visited: list[int], prompt_len: int, length: int, max_anchors: int, share: float,
                generator: torch.Generator) -> list[int]:
    """On-policy anchors: round(share * max_anchors) of them from `visited` (the rollout's anchors), the
    rest evenly from the other anchor positions; without replacement, ascending."""
    on = torch.randperm(len(visited), generator=generator)[: min(len(visited), round(share * max_anchors))]
    picked = {visited[int(i)] for i in on}
    others = [t for t in range(prompt_len, length - 1) if t not in picked]
    rest = torch.randperm(len(others), generator=generator)[: max_anchors - len(picked)]
    return sorted(picked | {others[int(i)] for i in rest})


def rollout_tau(tokens: int, rounds: int, utterances: int) -> float:
    """Tokens per target call of the rollout: each utterance's prefill plus one verify call per round."""
    calls = utterances + rounds
    return tokens / calls if calls else math.nan


def expected_tau(prefix: Tensor) -> float:
    """Tokens per target call if every block were a round: accepted + 1 (correction/bonus)."""
    return float(prefix.float().mean() + 1.0) if prefix.numel() else math.nan
