"""What temperature fallback needs from the ASR stage's decode worker, and its verdict per window.

openai-whisper judges a decoded 30 s window by three numbers (``flash/fallback.py``): the
average log-probability of its tokens, the gzip compression ratio of its text, and the
``<|nospeech|>`` probability at the ``<|startoftranscript|>`` position. sglang-omni computes none
of them without ``return_logprob``, which would take every request off the speculative path
and scale the log-probabilities by the temperature. So the worker scores what it emits itself:

* ``ScoringRunnerMixin`` on both of the plugin's model runners (plain and speculative):
  - each token the sampler picks is scored on the logits exactly as the sampler saw them
    (logit bias, suppress tokens and timestamp rules applied, no temperature), through a
    wrapper on the sampler's own preprocessing;
  - the speculative step adds the scores of the tokens it emits, from the block rows that
    verified them (``flash.rounds.Settled.logprobs``, the same fp32 log-softmax as the sampler's);
  - ``<|nospeech|>`` comes from the final decoder norm's output at the SOT row of the prefill
    (openai-whisper: raw head logits there, no rules).
* ``window_report`` turns a finished request's score into the verdict dict that rides back to
  the HTTP route in the result payload (``omni_rollout["whisper_flash"]``); the route decides to
  decode the window again at ``next_temperature`` (``routes.transcriptions``).

Scores are bookkeeping only: no token, slot or draft depends on them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from sglang_omni.model_runner.base import ModelRunner

from sglang_omni_flash.flash.fallback import FallbackPolicy, judge
from sglang_omni_flash.integration.worker.compute_turns import StepTurnsMixin
from sglang_omni_flash.kernels.linear import row_copy

MAX_SCORED_REQUESTS = 4096  # a request that never reaches the result adapter cannot grow the table
REPORT_KEY = "whisper_flash"  # omni_rollout[REPORT_KEY]: the window's verdict
ATTEMPT_PARAM = "whisper_flash_attempt"  # request param: 0 for a first decode, n for the n-th retry


@dataclass
class WindowScore:
    sum_logprob: float = 0.0
    tokens: int = 0
    no_speech_prob: float | None = None


@dataclass
class WindowScores:
    """Per request id: the running score (written by the scheduler thread, popped by the result adapter)."""

    table: OrderedDict = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _get(self, rid: str) -> WindowScore:
        score = self.table.get(rid)
        if score is None:
            score = self.table[rid] = WindowScore()
            if len(self.table) > MAX_SCORED_REQUESTS:
                self.table.popitem(last=False)
        return score

    def add(self, rid: str, logprobs: list[float]) -> None:
        with self.lock:
            score = self._get(rid)
            for value in logprobs:  # one addition per token, in order: the same float sum whether a
                score.sum_logprob += float(value)  # step emitted one token or a round several
            score.tokens += len(logprobs)

    def set_no_speech(self, rid: str, prob: float) -> None:
        with self.lock:
            self._get(rid).no_speech_prob = float(prob)

    def pop(self, rid: str) -> WindowScore | None:
        with self.lock:
            return self.table.pop(rid, None)


class ScoringRunnerMixin:
    """Scores of emitted tokens and the no-speech probability, for a sglang-omni ``ModelRunner``.

    Call ``init_scoring`` after ``ModelRunner.__init__``. A subclass overriding the prefill hooks
    calls ``super()`` for them.
    """

    def init_scoring(self, *, no_speech_id: int, sot_id: int) -> None:
        self.scores = WindowScores()
        self.no_speech_id, self.sot_id = int(no_speech_id), int(sot_id)
        self._final_norm: torch.Tensor | None = None
        self._norm_armed = False
        self._sampled_logprobs: torch.Tensor | None = None
        self._want_logprobs = False
        model = self.tp_worker.model_runner.model
        model.model.decoder.layer_norm.register_forward_hook(self._on_final_norm)
        self._head_module = model.lm_head
        sampler = self.tp_worker.model_runner.sampler
        real = sampler._preprocess_logits

        def preprocess(logits, sampling_info):  # the logits the sampler picks from, before any temperature
            out = real(logits, sampling_info)
            if self._want_logprobs:
                self._want_logprobs = False  # the first call is the sampled batch's
                self._sampled_logprobs = torch.log_softmax(out.float(), dim=-1)
            return out

        sampler._preprocess_logits = preprocess  # instance attribute: this worker's sampler only

    def _on_final_norm(self, module, args, output) -> None:
        if self._norm_armed:
            self._final_norm = output

    # -- prefill: <|nospeech|> at the SOT row -------------------------------------------------

    def before_prefill(self, forward_batch, schedule_batch, requests) -> None:
        self._final_norm, self._norm_armed = None, True
        super().before_prefill(forward_batch, schedule_batch, requests)

    def cleanup_prefill(self, forward_batch, schedule_batch, requests) -> None:
        self._norm_armed = False
        super().cleanup_prefill(forward_batch, schedule_batch, requests)

    def post_prefill(self, result, forward_batch, schedule_batch, requests) -> None:
        super().post_prefill(result, forward_batch, schedule_batch, requests)
        hidden, self._final_norm = self._final_norm, None
        if hidden is None or forward_batch is None:
            return  # no hook output (a captured graph): the window is judged without it
        extend = list(forward_batch.extend_seq_lens_cpu)
        prefix = list(forward_batch.extend_prefix_lens_cpu)
        if sum(extend) != hidden.shape[0]:
            return
        rows, rids, row = [], [], 0
        for i, req in enumerate(schedule_batch.reqs):
            n = extend[i]
            prompt = list(req.origin_input_ids[-n:]) if n else []
            if prefix[i] == 0 and self.sot_id in prompt:
                rows.append(row + len(prompt) - 1 - prompt[::-1].index(self.sot_id))
                rids.append(req.rid)
            row += n
        if not rows:
            return
        with torch.inference_mode():  # the decode step's own head: the same bits whatever else was prefilled
            logits = row_copy(self._head_module)(hidden[rows]).float()
            probs = torch.softmax(logits, dim=-1)[:, self.no_speech_id].tolist()
        for rid, prob in zip(rids, probs):
            self.scores.set_no_speech(rid, prob)

    # -- tokens -------------------------------------------------------------------------------

    def sample_next_token_ids(self, logits_output, forward_batch, schedule_batch, requests):
        self._want_logprobs, self._sampled_logprobs = True, None
        try:
            ids = super().sample_next_token_ids(logits_output, forward_batch, schedule_batch, requests)
        finally:
            self._want_logprobs = False
        logprobs, self._sampled_logprobs = self._sampled_logprobs, None
        if logprobs is not None and logprobs.shape[0] == len(requests):
            picked = logprobs.gather(1, ids.view(-1, 1).to(logprobs.device, torch.long))[:, 0].tolist()
            for request, value in zip(requests, picked):
                self.scores.add(request.request_id, [value])
        return ids


class ScoringModelRunner(StepTurnsMixin, ScoringRunnerMixin, ModelRunner):
    """sglang-omni's plain model runner, scoring what it samples (the stage without speculation)."""


def window_report(*, text: str, score: WindowScore | None, temperature: float, attempt: int,
                  policy: FallbackPolicy) -> dict | None:
    """The verdict dict of one finished window (None without a score: nothing to judge)."""
    if score is None or not score.tokens:
        return None
    verdict = judge(text, score.sum_logprob, score.tokens, score.no_speech_prob,
                    compression_ratio_threshold=policy.compression_ratio_threshold,
                    logprob_threshold=policy.logprob_threshold, no_speech_threshold=policy.no_speech_threshold)
    retry = policy.enabled and verdict.retry
    return {
        "temperature": float(temperature),
        "attempt": int(attempt),
        "avg_logprob": verdict.avg_logprob,
        "compression_ratio": verdict.compression_ratio,
        "no_speech_prob": verdict.no_speech_prob,
        "silence": policy.enabled and verdict.silence,  # at any temperature, as openai-whisper skips it
        "retry": retry,
        "next_temperature": policy.next_temperature(temperature) if retry else None,
    }
