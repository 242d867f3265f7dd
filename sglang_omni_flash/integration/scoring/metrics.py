"""Acceptance metrics of the decode worker, served by the ASR stage's own HTTP routes.

sglang-omni lets a stage serve HTTP routes from its own process: the stage config lists path
prefixes in ``http_routes``, the scheduler provides the ASGI app through ``http_app()``, and the
Omni HTTP server relays every request under those prefixes to the stage (``serve/stage_routes.py``).
The worker's counters live in the stage process, so that is where they are exported:

    GET /whisper-flash/metrics   Prometheus text format (prometheus_client, a registry of its own)
    GET /whisper-flash/stats     the same totals as JSON, plus the most recent finished requests

``SpecMetrics`` (the speculative worker's acceptance) exists on a speculative stage only;
``FallbackMetrics`` (temperature fallback: windows judged, retries per temperature, silent
windows) on every stage built by the plugin.

Counters are read at scrape time from the runner (plain ints written by the scheduler thread;
a scrape may see one step half-counted, never a wrong total afterwards).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass

ROUTE_PREFIX = "/whisper-flash"
RECENT_REQUESTS = 256
RECORDED_RIDS = 4096


@dataclass(frozen=True)
class FinishedRequest:
    rid: str
    proposed: int  # candidates the drafter proposed
    accepted: int  # of them, accepted by the target
    target_calls: int  # target forward passes (prefill included)
    output_tokens: int  # tokens generated (None-safe: 0 when unknown, e.g. an abort)
    finished: bool  # False: aborted / disconnected
    at: float  # unix time


class SpecMetrics:
    """What the worker has done since the stage started, and its recent requests."""

    def __init__(self, runner, recent: int = RECENT_REQUESTS):
        self.runner = runner
        self.started = time.time()
        self.requests = 0
        self.aborted = 0
        self.output_tokens = 0
        self._recent: deque[FinishedRequest] = deque(maxlen=recent)
        self._recorded: OrderedDict[str, None] = OrderedDict()  # rids counted (an abort may be followed by a finish)
        self._lock = threading.Lock()

    def record(self, rid: str, stats, output_tokens: int | None) -> None:
        """A request left the worker (finished when its output ids are known, else aborted)."""
        done = FinishedRequest(rid=rid, proposed=stats.proposed, accepted=stats.accepted,
                               target_calls=stats.target_calls, output_tokens=int(output_tokens or 0),
                               finished=output_tokens is not None, at=time.time())
        with self._lock:
            if rid in self._recorded:
                return
            self._recorded[rid] = None
            if len(self._recorded) > RECORDED_RIDS:
                self._recorded.popitem(last=False)
            self.requests += 1
            self.aborted += int(not done.finished)
            self.output_tokens += done.output_tokens
            self._recent.append(done)

    def totals(self) -> dict[str, float]:
        runner = self.runner
        t = runner.totals
        timing = runner.timing
        return {
            "requests": self.requests,
            "aborted_requests": self.aborted,
            "active_requests": len(runner.states),
            "output_tokens": self.output_tokens,
            "proposed_tokens": t.proposed,
            "accepted_tokens": t.accepted,
            "speculative_steps": int(timing["spec_steps"]),
            "stock_steps": int(timing["stock_steps"]),
            # accepted / proposed; and tokens per verify pass of one request (accepted + 1 each)
            "accept_rate": t.accepted / t.proposed if t.proposed else 0.0,
            "draft_seconds": timing["draft"],
            "verify_seconds": timing["verify"],
            "accept_seconds": timing["accept"],
            "stock_seconds": timing["stock"],
            "num_draft_tokens": runner.k,
            "uptime_seconds": time.time() - self.started,
        }

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            recent = [asdict(r) for r in self._recent]
        finished = [r for r in recent if r["finished"] and r["target_calls"]]
        calls = sum(r["target_calls"] for r in finished)
        tokens = sum(r["output_tokens"] for r in finished)
        return {
            "totals": self.totals(),
            # over the recent finished requests: output tokens per target forward pass
            "recent_tokens_per_target_call": tokens / calls if calls else 0.0,
            "recent": recent,
        }

    # ------------------------------------------------------------------ Prometheus exposition

    def collect(self):
        """prometheus_client custom-collector protocol: metric families built at scrape time."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        t = self.totals()
        counters = (
            ("requests", "requests that left the speculative worker (finished or aborted)"),
            ("aborted_requests", "requests aborted or disconnected"),
            ("output_tokens", "tokens generated by finished requests"),
            ("proposed_tokens", "draft candidates proposed"),
            ("accepted_tokens", "draft candidates accepted by the target"),
            ("speculative_steps", "decode steps that drafted and verified"),
            ("stock_steps", "decode steps taken by the stock (non-speculative) path"),
        )
        for name, doc in counters:
            yield CounterMetricFamily(f"whisper_flash_{name}", doc, value=t[name])
        seconds = CounterMetricFamily("whisper_flash_step_seconds", "time spent per decode phase",
                                      labels=["phase"])
        for phase in ("draft", "verify", "accept", "stock"):
            seconds.add_metric([phase], t[f"{phase}_seconds"])
        yield seconds
        yield GaugeMetricFamily("whisper_flash_active_requests", "requests with drafter state",
                                value=t["active_requests"])
        yield GaugeMetricFamily("whisper_flash_accept_rate", "accepted / proposed draft candidates",
                                value=t["accept_rate"])
        yield GaugeMetricFamily("whisper_flash_num_draft_tokens", "candidates proposed per round",
                                value=t["num_draft_tokens"])


@dataclass(frozen=True)
class JudgedWindow:
    rid: str
    attempt: int  # 0: the first decode, n: the n-th fallback retry
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float | None
    verdict: str  # "ok", "retry" (too repetitive or unsure), "silence"
    at: float


class FallbackMetrics:
    """Temperature fallback in this stage: each decoded window's verdict (``window_scores``).

    One request of the OpenAI routes is one window per 30 s chunk; a retry is a new window
    decode with ``attempt`` > 0, so a request's fallback count is its retries here (their rids
    carry the request id).
    """

    def __init__(self, recent: int = RECENT_REQUESTS):
        self.windows = 0  # first decodes judged
        self.retries: dict[str, int] = {}  # temperature -> decodes of fallback retries
        self.retry_verdicts = 0  # decodes judged too repetitive or unsure
        self.silent = 0  # decodes judged silence
        self._recent: deque[JudgedWindow] = deque(maxlen=recent)
        self._lock = threading.Lock()

    def record(self, rid: str, report: dict) -> None:
        verdict = "silence" if report["silence"] else "retry" if report["retry"] else "ok"
        window = JudgedWindow(rid=rid, attempt=report["attempt"], temperature=report["temperature"],
                              avg_logprob=report["avg_logprob"], compression_ratio=report["compression_ratio"],
                              no_speech_prob=report["no_speech_prob"], verdict=verdict, at=time.time())
        with self._lock:
            if window.attempt:
                key = f"{window.temperature:.1f}"
                self.retries[key] = self.retries.get(key, 0) + 1
            else:
                self.windows += 1
            self.retry_verdicts += verdict == "retry"
            self.silent += verdict == "silence"
            self._recent.append(window)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {"windows": self.windows, "retries": sum(self.retries.values()),
                    "retries_by_temperature": dict(self.retries), "retry_verdicts": self.retry_verdicts,
                    "silent_windows": self.silent, "recent": [asdict(w) for w in self._recent]}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        snap = self.snapshot()
        yield CounterMetricFamily("whisper_flash_fallback_windows", "windows decoded (first attempts) and judged",
                                  value=snap["windows"])
        retries = CounterMetricFamily("whisper_flash_fallback_retries", "fallback decodes of a window, by temperature",
                                      labels=["temperature"])
        for temperature, n in sorted(snap["retries_by_temperature"].items()):
            retries.add_metric([temperature], n)
        yield retries
        yield CounterMetricFamily("whisper_flash_fallback_retry_verdicts",
                                  "decodes judged too repetitive or too unsure", value=snap["retry_verdicts"])
        yield CounterMetricFamily("whisper_flash_fallback_silent_windows", "decodes judged silence (empty text)",
                                  value=snap["silent_windows"])


def metrics_app(metrics: SpecMetrics | None, prefix: str = ROUTE_PREFIX, fallback: FallbackMetrics | None = None):
    """The ASGI app the stage serves under ``prefix`` (see the module docstring)."""
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    for collector in (metrics, fallback):
        if collector is not None:
            registry.register(collector)

    async def prometheus(request):
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def stats(request):
        body = metrics.snapshot() if metrics is not None else {}
        if fallback is not None:
            body["fallback"] = fallback.snapshot()
        return JSONResponse(body)

    return Starlette(routes=[Route(f"{prefix}/metrics", prometheus, methods=["GET"]),
                             Route(f"{prefix}/stats", stats, methods=["GET"])])
