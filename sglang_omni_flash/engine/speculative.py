"""The engine-agnostic Whisper-Flash loop: prefill, then rounds of propose -> verify -> accept -> advance.

Words (as in `flash.accept`): the *anchor* is the latest emitted token, not yet seen by the target;
*candidates* are the proposer's guesses after it; *accepted* is the prefix the target agrees with;
the *correction* / *bonus* is the target's own next token, which becomes the next anchor.

Invariant (paper A.1): before a round with anchor y_t at position t, the target cache and the
drafter history hold exactly positions 0..t-1 of the request (prompt + emitted tokens before the
anchor). One causal target pass over [anchor, c_1..c_k] at positions t..t+k gives row i = the
target's token after c_1..c_i. With a candidates accepted the cache keeps t+1+a positions (rollback
by length only: the rest stays allocated and masked) and the history keeps the states of the same
positions, captured in that same pass; c_1..c_a and the correction/bonus are emitted (only c_1..c_a
if c_a is EOS). With R output tokens left a request proposes at most R-1 candidates.

Whisper's logit rules are applied at every position, in draft and verify alike, with the prefix of
position i including the earlier candidates, so greedy output is the target's own greedy transcript
token for token (with or without timestamps); with T > 0 the rejection rule keeps the target's
sampling distribution.

Greedy rounds under prefix-free rules may verify a draft tree instead of one chain (`tree_round`,
`flash.tree`): several continuations in the same single pass, the accepted path's K/V moved to its
positions afterwards; the output is the same greedy transcript.

With a `Pacer` (engine/pacing.py) the loop takes a plain step instead of a round wherever the
measured cost of rounds is not paid by the running acceptance: same tokens, lower cost.

Two small protocols make the loop reusable: a `VerifyBackend` runs the target (the standalone
transformers-weights engine here; an SGLang-Omni worker later), a `Proposer` makes candidates
(the Whisper-Flash drafter, or oracle/random/adversarial proposers in tests). Without a proposer the
same loop is the plain baseline: one token per target call, same kernels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sglang_omni_flash.engine.logit_rules import LogitRules, Prefix
from sglang_omni_flash.engine.pacing import Pacer, batch_min_path_prob
from sglang_omni_flash.flash.accept import (
    confident_length, greedy_accept, probs_from_logits, sample_tokens, speculative_sample,
)
from sglang_omni_flash.flash.tree import (
    build_tree, greedy_tree_accept, move_plan, tree_attention_mask, tree_positions,
)


# ---------------------------------------------------------------------------------- protocols


class VerifyBackend(Protocol):
    """Runs the target over rows 0..n-1 of the active batch (rows are compacted, see `retire`)."""

    def verify(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int, want_history: bool,
               slots: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None):
        """tokens, positions [n, T] -> (logits [n, T, V] raw, history states [n, T, n_hist, d] or None).

        Writes the K/V of every new position into the cache (positions are each row's own; slots
        past a row's committed length are free to overwrite). kv_len = 1 + the largest position.
        A draft tree gives the slots [n, T] to write (else the positions) and its own attention
        mask [n, 1, T, kv_len] (else causal by position); kv_len is then 1 + the largest slot."""
        ...

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots src [n, m] to slots dst [n, m] (draft trees only)."""
        ...

    def commit(self, lengths: list[int]) -> None:
        """Row b now holds exactly positions 0..lengths[b]-1 (rollback by length)."""
        ...

    def retire(self, keep: torch.Tensor) -> None:
        """Only rows `keep` (ascending) stay active; they move to rows 0..len(keep)-1."""
        ...


@dataclass
class Proposal:
    """Candidates of one round: raw drafter logits [n, K, V] (the loop applies the logit rules and
    picks), or fixed tokens [n, K] (test proposers; treated as a deterministic draft when sampling)."""

    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


@dataclass
class RoundInputs:
    """What a proposer may read: the anchor of each row and the request's tokens so far."""

    anchor: torch.Tensor  # [n] long
    anchor_pos: torch.Tensor  # [n] long: position t of the anchor == history length
    kv_len: int  # 1 + the largest anchor position (host int)
    k: int  # candidates needed this round (<= block size)
    request_ids: list[int]  # original request index of each row
    generated: list[list[int]]  # per row: emitted tokens after the prompt (anchor last)


class Proposer(Protocol):
    block_size: int

    def propose(self, inputs: RoundInputs) -> Proposal: ...

    def observe(self, states: torch.Tensor | None, positions: torch.Tensor) -> None:
        """History states [n, T, n_hist, d] of a verify/prefill pass at positions [n, T]; only those
        below each row's committed length count (the rest are overwritten later)."""
        ...

    def retire(self, keep: torch.Tensor) -> None: ...

    # optional: `prepare()`, one-off work of a batch before its first proposal (made by `propose`
    # itself when not called); the pacer times it apart from the round


# ------------------------------------------------------------------------------------ results


@dataclass
class DecodeResult:
    tokens: list[int]  # generated token ids after the prompt, EOS included when reached
    prompt: list[int] = field(default_factory=list)
    text: str = ""
    proposed: int = 0  # candidates proposed
    accepted: int = 0  # candidates accepted
    target_calls: int = 0  # target passes (prefill included)
    first_accepts: int = 0  # rounds whose first candidate was accepted
    rounds: int = 0  # rounds with at least one candidate
    accepted_lengths: list[int] = field(default_factory=list)  # accepted candidates of each such round
    language: str | None = None
    # the target's log-probabilities of the emitted tokens (rule-shaped logits, before temperature),
    # summed, and its <|nospeech|> probability at <|startoftranscript|>: what temperature fallback judges
    sum_logprob: float = 0.0
    no_speech_prob: float | None = None
    temperature: float = 0.0  # of the attempt this result is
    fallbacks: int = 0  # earlier attempts at lower temperatures that were judged and discarded
    compression_ratio: float | None = None  # set by the fallback judgement
    no_speech: bool = False  # judged silent: `text` is empty

    @property
    def avg_logprob(self) -> float:
        return self.sum_logprob / max(1, len(self.tokens))


@dataclass
class _Row:
    """Host-side state of one active request."""

    rid: int
    cache_len: int  # positions held by the target cache == anchor position
    budget: int  # generated-token budget (EOS included)
    generated: list[int]
    last_timestamp: int = -1  # last timestamp token emitted (timestamp rules), -1 if none


# --------------------------------------------------------------------------------------- loop


class SpeculativeDecoder:
    """Decodes one static batch: prefill, then rounds until every request finished."""

    def __init__(
        self,
        backend: VerifyBackend,
        proposer: Proposer | None,
        rules: LogitRules,
        eos_id: int,
        timestamp_begin: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        device="cpu",
        min_draft_prob: float = 0.0,
        tree_nodes: int = 0,
        tree_min_prob: float = 0.0,
        pacer: Pacer | None = None,
        clock=time.perf_counter,
        no_speech_id: int | None = None,
    ):
        self.backend = backend
        # <|nospeech|> (<|nocaptions|> in older vocabularies): its probability after <|startoftranscript|>
        self.no_speech_id = no_speech_id
        # per step: a round where it pays, else a plain step (`engine.pacing`); None: always rounds.
        # `clock` must return seconds after the device finished (the engine syncs CUDA in it)
        self.pacer = pacer
        self.clock = clock
        self._plain = False  # the last call was a plain step
        self._retire_s = 0.0  # seconds the last call spent retiring finished rows
        # greedy rounds without timestamp rules verify a draft tree of this many nodes instead of
        # one chain (`flash.tree`; 0 = the paper's chain); the backend must offer `move`
        self.tree_nodes = int(tree_nodes)
        self.tree_min_prob = float(tree_min_prob)
        # propose only the leading candidates the drafter gives >= this probability (at least one):
        # fewer verify rows, same output (`flash.accept.confident_length`)
        self.min_draft_prob = float(min_draft_prob)
        self.proposer = proposer
        self.rules = rules
        self.eos_id = eos_id
        self.timestamp_begin = timestamp_begin
        self.temperature = temperature
        self.generator = generator
        self.device = device

    # -- public -------------------------------------------------------------------------------
    def run(self, prompts: list[list[int]], budgets: list[int], request_ids: list[int] | None = None) -> list[DecodeResult]:
        """Decode requests with equal-length prompts; returns one result per request, in order.
        `request_ids` (default 0..n-1) is what proposers see as `RoundInputs.request_ids`."""
        results = [DecodeResult(tokens=[], prompt=list(p)) for p in prompts]
        self.request_ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
        self._ready = not hasattr(self.proposer, "prepare")  # the proposer's set-up for this batch done
        rows = self.prefill(prompts, budgets, results)
        while rows:
            if self.pacer is None or self.proposer is None:
                rows = self.round(rows, results)
            else:
                rows = self._paced(rows, results)
        return results

    def _paced(self, rows: list[_Row], results: list[DecodeResult]) -> list[_Row]:
        """A round or a plain step, as the pacer decides; its cost and yield go back to the pacer."""
        n, live = len(rows), list(rows)
        before = sum(len(r.generated) for r in live)
        speculate = self.pacer.speculate(n, ready=self._ready)
        if speculate and not self._ready:  # the batch's one-off drafter set-up, timed apart from the round
            start = self.clock()
            self.proposer.prepare()
            self.pacer.record_setup(n, self.clock() - start)
            self._ready = True
        self._plain = False
        self._retire_s = 0.0
        start = self.clock()
        rows = self.round(live, results) if speculate else self.step(live, results)
        seconds = self.clock() - start - self._retire_s  # retiring rows costs the same either way
        if self._plain:  # a plain step (or a round with no candidate left in any budget)
            self.pacer.record_step(n, seconds)
        else:
            self.pacer.record_round(n, seconds, (sum(len(r.generated) for r in live) - before) / n)
        return rows

    def prefill(self, prompts, budgets, results) -> list[_Row]:
        """Process the prompts; the first generated token becomes the first anchor."""
        n, p = len(prompts), len(prompts[0])
        tokens = torch.tensor(prompts, dtype=torch.long, device=self.device)
        positions = torch.arange(p, device=self.device).expand(n, p)
        logits, states = self.backend.verify(tokens, positions, p, want_history=self.proposer is not None)
        if self.no_speech_id is not None:  # the prompt starts with <|startoftranscript|>
            no_speech = torch.softmax(logits[:, 0].float(), dim=-1)[:, self.no_speech_id].tolist()
            for i in range(n):
                results[i].no_speech_prob = no_speech[i]
        last = logits[:, -1]
        prefix = Prefix.from_tokens([[] for _ in range(n)], self.timestamp_begin, self.device)
        shaped = self.rules.apply(last, prefix)
        first = self._pick(shaped).tolist()
        self._add_logprobs(results, range(n), shaped[:, None], [[t] for t in first], [[0]] * n)
        if self.proposer is not None:
            self.proposer.observe(states, positions)
        rows = [_Row(i, p, budgets[i], results[i].tokens) for i in range(n)]
        self.backend.commit([p] * n)
        for row, tok in zip(rows, first):
            results[row.rid].target_calls += 1
            self._emit(row, [tok])
        return self._finish(rows)

    def round(self, rows: list[_Row], results: list[DecodeResult]) -> list[_Row]:
        """One propose -> verify -> accept -> advance round (a plain step without a proposer)."""
        block = self.proposer.block_size if self.proposer is not None else 0
        num = [max(0, min(block, r.budget - len(r.generated) - 1)) for r in rows]
        k = max(num)
        if k == 0:
            return self.step(rows, results)
        n = len(rows)
        anchor = torch.tensor([r.generated[-1] for r in rows], dtype=torch.long, device=self.device)
        anchor_pos = torch.tensor([r.cache_len for r in rows], dtype=torch.long, device=self.device)
        kv_len = max(r.cache_len for r in rows) + 1
        inputs = RoundInputs(
            anchor, anchor_pos, kv_len, k, [self.request_ids[r.rid] for r in rows], [r.generated for r in rows]
        )
        proposal = self.proposer.propose(inputs)

        # propose: rules at every position, prefix including earlier candidates
        sampling = self.temperature > 0
        if (self.tree_nodes > 0 and proposal.logits is not None and not sampling
                and not self.rules.needs_prefix_tensors):
            return self.tree_round(rows, results, proposal, anchor, anchor_pos, kv_len, num)
        prefixes = [self._prefix(rows)]
        draft_probs = shaped = confidence = None
        if proposal.tokens is not None:  # fixed tokens (tests): taken as they are
            candidates = proposal.tokens[:, :k].to(self.device)
        elif not self.rules.needs_prefix_tensors:  # prefix-free rules: the whole block at once
            shaped = proposal.logits[:, :k]
            first = prefixes[0]
            self.rules.apply(shaped, Prefix.lengths_only(first.min_length, first.max_length + k))
            if sampling:
                draft_probs = probs_from_logits(shaped, self.temperature)
                candidates = sample_tokens(draft_probs, self.generator)
            else:
                candidates = shaped.argmax(-1)
        elif not sampling:  # timestamp rules, greedy: every position shaped at once (drafts only)
            candidates, confidence = self.rules.draft_chain(proposal.logits[:, :k], prefixes[0])
        else:  # timestamp rules, sampled: position j's prefix ends with candidate j-1
            picks, probs = [], []
            for j in range(k):
                row = self.rules.apply(proposal.logits[:, j], prefixes[-1])
                self.rules.timestamps.favour_pair_repeat(row, prefixes[-1])
                probs.append(probs_from_logits(row, self.temperature))
                picks.append(sample_tokens(probs[-1], self.generator))
                prefixes.append(prefixes[-1].extend(picks[-1], self.timestamp_begin))
            candidates = torch.stack(picks, 1)
            draft_probs = torch.stack(probs, 1)
        if self.min_draft_prob > 0 and proposal.tokens is None:  # cut each block where the drafter doubts
            if sampling:
                confidence = draft_probs.gather(2, candidates[..., None])[..., 0]
            elif confidence is None:
                confidence = torch.softmax(shaped.float(), dim=-1).amax(dim=-1)
            confident = confident_length(confidence, self.min_draft_prob, minimum=1).tolist()
            num = [min(n_i, c_i) for n_i, c_i in zip(num, confident)]
            k = max(num)
            candidates = candidates[:, :k]
            draft_probs = None if draft_probs is None else draft_probs[:, :k]
            prefixes = prefixes[: k + 1]
        while len(prefixes) < k + 1:
            prefixes.append(prefixes[-1].extend(candidates[:, len(prefixes) - 1], self.timestamp_begin))

        # verify: one causal pass over [anchor, candidates]
        tokens = torch.cat([anchor[:, None], candidates], 1)
        positions = anchor_pos[:, None] + torch.arange(k + 1, device=self.device)
        logits, states = self.backend.verify(tokens, positions, kv_len + k, want_history=True)
        self.rules.apply(logits, Prefix.interleave(prefixes))

        # accept
        num_t = torch.tensor(num, dtype=torch.long, device=self.device)
        if sampling:
            target_probs = probs_from_logits(logits, self.temperature)
            if draft_probs is None:  # fixed tokens: a deterministic (one-hot) draft
                draft_probs = torch.zeros_like(target_probs[:, :k])
                draft_probs.scatter_(2, candidates[..., None], 1.0)
            res = speculative_sample(candidates, draft_probs, target_probs, num_t, self.eos_id, self.generator)
        else:
            res = greedy_accept(candidates, logits, num_t, self.eos_id)
        accepted, next_token, eos_accepted = (x.tolist() for x in res)
        cand = candidates.tolist()

        # advance: keep anchor + accepted in cache and history, emit accepted + next anchor
        self.proposer.observe(states, positions)
        emitted = [c[:a] for c, a in zip(cand, accepted)]
        self._add_logprobs(results, [r.rid for r in rows], logits, self._with_next(emitted, next_token, eos_accepted),
                           [list(range(a + 1)) for a in accepted])
        return self._advance(rows, results, num, emitted, next_token, eos_accepted)

    def tree_round(self, rows, results, proposal, anchor, anchor_pos, kv_len, num) -> list[_Row]:
        """A greedy round over a draft tree (prefix-free rules only: each node's rules depend on its
        depth alone, and no rule acts past the first generated position except token suppression)."""
        n, k = len(rows), max(num)
        first = self._prefix(rows)
        lengths = Prefix.lengths_only(first.min_length, first.max_length + k)
        shaped = self.rules.apply(proposal.logits[:, :k], lengths)
        tree = build_tree(torch.softmax(shaped.float(), dim=-1), num, self.tree_nodes,
                          min_path_prob=batch_min_path_prob(self.tree_min_prob, len(rows)))

        # verify: anchor + every node in one pass, each row seeing its own ancestors only
        tokens = torch.cat([anchor[:, None], tree.tokens], 1)
        t = tokens.shape[1]
        slots = anchor_pos[:, None] + torch.arange(t, device=self.device)
        width = kv_len + t - 1
        mask = tree_attention_mask(tree, anchor_pos, width)
        logits, states = self.backend.verify(tokens, tree_positions(tree, anchor_pos), width,
                                             want_history=True, slots=slots, attn_mask=mask)
        picks = self.rules.apply(logits, lengths).argmax(-1)

        # accept, then bring the accepted nodes' K/V and history states to positions t+1..t+a
        accepted, paths, next_token, eos_accepted = greedy_tree_accept(tree, picks.tolist(), num, self.eos_id)
        plan = move_plan(anchor_pos.tolist(), paths, max(accepted))
        if plan is not None:
            self.backend.move(*(torch.tensor(x, dtype=torch.long, device=self.device) for x in plan))
        depth = max(accepted)  # history of anchor + accepted nodes (the rest is overwritten later anyway)
        path_rows = torch.tensor([[0] + p + [0] * (depth - len(p)) for p in paths], dtype=torch.long, device=self.device)
        if states is not None:
            states = states.gather(1, path_rows[:, :, None, None].expand(-1, -1, *states.shape[2:]))
        self.proposer.observe(states, anchor_pos[:, None] + torch.arange(depth + 1, device=self.device))
        emitted = [[tree.token_lists[i][r - 1] for r in path] for i, path in enumerate(paths)]
        self._add_logprobs(results, [r.rid for r in rows], logits, self._with_next(emitted, next_token, eos_accepted),
                           [[0] + path for path in paths])  # row 0 (the anchor) predicts the first token
        return self._advance(rows, results, tree.valid.sum(1).tolist(), emitted, next_token, eos_accepted)

    def _advance(self, rows, results, proposed: list[int], accepted: list[list[int]], next_token: list[int],
                 eos_accepted: list[bool]) -> list[_Row]:
        """After a round: count it, keep anchor + accepted candidates in the cache, emit the accepted
        ones and the next anchor (not after an accepted EOS), and drop finished rows."""
        for i, row in enumerate(rows):
            a = len(accepted[i])
            out = results[row.rid]
            out.target_calls += 1
            out.rounds += 1
            out.proposed += proposed[i]
            out.accepted += a
            out.first_accepts += int(a > 0)
            out.accepted_lengths.append(a)
            row.cache_len += 1 + a
            self._emit(row, accepted[i] if eos_accepted[i] else accepted[i] + [next_token[i]])
        self.backend.commit([r.cache_len for r in rows])
        return self._finish(rows)

    def step(self, rows: list[_Row], results: list[DecodeResult]) -> list[_Row]:
        """The baseline: one target call, one token per request."""
        self._plain = True
        anchor = torch.tensor([[r.generated[-1]] for r in rows], dtype=torch.long, device=self.device)
        positions = torch.tensor([[r.cache_len] for r in rows], dtype=torch.long, device=self.device)
        kv_len = max(r.cache_len for r in rows) + 1
        logits, states = self.backend.verify(anchor, positions, kv_len, want_history=self.proposer is not None)
        shaped = self.rules.apply(logits[:, 0], self._prefix(rows))
        nxt = self._pick(shaped).tolist()
        self._add_logprobs(results, [r.rid for r in rows], shaped[:, None], [[t] for t in nxt], [[0]] * len(rows))
        if self.proposer is not None:
            self.proposer.observe(states, positions)
        for row, tok in zip(rows, nxt):
            results[row.rid].target_calls += 1
            row.cache_len += 1
            self._emit(row, [tok])
        self.backend.commit([r.cache_len for r in rows])
        return self._finish(rows)

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _with_next(accepted: list[list[int]], next_token: list[int], eos_accepted: list[bool]) -> list[list[int]]:
        return [a if eos else a + [t] for a, t, eos in zip(accepted, next_token, eos_accepted)]

    @staticmethod
    def _add_logprobs(results, rids, shaped: torch.Tensor, emitted: list[list[int]], rows: list[list[int]]) -> None:
        """Add log p(token) of each emitted token to its result's sum; token j of request i was predicted
        by row rows[i][j] of the rule-shaped logits [n, R, V] (one batched gather, one transfer)."""
        index_i, index_r, tokens = [], [], []
        for i, (toks, rws) in enumerate(zip(emitted, rows)):
            for tok, r in zip(toks, rws):
                index_i.append(i)
                index_r.append(r)
                tokens.append(tok)
        if not tokens:
            return
        dev = shaped.device
        picked = shaped[torch.tensor(index_i, device=dev), torch.tensor(index_r, device=dev)].float()  # [m, V]
        logp = (picked.gather(1, torch.tensor(tokens, device=dev)[:, None])[:, 0] - torch.logsumexp(picked, -1)).tolist()
        for i, lp in zip(index_i, logp):
            results[rids[i]].sum_logprob += lp

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature > 0:
            return sample_tokens(probs_from_logits(logits, self.temperature), self.generator)
        return logits.argmax(-1)

    def _prefix(self, rows: list[_Row]) -> Prefix:
        lengths = [len(r.generated) for r in rows]
        if not self.rules.needs_prefix_tensors:
            return Prefix.lengths_only(min(lengths), max(lengths))
        return Prefix.from_state(
            lengths,
            [r.generated[-1] if r.generated else -1 for r in rows],
            [r.generated[-2] if len(r.generated) >= 2 else -1 for r in rows],
            [r.last_timestamp for r in rows],
            self.device,
        )

    def _emit(self, row: _Row, tokens: list[int]) -> None:
        row.generated.extend(tokens)
        for tok in tokens:
            if tok >= self.timestamp_begin:
                row.last_timestamp = tok

    def _finish(self, rows: list[_Row]) -> list[_Row]:
        """Drop finished rows (EOS emitted or budget spent) from the backend, proposer and loop."""
        alive = [i for i, r in enumerate(rows) if r.generated[-1] != self.eos_id and len(r.generated) < r.budget]
        if len(alive) == len(rows):
            return rows
        if alive:
            start = self.clock()
            keep = torch.tensor(alive, dtype=torch.long, device=self.device)
            self.backend.retire(keep)
            if self.proposer is not None:
                self.proposer.retire(keep)
            self._retire_s += self.clock() - start
        return [rows[i] for i in alive]
