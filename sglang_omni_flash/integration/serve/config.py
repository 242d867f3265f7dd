"""``WhisperFlashASRPipelineConfig``: sglang-omni's Whisper ASR pipeline plus Whisper-Flash options.

The options are fields of the ASR *stage* config, so the command line paths are
``--asr.speculative``, ``--asr.speculative_draft_model_path``,
``--asr.speculative_num_draft_tokens``, ``--asr.temperature_fallback`` ... (sglang-omni prefixes a
dotted flag whose head is a stage name with ``stages.``; ``O/config/path.py`` compiles it against
``stage_config_types["asr"]``). Every ``speculative_<name>`` field but the switch and the drafter
path is a field of ``flash.options.SpecOptions``, made here from that dataclass (type and
default) and validated by it, so no knob is spelled out twice. They reach the plugin's stage
factory through ``stage_factory_kwargs``: the speculative ones (``speculative_options``, the
SpecOptions fields as a dict) only when ``speculative`` is set, the fallback ones always (the
factory takes them off before anything of sglang-omni's sees its kwargs).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import Field, create_model, field_validator, model_validator

from sglang_omni.config import StageConfig
from sglang_omni.models.whisper_asr.config import (
    WhisperASRPipelineConfig,
    WhisperASRStageConfig,
)

from sglang_omni_flash.flash.fallback import FallbackPolicy
from sglang_omni_flash.flash.options import SpecOptions
from sglang_omni_flash.integration.scoring.metrics import ROUTE_PREFIX as METRICS_ROUTE

_FALLBACK = FallbackPolicy()  # openai-whisper's defaults
FACTORY_PATH = "sglang_omni_flash.integration.serve.stages.create_whisper_flash_asr_executor"
SPECULATIVE_ALGORITHMS = ("whisper-flash",)


SPEC_PREFIX = "speculative_"


def _spec_fields() -> dict[str, tuple]:
    """speculative_<name>: (type, default) for every SpecOptions field (its comments document them)."""
    hints = typing.get_type_hints(SpecOptions)
    return {SPEC_PREFIX + f.name: (hints[f.name], f.default) for f in dataclasses.fields(SpecOptions)}


_StageWithSpecOptions = create_model("_StageWithSpecOptions", __base__=WhisperASRStageConfig, **_spec_fields())


class WhisperFlashASRStageConfig(_StageWithSpecOptions):
    """The stock Whisper ASR stage with the speculative-decoding switch and SpecOptions' knobs."""

    # None: plain greedy/sampled decoding, exactly sglang-omni's.
    speculative: Literal["whisper-flash"] | None = None
    # Drafter checkpoint directory; None: the shipped drafter that fits the target.
    speculative_draft_model_path: str | None = None

    # OpenAI's temperature fallback (window_scores.py, flash/fallback.py): on the audio routes a
    # request at temperature 0 (or none) has each 30 s window judged, and one judged too repetitive
    # (gzip ratio above compression_ratio_threshold) or too unsure (average log-probability below
    # logprob_threshold) decoded again at 0.2, 0.4 .. 1.0. A window whose <|nospeech|> probability is
    # above no_speech_threshold while it is also unsure is silence: empty text. A check is switched
    # off by a threshold it cannot cross (inf, -inf, 1); temperature_fallback false switches off both
    # the retries and the silence (json/text then take the stock route).
    temperature_fallback: bool = _FALLBACK.enabled
    compression_ratio_threshold: float = _FALLBACK.compression_ratio_threshold
    logprob_threshold: float = _FALLBACK.logprob_threshold
    no_speech_threshold: float = Field(default=_FALLBACK.no_speech_threshold, le=1.0)

    @field_validator("speculative", mode="before")
    @classmethod
    def _known_algorithm(cls, value: object) -> object:
        if value is None or value in SPECULATIVE_ALGORITHMS:
            return value
        raise ValueError(
            f"asr.speculative={value!r} is not supported: the Whisper ASR stage speculates only with "
            f"{' or '.join(repr(a) for a in SPECULATIVE_ALGORITHMS)} (or leave it unset for plain decoding)"
        )

    @model_validator(mode="after")
    def _options_need_the_switch(self) -> "WhisperFlashASRStageConfig":
        spec = self.spec_options()  # SpecOptions validates its own fields (a ValueError names the bad one)
        if self.speculative is None and (self.speculative_draft_model_path is not None or spec != SpecOptions()):
            set_ = [SPEC_PREFIX + name for name in SpecOptions.names() if getattr(spec, name) != getattr(SpecOptions(), name)]
            if self.speculative_draft_model_path is not None:
                set_.insert(0, "speculative_draft_model_path")
            raise ValueError(
                f"{', '.join('asr.' + name for name in set_)} set but asr.speculative is not: "
                "add --asr.speculative whisper-flash (or drop them)"
            )
        return self

    def spec_options(self) -> SpecOptions:
        try:
            return SpecOptions(**{name: getattr(self, SPEC_PREFIX + name) for name in SpecOptions.names()})
        except ValueError as exc:  # SpecOptions names the field without the prefix the flag has
            raise ValueError(f"asr.{SPEC_PREFIX}* options: {exc}") from None

    def model_post_init(self, __context: object = None) -> None:
        # The worker's acceptance and fallback metrics are served by this stage's own process (metrics.py).
        # (and only then: a config re-validated from a dump of the defaults carries the route already)
        served = self.speculative is not None or self.temperature_fallback
        if served and METRICS_ROUTE not in self.http_routes:
            self.http_routes = [*self.http_routes, METRICS_ROUTE]
        elif not served and METRICS_ROUTE in self.http_routes:
            self.http_routes = [r for r in self.http_routes if r != METRICS_ROUTE]
        super().model_post_init(__context)

    def speculative_options(self) -> dict[str, object]:
        """The factory kwargs of the speculative fields; empty when speculation is off."""
        if self.speculative is None:
            return {}
        return {
            "speculative": self.speculative,
            "speculative_draft_model_path": self.speculative_draft_model_path,
            "speculative_options": dataclasses.asdict(self.spec_options()),
        }

    def fallback_options(self) -> dict[str, object]:
        """The factory kwargs of the fallback fields (always passed: the plugin's factory takes them)."""
        return {"temperature_fallback": self.temperature_fallback,
                "compression_ratio_threshold": float(self.compression_ratio_threshold),
                "logprob_threshold": float(self.logprob_threshold),
                "no_speech_threshold": float(self.no_speech_threshold)}


def _plugin_stage(stock: WhisperASRStageConfig) -> WhisperFlashASRStageConfig:
    """The stock default stage, retyped, with the plugin factory; every other value kept."""
    data = stock.model_dump(exclude_unset=True)
    data["factory_path"] = FACTORY_PATH
    return WhisperFlashASRStageConfig.model_validate(data)


_STOCK_STAGES = WhisperASRPipelineConfig.model_fields["stages"].default


class WhisperFlashASRPipelineConfig(WhisperASRPipelineConfig):
    """Whisper ASR with optional Whisper-Flash speculative decoding (``--asr.speculative``)."""

    stage_config_types: ClassVar[dict[str, type[StageConfig]]] = {"asr": WhisperFlashASRStageConfig}

    stages: list[StageConfig] = [_plugin_stage(stage) for stage in _STOCK_STAGES]

    def model_post_init(self, __context: object = None) -> None:
        super().model_post_init(__context)
        global _served_model_path, _served_fallback
        _served_model_path = str(self.model_path)
        _served_fallback = any(s.temperature_fallback for s in self.stages if isinstance(s, WhisperFlashASRStageConfig))

    def stage_factory_kwargs(self, stage_name: str) -> Mapping[str, object]:
        kwargs = dict(super().stage_factory_kwargs(stage_name) or {})
        stage = self.stage_named(stage_name)
        if isinstance(stage, WhisperFlashASRStageConfig):
            kwargs.update(stage.speculative_options())
            kwargs.update(stage.fallback_options())
        return kwargs


# The model path of the latest pipeline config built in this process: the launcher builds the one
# it serves, and its HTTP app needs that model's tokenizer (verbose_json segment tokens).
_served_model_path: str | None = None
_served_fallback = True  # and whether its ASR stage falls back (the audio routes then judge every window)


def served_model_path() -> str | None:
    return _served_model_path


def served_fallback() -> bool:
    return _served_fallback


EntryClass = WhisperFlashASRPipelineConfig
