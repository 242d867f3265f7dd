"""The stage scheduler's idle wait (integration/serve/idle_wait.py): it blocks on pending builds instead of
spinning, wakes as soon as one finishes, and leaves every other case to the stock method."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

from sglang_omni_flash.integration.serve.idle_wait import POLL_S, install


class FakeScheduler:
    """The attributes of sglang-omni 0.1.9's OmniScheduler that the idle wait reads."""

    def __init__(self):
        self.request_admission_lock = threading.RLock()
        self.pending_request_builds = {}
        self.pending_request_admissions = {}
        self.stock_calls = 0

    def sleep_during_idle(self):
        self.stock_calls += 1


def test_a_pending_build_is_waited_on_and_wakes_the_scheduler_when_done():
    scheduler = FakeScheduler()
    assert install(scheduler)
    build = Future()
    scheduler.pending_request_builds["r1"] = (None, False, build)

    start = time.perf_counter()
    scheduler.sleep_during_idle()  # nothing finishes: one bounded wait, no stock spin
    waited = time.perf_counter() - start
    assert scheduler.stock_calls == 0
    assert waited >= POLL_S * 0.9

    threading.Timer(0.05, build.set_result, args=("built",)).start()
    calls, start = 0, time.perf_counter()
    while not build.done():  # the scheduler loop: each idle call blocks up to POLL_S
        scheduler.sleep_during_idle()
        calls += 1
    assert time.perf_counter() - start < 0.5
    assert calls <= 0.05 / POLL_S * 3, "the wait must block, not spin"  # the stock loop: ~500 calls


def test_a_deferred_admission_is_waited_on_too():
    scheduler = FakeScheduler()
    install(scheduler)
    ready = Future()
    scheduler.pending_request_admissions["r1"] = (None, False, SimpleNamespace(ready=ready))
    ready.set_result(None)
    scheduler.sleep_during_idle()  # done but not yet drained: nothing to wait on, stock behaviour
    assert scheduler.stock_calls == 1


def test_nothing_pending_or_an_unknown_future_type_keeps_the_stock_wait():
    scheduler = FakeScheduler()
    install(scheduler)
    scheduler.sleep_during_idle()
    assert scheduler.stock_calls == 1

    class OtherFuture:
        def done(self):
            return False

    scheduler.pending_request_admissions["r1"] = (None, False, SimpleNamespace(ready=OtherFuture()))
    scheduler.sleep_during_idle()
    assert scheduler.stock_calls == 2


def test_tensor_parallel_followers_and_unexpected_schedulers_are_left_alone():
    follower = FakeScheduler()
    follower.tp_size, follower.is_entry_rank = 2, False
    install(follower)
    follower.pending_request_builds["r1"] = (None, False, Future())
    follower.sleep_during_idle()
    assert follower.stock_calls == 1

    bare = SimpleNamespace(sleep_during_idle=lambda: None)
    assert not install(bare)
