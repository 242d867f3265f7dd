"""ComputeTurns (integration/worker/compute_turns.py): the CPU stage's encoder windows and scheduler
steps run one at a time on one thread, windows first, without starving steps; results, exceptions and
the caller's inference mode come through."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sglang_omni_flash.integration.worker.compute_turns import ComputeTurns


def test_calls_run_on_one_thread_with_the_callers_mode_and_raise_in_the_caller():
    turns = ComputeTurns()
    with torch.inference_mode():
        name, inference = turns.call(lambda: (threading.current_thread().name, torch.is_inference_mode_enabled()),
                                     encoder=True)
    assert name == "whisper-flash-compute" and inference
    assert turns.call(torch.is_inference_mode_enabled, encoder=False) is False
    assert turns.call(lambda: turns.call(lambda: "inner", encoder=True), encoder=False) == "inner"  # nested: at once
    with pytest.raises(ZeroDivisionError):
        turns.call(lambda: 1 / 0, encoder=False)
    assert turns.call(lambda: 7, encoder=False) == 7  # the compute thread survives a failed call


def _queue_behind(turns: ComputeTurns, kinds: list[str]) -> list[str]:
    """Hold the compute thread, queue callers of `kinds` in that order, release; the order they ran in."""
    ran, release, started = [], threading.Event(), threading.Event()

    def holder():
        started.set()
        release.wait(5)

    blocker = threading.Thread(target=lambda: turns.call(holder, encoder=False))
    blocker.start()
    started.wait(5)
    callers = []
    for i, kind in enumerate(kinds):
        t = threading.Thread(target=lambda i=i, kind=kind: turns.call(lambda: ran.append(f"{kind}{i}"),
                                                                    encoder=kind == "e"))
        t.start()
        callers.append(t)
        time.sleep(0.02)  # each is waiting before the next comes
    release.set()
    for t in [blocker, *callers]:
        t.join(5)
    return ran


def test_waiting_encoder_windows_go_before_waiting_steps():
    ran = _queue_behind(ComputeTurns(), ["s", "e", "s", "e"])
    assert [r[0] for r in ran] == ["e", "e", "s", "s"]


def test_a_step_goes_after_max_encoder_run_windows_in_a_row():
    ran = _queue_behind(ComputeTurns(max_encoder_run=2), ["s", "e", "e", "e", "e", "e"])
    assert [r[0] for r in ran] == ["e", "e", "s", "e", "e", "e"]
