"""The benchmark scripts answer a user's mistake as the `whisper-flash` commands do: one line naming
the problem and exit status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["asr_server_bench.py", "peers.py"])
def test_a_bad_manifest_line_is_one_line_and_exit_2(script, tmp_path):
    manifest = tmp_path / "bad.jsonl"
    manifest.write_text('{"id": "a"}\n')
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--manifest", str(manifest)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{script}: error: {manifest}:1: bad manifest line" in proc.stderr
    assert "Traceback" not in proc.stderr
