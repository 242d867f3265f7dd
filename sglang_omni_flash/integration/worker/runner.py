"""The Whisper-Flash decode step inside sglang-omni's ASR stage (``WhisperFlashModelRunner``).

sglang-omni's scheduler stays a plain, single-token scheduler: before each decode step it has
allocated one KV slot per running request for the *anchor* (the latest emitted token, not yet
seen by the target) and done ``seq_lens += 1``. ``custom_decode_forward`` then executes one round
of ``flash.rounds`` (the algorithm the standalone engine runs too) over the batch:

1. the pacing decision (``flash.pacing``): a round, or the stock decode step;
2. draft: one drafter call for every request that drafts (``flash.rounds.draft_round`` turns its
   logits into each request's verify block: a chain or a draft tree, under the request's rules);
3. verify: the block's extra rows get KV slots, written into the request's ``req_to_token`` row
   after the anchor, and ONE target pass runs every block (``verify.verify_forward``);
4. commit what ``flash.rounds.settle_round`` keeps: the kept rows' slots become the request's next
   positions and the other slots are freed, the accepted tokens go into sglang's bookkeeping
   (``output_ids``, ``kv_*_len``, ``seq_lens*``), the kept rows' history states stay pending for
   the drafter (projected, with every other pending row of the batch, in one drafter call when the
   request drafts again);
5. the last emitted token (the target's correction or bonus, or a stop token) is this step's
   sampled token, so the scheduler's own result processing appends it, checks EOS /
   max_new_tokens and frees finished requests exactly as in plain decoding.

Invariant between steps: ``kv_allocated_len == kv_committed_len`` (sglang asserts it on every
release path when no spec algorithm is configured) and the drafter history of a request holds
exactly its committed decoder positions, projected or pending. A step the worker cannot speculate
(other custom logit processors, logprobs, penalties, no free slots, no request with a draft) is
the stock decode, with forward hooks on the history layers keeping the drafter cache in step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_omni.model_runner.base import ModelRunner

from sglang_omni_flash.flash.logit_rules import LogitRules
from sglang_omni_flash.flash.options import SpecOptions
from sglang_omni_flash.flash.pacing import Pacer, round_price
from sglang_omni_flash.flash.rounds import RoundRequest, allowed_candidates, draft_round, settle_round
from sglang_omni_flash.integration.scoring.metrics import SpecMetrics
from sglang_omni_flash.integration.worker.compute_turns import StepTurnsMixin
from sglang_omni_flash.integration.worker.history import DraftState, DrafterMemories, HistoryTap, SpecStats
from sglang_omni_flash.integration.worker.timestamp_rows import TimestampRows, is_timestamped
from sglang_omni_flash.integration.worker.verify import VerifyRow, verify_forward
from sglang_omni_flash.integration.scoring.window_scores import ScoringRunnerMixin

logger = logging.getLogger("sglang_omni_flash.spec")


@dataclass
class _Member:
    """One request of a speculative step (host side)."""

    index: int  # row in the batch
    row: int  # req_to_token row (req_pool_idx)
    state: DraftState | None
    prefix_len: int  # L: the anchor's position
    slots: Tensor | None = None  # KV slots of the block's rows after the anchor


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


class WhisperFlashModelRunner(StepTurnsMixin, ScoringRunnerMixin, ModelRunner):
    """sglang-omni's ASR model runner with Whisper-Flash speculative decode steps."""

    def __init__(self, tp_worker, output_processor, *, drafter, tap: HistoryTap, spec: SpecOptions):
        super().__init__(tp_worker, output_processor)
        self.drafter = drafter
        p = next(drafter.parameters())
        self._device, self._dtype = p.device, p.dtype
        # the round's knobs, with the defaults of the target's device and dtype (the drafter's are the same)
        self.spec = spec.resolved(p.device.type, p.dtype)
        # per step, for the whole batch: a round only where its measured cost is paid by the running
        # acceptance, else a stock step (flash.pacing, as the standalone engine; cost only, never output)
        self.pacer = Pacer() if self.spec.pace else None
        self.tap = tap
        self.k = min(self.spec.num_draft_tokens, drafter.config.block_size)
        cfg = drafter.config
        self.max_positions = int(getattr(self.model.config, "max_target_positions", cfg.max_positions))
        self.vocab_size = int(self.model.config.vocab_size)  # width of the draft and verify logits rows
        self.memories = DrafterMemories(drafter, self.max_positions, self.spec.max_backoff)
        self.states: dict[str, DraftState] = {}
        self.step_tokens: dict[str, list[int]] = {}  # rid -> tokens emitted this step (for streaming)
        self.totals = SpecStats()
        self.metrics = SpecMetrics(self)  # exported by the stage's /whisper-flash routes
        self.timing = {"draft": 0.0, "draft_steps": 0, "verify": 0.0, "accept": 0.0, "spec_steps": 0, "stock": 0.0, "stock_steps": 0,
                       "deciding": 0.0}
        self._stock_t0 = 0.0
        self._plain_step = False
        self._decide_t0 = 0.0  # set as each decode step starts (custom_decode_forward)
        self._committed = False
        self._prefill_capture: tuple[Tensor | None, list[Tensor]] = (None, [])
        self.timestamp_rows = TimestampRows(p.device)
        self._no_rules = LogitRules([])  # sglang's logit_bias carries the suppress tokens: no rules else
        self.memories.warm_up(int(getattr(self.model.config, "max_source_positions", 1500)))

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
                    state = self.memories.new_state(states[row: row + n], encoder_out)
                    state.stats.target_calls = 1
                    self.states[req.rid] = state
                row += n

    # ------------------------------------------------------------------------------- decode

    def custom_decode_forward(self, forward_batch, schedule_batch, requests):
        self._decide_t0 = time.perf_counter()  # what choosing costs a plain step (log_timing)
        reqs = schedule_batch.reqs
        live = {req.rid for req in reqs}
        for rid in [r for r in self.states if r not in live]:
            self.forget(rid)  # left the batch without a finish callback (abort, retraction)
        self.step_tokens.clear()
        if not all(_sampling_ok(req) for req in reqs):
            return self._stock_step()

        seq_lens = schedule_batch.seq_lens_cpu.tolist()
        pool_rows = schedule_batch.req_pool_indices.tolist()
        enc_lens = list(schedule_batch.encoder_lens_cpu or [0] * len(reqs))
        width = schedule_batch.req_to_token_pool.req_to_token.shape[1]
        bias = schedule_batch.sampling_info.logit_bias
        members, round_requests = [], []
        for i, req in enumerate(reqs):
            state = self.states.get(req.rid)
            L = int(seq_lens[i]) - 1
            if state is not None and state.length != L:
                self.forget(req.rid, leaving=False)  # out of step: it decodes on without drafts
                state = None
            room = width - int(enc_lens[i]) - L - 1  # req_to_token positions after the anchor
            num = 0
            if state is not None and state.backoff.drafts_now():
                tokens_left = req.sampling_params.max_new_tokens - len(req.output_ids)
                num = min(allowed_candidates(self.k, tokens_left, self.max_positions - 1 - L), room)
            members.append(_Member(index=i, row=int(pool_rows[i]), state=state, prefix_len=L))
            round_requests.append(RoundRequest(
                generated=req.output_ids, num=num,
                rules=self.timestamp_rows.rules_for(req, self.vocab_size) or self._no_rules,
                temperature=_temperature(req), bias=None if bias is None else bias[i],
                stops=frozenset(req.sampling_params.stop_token_ids or ()) | frozenset(req.eos_token_ids or ()),
                room=room))
        if not any(r.num for r in round_requests):
            return self._stock_step()
        drafting = [j for j, r in enumerate(round_requests) if r.num]
        states = [members[j].state for j in drafting]
        unready = sum(not state.ready for state in states)
        if self.pacer is not None and not self.pacer.speculate(len(reqs), unready=unready):
            return self._stock_step()
        with torch.inference_mode():
            if unready:  # first drafts: their acoustic K/V, priced apart from the round (a one-off)
                setup_t0 = time.perf_counter()
                self.memories.prepare(states)
                if self.pacer is not None:
                    self.pacer.record_setup(unready, time.perf_counter() - setup_t0)
        t0 = time.perf_counter()  # the round's start: its drafting, and its whole price for the pacer
        with torch.inference_mode():
            history_positions = sum(state.pending_rows for state in states) / len(states)
            history_t0 = time.perf_counter()
            self.memories.project_pending(states)
            history_s = time.perf_counter() - history_t0
            logits = torch.stack(self.memories.draft_logits(
                [(members[j].state, round_requests[j].generated[-1], members[j].prefix_len) for j in drafting]))
            plan = draft_round(round_requests, self.spec, logits=logits[:, : self.k], drafted=drafting)
            self.timing["draft"] += time.perf_counter() - t0
            self.timing["draft_steps"] += 1
        n_extra = sum(len(b) - 1 for b in plan.blocks)
        allocator = schedule_batch.token_to_kv_pool_allocator
        extra = allocator.alloc(n_extra) if n_extra else None
        if extra is None and n_extra:
            return self._stock_step()
        try:
            with torch.inference_mode():
                out = self._speculate(plan, members, extra, schedule_batch)
            if self.pacer is not None:
                emitted = sum(len(self.step_tokens.get(req.rid, ())) or 1 for req in reqs)
                gain = emitted / len(reqs)
                self.pacer.record_round(len(reqs), round_price(time.perf_counter() - t0, gain, history_s,
                                                               history_positions), gain)
            return out
        except BaseException:
            if not self._committed and extra is not None:
                allocator.free(extra)  # nothing of this step reached sglang's bookkeeping
            raise

    def _speculate(self, plan, members: list[_Member], extra: Tensor | None, schedule_batch):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        self._committed = False
        reqs = schedule_batch.reqs
        req_to_token = schedule_batch.req_to_token_pool.req_to_token
        enc_lens = list(schedule_batch.encoder_lens_cpu)

        # the blocks' rows after the anchor get slots, placed after the anchor in the request's row
        start = 0
        for m, block in zip(members, plan.blocks):
            n = len(block) - 1
            if n:
                m.slots = extra[start: start + n]
                start += n
                pos0 = enc_lens[m.index] + m.prefix_len + 1
                req_to_token[m.row, pos0: pos0 + n] = m.slots.to(req_to_token.dtype)

        # one target pass over every block
        t1 = time.perf_counter()
        rows = [VerifyRow(row=m.row, encoder_len=enc_lens[m.index], prefix_len=m.prefix_len, tokens=tuple(block.tokens),
                          depths=None if block.is_chain else tuple(block.depth[1:]),
                          parents=None if block.is_chain else tuple(block.parent[1:]))
                for m, block in zip(members, plan.blocks)]
        out = verify_forward(self.model, self.tp_worker.model_runner.token_to_kv_pool, req_to_token, rows,
                             self.drafter.config.history_layers)
        settled = settle_round(plan, out.logits, out.offsets)

        # commit: kept rows at positions L+1.., the other slots freed, tokens into sglang's bookkeeping
        t2 = time.perf_counter()
        self._committed = True
        allocator = schedule_batch.token_to_kv_pool_allocator
        next_tokens, grown = [], []
        for m, s in zip(members, settled):
            req = reqs[m.index]
            a = len(s.emitted) - 1  # the last emitted token is this step's sampled token
            self.scores.add(req.rid, s.logprobs)
            if m.slots is not None:
                keep = torch.tensor([r - 1 for r in s.rows[1:]], dtype=torch.long, device=m.slots.device)
                pos0 = enc_lens[m.index] + m.prefix_len + 1
                req_to_token[m.row, pos0: pos0 + a] = m.slots[keep].to(req_to_token.dtype)
                dropped = torch.ones(m.slots.numel(), dtype=torch.bool, device=m.slots.device)
                dropped[keep] = False
                allocator.free(m.slots[dropped])
            req.output_ids.extend(s.emitted[:-1])
            req.kv.kv_committed_len += a
            req.kv.kv_allocated_len += a
            grown.append(a)
            next_tokens.append(s.emitted[-1])
            self.step_tokens[req.rid] = list(s.emitted)
            if m.state is not None:
                lo = out.offsets[m.index]
                m.state.keep(out.history[[lo + r for r in s.rows]])  # positions L .. L+a
                m.state.backoff.after_round(s.proposed, s.accepted)
                m.state.stats.proposed += s.proposed
                m.state.stats.accepted += s.accepted
                m.state.stats.target_calls += 1
            self.totals.proposed += s.proposed
            self.totals.accepted += s.accepted
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
                    "%d stock (%.1f ms per step, %.2f ms of it deciding); totals %s", t["spec_steps"],
                    per("draft", "draft_steps"), per("verify", "spec_steps"), per("accept", "spec_steps"),
                    t["stock_steps"], per("stock", "stock_steps") + per("deciding", "stock_steps"),
                    per("deciding", "stock_steps"), self.totals.line())

    def _stock_step(self):
        """The stock decode forward, with the history hooks armed (see post_decode)."""
        self._stock_t0 = time.perf_counter()
        self.timing["deciding"] += self._stock_t0 - self._decide_t0
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
        if self.timing["stock_steps"] % 500 == 0:  # a server whose batches never draft logs too
            self.log_timing()
        if self.pacer is not None:
            self.pacer.record_step(len(schedule_batch.reqs), seconds)
