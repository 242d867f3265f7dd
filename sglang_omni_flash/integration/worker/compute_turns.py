"""One torch computation at a time in a CPU stage process, all on one thread: encoder windows first.

A sglang-omni ASR stage computes in two threads: the pre-LM encoder service (``whisper-asr-audio-encode``)
and the scheduler (prefill and decode steps). Each runs torch ops on its own OpenMP team sized to all
cores, so on a CPU they share the cores (four busy threads on two), and GNU OpenMP, seeing more threads
than cores, lets idle workers sleep at once: every small parallel region of a decode step then waits
for a worker to wake.

``ComputeTurns.call`` runs each encoder window and each scheduler step on one thread of its own, one
at a time, so the stage has one OpenMP team and nothing competes with it. A waiting encoder window
goes first: a long file's windows are all encoded before their decode steps run, and then decode in
one batch, as the standalone engine batches them. What is computed does not change, only when and on
which thread: every window and step keeps the bits of the same call alone.

Measured on a 2-core AMD EPYC (base, fp32, 4 long-form files of 115-120 s sent one after another):
15.5 audio s/s with the two threads computing concurrently, 18.0 in turns on one thread
(docs/cpu-serving.md).
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from contextlib import contextmanager

import torch

# "0" lets the encoder service and the scheduler compute concurrently, each on its own thread, as
# stock sglang-omni does (for measuring what the turns are worth)
TURNS_ENV = "WHISPER_FLASH_COMPUTE_TURNS"


def take_turns() -> bool:
    return os.environ.get(TURNS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class ComputeTurns:
    """Encoder windows and scheduler steps, one at a time, on one compute thread.

    A waiting encoder window goes before waiting steps, but after `max_encoder_run` windows in a row
    a waiting step goes next, so an endless stream of new audio cannot stall requests already
    decoding. A call made from inside a running one (the stock model encodes inside a prefill where
    no encoder output was attached) runs at once."""

    def __init__(self, max_encoder_run: int = 8) -> None:
        self.max_encoder_run = max_encoder_run
        self._changed = threading.Condition()
        self._busy = False
        self._encoders_waiting = 0
        self._steps_waiting = 0
        self._encoder_run = 0  # encoder turns granted since the last step turn
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def call(self, fn, *, encoder: bool):
        """fn() on the compute thread, in its turn; its result, or its exception raised here."""
        if threading.current_thread() is self._worker:
            return fn()
        with self._turn(encoder=encoder):
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="whisper-flash-compute", daemon=True)
                self._worker.start()
            done: Future = Future()
            # grad and inference mode are per thread: the job runs under the caller's
            self._jobs.put((fn, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), done))
            return done.result()

    def _serve(self) -> None:
        while True:
            fn, inference, grad, done = self._jobs.get()
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    done.set_result(fn())
            except BaseException as exc:  # raised again in the caller
                done.set_exception(exc)

    @contextmanager
    def _turn(self, *, encoder: bool):
        with self._changed:
            if encoder:
                self._encoders_waiting += 1
            else:
                self._steps_waiting += 1
            try:
                while not self._may_take(encoder):
                    self._changed.wait()
            finally:
                if encoder:
                    self._encoders_waiting -= 1
                else:
                    self._steps_waiting -= 1
            self._busy = True
            self._encoder_run = self._encoder_run + 1 if encoder else 0
        try:
            yield
        finally:
            with self._changed:
                self._busy = False
                self._changed.notify_all()

    def _may_take(self, encoder: bool) -> bool:
        if self._busy:
            return False
        steps_due = self._steps_waiting > 0 and self._encoder_run >= self.max_encoder_run
        return not steps_due if encoder else (self._encoders_waiting == 0 or steps_due)


def turns_of(model) -> ComputeTurns | None:
    """The turns `cpu_model.install` gave `model` (None where it did not: off a CPU, or turned off)."""
    return getattr(model, "_whisper_flash_turns", None)


class StepTurnsMixin:
    """For a sglang-omni ``ModelRunner``: every scheduler step (``execute``) in a step turn."""

    def execute(self, scheduler_output):
        turns = turns_of(self.tp_worker.model_runner.model)
        if turns is None:
            return super().execute(scheduler_output)
        return turns.call(lambda: super(StepTurnsMixin, self).execute(scheduler_output), encoder=False)
