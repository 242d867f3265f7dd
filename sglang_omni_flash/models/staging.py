"""Write a directory all at once: build it in a hidden sibling, then rename it into place.

A rename within one filesystem is atomic, so readers see either no directory or a complete
one; an interrupted run leaves only a hidden `.NAME.KIND-PID-XXXX` sibling, which the next
run deletes once its process is gone.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def make_staging_dir(final: Path, kind: str = "partial") -> Path:
    """A new empty hidden sibling of `final` to build it in (created with the usual umask)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(final, kind)
    staging = final.parent / f".{final.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def publish(staging: Path, final: Path, is_complete: Callable[[Path], bool]) -> None:
    """Rename `staging` to `final`; a `final` another process completed meanwhile is kept."""
    try:
        staging.rename(final)
    except OSError:
        if not is_complete(final):
            raise
        shutil.rmtree(staging, ignore_errors=True)


def _remove_abandoned(final: Path, kind: str) -> None:
    for staging in final.parent.glob(f".{final.name}.{kind}-*"):
        try:
            pid = int(staging.name.rsplit("-", 2)[-2])
            os.kill(pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            shutil.rmtree(staging, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue
