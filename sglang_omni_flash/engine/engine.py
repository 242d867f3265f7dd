"""The standalone Whisper-Flash engine over transformers Whisper weights.

`WhisperFlashEngine(options)` loads the target (and a drafter), then for each static batch of
`options.batch_size` requests: encodes the audio once, fills the target's cross-attention K/V and the
drafter's acoustic K/V once, detects the language where needed, and runs `SpeculativeDecoder` (or its
baseline mode, one token per step) over a static preallocated cache. Finished requests are compacted
out of every buffer, so the remaining ones never wait or pay for them.

CPU: bfloat16 with AMX-BF16, else float32 (`hardware.choose_dtype`); SDPA, attention limited to
the live part of the cache. CUDA: float16 and CUDA graphs for prefill, each verify length and the
drafter, captured once per (batch bucket, length) over preallocated buffers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sglang_omni_flash.engine.audio import LogMel, load_audio
from sglang_omni_flash.engine.backends import SLACK, DrafterProposer, TargetBackend
from sglang_omni_flash.engine.options import EngineOptions
from sglang_omni_flash.flash.fallback import judge
from sglang_omni_flash.flash.logit_rules import LogitRules
from sglang_omni_flash.flash.pacing import Pacer
from sglang_omni_flash.engine.prompt import SpecialTokens, build_prompt, detect_language
from sglang_omni_flash.engine.speculative import DecodeResult, SpeculativeDecoder
from sglang_omni_flash.engine.target import WhisperTarget
from sglang_omni_flash.errors import UserError
from sglang_omni_flash.hardware import DtypeChoice, choose_device, choose_dtype



def resolve_device(options: EngineOptions) -> tuple[torch.device, torch.dtype, DtypeChoice]:
    """(device, dtype, why that dtype) for `options`; dtype "auto" follows `hardware.choose_dtype`."""
    try:
        device = torch.device(choose_device(options.device))
        choice = choose_dtype(options.dtype, device.type)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return device, getattr(torch, choice.name), choice


# -------------------------------------------------------------------------------------- engine


@dataclass
class Timing:
    """Seconds of the last `decode` call (log-mel in, last token out)."""

    encoder_s: float = 0.0
    decode_s: float = 0.0  # everything after the encoder (prompt, prefill, rounds)

    @property
    def total_s(self) -> float:
        return self.encoder_s + self.decode_s


class WhisperFlashEngine:
    """Greedy / sampling Whisper decoding, with or without Whisper-Flash speculation."""

    def __init__(self, options: EngineOptions, model=None, drafter=None):
        from transformers import WhisperForConditionalGeneration, WhisperTokenizerFast

        if options.batch_size < 1:
            raise UserError(f"batch size must be at least 1, got {options.batch_size}")
        if options.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {options.temperature}")
        if any(not 0 < t <= 2 for t in options.temperature_fallback) or list(options.temperature_fallback) != sorted(
                options.temperature_fallback):
            raise UserError(f"temperature_fallback must be rising temperatures in (0, 2], got {options.temperature_fallback}")
        self.options = options
        self.device, self.dtype, self.dtype_choice = resolve_device(options)
        self.spec = options.spec.resolved(self.device.type, self.dtype)  # no None left
        # the drafter's pacer lives as long as the engine: costs per batch size and the running gain
        # carry from one decode call to the next (test proposers get a fresh pacer per call)
        self.drafter_pacer = Pacer()
        self.pacer: Pacer | None = None  # the last decode call's
        if options.threads is not None and self.device.type == "cpu":
            torch.set_num_threads(options.threads)

        if model is None:
            from sglang_omni_flash.models.embedded import resolve_model

            self.model_dir = resolve_model(options.model)
            model = WhisperForConditionalGeneration.from_pretrained(str(self.model_dir), dtype=self.dtype)
        else:
            self.model_dir = Path(getattr(model.config, "_name_or_path", "") or ".")
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.special = SpecialTokens.from_model(self.model)
        self.tokenizer = WhisperTokenizerFast.from_pretrained(str(self.model_dir))
        self.log_mel = LogMel(self.model_dir, self.model.config.num_mel_bins)

        self.drafter, self.drafter_source = (drafter, "given") if drafter is not None else self._load_drafter()
        if self.drafter is not None:
            self.drafter = self.drafter.to(device=self.device, dtype=self.dtype).eval()
            self.drafter.set_cpu_int8(self.spec.drafter_int8)
            self._warm_up_drafter()
        history_layers = self.drafter.config.history_layers if self.drafter is not None else ()
        self.target = WhisperTarget(self.model, history_layers)
        self.timing = Timing()
        self.resize(options.batch_size)

    def resize(self, batch_size: int) -> None:
        """(Re)allocate the static buffers for batches of `batch_size` requests."""
        if batch_size < 1:
            raise UserError(f"batch size must be at least 1, got {batch_size}")
        self.options = self.options.with_(batch_size=batch_size)
        enc_len = self.model.config.max_source_positions
        graphs = self.options.cuda_graphs and self.device.type == "cuda"
        self.backend = self.proposer = None  # free the old buffers first
        self.backend = TargetBackend(self.target, batch_size, enc_len, graphs)
        if self.drafter is not None:
            max_len = self.target.max_positions + SLACK
            self.proposer = DrafterProposer(self.drafter, batch_size, max_len, enc_len, graphs)

    @torch.inference_mode()
    def _warm_up_drafter(self) -> None:
        """One draft of a made-up request. The drafter's first call pays one-time kernel set-up
        (~0.4 s on a CPU with int8 weights); in the first round it would set the pacer's price of a
        round far too high, and the pacer would step aside while that average decays."""
        d, cfg = self.drafter, self.drafter.config
        z = dict(device=self.device, dtype=self.dtype)
        hist = d.history_kv(d.project_history(torch.zeros(1, 4, len(cfg.history_layers), cfg.d_model, **z)),
                            torch.arange(4, device=self.device)[None]) if cfg.use_history else None
        acoustic = d.acoustic_memory(torch.zeros(1, 8, cfg.d_model, **z)) if cfg.use_audio else None
        at = torch.tensor([4], device=self.device)
        d(torch.zeros(1, dtype=torch.long, device=self.device), at, hist, at, acoustic)

    # -- loading -----------------------------------------------------------------------------
    def _load_drafter(self):
        """-> (drafter or None, where it came from: a path, "shipped: PATH", "untrained", "none")."""
        opts = self.options
        if not opts.speculative and opts.drafter is None:
            return None, "none"
        from sglang_omni_flash.flash.checkpoint import find_shipped_drafter, load_drafter
        from sglang_omni_flash.flash.drafter import WhisperFlashDrafter

        if opts.drafter is not None:
            path = Path(opts.drafter).expanduser()
            if not path.is_dir():
                raise UserError(f"drafter directory not found: {path}")
            return load_drafter(path, self.model), str(path)
        shipped = find_shipped_drafter(self.model)
        if shipped is not None:
            return load_drafter(shipped, self.model), f"shipped: {shipped}"
        with torch.random.fork_rng(devices=[]):  # the untrained drafter's mask vector is random
            torch.manual_seed(opts.seed)
            drafter = WhisperFlashDrafter.from_target(self.model, block_size=opts.spec.num_draft_tokens)
        return drafter, "untrained (initialised from the target)"

    # -- public ------------------------------------------------------------------------------
    def features(self, audio) -> torch.Tensor:
        """Paths or 16 kHz float arrays -> log-mel [N, n_mels, 3000]."""
        waves = [load_audio(a) if isinstance(a, (str, Path)) else np.asarray(a, dtype=np.float32) for a in audio]
        return self.log_mel(waves)

    def transcribe(self, audio, speculative: bool | None = None, progress=None) -> list[DecodeResult]:
        return self.decode(self.features(audio), speculative=speculative, progress=progress)

    @torch.inference_mode()
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Log-mel [N, n_mels, 3000] -> encoder output [N, 1500, d] (in static batches)."""
        bs = self.options.batch_size
        return torch.cat([self.target.encode(features[i : i + bs].to(self.device)) for i in range(0, features.shape[0], bs)])

    @torch.inference_mode()
    def decode(
        self,
        features: torch.Tensor | None = None,
        speculative: bool | None = None,
        proposer=None,
        progress=None,
        encoder_out: torch.Tensor | None = None,
    ) -> list[DecodeResult]:
        """Decode log-mel features [N, n_mels, 3000] (or their encoder output [N, 1500, d]) in static
        batches of `options.batch_size`.

        `speculative` defaults to options.speculative; `proposer` replaces the drafter (tests plug
        oracle / random / adversarial proposers here). Timing of the whole call goes to `self.timing`.
        """
        opts = self.options
        speculative = opts.speculative if speculative is None else speculative
        if speculative and proposer is None:
            proposer = self.proposer
            if proposer is None:
                raise UserError("speculative decoding needs a drafter (none was loaded)")
        if not speculative:
            proposer = None
        source = features if encoder_out is None else encoder_out
        self.timing = Timing()
        self.pacer = None
        if self.spec.pace and proposer is not None:
            self.pacer = self.drafter_pacer if proposer is self.proposer else Pacer()
        fallback = opts.temperature == 0 and bool(opts.temperature_fallback)
        generator = self._generator(fallback)  # one seeded stream per call
        results: list[DecodeResult] = []
        for start in range(0, source.shape[0], opts.batch_size):
            chunk = source[start : start + opts.batch_size].to(self.device)
            if fallback and encoder_out is None:  # retries decode the same encoder output again
                chunk = self._encode_timed(chunk)
            part = self._decode_batch(chunk, proposer, encoder_out is not None or fallback, generator, start)
            if fallback:
                part = self._fall_back(chunk, part, proposer, generator, start)
            results += part
            if progress is not None:
                progress(chunk.shape[0])
        return results

    def _encode_timed(self, features: torch.Tensor) -> torch.Tensor:
        """The encoder, its time added to `timing.encoder_s` (device work finished included)."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = self.target.encode(features)
        sync()
        self.timing.encoder_s += time.perf_counter() - t0
        return out

    def _fall_back(self, encoder_out, results: list[DecodeResult], proposer, generator, first_id: int):
        """Judge each window (flash.fallback); decode the ones to retry again at the next temperature."""
        opts = self.options
        thresholds = dict(compression_ratio_threshold=opts.compression_ratio_threshold,
                          logprob_threshold=opts.logprob_threshold, no_speech_threshold=opts.no_speech_threshold)
        pending = list(range(len(results)))
        for attempt, temperature in enumerate((0.0, *opts.temperature_fallback)):
            if attempt:
                retried = self._decode_batch(encoder_out[pending], proposer, True, generator, first_id, temperature,
                                             request_ids=[first_id + i for i in pending])
                for i, res in zip(pending, retried):
                    res.fallbacks = attempt
                    res.target_calls += results[i].target_calls  # every attempt's target calls count
                    results[i] = res
            again = []
            for i in pending:
                res = results[i]
                words = self.tokenizer.decode(res.tokens, skip_special_tokens=True)  # no timestamp markup
                verdict = judge(words, res.sum_logprob, len(res.tokens), res.no_speech_prob, **thresholds)
                res.compression_ratio = verdict.compression_ratio
                if verdict.silence:
                    res.no_speech, res.text = True, ""
                elif verdict.retry:
                    again.append(i)
            pending = again
            if not pending:
                break
        return results

    # -- one static batch --------------------------------------------------------------------
    def _decode_batch(self, inputs: torch.Tensor, proposer, encoded: bool, generator, first_id: int,
                      temperature: float | None = None, request_ids: list[int] | None = None) -> list[DecodeResult]:
        opts, special = self.options, self.special
        temperature = opts.temperature if temperature is None else temperature
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        encoder_out = inputs.to(self.dtype) if encoded else self._encode_timed(inputs)
        sync()
        t1 = time.perf_counter()

        n = inputs.shape[0]
        self.backend.start(encoder_out)
        if proposer is not None and hasattr(proposer, "start"):
            proposer.start(encoder_out)
        languages = self._languages(n)
        prompts = [build_prompt(special, lang, opts.task, opts.timestamps) for lang in languages]
        budget = special.max_target_positions - len(prompts[0])
        if opts.max_new_tokens is not None:
            budget = max(1, min(budget, opts.max_new_tokens))
        decoder = SpeculativeDecoder(
            self.backend,
            proposer,
            self.rules(),
            special.eos,
            temperature,
            generator,
            self.device,
            spec=self.spec,
            pacer=self.pacer,
            clock=lambda: (sync(), time.perf_counter())[1],
            no_speech_id=special.no_timestamps - 1,  # <|nospeech|> / <|nocaptions|> (as transformers)
        )
        results = decoder.run(prompts, [budget] * n, request_ids or list(range(first_id, first_id + n)))
        sync()
        t2 = time.perf_counter()
        self.timing.decode_s += t2 - t1
        for res, lang in zip(results, languages):
            res.language = special.language_code(lang) if special.multilingual else "en"
            res.text = self.text(res.tokens)
            res.temperature = temperature
        return results

    def rules(self) -> LogitRules:
        special = self.special
        return LogitRules.for_whisper(
            self.target.vocab_size,
            special.suppress_tokens,
            special.begin_suppress_tokens,
            special.eos,
            special.no_timestamps,
            self.options.timestamps,
            special.max_initial_timestamp_index,
            self.device,
        )

    def _generator(self, fallback: bool = False) -> torch.Generator | None:
        if self.options.temperature <= 0 and not fallback:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.options.seed)
        return generator

    def _languages(self, n: int) -> list[int | None]:
        special, opts = self.special, self.options
        if not special.multilingual:
            return [None] * n
        if opts.language is not None:
            return [special.language_token(opts.language)] * n
        # one decoder step over <|startoftranscript|>, argmax over the language tokens
        sot = torch.full((n, 1), special.sot, dtype=torch.long, device=self.device)
        pos = torch.zeros((n, 1), dtype=torch.long, device=self.device)
        logits, _ = self.backend.verify(sot, pos, 1, want_history=False)
        return detect_language(logits[:, 0], special)

    def text(self, tokens: list[int]) -> str:
        if self.options.timestamps:
            return self.tokenizer.decode(tokens, skip_special_tokens=False, decode_with_timestamps=True).replace(
                self.tokenizer.eos_token or "", ""
            ).strip()
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
