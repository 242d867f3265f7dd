"""sglang-omni-flash: Whisper-Flash speculative decoding for SGLang-Omni's Whisper ASR stage."""

__version__ = "0.1.0"
