"""Every knob of the standalone engine, in one frozen dataclass passed from the CLI down. The
speculation knobs are `flash.options.SpecOptions` (`spec`), shared with the ASR-stage worker."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sglang_omni_flash.flash.options import SpecOptions


@dataclass(frozen=True)
class EngineOptions:
    # target model: "base", "tiny.en" (embedded, converted on first use) or a transformers Whisper directory
    model: str = "base"
    # drafter directory; None = the drafter shipped for the model if any, else untrained-from-target
    drafter: str | None = None
    # True: Whisper-Flash propose/verify/advance; False: plain greedy/sampling, one token per target call
    speculative: bool = True
    # requests decoded together as one static batch
    batch_size: int = 1
    # 0 = greedy (argmax); > 0 = fixed-temperature sampling with speculative rejection sampling
    temperature: float = 0.0
    # seed of the sampling generator (one torch.Generator per decode call)
    seed: int = 0
    # temperature fallback (flash.fallback), with temperature 0 only: a window judged too repetitive or
    # too unsure is decoded again at each of these temperatures in turn, the last attempt kept; () = off.
    # openai-whisper's ladder is flash.fallback.LADDER (0.2 .. 1.0)
    temperature_fallback: tuple[float, ...] = ()
    compression_ratio_threshold: float | None = 2.4  # retry above this gzip ratio (None: no check)
    logprob_threshold: float | None = -1.0  # retry below this average log-probability (None: no check)
    no_speech_threshold: float | None = 0.6  # silence above this <|nospeech|> probability, when also unsure
    # emit Whisper timestamp tokens (timestamp logit rules on, <|notimestamps|> left out of the prompt)
    timestamps: bool = False
    # language code ("en", "de", ...) for multilingual models; None = detect per request
    language: str | None = None
    # "transcribe" or "translate" (multilingual models only)
    task: str = "transcribe"
    # generated-token budget per request, EOS included; None = up to the 448-position decoder window
    max_new_tokens: int | None = None
    # "auto" (cuda if available, else cpu), "cpu" or "cuda"
    device: str = "auto"
    # "auto" (cuda: float16; cpu: bfloat16 where the CPU has AMX-BF16 or AVX512-BF16, else float32; see
    # hardware.choose_dtype), "float32", "float16" or "bfloat16"
    dtype: str = "auto"
    # CUDA only: replay prefill / draft / verify through captured CUDA graphs
    cuda_graphs: bool = True
    # torch intra-op threads on CPU; None = leave torch's default
    threads: int | None = None
    # how rounds are drafted and paced (cost only, never output); None fields by the target's
    # device and dtype (SpecOptions.resolved)
    spec: SpecOptions = field(default_factory=SpecOptions)

    def with_(self, **changes) -> "EngineOptions":
        """A copy with some fields changed (the options object itself never changes); the names of
        `SpecOptions` fields change `spec`."""
        spec = {name: changes.pop(name) for name in SpecOptions.names() if name in changes}
        if spec:
            changes["spec"] = self.spec.with_(**spec)
        return replace(self, **changes)
