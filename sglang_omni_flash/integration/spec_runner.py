"""The Whisper-Flash decode step inside sglang-omni's ASR stage (``WhisperFlashModelRunner``).

sglang-omni's scheduler stays a plain, single-token scheduler: before each decode step it has
allocated one KV slot per running request for the *anchor* (the latest emitted token, not yet
seen by the target) and done ``seq_lens += 1``. ``custom_decode_forward`` then, per step:

1. drafts k_i candidates per request with the drafter (k_i = min(K, R_i - 1) for R_i tokens
   left; 0 for a request without drafter state),
2. allocates k_i more slots per request and writes them into the request's ``req_to_token``
   row after the anchor,
3. verifies anchor + candidates of every request in ONE target pass (``verify.verify_forward``),
4. accepts with the core's rules (``flash.accept``: greedy prefix, or rejection sampling at
   T > 0), cut at the first accepted stop token,
5. frees the slots of the rejected positions, commits the accepted candidates into sglang's
   request/batch bookkeeping (``output_ids``, ``kv_*_len``, ``seq_lens*``) and keeps the
   history states of anchor + accepted positions for the drafter (projected, with every other
   pending row of the batch, in one drafter call when the request drafts again),
6. returns the target's next token (correction or bonus) as this step's sampled token, so the
   scheduler's own result processing appends it, checks EOS / max_new_tokens and frees
   finished requests exactly as in plain decoding.

Invariant between steps: ``kv_allocated_len == kv_committed_len`` (sglang asserts it on every
release path when no spec algorithm is configured) and the drafter history of a request holds
exactly its committed decoder positions, projected or pending. Timestamped requests speculate under Whisper's
timestamp rules, applied to every draft and verify row with that row's prefix
(``timestamp_rows``). A step the worker cannot speculate (other custom logit processors,
logprobs, penalties, no free slots, no request with a draft) is the stock decode, with forward
hooks on the history layers keeping the drafter cache in step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sglang_omni.model_runner.base import ModelRunner

from sglang_omni_flash.engine.options import default_min_draft_prob, default_pace, default_tree
from sglang_omni_flash.flash.pacing import Pacer, batch_min_path_prob
from sglang_omni_flash.flash.accept import (
    confident_length, greedy_accept, probs_from_logits, sample_tokens, speculative_sample,
)
from sglang_omni_flash.flash.tree import DraftTree, build_tree, greedy_tree_accept
from sglang_omni_flash.integration.metrics import SpecMetrics
from sglang_omni_flash.integration.timestamp_rows import TimestampRows, is_timestamped
from sglang_omni_flash.integration.verify import VerifyRow, verify_forward
from sglang_omni_flash.integration.window_scores import ScoringRunnerMixin

logger = logging.getLogger("sglang_omni_flash.spec")


class HistoryTap:
    """Forward hooks on the target's history layers + a tee of the encoder states (both inert unless armed).

    Armed around prefill (and around stock decode steps) so the drafter's history and acoustic
    memories come from what the stage computes anyway.
    """

    def __init__(self, model, history_layers: tuple[int, ...]):
        self.history_layers = history_layers
        self.armed = False
        self.states: dict[int, Tensor] = {}
        self.encoder: list[Tensor] = []
        layers = model.model.decoder.layers
        for i in history_layers:
            layers[i].register_forward_hook(self._hook(i))
        inner = model.model
        real = inner.cache_encoder_states

        def cache_encoder_states(states, cache_loc):
            if self.armed:
                self.encoder.append(states)
            return real(states, cache_loc)

        inner.cache_encoder_states = cache_encoder_states  # instance attribute: this model only

    def _hook(self, index: int):
        def hook(module, args, output):
            if self.armed:
                self.states[index] = output
        return hook

    def arm(self) -> None:
        self.states, self.encoder, self.armed = {}, [], True

    def disarm(self) -> tuple[Tensor | None, list[Tensor]]:
        """-> (history states [N, n_hist, d] or None if a hook did not fire, encoder chunks)."""
        self.armed = False
        states, encoder = self.states, self.encoder
        self.states, self.encoder = {}, []
        if any(i not in states for i in self.history_layers):
            return None, encoder
        return torch.stack([states[i] for i in self.history_layers], dim=-2), encoder


@dataclass
class SpecStats:
    """Per-request acceptance: candidates proposed / accepted and target forward passes."""

    proposed: int = 0
    accepted: int = 0
    target_calls: int = 0

    def line(self) -> str:
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return (f"proposed={self.proposed} accepted={self.accepted} ({rate:.0%}) "
                f"target_calls={self.target_calls}")


@dataclass
class DraftState:
    """The drafter's memories of one request: history K/V by position, acoustic K/V once."""

    hist: list[tuple[Tensor, Tensor]]  # per drafter layer (k, v) [1, H, max_positions, hd], RoPE on k
    acoustic: list[tuple[Tensor, Tensor]]  # per drafter layer (k, v) [1, H, T, hd]
    length: int = 0  # history positions 0..length-1 (== committed decoder length), pending ones included
    pending: list[Tensor] = field(default_factory=list)  # target states [n, n_hist, d] of the last
    # pending_rows positions (length - pending_rows .. length - 1), projected when the request drafts
    skip: int = 0  # decode steps left without drafting (back-off after fruitless rounds)
    backoff: int = 0  # length of the next back-off (doubles while drafts keep failing)
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def pending_rows(self) -> int:
        return sum(rows.shape[0] for rows in self.pending)

    def keep(self, rows: Tensor) -> None:
        """Target states [n, n_hist, d] of the next n positions, projected when the request drafts
        again (WhisperFlashModelRunner._project_pending)."""
        self.pending.append(rows)
        self.length += rows.shape[0]


@dataclass
class _Plan:
    """One request of a speculative step (host side)."""

    index: int  # row in the batch
    row: int  # req_to_token row (req_pool_idx)
    state: DraftState | None
    anchor: int
    prefix_len: int  # L: anchor position
    k: int  # candidates proposed
    candidates: list[int] = field(default_factory=list)
    draft_probs: Tensor | None = None  # [k, V] at T > 0
    slots: Tensor | None = None  # [k] extra KV slots
    tree: DraftTree | None = None  # greedy draft tree: then k = its nodes, candidates = their tokens
    room: int = 0  # free req_to_token positions after the anchor (a tree's nodes sit there while verified)
    rules: object | None = None  # the request's timestamp rules (LogitRules), None without timestamps


def _sampling_ok(req) -> bool:
    """Sampling knobs the worker reproduces exactly (else the step is the stock decode)."""
    sp = req.sampling_params
    return (
        (req.custom_logit_processor is None or is_timestamped(req))
        and not req.return_logprob
        and getattr(req, "grammar", None) is None
        and sp.repetition_penalty == 1.0
        and sp.frequency_penalty == 0.0
        and sp.presence_penalty == 0.0
        and sp.min_new_tokens == 0
        and (_temperature(req) == 0.0 or (sp.top_p >= 1.0 and sp.top_k in (-1, 1 << 30) and sp.min_p <= 0.0))
        and not sp.stop_strs
    )


def _temperature(req) -> float:
    """0 for greedy: sglang normalises temperature 0 to (temperature 1, top_k 1)."""
    sp = req.sampling_params
    return 0.0 if sp.top_k == 1 or sp.temperature < 1e-6 else float(sp.temperature)


class WhisperFlashModelRunner(ScoringRunnerMixin, ModelRunner):
    """sglang-omni's ASR model runner with Whisper-Flash speculative decode steps."""

    def __init__(self, tp_worker, output_processor, *, drafter, tap: HistoryTap, num_draft_tokens: int,
                 min_draft_prob: float | None = None, max_backoff: int = 8, tree_nodes: int | None = None,
                 tree_min_prob: float | None = None, pace: bool | None = None):
        super().__init__(tp_worker, output_processor)
        self.drafter = drafter
        # Candidates are proposed while the drafter's probability of its own token is >= this
        # (0: always k; None: by device, as the standalone engine: on a CPU every verified row
        # costs); a request whose round proposed or accepted nothing drafts again only after
        # 1, 2, 4 .. max_backoff stock steps. Neither changes the output, only the cost.
        weights = next(drafter.parameters())
        if min_draft_prob is None:
            min_draft_prob = default_min_draft_prob(weights.device.type, weights.dtype)
        self.min_draft_prob = float(min_draft_prob)
        # Greedy steps verify a draft tree of up to tree_nodes nodes per request instead of a chain
        # (flash/tree.py; 0 = chain). None: by device, as the standalone engine.
        nodes, min_prob = default_tree(weights.device.type, weights.dtype)
        self.tree_nodes = nodes if tree_nodes is None else int(tree_nodes)
        self.tree_min_prob = min_prob if tree_min_prob is None else float(tree_min_prob)
        self.max_backoff = int(max_backoff)
        # Per step, for the whole batch: a round only where its measured cost is paid by the running
        # acceptance, else a stock step (flash/pacing.py, as the standalone engine; cost only, never
        # output). None: by device, on for CPU (at C=16 in fp32 a round costs far more than a step).
        if pace is None:
            pace = default_pace(weights.device.type)
        self.pacer = Pacer() if pace else None
        self.tap = tap
        self.k = min(int(num_draft_tokens), drafter.config.block_size)
        cfg = drafter.config
        self.max_positions = int(getattr(self.model.config, "max_target_positions", cfg.max_positions))
        self.vocab_size = int(self.model.config.vocab_size)  # width of the draft and verify logits rows
        self.states: dict[str, DraftState] = {}
        self.step_tokens: dict[str, list[int]] = {}  # rid -> tokens emitted this step (for streaming)
        self.totals = SpecStats()
        self.metrics = SpecMetrics(self)  # exported by the stage's /whisper-flash routes
        self.timing = {"draft": 0.0, "draft_steps": 0, "verify": 0.0, "accept": 0.0, "spec_steps": 0, "stock": 0.0, "stock_steps": 0}
        self._stock_t0 = 0.0
        self._plain_step = False
        self._committed = False
        self._prefill_capture: tuple[Tensor | None, list[Tensor]] = (None, [])
        # the stacked acoustic K/V of the last batched draft, kept while the same requests draft
        self._acoustic_batch: tuple[tuple[DraftState, ...], list[tuple[Tensor, Tensor]]] | None = None
        p = next(drafter.parameters())
        self._device, self._dtype = p.device, p.dtype
        self.timestamp_rows = TimestampRows(p.device)
        self._warm_up()

    def _warm_up(self) -> None:
        """One draft of a made-up request at start-up. The drafter's first call pays one-time
        kernel set-up (~0.4 s on a CPU with int8 weights); inside the first round it would also
        set the pacer's price of a round ten times too high, and the pacer would step aside for
        hundreds of steps while the average decays."""
        cfg = self.drafter.config
        encoder_len = int(getattr(self.model.config, "max_source_positions", 1500))
        with torch.inference_mode():
            state = self._new_state(torch.zeros(4, len(cfg.history_layers), cfg.d_model, device=self._device),
                                    torch.zeros(encoder_len, cfg.d_model, device=self._device))
            self._project_pending([state])
            self._draft_logits([_Plan(index=0, row=0, state=state, anchor=0, prefix_len=state.length, k=self.k)])
        self._acoustic_batch = None

    # ------------------------------------------------------------------ lifecycle of the state

    def lookahead_eligible(self, batch) -> bool:
        return False  # a step commits a variable number of tokens: no one-step lookahead

    def forget(self, rid: str, output_ids: list[int] | None = None, leaving: bool = True) -> None:
        """Drop a request's drafter state (finish / abort / disconnect) and log its acceptance.

        The line also carries the KV pool's free slots after the release (an idle server must
        always show the same number) and, for finished requests, the output token ids.
        """
        state = self.states.pop(rid, None)
        self.step_tokens.pop(rid, None)
        if state is None and output_ids is None:
            return
        stats = state.stats if state is not None else SpecStats()
        if leaving:
            self.metrics.record(rid, stats, None if output_ids is None else len(output_ids))
        free = self.tp_worker.model_runner.token_to_kv_pool_allocator.available_size()
        ids = "" if output_ids is None else f" ids={list(output_ids)}"
        logger.info("whisper-flash %s: %s kv_free=%d%s", rid, stats.line(), free, ids)

    def on_request_finished(self, request_id, req_data) -> None:
        req = getattr(req_data, "req", None)
        self.forget(request_id, None if req is None else list(req.output_ids))

    def _new_state(self, history: Tensor, encoder_out: Tensor) -> DraftState:
        """history [P, n_hist, d] at positions 0..P-1, encoder_out [T, d]."""
        d = self.drafter
        cfg = d.config
        hist = []
        for _ in range(cfg.n_layers):
            z = torch.zeros(1, cfg.n_heads, self.max_positions, cfg.head_dim, device=self._device, dtype=self._dtype)
            hist.append((z, z.clone()))
        state = DraftState(hist=hist, acoustic=d.acoustic_kv(encoder_out[None].to(self._dtype)))
        state.keep(history)
        return state

    def _project_pending(self, states: list[DraftState]) -> None:
        """Project the history rows left pending (the prompt's at prefill, a round's accepted rows,
        stock steps' rows), for every state given, in one drafter call. A request that the pacer
        or its back-off keeps from drafting never pays for the projection, and a batch pays one
        drafter call for all its requests, inside the price of the round that needs the rows
        (what the pacer weighs)."""
        todo = [state for state in states if state.pending]
        if not todo:
            return
        rows = torch.cat([chunk for state in todo for chunk in state.pending])  # [M, n_hist, d]
        positions = torch.cat([torch.arange(state.length - state.pending_rows, state.length) for state in todo])
        projected = self.drafter.project_history(rows[:, None].to(self._device))  # [M, 1, d]
        layers = self.drafter.history_kv(projected, positions[:, None].to(self._device))  # (k, v) [M, H, 1, hd]
        j = 0
        for state in todo:
            n = state.pending_rows
            start = state.length - n
            for (hk, hv), (k, v) in zip(state.hist, layers):
                hk[:, :, start:start + n] = k[j:j + n].transpose(0, 2)
                hv[:, :, start:start + n] = v[j:j + n].transpose(0, 2)
            state.pending.clear()
            j += n

    # ------------------------------------------------------------------------------ prefill

    def before_prefill(self, forward_batch, schedule_batch, requests) -> None:
        super().before_prefill(forward_batch, schedule_batch, requests)
        self.tap.arm()

    def cleanup_prefill(self, forward_batch, schedule_batch, requests) -> None:
        # runs right after the forward (also on failure), before post_prefill
        super().cleanup_prefill(forward_batch, schedule_batch, requests)
        self._prefill_capture = self.tap.disarm()

    def post_prefill(self, result, forward_batch, schedule_batch, requests) -> None:
        super().post_prefill(result, forward_batch, schedule_batch, requests)
        states, encoder = self._prefill_capture
        self._prefill_capture = (None, [])
        reqs = schedule_batch.reqs
        for req in reqs:
            self.forget(req.rid, leaving=False)  # (re-)prefill starts the request's drafter state afresh
        if states is None or forward_batch is None:
            return
        encoder_flat = torch.cat(encoder) if encoder else None
        extend = list(forward_batch.extend_seq_lens_cpu)
        prefix = list(forward_batch.extend_prefix_lens_cpu)
        enc_lens = list(schedule_batch.encoder_lens_cpu or [0] * len(reqs))
        cached = list(forward_batch.encoder_cached or [True] * len(reqs))
        if sum(extend) != states.shape[0]:
            logger.warning("whisper-flash: prefill states %s do not match extend lengths %s; "
                           "these requests decode without drafts", tuple(states.shape), extend)
            return
        row = enc_row = 0
        with torch.inference_mode():
            for i, req in enumerate(reqs):
                n, enc = extend[i], enc_lens[i]
                encoder_out = None
                if not cached[i] and encoder_flat is not None and enc_row + enc <= encoder_flat.shape[0]:
                    encoder_out = encoder_flat[enc_row: enc_row + enc]
                    enc_row += enc
                if encoder_out is not None and prefix[i] == 0 and n > 0:
                    state = self._new_state(states[row: row + n], encoder_out)
                    state.stats.target_calls = 1
                    self.states[req.rid] = state
                row += n

    # ------------------------------------------------------------------------------- decode

    def custom_decode_forward(self, forward_batch, schedule_batch, requests):
        reqs = schedule_batch.reqs
        live = {req.rid for req in reqs}
        for rid in [r for r in self.states if r not in live]:
            self.forget(rid)  # left the batch without a finish callback (abort, retraction)
        self.step_tokens.clear()
        if not all(_sampling_ok(req) for req in reqs):
            return self._stock_step()

        anchors = forward_batch.input_ids.tolist()
        seq_lens = schedule_batch.seq_lens_cpu.tolist()
        pool_rows = schedule_batch.req_pool_indices.tolist()
        enc_lens = list(schedule_batch.encoder_lens_cpu or [0] * len(reqs))
        width = schedule_batch.req_to_token_pool.req_to_token.shape[1]
        plans = []
        for i, req in enumerate(reqs):
            state = self.states.get(req.rid)
            L = int(seq_lens[i]) - 1
            if state is not None and state.length != L:
                self.forget(req.rid, leaving=False)  # out of step: it decodes on without drafts
                state = None
            budget = req.sampling_params.max_new_tokens - len(req.output_ids) - 1
            k = max(0, min(self.k, budget, self.max_positions - 1 - L)) if state is not None else 0
            if k and state.skip > 0:
                state.skip -= 1
                k = 0
            room = width - int(enc_lens[i]) - L - 1
            plans.append(_Plan(index=i, row=int(pool_rows[i]), state=state, anchor=int(anchors[i]), prefix_len=L, k=k,
                               room=room, rules=self.timestamp_rows.rules_for(req, self.vocab_size)))
        if not any(p.k for p in plans):
            return self._stock_step()
        if self.pacer is not None and not self.pacer.speculate(len(reqs)):
            return self._stock_step()
        t0 = time.perf_counter()  # the round's start: its drafting, and its whole price for the pacer
        with torch.inference_mode():
            self._project_pending([p.state for p in plans if p.k])
            self._draft(plans, schedule_batch)  # may shorten p.k (confidence cut)
            self.timing["draft"] += time.perf_counter() - t0
            self.timing["draft_steps"] += 1
        n_extra = sum(p.k for p in plans)
        allocator = schedule_batch.token_to_kv_pool_allocator
        extra = allocator.alloc(n_extra) if n_extra else None
        if extra is None:
            return self._stock_step()
        try:
            with torch.inference_mode():
                out = self._speculate(plans, extra, schedule_batch)
            if self.pacer is not None:
                emitted = sum(len(self.step_tokens.get(req.rid, ())) or 1 for req in reqs)
                self.pacer.record_round(len(reqs), time.perf_counter() - t0, emitted / len(reqs))
            return out
        except BaseException:
            if not self._committed:
                allocator.free(extra)  # nothing of this step reached sglang's bookkeeping
            raise

    def _bias(self, schedule_batch, i: int) -> Tensor | None:
        bias = schedule_batch.sampling_info.logit_bias
        return None if bias is None else bias[i]

    def _back_off(self, state: DraftState) -> None:
        state.backoff = min(self.max_backoff, max(1, 2 * state.backoff))
        state.skip = state.backoff

    def _draft(self, plans: list[_Plan], schedule_batch) -> None:
        """Candidates (and q at T > 0) per request; k cut where the drafter's confidence drops."""
        reqs = schedule_batch.reqs
        active = [p for p in plans if p.k]
        for p, logits in zip(active, self._draft_logits(active)):
            req, st = reqs[p.index], p.state
            logits = logits[: p.k].float()  # [k, V]
            bias = self._bias(schedule_batch, p.index)
            if bias is not None:
                logits = logits + bias.to(logits.device, logits.dtype)
            temperature = _temperature(req)
            if temperature == 0 and self.tree_nodes > 0 and p.room > 0 and p.rules is None:
                # a greedy draft tree: its nodes are this step's candidates (slots, verify rows)
                p.tree = build_tree(torch.softmax(logits, dim=-1)[None], [p.k], min(self.tree_nodes, p.room),
                                    min_path_prob=batch_min_path_prob(self.tree_min_prob, len(plans)))
                p.candidates = p.tree.token_lists[0][: int(p.tree.valid.sum())]
                p.k = len(p.candidates)
                continue
            if p.rules is not None and temperature == 0:  # a greedy chain under the timestamp rules
                cands, conf = self.timestamp_rows.draft(p.rules, logits, req.output_ids)
            else:
                if p.rules is not None:  # a sampled chain under the timestamp rules, candidate by candidate
                    cands, logits = self.timestamp_rows.draft_sampled(p.rules, logits, req.output_ids, temperature)
                probs = probs_from_logits(logits, temperature) if temperature > 0 else torch.softmax(logits, dim=-1)
                if temperature > 0:
                    p.draft_probs = probs
                if p.rules is None:
                    cands = sample_tokens(probs) if temperature > 0 else probs.argmax(dim=-1)
                conf = probs.gather(1, cands[:, None])[:, 0]
            if self.min_draft_prob > 0:
                p.k = int(confident_length(conf, self.min_draft_prob))
            p.candidates = cands[: p.k].tolist()
            if p.draft_probs is not None:
                p.draft_probs = p.draft_probs[: p.k]
            if p.k == 0:
                self._back_off(st)

    def _draft_logits(self, active: list[_Plan]) -> list[Tensor]:
        """One drafter forward for all drafting requests -> logits [K, V] per plan.

        On a CPU every per-request call re-reads the drafter's weights and head (memory-bound
        matrix-vector work), so requests are drafted together: histories are cut to the longest
        prefix of the batch (each request's own length masks the rest, `history_len`) and the
        acoustic K/V, the same length for every Whisper request (one 30 s window), are stacked.
        Batching changes the drafts by float rounding at most, and the target verifies every one."""
        if not active:
            return []
        acoustic_lengths = {tuple(k.shape[2] for k, _ in p.state.acoustic) for p in active}
        if len(acoustic_lengths) == 1:
            longest = max(p.prefix_len for p in active)
            hist = [tuple(torch.cat([p.state.hist[i][j][:, :, :longest] for p in active]) for j in (0, 1))
                    for i in range(len(active[0].state.hist))]
            acoustic = self._stacked_acoustic(active)
            pos = torch.tensor([p.prefix_len for p in active], device=self._device)
            anchor = torch.tensor([p.anchor for p in active], device=self._device)
            return list(self.drafter(anchor, pos, hist, pos, acoustic).unbind(0))
        out = []  # acoustic memories of different lengths: one call each
        for p in active:
            pos = torch.tensor([p.prefix_len], device=self._device)
            one = [(k[:, :, : p.prefix_len], v[:, :, : p.prefix_len]) for k, v in p.state.hist]
            out.append(self.drafter(torch.tensor([p.anchor], device=self._device), pos, one, pos,
                                    p.state.acoustic)[0])
        return out

    def _stacked_acoustic(self, active: list[_Plan]) -> list[tuple[Tensor, Tensor]]:
        """The acoustic K/V of these requests stacked in batch order; reused while the drafting set
        is unchanged (steady decoding), since restacking copies ~1.5 MB per request, layer and
        K/V every step. Keyed by the state objects themselves (held, so an id is never reused):
        a new request is a new state."""
        key = tuple(p.state for p in active)
        cached = self._acoustic_batch
        if cached is None or len(cached[0]) != len(key) or any(a is not b for a, b in zip(cached[0], key)):
            stacked = [tuple(torch.cat([p.state.acoustic[i][j] for p in active]) for j in (0, 1))
                       for i in range(len(active[0].state.acoustic))]
            self._acoustic_batch = (key, stacked)
        return self._acoustic_batch[1]

    def _speculate(self, plans: list[_Plan], extra: Tensor, schedule_batch):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        self._committed = False
        reqs = schedule_batch.reqs
        req_to_token = schedule_batch.req_to_token_pool.req_to_token
        enc_lens = list(schedule_batch.encoder_lens_cpu)

        # 2. place the candidates' slots after the anchor
        start = 0
        for p in plans:
            if p.k:
                p.slots = extra[start: start + p.k]
                start += p.k
                pos0 = enc_lens[p.index] + p.prefix_len + 1
                req_to_token[p.row, pos0: pos0 + p.k] = p.slots.to(req_to_token.dtype)

        # 3. one target pass over anchor + candidates of every request
        t1 = time.perf_counter()
        rows = [VerifyRow(row=p.row, encoder_len=enc_lens[p.index], prefix_len=p.prefix_len,
                          tokens=(p.anchor, *p.candidates),
                          depths=None if p.tree is None else tuple(p.tree.depth[0, : p.k].tolist()),
                          parents=None if p.tree is None else tuple(p.tree.parent[0, : p.k].tolist()))
                for p in plans]
        out = verify_forward(self.model, self.tp_worker.model_runner.token_to_kv_pool, req_to_token, rows,
                             self.drafter.config.history_layers)

        # 4-5. accept, free the rejected slots, commit
        t2 = time.perf_counter()
        self._committed = True
        allocator = schedule_batch.token_to_kv_pool_allocator
        next_tokens, grown = [], []
        for p in plans:
            req = reqs[p.index]
            lo, hi = out.offsets[p.index], out.offsets[p.index + 1]
            logits = out.logits[lo:hi].float()  # [k+1, V]
            bias = self._bias(schedule_batch, p.index)
            if bias is not None:
                logits = logits + bias.to(logits.device, logits.dtype)
            if p.rules is not None:  # as sglang's sampler: the bias, then the timestamp processor
                self.timestamp_rows.verify(p.rules, logits, req.output_ids, p.candidates)
            if p.tree is not None:  # the walk through the tree (its depth was bounded by the budget when built)
                (a,), (path,), (nxt,), _ = greedy_tree_accept(p.tree, [logits.argmax(-1).tolist()], [p.k], eos_id=-1)
            else:
                cands = torch.tensor([p.candidates], dtype=torch.long, device=logits.device).view(1, p.k)
                n_prop = torch.tensor([p.k], device=logits.device)
                temperature = _temperature(req)
                if temperature > 0:
                    q = p.draft_probs[None] if p.k else torch.zeros(1, 0, logits.shape[-1], device=logits.device)
                    res = speculative_sample(cands, q, probs_from_logits(logits, temperature)[None], n_prop, eos_id=-1)
                else:
                    res = greedy_accept(cands, logits[None], n_prop, eos_id=-1)
                a, nxt = int(res.accepted[0]), int(res.next_token[0])
                path = list(range(1, a + 1))  # a chain: the first a candidates
            accepted = [p.candidates[r - 1] for r in path]
            stops = set(req.sampling_params.stop_token_ids or ()) | set(req.eos_token_ids or ())
            for j in range(a):
                if accepted[j] in stops:  # an accepted stop token ends the run; it is the step's token
                    a, nxt = j, accepted[j]
                    break
            accepted, path = accepted[:a], path[:a]
            self.add_verified(req.rid, logits, [0, *path], [*accepted, nxt])  # token j verified by row [0, *path][j]
            if p.k:
                if p.tree is not None:  # positions L+1..L+a now map to the accepted nodes' slots
                    pos0 = enc_lens[p.index] + p.prefix_len + 1
                    keep = torch.tensor([r - 1 for r in path], dtype=torch.long, device=p.slots.device)
                    req_to_token[p.row, pos0: pos0 + a] = p.slots[keep].to(req_to_token.dtype)
                    rejected = torch.ones(p.k, dtype=torch.bool, device=p.slots.device)
                    rejected[keep] = False
                    allocator.free(p.slots[rejected])
                else:
                    allocator.free(p.slots[a:])
            req.output_ids.extend(accepted)
            req.kv.kv_committed_len += a
            req.kv.kv_allocated_len += a
            grown.append(a)
            next_tokens.append(nxt)
            self.step_tokens[req.rid] = [*accepted, nxt]
            if p.state is not None:
                p.state.keep(out.history[[lo + r for r in [0, *path]]])  # positions L .. L+a
                if p.k and a == 0:
                    self._back_off(p.state)
                elif a:
                    p.state.backoff = 0
                p.state.stats.proposed += p.k
                p.state.stats.accepted += a
                p.state.stats.target_calls += 1
            self.totals.proposed += p.k
            self.totals.accepted += a
        self.totals.target_calls += 1
        t3 = time.perf_counter()
        timing = self.timing
        timing["verify"] += t2 - t1
        timing["accept"] += t3 - t2
        timing["spec_steps"] += 1
        if timing["spec_steps"] % 50 == 0:
            self.log_timing()

        delta_cpu = torch.tensor(grown, dtype=schedule_batch.seq_lens_cpu.dtype)
        schedule_batch.seq_lens = schedule_batch.seq_lens + delta_cpu.to(schedule_batch.seq_lens.device)
        schedule_batch.seq_lens_cpu = schedule_batch.seq_lens_cpu + delta_cpu
        if schedule_batch.orig_seq_lens is not None:
            schedule_batch.orig_seq_lens = schedule_batch.orig_seq_lens + delta_cpu.to(
                schedule_batch.orig_seq_lens.device, schedule_batch.orig_seq_lens.dtype)
        schedule_batch.seq_lens_sum = None

        device = schedule_batch.input_ids.device if schedule_batch.input_ids is not None else self._device
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None),
            next_token_ids=torch.tensor(next_tokens, dtype=torch.long, device=device),
            can_run_cuda_graph=False,
        )

    def log_timing(self) -> None:
        t = self.timing
        per = lambda key, n: 1000 * t[key] / max(1, t[n])  # noqa: E731
        logger.info("whisper-flash steps: %d speculative (draft %.1f ms, verify %.1f ms, accept %.1f ms per step), "
                    "%d stock (%.1f ms per step); totals %s", t["spec_steps"], per("draft", "draft_steps"),
                    per("verify", "spec_steps"), per("accept", "spec_steps"), t["stock_steps"],
                    per("stock", "stock_steps"), self.totals.line())

    def _stock_step(self):
        """The stock decode forward, with the history hooks armed (see post_decode)."""
        self._stock_t0 = time.perf_counter()
        self._plain_step = True
        self.tap.arm()
        return None

    def post_decode(self, result, forward_batch, schedule_batch, requests) -> None:
        if not self._plain_step:
            return
        self._plain_step = False
        states, _ = self.tap.disarm()
        seq_lens = schedule_batch.seq_lens_cpu.tolist()
        for i, req in enumerate(schedule_batch.reqs):
            state = self.states.get(req.rid)
            if state is None:
                continue
            L = int(seq_lens[i]) - 1
            state.stats.target_calls += 1
            if states is None or states.shape[0] != len(schedule_batch.reqs) or state.length != L:
                self.forget(req.rid, leaving=False)  # hooks did not fire (a graph replay): no more drafts for it
                continue
            state.keep(states[i: i + 1].clone())
        seconds = time.perf_counter() - self._stock_t0
        self.timing["stock"] += seconds
        self.timing["stock_steps"] += 1
        if self.pacer is not None:
            self.pacer.record_step(len(schedule_batch.reqs), seconds)
