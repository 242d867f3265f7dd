"""The stage scheduler's idle wait while a request is being built: block on the builds, do not spin.

sglang-omni 0.1.9's `OmniScheduler.sleep_during_idle` sleeps 0.1 ms at a time, as long as a request
build is pending. For Whisper the build is the encoder: about 0.5 s of a 30 s window on a CPU. For all
of that time the scheduler thread loops about 10,000 times a second through its whole event loop
(inputs, batch selection, idle checks). On a 2-core machine that took about 7 s of CPU time over
20 requests of base at C=1, with py-spy. It is taken from the encoder's two torch threads. Plain
serving at C=1 ran 1.56x the standalone engine's greedy for the same clips, and 1.29x with this wait.

`install(scheduler)` replaces that one spin with a wait on the pending builds' futures. The wait
returns as soon as one finishes, or after `POLL_S`, so requests that arrive meanwhile are still taken
within `POLL_S`. Nothing else changes: when nothing is being built, when a pending item is not a
`concurrent.futures.Future`, and on tensor-parallel followers, the stock method runs.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait

logger = logging.getLogger("sglang_omni_flash.idle_wait")

POLL_S = 0.002  # longest delay for a request arriving while another one is being built


def pending_futures(scheduler) -> list | None:
    """The unfinished futures of the scheduler's pending builds and admissions; None where one of them
    is not a `concurrent.futures.Future` (the stock spin then stays)."""
    with scheduler.request_admission_lock:
        items = [entry[2] for entry in scheduler.pending_request_builds.values()]
        items += [entry[2].ready for entry in scheduler.pending_request_admissions.values()]
    if not all(isinstance(item, Future) for item in items):
        return None
    return [item for item in items if not item.done()]


def install(scheduler) -> bool:
    """Make `scheduler.sleep_during_idle` wait on pending builds instead of spinning; False (nothing
    changed) where the scheduler is not laid out as sglang-omni 0.1.9's `OmniScheduler`."""
    stock = getattr(scheduler, "sleep_during_idle", None)
    needed = ("request_admission_lock", "pending_request_builds", "pending_request_admissions")
    if stock is None or not all(hasattr(scheduler, name) for name in needed):
        logger.warning("whisper-flash: scheduler without %s; its stock idle wait kept", ", ".join(needed))
        return False
    follower = getattr(scheduler, "tp_size", 1) > 1 and not getattr(scheduler, "is_entry_rank", True)

    def sleep_during_idle() -> None:
        futures = None if follower else pending_futures(scheduler)
        if not futures:  # nothing building, a done item not yet drained, or not a Future: stock
            stock()
            return
        wait(futures, timeout=POLL_S, return_when=FIRST_COMPLETED)

    scheduler.sleep_during_idle = sleep_during_idle
    logger.info("whisper-flash: the scheduler waits on request builds instead of polling every 0.1 ms")
    return True
