"""Where the project keeps what it downloads, converts and generates.

Everything large lives in one user cache directory so a second `make test` or
`make serve` re-uses it; `WHISPER_FLASH_CACHE` moves it (read here only, then passed
down as a path).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache directory: $WHISPER_FLASH_CACHE, else $XDG_CACHE_HOME/sglang-omni-flash."""
    explicit = os.environ.get("WHISPER_FLASH_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sglang-omni-flash"


def models_dir() -> Path:
    return cache_dir() / "models"


def audio_dir() -> Path:
    return cache_dir() / "audio"


def build_dir() -> Path:
    return cache_dir() / "build"
