"""The standalone engine's decode loop: prefill, then paced Whisper-Flash rounds or plain steps.

The round itself (drafts under the logit rules, chain or tree, the confidence cut, the accept rule,
stop tokens, what the cache keeps) is `flash.rounds`, the one the ASR-stage decode worker runs too.
This loop only executes it over a static batch: one drafter call (`Proposer`), one padded verify
pass (`VerifyBackend`), then the commit: the settled rows' K/V move to their positions (draft
trees), their history states go to the drafter, and the rest is rolled back by length.

Invariant (paper A.1): before a round with anchor y_t at position t, the target cache and the
drafter history hold exactly positions 0..t-1 of the request (prompt + emitted tokens before the
anchor). With a `Pacer` (flash/pacing.py) the loop takes a plain step instead of a round wherever
the measured cost of rounds is not paid by the running acceptance: same tokens, lower cost.

Two small protocols make the loop reusable: a `VerifyBackend` runs the target, a `Proposer` makes
candidates (the Whisper-Flash drafter, or oracle/random/adversarial proposers in tests). Without a
proposer the same loop is the plain baseline: one token per target call, same kernels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.profiler import record_function

from sglang_omni_flash.flash.logit_rules import LogitRules, Prefix
from sglang_omni_flash.flash.options import SpecOptions
from sglang_omni_flash.flash.pacing import Backoff, Pacer, round_price
from sglang_omni_flash.flash.rounds import (
    RoundRequest, allowed_candidates, draft_round, settle_round, token_logprobs,
)
from sglang_omni_flash.flash.accept import probs_from_logits, sample_tokens
from sglang_omni_flash.flash.tree import move_plan, tree_attention_mask
from sglang_omni_flash.kernels.argmax import argmax


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
    backoff: Backoff = field(default_factory=Backoff)


# --------------------------------------------------------------------------------------- loop


class SpeculativeDecoder:
    """Decodes one static batch: prefill, then rounds (or plain steps) until every request finished."""

    def __init__(
        self,
        backend: VerifyBackend,
        proposer: Proposer | None,
        rules: LogitRules,
        eos_id: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        device="cpu",
        spec: SpecOptions = SpecOptions().resolved("cpu", torch.float32),
        pacer: Pacer | None = None,
        clock=time.perf_counter,
        no_speech_id: int | None = None,
    ):
        self.backend = backend
        self.proposer = proposer
        self.rules = rules
        self.eos_id = eos_id
        self.stops = frozenset([eos_id])
        self.temperature = temperature
        self.generator = generator
        self.device = device
        self.spec = spec  # resolved: no None left
        # per step: a round where it pays, else a plain step (`flash.pacing`); None: always rounds.
        # `clock` must return seconds after the device finished (the engine syncs CUDA in it)
        self.pacer = pacer if proposer is not None else None
        self.clock = clock
        # <|nospeech|> (<|nocaptions|> in older vocabularies): its probability after <|startoftranscript|>
        self.no_speech_id = no_speech_id
        self._retire_s = 0.0  # seconds the last call spent retiring finished rows

    # -- public -------------------------------------------------------------------------------
    def run(self, prompts: list[list[int]], budgets: list[int], request_ids: list[int] | None = None) -> list[DecodeResult]:
        """Decode requests with equal-length prompts; returns one result per request, in order.
        `request_ids` (default 0..n-1) is what proposers see as `RoundInputs.request_ids`."""
        results = [DecodeResult(tokens=[], prompt=list(p)) for p in prompts]
        self.request_ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
        self._ready = not hasattr(self.proposer, "prepare")  # the proposer's set-up for this batch done
        rows = self.prefill(prompts, budgets, results)
        block = self.proposer.block_size if self.proposer is not None else 0
        block = min(block, self.spec.num_draft_tokens)
        while rows:
            # candidates each request may propose (its budget, its back-off), then: a round or a step
            num = [allowed_candidates(block, r.budget - len(r.generated)) if r.backoff.drafts_now() else 0
                   for r in rows]
            if self.proposer is None or not any(num):
                rows = self.step(rows, results)
            elif self.pacer is None:
                rows = self.round(rows, results, num)
            else:
                rows = self._paced(rows, results, num)
        return results

    def _paced(self, rows: list[_Row], results: list[DecodeResult], num: list[int]) -> list[_Row]:
        """A round or a plain step, as the pacer decides; its cost and yield go back to the pacer."""
        n, live = len(rows), list(rows)
        before = sum(len(r.generated) for r in live)
        speculate = self.pacer.speculate(n, unready=0 if self._ready else n)
        if speculate and not self._ready:  # the batch's one-off drafter set-up, timed apart from the round
            start = self.clock()
            self.proposer.prepare()
            self.pacer.record_setup(n, self.clock() - start)
            self._ready = True
        self._retire_s = 0.0
        start = self.clock()
        rows = self.round(live, results, num) if speculate else self.step(live, results)
        seconds = self.clock() - start - self._retire_s  # retiring rows costs the same either way
        if speculate:
            gain = (sum(len(r.generated) for r in live) - before) / n
            price = round_price(seconds, gain, getattr(self.proposer, "history_s", 0.0),
                                getattr(self.proposer, "history_positions", 0.0))
            self.pacer.record_round(n, price, gain)
        else:
            self.pacer.record_step(n, seconds)
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
        if self.proposer is not None:
            self.proposer.observe(states, positions)
        rows = [_Row(i, p, budgets[i], results[i].tokens, Backoff(self.spec.max_backoff)) for i in range(n)]
        self.backend.commit([p] * n)
        return self._plain_tokens(rows, results, logits[:, -1])

    def step(self, rows: list[_Row], results: list[DecodeResult]) -> list[_Row]:
        """The baseline: one target call, one token per request."""
        with record_function("step"):
            return self._step(rows, results)

    def _step(self, rows: list[_Row], results: list[DecodeResult]) -> list[_Row]:
        anchor = torch.tensor([[r.generated[-1]] for r in rows], dtype=torch.long, device=self.device)
        positions = torch.tensor([[r.cache_len] for r in rows], dtype=torch.long, device=self.device)
        kv_len = max(r.cache_len for r in rows) + 1
        with record_function("step.verify"):
            logits, states = self.backend.verify(anchor, positions, kv_len, want_history=self.proposer is not None)
        with record_function("step.commit"):
            if self.proposer is not None:
                self.proposer.observe(states, positions)
            for row in rows:
                row.cache_len += 1
            self.backend.commit([r.cache_len for r in rows])
        with record_function("step.pick"):
            return self._plain_tokens(rows, results, logits[:, 0])

    def _plain_tokens(self, rows: list[_Row], results: list[DecodeResult], logits: torch.Tensor) -> list[_Row]:
        """Each row's next token from its logits [n, V] under the rules (argmax, or a draw), scored."""
        lengths = [len(r.generated) for r in rows]
        prefix = Prefix.lengths_only(min(lengths), max(lengths)) if not self.rules.needs_prefix_tensors else \
            Prefix.from_tokens([r.generated for r in rows], self.rules.timestamps.timestamp_begin, self.device)
        shaped = self.rules.apply(logits, prefix)
        if self.temperature > 0:
            picks = sample_tokens(probs_from_logits(shaped, self.temperature), self.generator)
        else:
            picks = argmax(shaped)
        tokens = picks.tolist()
        for row, token, lp in zip(rows, tokens, token_logprobs(shaped, tokens)):
            results[row.rid].target_calls += 1
            results[row.rid].sum_logprob += lp
            row.generated.append(token)
        return self._finish(rows)

    def round(self, rows: list[_Row], results: list[DecodeResult], num: list[int]) -> list[_Row]:
        """One round (`flash.rounds`): draft, verify every block in one pass, commit what settled."""
        # the labels name a round's parts for benchmarks/round_costs.py --breakdown (torch.profiler)
        with record_function("round"):
            return self._round(rows, results, num)

    def _round(self, rows: list[_Row], results: list[DecodeResult], num: list[int]) -> list[_Row]:
        n, k = len(rows), max(num)
        anchor = torch.tensor([r.generated[-1] for r in rows], dtype=torch.long, device=self.device)
        anchor_pos = torch.tensor([r.cache_len for r in rows], dtype=torch.long, device=self.device)
        kv_len = max(r.cache_len for r in rows) + 1
        inputs = RoundInputs(
            anchor, anchor_pos, kv_len, k, [self.request_ids[r.rid] for r in rows], [r.generated for r in rows]
        )
        with record_function("round.draft"):
            proposal = self.proposer.propose(inputs)
        with record_function("round.plan"):
            requests = [RoundRequest(r.generated, n_i, self.rules, self.temperature, stops=self.stops)
                        for r, n_i in zip(rows, num)]
            plan = draft_round(requests, self.spec, logits=proposal.logits, tokens=proposal.tokens,
                               generator=self.generator)

        with record_function("round.verify"):  # every block padded to T rows (row r in slot t + r, at t + depth)
            t = max(len(b) for b in plan.blocks)
            pad = [t - len(b) for b in plan.blocks]
            tokens = torch.tensor([b.tokens + [b.tokens[-1]] * p for b, p in zip(plan.blocks, pad)],
                                  device=self.device)
            slots = anchor_pos[:, None] + torch.arange(t, device=self.device)
            width = kv_len + t - 1
            if all(b.is_chain for b in plan.blocks):  # causal by position (the padding rows are never read)
                logits, states = self.backend.verify(tokens, slots, width, want_history=True)
            else:  # a padding row hangs off the anchor at depth 1
                depth = torch.tensor([b.depth + [1] * p for b, p in zip(plan.blocks, pad)], device=self.device)
                parent = torch.tensor([b.parent[1:] + [0] * p for b, p in zip(plan.blocks, pad)], device=self.device)
                logits, states = self.backend.verify(tokens, anchor_pos[:, None] + depth, width, want_history=True,
                                                     slots=slots,
                                                     attn_mask=tree_attention_mask(parent, anchor_pos, width))
        with record_function("round.settle"):
            settled = settle_round(plan, logits.view(n * t, -1), [i * t for i in range(n)], self.generator)
        with record_function("round.commit"):  # the kept rows' K/V to positions t.., their history states
            self._commit_round(rows, results, settled, anchor_pos, states)
        return self._finish(rows)

    def _commit_round(self, rows, results, settled, anchor_pos, states) -> None:
        kept = max(len(s.rows) for s in settled)
        moves = move_plan(anchor_pos.tolist(), [s.rows[1:] for s in settled], kept - 1)
        if moves is not None:
            self.backend.move(*(torch.tensor(x, dtype=torch.long, device=self.device) for x in moves))
        if states is not None:
            index = torch.tensor([s.rows + [0] * (kept - len(s.rows)) for s in settled], device=self.device)
            states = states.gather(1, index[:, :, None, None].expand(-1, -1, *states.shape[2:]))
        self.proposer.observe(states, anchor_pos[:, None] + torch.arange(kept, device=self.device))
        for row, s in zip(rows, settled):
            out = results[row.rid]
            out.target_calls += 1
            out.rounds += 1
            out.proposed += s.proposed
            out.accepted += s.accepted
            out.first_accepts += int(s.accepted > 0)
            out.accepted_lengths.append(s.accepted)
            for value in s.logprobs:  # one addition per token, as plain steps add them
                out.sum_logprob += value
            row.backoff.after_round(s.proposed, s.accepted)
            row.cache_len += len(s.rows)
            row.generated.extend(s.emitted)
        self.backend.commit([r.cache_len for r in rows])

    # -- helpers ------------------------------------------------------------------------------
    def _finish(self, rows: list[_Row]) -> list[_Row]:
        """Drop finished rows (a stop token emitted or budget spent) from the backend, proposer and loop."""
        alive = [i for i, r in enumerate(rows) if r.generated[-1] not in self.stops and len(r.generated) < r.budget]
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
