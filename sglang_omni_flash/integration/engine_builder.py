"""``WhisperFlashEngineBuilder``: sglang-omni's Whisper ASR engine builder with the plugin's fixes.

Built by ``stages.create_whisper_flash_asr_executor`` only when the stock builder would do
the wrong thing (today: ``.en`` checkpoints); multilingual checkpoints without
``--asr.speculative`` go through sglang-omni's own factory untouched.
"""

from __future__ import annotations

import inspect

from sglang_omni.models.whisper_asr.config import WhisperASRFactoryArgs
from sglang_omni.models.whisper_asr.engine_builder import WhisperASREngineBuilder
from sglang_omni.models.whisper_asr.stages import create_sglang_whisper_asr_executor

from sglang_omni_flash.integration.english_only import EnglishOnlyPrefix, is_english_only

# Arguments of the stock factory that go to `.build(...)`; all others go to the builder.
BUILD_ARGS = ("model_path", "device", "gpu_id", "dtype", "server_args_overrides")


class WhisperFlashEngineBuilder(WhisperASREngineBuilder):
    def make_adapters(self, model):
        if not is_english_only(self.generation_config):
            return super().make_adapters(model)
        real = self.tokenizer
        self.tokenizer = EnglishOnlyPrefix(real)  # what the request builder closes over
        try:
            return super().make_adapters(model)
        finally:
            self.tokenizer = real


def build_executor(builder_cls: type[WhisperASREngineBuilder], model_path: str, **stock_kwargs):
    """What ``create_sglang_whisper_asr_executor(model_path, **stock_kwargs)`` does, with ``builder_cls``.

    The stock factory is a pass-through: its defaults are bound here from its own signature
    (not copied), its build arguments go to ``build()`` and the rest to the builder.
    """
    bound = inspect.signature(create_sglang_whisper_asr_executor).bind(model_path, **stock_kwargs)
    bound.apply_defaults()
    args = dict(bound.arguments)
    build = {name: args.pop(name) for name in BUILD_ARGS}
    if args["encoder_attention_backend"] is None:
        args["encoder_attention_backend"] = WhisperASRFactoryArgs().encoder_attention_backend
    return builder_cls(**args).build(build.pop("model_path"), **build)
