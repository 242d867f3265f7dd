"""English-only (``.en``) Whisper checkpoints: the decoder prompt has no language or task token.

sglang-omni 0.1.9 always builds ``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``
(``request_builders.build_prefix_tokens`` sets language and task on the tokenizer); an
``.en`` model was trained on ``<|startoftranscript|><|notimestamps|>`` and answers EOS at
once to the longer prefix, so the server returns "". ``EnglishOnlyPrefix`` is the tokenizer
view the request builder gets for such checkpoints: ``set_prefix_tokens`` keeps only the
timestamp switch, everything else is the real tokenizer.
"""

from __future__ import annotations


def is_english_only(generation_config: object) -> bool:
    """True for ``.en`` checkpoints (transformers marks them ``is_multilingual=False``)."""
    return getattr(generation_config, "is_multilingual", True) is False


def checkpoint_is_english_only(model_path: str) -> bool:
    from transformers import GenerationConfig

    try:
        return is_english_only(GenerationConfig.from_pretrained(model_path))
    except (OSError, ValueError):  # no generation_config.json: sglang-omni's defaults apply
        return False


class EnglishOnlyPrefix:
    """A WhisperTokenizer whose prefix is ``<|startoftranscript|>[<|notimestamps|>]``."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def set_prefix_tokens(self, language=None, task=None, predict_timestamps=None) -> None:
        del language, task  # an English-only model knows neither token
        self._tokenizer.language = None
        self._tokenizer.task = None
        if predict_timestamps is not None:
            self._tokenizer.predict_timestamps = predict_timestamps

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)
