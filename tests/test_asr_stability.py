"""benchmarks/asr_stability.py for 40 seconds against its own speculative server (CPU, converted base).

The script is run as a user runs it (a subprocess, its own `Server` start path, `--out FILE`):
functional checks, every bad input, a 40 s soak at concurrency 1 and 4 with a chaos action every
2 s on average (every kind runs in each shuffled round of four; a 65 s file
sent again and again must get the same bytes each time), and the
after-soak checks (worker idle, KV pool back at its idle free count, /health). The test asserts
what the JSON says and that each section really ran; it never asserts wall times, which depend
on whatever else this machine is doing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "asr_stability.py"
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
# The bad inputs the benchmark must refuse with a 4xx and the OpenAI envelope.
BAD_INPUTS = {
    "empty_file", "garbage_bytes", "truncated_wav", "header_only_wav", "nan_samples", "oversized_upload",
    "stream_over_30s", "missing_file", "json_body",
    "temperature_negative", "temperature_above_one", "temperature_not_a_number", "temperature_nan",
    "response_format_unknown", "response_format_srt_streamed", "language_unknown",
    "timestamp_granularity_unknown", "timestamp_granularity_word_unsupported",
    "timestamp_granularities_without_verbose_json", "max_new_tokens_zero",
    "translations_garbage_bytes", "translations_temperature_negative",
}
FUNCTIONAL = {
    "health_before", *(f"format_{fmt}" for fmt in FORMATS), "format_text_equals_json", "translations_json",
    "stream_equals_non_stream", "stream_cancel_then_reconnect",
    "clip_29.9s_json", "clip_29.9s_verbose_json", "clip_30.1s_json", "clip_30.1s_verbose_json",
    "clip_long_json", "clip_long_srt", "truncated_in_data_no_5xx",
}
AFTER_SOAK = {"worker_idle", "kv_pool_returns_to_idle", "health_after", "server_alive"}


@pytest.fixture(scope="module")
def stability(tmp_path_factory, base_model_dir, test_set_paths) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("stability") / "result.json"
    log = out.with_name("server.log")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--duration", "40", "--chaos-interval", "2", "--concurrency", "1,4", "--seed", "0",
         "--model", str(base_model_dir), "--server-log", str(log), "--out", str(out)],
        capture_output=True, text=True, timeout=1800)
    if not out.is_file():
        pytest.fail(f"no result (exit {proc.returncode}):\n{proc.stderr[-5000:]}")
    return proc, json.loads(out.read_text(encoding="utf-8"))


def failed(section: dict) -> list[dict]:
    return [check for check in section["checks"] if not check["ok"]]


def what_failed(result: dict) -> str:
    """One line per failed check or soak error, for the assertion message."""
    lines = [f"{name}: {check['name']}: {check['detail'][:200]}"
             for name in ("functional", "bad_inputs", "after_soak") if name in result
             for check in failed(result[name])]
    soak = result.get("soak", {})
    lines += [f"soak: {error}" for error in soak.get("error_samples", [])[:10]]
    if "server" in result and "error" in result["server"]:
        lines.append(f"server: {result['server']['error']}")
    return "\n".join(lines)


def test_the_benchmark_passes_and_says_so(stability):
    proc, result = stability
    assert result["ok"], what_failed(result)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["server"]["started_here"] and result["server"]["url"].startswith("http://127.0.0.1:")


def test_every_functional_check_ran(stability):
    _, result = stability
    names = {check["name"] for check in result["functional"]["checks"]}
    assert FUNCTIONAL <= names, FUNCTIONAL - names
    assert not failed(result["functional"]), failed(result["functional"])
    durations = {c["name"]: c["duration_s"] for c in result["functional"]["checks"] if "duration_s" in c}
    assert durations["clip_29.9s_json"] < 30 < durations["clip_30.1s_json"] and durations["clip_long_json"] > 60


def test_every_bad_input_was_refused_with_the_envelope(stability):
    _, result = stability
    checks = {check["name"]: check for check in result["bad_inputs"]["checks"]}
    assert BAD_INPUTS <= set(checks), BAD_INPUTS - set(checks)
    for name in BAD_INPUTS:
        assert checks[name]["ok"] and 400 <= checks[name]["status"] < 500, checks[name]


def test_the_soak_ran_every_level_and_chaos_action(stability):
    _, result = stability
    soak = result["soak"]
    assert [row["concurrency"] for row in soak["levels"]] == [1, 4]
    assert all(row["requests"] > 0 for row in soak["levels"]), soak["levels"]
    assert soak["requests"] == sum(row["requests"] for row in soak["levels"])
    assert soak["errors"] == 0 and soak["chaos"]["errors"] == 0, soak["error_samples"]
    assert soak["latency"]["p50_s"] is not None and soak["latency"]["p99_s"] >= soak["latency"]["p50_s"]
    assert soak["chaos"]["actions"] > 0
    # the long file (several windows) went first at every level: its json answers repeated byte for byte
    assert soak["long_files"]["seconds"][0] > 60 and soak["kinds"]["long"] >= 2, soak["long_files"]
    assert soak["long_files"]["sent"][f"{soak['long_files']['files'][0]}:json"] >= 2
    assert soak["long_files"]["repeated"] >= 1 and "not_repeatable" not in soak["error_kinds"]
    assert set(soak["chaos"]["by_action"]) == {"malformed_upload", "cancel_stream", "disconnect_mid_request",
                                               "disconnect_mid_upload"}, soak["chaos"]


def test_after_the_soak_the_server_is_idle_healthy_and_the_kv_pool_is_back(stability):
    _, result = stability
    checks = {check["name"]: check for check in result["after_soak"]["checks"]}
    assert AFTER_SOAK <= set(checks), AFTER_SOAK - set(checks)
    kv = checks["kv_pool_returns_to_idle"]
    assert kv["idle_free"] is not None and kv["after_free"] == kv["idle_free"], kv
    assert not failed(result["after_soak"]), failed(result["after_soak"])
