"""The decode worker's metrics export (integration/scoring/metrics.py) without a server: counting, the
Prometheus text and the stage app's routes. The real server is checked in
test_integration_spec_server.py (the routes relayed by sglang-omni agree with the worker's log)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")


def fake_runner():
    totals = SimpleNamespace(proposed=40, accepted=10, target_calls=12)
    timing = {"spec_steps": 5, "stock_steps": 3, "draft": 0.5, "verify": 1.0, "accept": 0.1, "stock": 0.3}
    return SimpleNamespace(totals=totals, timing=timing, states={"live": object()}, k=8)


def stats(proposed, accepted, calls):
    return SimpleNamespace(proposed=proposed, accepted=accepted, target_calls=calls)


def test_requests_are_counted_once_and_aborts_apart():
    from sglang_omni_flash.integration.scoring.metrics import SpecMetrics

    metrics = SpecMetrics(fake_runner())
    metrics.record("r1", stats(16, 6, 5), output_tokens=11)
    metrics.record("r2", stats(8, 0, 3), output_tokens=None)  # aborted
    metrics.record("r2", stats(0, 0, 0), output_tokens=3)  # ... and then reported finished: not twice
    snap = metrics.snapshot()
    totals = snap["totals"]
    assert (totals["requests"], totals["aborted_requests"], totals["output_tokens"]) == (2, 1, 11)
    assert totals["accept_rate"] == 10 / 40 and totals["active_requests"] == 1
    assert [r["rid"] for r in snap["recent"]] == ["r1", "r2"]
    assert snap["recent_tokens_per_target_call"] == 11 / 5  # finished requests only


def test_prometheus_text_and_stage_routes():
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from sglang_omni_flash.integration.scoring.metrics import ROUTE_PREFIX, SpecMetrics, metrics_app

    metrics = SpecMetrics(fake_runner())
    metrics.record("r1", stats(16, 6, 5), output_tokens=11)
    client = TestClient(metrics_app(metrics))
    resp = client.get(f"{ROUTE_PREFIX}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(resp.text) for s in family.samples}
    assert samples[("whisper_flash_requests_total", ())] == 1
    assert samples[("whisper_flash_accepted_tokens_total", ())] == 10
    assert samples[("whisper_flash_proposed_tokens_total", ())] == 40
    assert samples[("whisper_flash_step_seconds_total", (("phase", "verify"),))] == 1.0
    assert samples[("whisper_flash_num_draft_tokens", ())] == 8
    body = client.get(f"{ROUTE_PREFIX}/stats").json()
    assert body["totals"]["speculative_steps"] == 5 and body["recent"][0]["output_tokens"] == 11
    assert client.get(f"{ROUTE_PREFIX}/nothing").status_code == 404
    assert client.post(f"{ROUTE_PREFIX}/metrics").status_code == 405
