"""One Whisper-Flash round, planned here once for both back ends.

A round of a request whose anchor (its latest emitted token, not yet seen by the target) sits at
position t (paper 3.1, A.1):

1. **draft**   the drafter's logits for the K positions after the anchor become candidates under
               Whisper's logit rules: a greedy chain, a greedy draft tree (several continuations
               that share prefixes, `flash.tree`), a chain under the timestamp rules, or a sampled
               chain; the block is cut where the drafter doubts (`min_draft_prob`);
2. **verify**  the target runs the anchor and every candidate in one pass: block row r at position
               t + depth(r), attending to the request's cache and to its own ancestors in the block;
3. **settle**  the target's rules-shaped rows decide: the longest agreeing path (greedy) or the
               rejection rule (sampling), then the target's own next token, cut at a stop token.

`draft_round` is step 1 and `settle_round` step 3, as functions of tensors and host lists. The
back ends only execute: the transformers engine (engine/speculative.py) and sglang-omni's ASR-stage
decode worker (integration/worker/) each run the drafter (one call), the verify pass (their own
caches and kernels) and commit what `Settled.rows` says: the K/V and history states of those block
rows become positions t, t+1, ..., t+len(rows)-1 of the request, and everything else of the
block is dropped (rollback). `allowed_candidates` and `flash.pacing` decide, the same way for both,
how many candidates a request may propose and whether a round pays at all.

Words (as in `flash.accept`): emitted[j] is the target's token after block row rows[j]; rows[0]
is the anchor; emitted[-1] is the next anchor, unless the request ended on a stop token. Greedy
output is the target's own greedy transcript token for token, whatever the drafter proposes:
every emitted token is the target's argmax after exactly the tokens emitted before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from sglang_omni_flash.flash.accept import confident_length, greedy_accept, sample_tokens, speculative_sample
from sglang_omni_flash.flash.logit_rules import LogitRules, Prefix
from sglang_omni_flash.flash.options import SpecOptions
from sglang_omni_flash.flash.pacing import batch_min_path_prob
from sglang_omni_flash.flash.tree import DraftTree, build_tree, greedy_tree_accept
from sglang_omni_flash.kernels.argmax import argmax

NO_STOP = -1  # the accept rules' "eos id" when stop tokens are cut afterwards (`_cut_at_stop`)


def allowed_candidates(block: int, tokens_left: int, positions_left: int | None = None) -> int:
    """Candidates a request may propose: at most the block, one fewer than the tokens it may still
    emit (the target's own token comes after them), and none past the decoder window (positions_left:
    positions after the anchor's; None where the token budget already ends inside the window)."""
    return max(0, min(block, tokens_left - 1, block if positions_left is None else positions_left))


@dataclass
class RoundRequest:
    """What a round reads of one request."""

    generated: list[int]  # tokens emitted after the prompt, the anchor last
    num: int  # candidates it may propose (`allowed_candidates`); 0: its block is the anchor alone
    rules: LogitRules  # Whisper's logit rules it decodes under (an empty LogitRules for none)
    temperature: float = 0.0  # 0: greedy
    bias: Tensor | None = None  # [V] added to its draft and verify rows before the rules (sglang's logit_bias)
    stops: frozenset[int] = frozenset()  # tokens that end the request
    room: int | None = None  # most block rows after the anchor the back end can hold (None: no limit)


@dataclass
class Block:
    """One request's verify block: row 0 the anchor, row r > 0 a candidate at depth[r] whose
    ancestor row is parent[r] (a chain: parent r-1, depth r)."""

    tokens: list[int]
    depth: list[int]
    parent: list[int]  # parent[0] = -1

    @property
    def is_chain(self) -> bool:
        return all(p == r - 1 for r, p in enumerate(self.parent))

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Settled:
    """What one request keeps of a round."""

    emitted: list[int]  # tokens emitted this round, in order (ends with a stop token if one was reached)
    rows: list[int]  # block rows kept: rows[j] verified emitted[j]; they become positions t .. t+len-1
    proposed: int  # candidates (or tree nodes) proposed
    accepted: int  # candidates accepted (a stop token among them counts)
    logprobs: list[float]  # log p of each emitted token under its rule-shaped, untempered row


@dataclass
class _Group:
    """Requests of a round that share their logit rules and way of drafting (one tensor path each)."""

    members: list[int]
    rules: LogitRules
    mode: str  # "tree", "chain" (prefix-free rules, greedy), "timestamps" (greedy), "sampled"
    num: list[int] = field(default_factory=list)
    candidates: Tensor | None = None  # [m, k] chain candidates
    tree: DraftTree | None = None
    draft_probs: Tensor | None = None  # [m, k, V] sampled chains
    prefixes: list[Prefix] | None = None  # per block row j (timestamp rules)
    temperatures: Tensor | None = None  # [m] (sampled)


@dataclass
class Round:
    """A drafted round: the blocks to verify, and what settling needs."""

    requests: list[RoundRequest]
    blocks: list[Block]
    groups: list[_Group]


def _shaped_prefix(rules: LogitRules, generated: list[list[int]], device) -> Prefix:
    """The rules' view of each request's prefix (lengths only, unless the rules read tokens)."""
    if not rules.needs_prefix_tensors:
        lengths = [len(g) for g in generated]
        return Prefix.lengths_only(min(lengths), max(lengths))
    return Prefix.from_tokens(generated, rules.timestamps.timestamp_begin, device)


def _extend(rules: LogitRules, prefix: Prefix, tokens: Tensor) -> Prefix:
    tsb = rules.timestamps.timestamp_begin if rules.timestamps is not None else 0
    return prefix.extend(tokens, tsb)


def _tempered(logits: Tensor, temperatures: Tensor) -> Tensor:
    """fp32 softmax(logits / T) per request: logits [m, ..., V], temperatures [m]."""
    shape = (-1,) + (1,) * (logits.dim() - 1)
    return torch.softmax(logits.float() / temperatures.view(shape), dim=-1)


def _with_bias(logits: Tensor, requests: list[RoundRequest]) -> Tensor:
    """logits [m, ..., V] plus each request's bias, in fp32 where any request has one (sglang's
    sampler adds it in fp32 too); untouched otherwise."""
    if all(r.bias is None for r in requests):
        return logits
    out = logits.float()
    out = out.clone() if out is logits else out
    for i, r in enumerate(requests):
        if r.bias is not None:
            out[i] += r.bias.to(out.device, out.dtype)
    return out


def _mode(request: RoundRequest, options: SpecOptions, fixed: bool) -> str:
    if request.temperature > 0:
        return "sampled"
    if request.rules.needs_prefix_tensors:
        return "timestamps"
    room = options.tree_nodes if request.room is None else min(options.tree_nodes, request.room)
    return "tree" if not fixed and room > 0 and request.num > 0 else "chain"


def draft_round(requests: list[RoundRequest], options: SpecOptions, logits: Tensor | None = None,
                tokens: Tensor | None = None, generator: torch.Generator | None = None,
                drafted: list[int] | None = None) -> Round:
    """Step 1 of a round: drafter logits (raw) [m, K, V], or fixed candidate tokens [m, K] (test
    proposers: a chain as given, a deterministic draft when sampling) -> the blocks to verify.
    Row j of them belongs to request drafted[j] (default: request j; a request with num 0 needs none).

    `options` must be resolved (no None). Requests are grouped by their rules and way of drafting, so
    a back end may mix greedy, timestamped and sampled requests in one round."""
    source = logits if logits is not None else tokens
    device = source.device
    row_of = {i: i for i in range(len(requests))} if drafted is None else {r: j for j, r in enumerate(drafted)}
    groups: dict[tuple, _Group] = {}
    for i, request in enumerate(requests):
        mode = _mode(request, options, fixed=logits is None)
        groups.setdefault((id(request.rules), mode), _Group([], request.rules, mode)).members.append(i)
    blocks: list[Block | None] = [None] * len(requests)
    for group in groups.values():
        members = [requests[i] for i in group.members]
        group.num = [r.num for r in members]
        k = max(group.num)
        anchors = [r.generated[-1] for r in members]
        if group.mode == "sampled":  # settling needs them even where no member drafts this round
            group.temperatures = torch.tensor([r.temperature for r in members], device=device)
        if k == 0:
            group.candidates = torch.zeros(len(members), 0, dtype=torch.long, device=device)
        elif logits is None:  # fixed tokens: a chain as given (sampling: a one-hot draft, made in settle)
            group.candidates = _rows(tokens, [row_of.get(i, 0) for i in group.members])[:, :k].to(device)
        else:
            drafts = _rows(logits, [row_of.get(i, 0) for i in group.members])[:, :k]
            _draft_group(group, members, _with_bias(drafts, members), options, len(requests), generator)
        if group.mode == "timestamps" or (group.mode == "sampled" and group.rules.needs_prefix_tensors):
            k = group.candidates.shape[1]
            group.prefixes = [_shaped_prefix(group.rules, [r.generated for r in members], device)]
            for j in range(k):
                group.prefixes.append(_extend(group.rules, group.prefixes[-1], group.candidates[:, j]))
        if group.tree is not None:
            for i, (row, anchor) in enumerate(zip(group.members, anchors)):
                size = int(group.tree.valid[i].sum())
                blocks[row] = Block([anchor] + group.tree.token_lists[i][:size],
                                    [0] + group.tree.depth[i, :size].tolist(),
                                    [-1] + group.tree.parent[i, :size].tolist())
        else:
            cands = group.candidates.tolist()
            for i, (row, anchor) in enumerate(zip(group.members, anchors)):
                n = group.num[i]
                blocks[row] = Block([anchor] + cands[i][:n], list(range(n + 1)), list(range(-1, n)))
    return Round(requests, blocks, list(groups.values()))


def _rows(x: Tensor, members: list[int]) -> Tensor:
    """x's rows of these requests (x itself when they are all of them, in order: no copy)."""
    if members == list(range(x.shape[0])):
        return x
    return x.index_select(0, torch.tensor(members, device=x.device))


def _draft_group(group: _Group, members: list[RoundRequest], logits: Tensor, options: SpecOptions,
                 batch: int, generator) -> None:
    """Candidates of one group from its drafter logits [m, k, V] (bias added): sets group.candidates
    (or group.tree), group.num after the confidence cut, and the draft probabilities when sampling."""
    rules, k = group.rules, logits.shape[1]
    prefix = _shaped_prefix(rules, [r.generated for r in members], logits.device)
    confidence = None
    if group.mode in ("tree", "chain"):
        shaped = rules.apply(logits, Prefix.lengths_only(prefix.min_length, prefix.max_length + k))
        if group.mode == "tree":
            nodes = [options.tree_nodes if r.room is None else min(options.tree_nodes, r.room) for r in members]
            group.tree = build_tree(torch.softmax(shaped.float(), dim=-1), group.num, nodes,
                                    min_path_prob=batch_min_path_prob(options.tree_min_prob, batch))
            return
        group.candidates = argmax(shaped)
        if options.min_draft_prob > 0:
            confidence = torch.softmax(shaped.float(), dim=-1).amax(dim=-1)
    elif group.mode == "timestamps":
        group.candidates, confidence = rules.draft_chain(logits, prefix)
    else:  # sampled: position j's prefix ends with candidate j-1 under timestamp rules
        if not rules.needs_prefix_tensors:
            shaped = rules.apply(logits, Prefix.lengths_only(prefix.min_length, prefix.max_length + k))
            group.draft_probs = _tempered(shaped, group.temperatures)
            group.candidates = sample_tokens(group.draft_probs, generator)
        else:
            picks, probs = [], []
            for j in range(k):
                row = rules.apply(logits[:, j], prefix)
                rules.timestamps.favour_pair_repeat(row, prefix)
                probs.append(_tempered(row, group.temperatures))
                picks.append(sample_tokens(probs[-1], generator))
                prefix = _extend(rules, prefix, picks[-1])
            group.candidates, group.draft_probs = torch.stack(picks, 1), torch.stack(probs, 1)
        confidence = group.draft_probs.gather(2, group.candidates[..., None])[..., 0]
    if confidence is not None and options.min_draft_prob > 0:  # cut each block where the drafter doubts
        confident = confident_length(confidence, options.min_draft_prob, minimum=1).tolist()
        group.num = [min(n, c) for n, c in zip(group.num, confident)]
        k = max(group.num)
        group.candidates = group.candidates[:, :k]
        if group.draft_probs is not None:
            group.draft_probs = group.draft_probs[:, :k]


def settle_round(plan: Round, logits: Tensor, offsets: list[int], generator: torch.Generator | None = None
                 ) -> list[Settled]:
    """Step 3 of a round: the raw verify logits -> what each request keeps.

    logits [R, V]: request i's block row r at row offsets[i] + r (the engine's padded [n, T, V]
    flattened, with offsets i * T; the worker's rows as they come). Each block row is shaped by the
    rules with its own prefix (the emitted tokens and its ancestors in the block) before it decides."""
    settled: list[Settled | None] = [None] * len(plan.requests)
    for group in plan.groups:
        members = [plan.requests[i] for i in group.members]
        lengths = [len(plan.blocks[i]) for i in group.members]
        block = _with_bias(_block_rows(logits, offsets, group.members, lengths), members)  # [m, T, V]
        if group.prefixes is not None:  # row j's prefix: the emitted tokens and candidates 0..j-1
            group.rules.apply(block, Prefix.interleave(group.prefixes[: block.shape[1]]))
        else:
            generated = [len(r.generated) for r in members]
            group.rules.apply(block, Prefix.lengths_only(min(generated), max(generated) + block.shape[1] - 1))
        outcomes = [_cut_at_stop(*outcome, r.stops) for outcome, r in zip(_accept(group, block, generator), members)]
        # log p of every emitted token under its shaped row, one gather (temperature fallback judges them)
        owner = torch.tensor([m for m, (emitted, _, _) in enumerate(outcomes) for _ in emitted], device=block.device)
        row = torch.tensor([r for _, rows, _ in outcomes for r in rows], device=block.device)
        values = token_logprobs(block[owner, row], [t for emitted, _, _ in outcomes for t in emitted])
        start = 0
        for i, n, (emitted, rows, accepted) in zip(group.members, lengths, outcomes):
            settled[i] = Settled(emitted, rows, n - 1, accepted, values[start: start + len(emitted)])
            start += len(emitted)
    return settled


def token_logprobs(shaped: Tensor, tokens: list[int]) -> list[float]:
    """log p(tokens[i]) under rule-shaped rows shaped [m, V]: fp32 log_softmax, as sglang's sampler
    scores a plain step, so a token has the same score whichever pass emitted it."""
    index = torch.tensor(tokens, dtype=torch.long, device=shaped.device)[:, None]
    return torch.log_softmax(shaped.float(), dim=-1).gather(1, index)[:, 0].tolist()


def _block_rows(logits: Tensor, offsets: list[int], members: list[int], lengths: list[int]) -> Tensor:
    """[m, T, V] rows of these requests' blocks (T the longest; shorter blocks repeat their last
    row): a view of the engine's padded layout, a gather otherwise."""
    width = max(lengths)
    if offsets[: len(members)] == [i * width for i in range(len(members))] and members == list(range(len(members))) \
            and logits.shape[0] >= len(members) * width:
        return logits[: len(members) * width].view(len(members), width, -1)
    rows = torch.tensor([[offsets[i] + min(r, n - 1) for r in range(width)] for i, n in zip(members, lengths)],
                        device=logits.device)
    return logits[rows]


def _accept(group: _Group, block: Tensor, generator) -> list[tuple[list[int], list[int], int]]:
    """Per member: (emitted tokens, block rows that verified them, candidates accepted), before stops."""
    num = torch.tensor(group.num, dtype=torch.long, device=block.device)
    if group.tree is not None:
        accepted, paths, nxt, _ = greedy_tree_accept(group.tree, argmax(block).tolist(), group.num, NO_STOP)
        tokens = group.tree.token_lists
        return [([tokens[i][r - 1] for r in path] + [n], [0] + path, len(path))
                for i, (path, n) in enumerate(zip(paths, nxt))]
    k = group.candidates.shape[1]
    if group.mode == "sampled":
        q = group.draft_probs
        if q is None:  # fixed tokens: a deterministic (one-hot) draft
            q = torch.zeros(*group.candidates.shape, block.shape[-1], device=block.device)
            q.scatter_(2, group.candidates[..., None], 1.0)
        res = speculative_sample(group.candidates, q, _tempered(block[:, : k + 1], group.temperatures),
                                 num, NO_STOP, generator)
    else:
        res = greedy_accept(group.candidates, argmax(block[:, : k + 1]), num, NO_STOP)
    cands = group.candidates.tolist()
    return [(cands[i][:a] + [n], list(range(a + 1)), a)
            for i, (a, n) in enumerate(zip(res.accepted.tolist(), res.next_token.tolist()))]


def _cut_at_stop(emitted: list[int], rows: list[int], accepted: int, stops: frozenset[int]):
    """End the round at the first stop token it emits (an accepted EOS ends the transcript there)."""
    for j, token in enumerate(emitted):
        if token in stops:
            return emitted[: j + 1], rows[: j + 1], min(accepted, j + 1)
    return emitted, rows, accepted
