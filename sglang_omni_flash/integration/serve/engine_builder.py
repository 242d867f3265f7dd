"""The plugin's Whisper ASR engine builders (subclasses of sglang-omni's ``WhisperASREngineBuilder``).

* ``WhisperFlashEngineBuilder``      the stock builder with the ``.en`` prompt fix and, on a CPU, the
  CPU model of ``worker.cpu_model`` (row-invariant linears and attention, the encoder one window per call); built by
  ``stages.create_whisper_flash_asr_executor`` on a CPU and for ``.en`` checkpoints (multilingual
  checkpoints on CUDA without ``--asr.speculative`` use sglang-omni's factory).
  Its scheduler waits on request builds instead of polling (``idle_wait``).
* ``WhisperFlashSpecEngineBuilder``  adds the Whisper-Flash decode worker
  (``--asr.speculative whisper-flash``): loads the drafter before the KV pool is sized,
  installs the history hooks and the encoder tee on the target, and swaps in
  ``WhisperFlashModelRunner`` and a multi-token stream builder. Async decode is forced off
  (its one-step lookahead cannot carry a variable number of tokens per step).
"""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace

from sglang_omni.models.whisper_asr.config import WhisperASRFactoryArgs
from sglang_omni.models.whisper_asr.engine_builder import WhisperASREngineBuilder
from sglang_omni.models.whisper_asr.stages import create_sglang_whisper_asr_executor

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.flash.options import SpecOptions
from sglang_omni_flash.integration.serve.english_only import EnglishOnlyPrefix, is_english_only

# Arguments of the stock factory that go to `.build(...)`; all others go to the builder.
BUILD_ARGS = ("model_path", "device", "gpu_id", "dtype", "server_args_overrides")

logger = logging.getLogger("sglang_omni_flash.spec")


class WhisperFlashEngineBuilder(WhisperASREngineBuilder):
    def __init__(self, *, fallback=None, **stock):
        from sglang_omni_flash.integration.scoring.metrics import FallbackMetrics
        from sglang_omni_flash.flash.fallback import FallbackPolicy

        super().__init__(**stock)
        self.fallback = fallback if fallback is not None else FallbackPolicy()
        self.fallback_metrics = FallbackMetrics()
        self.runner = None

    def build(self, *args, **kwargs):
        from sglang_omni_flash.integration.serve.idle_wait import install as wait_on_builds

        scheduler = super().build(*args, **kwargs)
        wait_on_builds(scheduler)
        runner, fallback = self.runner, self.fallback_metrics

        def http_app():  # the stage serves it under the http_routes its config lists (metrics.py)
            from sglang_omni_flash.integration.scoring.metrics import metrics_app

            return metrics_app(getattr(runner, "metrics", None), fallback=fallback)

        scheduler.http_app = http_app
        return scheduler

    def setup_model(self, *, model_worker, **kwargs) -> None:
        super().setup_model(model_worker=model_worker, **kwargs)
        from sglang_omni_flash.integration.worker.compute_turns import take_turns
        from sglang_omni_flash.integration.worker.cpu_model import install

        install(model_worker.model_runner.model, take_turns=take_turns())  # CPU only (a no-op elsewhere)

    def make_model_runner(self, model_worker, output_proc):
        from sglang_omni_flash.integration.scoring.window_scores import ScoringModelRunner

        self.runner = ScoringModelRunner(model_worker, output_proc)
        self._init_scoring(self.runner)
        return self.runner

    def _init_scoring(self, runner) -> None:
        no_timestamps = int(self.generation_config.no_timestamps_token_id)
        runner.init_scoring(no_speech_id=no_timestamps - 1,  # <|nospeech|> / <|nocaptions|>, as the engine
                            sot_id=int(self.tokenizer.convert_tokens_to_ids("<|startoftranscript|>")))

    def make_adapters(self, model):
        if not is_english_only(self.generation_config):
            request_builder, result_adapter = super().make_adapters(model)
        else:
            real = self.tokenizer
            self.tokenizer = EnglishOnlyPrefix(real)  # what the request builder closes over
            try:
                request_builder, result_adapter = super().make_adapters(model)
            finally:
                self.tokenizer = real
        return request_builder, self._reporting(result_adapter)

    def _reporting(self, stock_result_adapter):
        """The stock result adapter plus the window's fallback verdict (``window_scores``), carried
        to the HTTP route in ``omni_rollout`` (which reaches ``CompletionResult.omni_rollout``)."""
        from sglang_omni_flash.integration.scoring.window_scores import ATTEMPT_PARAM, REPORT_KEY, window_report

        tokenizer, policy, metrics = self.tokenizer, self.fallback, self.fallback_metrics
        timestamp_begin = int(self.generation_config.no_timestamps_token_id) + 1

        def result_adapter(data):
            payload = stock_result_adapter(data)
            rid = data.req.rid
            score = self.runner.scores.pop(rid) if self.runner is not None else None
            if data.detect_language or not isinstance(payload.data, dict):
                return payload
            words = tokenizer.decode([t for t in data.output_ids or () if t < timestamp_begin],
                                     skip_special_tokens=True)  # the text without timestamps, as openai-whisper
            params = payload.request.params or {}
            report = window_report(text=words, score=score, temperature=float(data.temperature or 0.0),
                                   attempt=int(params.get(ATTEMPT_PARAM) or 0), policy=policy)
            if report is not None:
                metrics.record(rid, report)
                payload.data["omni_rollout"] = {**(payload.data.get("omni_rollout") or {}), REPORT_KEY: report}
            return payload

        return result_adapter

    def make_abort_callback(self):
        stock = super().make_abort_callback()
        builder = self

        def on_abort(request_id: str) -> None:
            if builder.runner is not None:
                builder.runner.scores.pop(request_id)
            if stock is not None:
                stock(request_id)

        return on_abort


class TargetView:
    """What the drafter checkpoint code reads of a transformers Whisper model, over sglang's model.

    sglang's ``WhisperForConditionalGeneration`` ties the output head to the token embedding
    (``lm_head is model.decoder.embed_tokens``) and has no ``get_output_embeddings``.
    """

    def __init__(self, model):
        self.config = model.config
        self.model = model.model
        self._head = SimpleNamespace(weight=model.lm_head.weight, bias=None)

    def get_output_embeddings(self):
        return self._head


class WhisperFlashSpecEngineBuilder(WhisperFlashEngineBuilder):
    def __init__(self, *, drafter_dir: str, spec: SpecOptions, **stock):
        stock["enable_async_decode"] = False
        super().__init__(**stock)
        self.drafter_dir = str(drafter_dir)
        self.spec = spec  # None fields: by the target's device and dtype (SpecOptions.resolved)
        self.drafter = None
        self.tap = None
        self.step_tokens: dict[str, list[int]] = {}  # shared by the runner and the stream builder

    def adjust_overrides(self, overrides: dict[str, object]) -> None:
        super().adjust_overrides(overrides)
        page_size = int(overrides.get("page_size") or 1)
        if page_size != 1:
            raise UserError(f"--asr.speculative whisper-flash needs page_size 1 (rejected slots are freed "
                            f"one by one), got engine.page_size={page_size}")
        overrides["page_size"] = 1

    def _load_drafter(self, model) -> None:
        if self.drafter is not None:
            return
        from sglang_omni_flash.flash.checkpoint import load_drafter

        target = TargetView(model)
        weight = model.lm_head.weight  # the drafter runs in the target's dtype, as the engine's does
        self.drafter = load_drafter(self.drafter_dir, target, dtype=weight.dtype)
        self.drafter.requires_grad_(False)
        spec = self.spec.resolved(weight.device.type, weight.dtype)
        self.drafter.set_cpu_int8(spec.drafter_int8)
        logger.info("whisper-flash: drafter %s (%d parameters, history layers %s, int8 %s); %s",
                    self.drafter_dir, self.drafter.num_parameters(), self.drafter.config.history_layers,
                    self.drafter.int8_inference, spec)

    def before_memory_pool(self, *, model_worker, **kwargs) -> None:
        super().before_memory_pool(model_worker=model_worker, **kwargs)
        model = getattr(model_worker.model_runner, "model", None)
        if model is not None:
            self._load_drafter(model)  # resident before the KV pool takes the rest of the memory

    def setup_model(self, *, model_worker, **kwargs) -> None:
        super().setup_model(model_worker=model_worker, **kwargs)
        from sglang_omni_flash.integration.worker.history import HistoryTap

        model = model_worker.model_runner.model
        self._load_drafter(model)
        self.tap = HistoryTap(model, self.drafter.config.history_layers)

    def make_model_runner(self, model_worker, output_proc):
        from sglang_omni_flash.integration.worker.runner import WhisperFlashModelRunner

        self.runner = WhisperFlashModelRunner(model_worker, output_proc, drafter=self.drafter, tap=self.tap,
                                              spec=self.spec)
        self.runner.step_tokens = self.step_tokens
        self._init_scoring(self.runner)
        return self.runner

    def extra_scheduler_kwargs(self):
        from sglang_omni_flash.integration.worker.streaming import MultiTokenStreamOutputBuilder

        kwargs = dict(super().extra_scheduler_kwargs())
        kwargs["stream_output_builder"] = MultiTokenStreamOutputBuilder(
            self.tokenizer, self.stream_emit_interval_s, self.step_tokens)
        kwargs["enable_async_decode"] = False
        return kwargs

    def make_abort_callback(self):
        plain = super().make_abort_callback()
        runner = self.runner

        def on_abort(request_id: str) -> None:
            if runner is not None:
                runner.forget(request_id)
            plain(request_id)

        return on_abort


def build_executor(builder_cls: type[WhisperASREngineBuilder], model_path: str, *,
                   builder_kwargs: dict | None = None, **stock_kwargs):
    """What ``create_sglang_whisper_asr_executor(model_path, **stock_kwargs)`` does, with ``builder_cls``.

    The stock factory is a pass-through: its defaults are bound here from its own signature
    (not copied), its build arguments go to ``build()`` and the rest (plus ``builder_kwargs``)
    to the builder.
    """
    bound = inspect.signature(create_sglang_whisper_asr_executor).bind(model_path, **stock_kwargs)
    bound.apply_defaults()
    args = dict(bound.arguments)
    build = {name: args.pop(name) for name in BUILD_ARGS}
    if args["encoder_attention_backend"] is None:
        args["encoder_attention_backend"] = WhisperASRFactoryArgs().encoder_attention_backend
    return builder_cls(**args, **(builder_kwargs or {})).build(build.pop("model_path"), **build)
