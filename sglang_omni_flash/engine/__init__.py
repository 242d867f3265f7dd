"""The standalone Whisper-Flash engine over transformers Whisper weights.

`WhisperFlashEngine(EngineOptions(...))` decodes greedily or with Whisper-Flash speculation
(token-identical output); `speculative.SpeculativeDecoder` is the engine-agnostic
propose / verify / advance loop that other back ends reuse through `VerifyBackend`.
"""

from sglang_omni_flash.engine.options import EngineOptions

__all__ = ["EngineOptions"]
