"""Launching SGLang-Omni's Whisper ASR server, on CUDA as is and on CPU with the workarounds it needs."""
