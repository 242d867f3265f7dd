"""The ASR stage factory that ``WhisperFlashASRPipelineConfig`` points at.

With ``speculative="whisper-flash"`` it builds ``WhisperFlashSpecEngineBuilder`` (the
Whisper-Flash decode worker) with the drafter ``drafter_source.resolve_drafter`` picks; a
drafter that does not fit the target is refused here, before anything is loaded. Without
``speculative`` it is the plugin builder, which scores windows for temperature fallback
(``window_scores.py``), fixes the ``.en`` prompt prefix (``english_only.py``) and gives a CPU its
decode step (``worker/cpu_model.py``); only a multilingual checkpoint on CUDA with fallback off gets
sglang-omni's ``create_sglang_whisper_asr_executor`` with the very same kwargs. The
stage worker imports this module by its dotted path (``StageConfig.factory_path``), so it needs
no registration of its own.
"""

from __future__ import annotations



def _on_cpu(stock_kwargs: dict) -> bool:
    """Whether the stage will run on a CPU (then the plugin builder's CPU decode step pays)."""
    device = str(stock_kwargs.get("device") or "")
    if device:
        return device.startswith("cpu")
    from sglang_omni_flash.hardware import choose_device

    return choose_device("auto") == "cpu"


def create_whisper_flash_asr_executor(
    model_path: str,
    *,
    gpu_id: int | None = None,
    speculative: str | None = None,
    speculative_draft_model_path: str | None = None,
    speculative_options: dict | None = None,
    temperature_fallback: bool | None = None,
    compression_ratio_threshold: float | None = None,
    logprob_threshold: float | None = None,
    no_speech_threshold: float | None = None,
    **stock_kwargs,
):
    from sglang_omni_flash.flash.fallback import FallbackPolicy

    given = {"enabled": temperature_fallback, "compression_ratio_threshold": compression_ratio_threshold,
             "logprob_threshold": logprob_threshold, "no_speech_threshold": no_speech_threshold}
    fallback = FallbackPolicy(**{k: v for k, v in given.items() if v is not None})  # unset: openai-whisper's
    if speculative is not None:
        from sglang_omni_flash.integration.serve.drafter_source import resolve_drafter
        from sglang_omni_flash.integration.serve.engine_builder import WhisperFlashSpecEngineBuilder, build_executor

        from sglang_omni_flash.flash.options import SpecOptions

        drafter_dir = resolve_drafter(model_path, speculative_draft_model_path)
        return build_executor(
            WhisperFlashSpecEngineBuilder, model_path, gpu_id=gpu_id,
            builder_kwargs={"drafter_dir": str(drafter_dir), "spec": SpecOptions(**(speculative_options or {})),
                            "fallback": fallback},
            **stock_kwargs,
        )
    from sglang_omni_flash.integration.serve.english_only import checkpoint_is_english_only

    if fallback.enabled or checkpoint_is_english_only(model_path) or _on_cpu(stock_kwargs):
        from sglang_omni_flash.integration.serve.engine_builder import WhisperFlashEngineBuilder, build_executor

        return build_executor(WhisperFlashEngineBuilder, model_path, gpu_id=gpu_id,
                              builder_kwargs={"fallback": fallback}, **stock_kwargs)

    from sglang_omni.models.whisper_asr.stages import create_sglang_whisper_asr_executor

    return create_sglang_whisper_asr_executor(model_path, gpu_id=gpu_id, **stock_kwargs)
