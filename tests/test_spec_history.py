"""The decode worker's drafter history (integration/worker/history.py): rows left pending (prefill,
rounds, stock steps) and projected later, all requests in one call, equal rows projected as they
came."""

from __future__ import annotations


import pytest
import torch

from sglang_omni_flash.flash.drafter import KeysLastKV, WhisperFlashDrafter
from sglang_omni_flash.integration.worker.history import DraftState, DrafterMemories
from sglang_omni_flash.kernels import attention as row_kernel
from test_drafter import tiny_target

MAX_POSITIONS = 32


def empty_state(drafter) -> DraftState:
    cfg = drafter.config
    hist = [(torch.zeros(1, cfg.n_heads, MAX_POSITIONS, cfg.head_dim),
             torch.zeros(1, cfg.n_heads, MAX_POSITIONS, cfg.head_dim)) for _ in range(cfg.n_layers)]
    return DraftState(hist=hist, acoustic=[])


def test_pending_rows_projected_together_equal_rows_projected_one_at_a_time():
    torch.manual_seed(1)
    drafter = WhisperFlashDrafter.from_target(tiny_target()).eval()
    n_hist, d = len(drafter.config.history_layers), drafter.config.d_model
    memories = DrafterMemories(drafter, MAX_POSITIONS, max_backoff=8)
    g = torch.Generator().manual_seed(3)
    prefill = [torch.randn(p, n_hist, d, generator=g) for p in (4, 7)]
    steps = [torch.randn(n, n_hist, d, generator=g) for n in (5, 2)]  # stock-step rows per request

    one_by_one, deferred = [], []
    with torch.inference_mode():
        for rows, more in zip(prefill, steps):
            state = empty_state(drafter)
            state.keep(rows)
            memories.project_pending([state])
            for row in more:  # projected as each step came
                state.keep(row[None])
                memories.project_pending([state])
            one_by_one.append(state)

            state = empty_state(drafter)
            state.keep(rows)
            for row in more:  # what post_decode and a round keep
                state.keep(row[None])
            assert state.pending_rows == rows.shape[0] + more.shape[0]
            deferred.append(state)
        memories.project_pending(deferred)

    for want, got, rows, more in zip(one_by_one, deferred, prefill, steps):
        assert got.length == want.length == rows.shape[0] + more.shape[0] and not got.pending
        for (wk, wv), (gk, gv) in zip(want.hist, got.hist):
            torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-6)
        assert wk[:, :, want.length:].abs().sum() == 0 == gk[:, :, got.length:].abs().sum()
        with torch.inference_mode():  # the drafter's own projection of the whole history, as the engine's
            every = torch.cat([rows, more])
            projected = drafter.project_history(every[None])
            reference = drafter.history_kv(projected, torch.arange(every.shape[0])[None])
        for (rk, rv), (gk, gv) in zip(reference, got.hist):
            torch.testing.assert_close(gk[:, :, : got.length], rk, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gv[:, :, : got.length], rv, rtol=1e-5, atol=1e-6)


def test_the_engines_deferred_history_equals_history_projected_as_observed():
    """engine.DrafterProposer keeps observed target states pending and projects them at the next
    proposal, all in one call, in the order observed: a position that a round
    rejected and a later step observes again holds the later state."""
    from sglang_omni_flash.engine.backends import DrafterProposer

    torch.manual_seed(2)
    drafter = WhisperFlashDrafter.from_target(tiny_target()).eval()
    n_hist, d = len(drafter.config.history_layers), drafter.config.d_model
    g = torch.Generator().manual_seed(5)
    batch = 3
    observed = [  # (states [n, T, n_hist, d], positions [n, T]): prefill, a round of 4 rows, two steps
        (torch.randn(batch, 4, n_hist, d, generator=g), torch.arange(4).expand(batch, 4)),
        (torch.randn(batch, 4, n_hist, d, generator=g), torch.arange(4, 8).expand(batch, 4)),
        (torch.randn(batch, 1, n_hist, d, generator=g), torch.full((batch, 1), 5)),  # rewrites position 5
        (torch.randn(batch, 1, n_hist, d, generator=g), torch.full((batch, 1), 6)),
    ]
    proposer = DrafterProposer(drafter, batch=batch, max_len=MAX_POSITIONS, enc_len=8, cuda_graphs=False)
    with torch.inference_mode():
        for states, positions in observed:
            proposer.observe(states, positions)
        assert len(proposer._pending) == len(observed)
        proposer._project_pending()
        want_k = torch.zeros_like(proposer.hist_k)
        for states, positions in observed:  # the drafter's own projection, one observation at a time
            layers = drafter.history_kv(drafter.project_history(states), positions)
            for i, (k, _) in enumerate(layers):
                want_k[i, :, :, positions[0]] = k
    torch.testing.assert_close(proposer.hist_k, want_k, rtol=1e-5, atol=1e-6)
    assert not proposer._pending


def test_the_engines_lazy_retirement_and_acoustic_kv_keep_the_live_rows_memories():
    """Retiring rows cuts the pending states to the live rows and compacts the drafter's K/V only
    when it next runs, and the acoustic K/V are made then, for the live rows: they then hold the same
    history and audio as if every observation had been projected at once, the acoustic K/V made at
    the start and every retirement compacted at once."""
    from sglang_omni_flash.engine.backends import DrafterProposer

    torch.manual_seed(3)
    drafter = WhisperFlashDrafter.from_target(tiny_target()).eval()
    n_hist, d = len(drafter.config.history_layers), drafter.config.d_model
    g = torch.Generator().manual_seed(7)
    batch, enc_len = 4, 8
    encoder_out = torch.randn(batch, enc_len, drafter.config.d_model, generator=g)
    lazy = DrafterProposer(drafter, batch=batch, max_len=MAX_POSITIONS, enc_len=enc_len, cuda_graphs=False)
    eager = DrafterProposer(drafter, batch=batch, max_len=MAX_POSITIONS, enc_len=enc_len, cuda_graphs=False)
    # observe T positions from p; retire keeping these of the live rows; catch up (what a proposal does first)
    script = [("observe", 3, 0), ("observe", 2, 3), ("retire", [0, 2, 3]), ("catch up",),
              ("observe", 1, 5), ("retire", [1, 2]), ("observe", 1, 6), ("catch up",)]
    with torch.inference_mode():
        lazy.start(encoder_out)
        eager.start(encoder_out)
        eager._catch_up()  # the acoustic K/V at once
        assert lazy._audio is not None and eager._audio is None
        live = batch
        for op in script:
            if op[0] == "observe":
                _, t, p = op
                states = torch.randn(live, t, n_hist, d, generator=g)
                positions = torch.arange(p, p + t).expand(live, t)
                lazy.observe(states, positions)
                eager.observe(states, positions)
                eager._project_pending()
            elif op[0] == "retire":
                keep = torch.tensor(op[1])
                lazy.retire(keep)
                eager._project_pending()
                m = keep.numel()
                for buf in (eager.hist_k, eager.hist_v, eager.ac_k, eager.ac_v):
                    buf[:, :m] = buf.index_select(1, keep)
                live = m
            else:
                lazy._catch_up()
        assert lazy._order is None and not lazy._pending and lazy._audio is None
    for got, want in ((lazy.hist_k, eager.hist_k), (lazy.hist_v, eager.hist_v),
                      (lazy.ac_k, eager.ac_k), (lazy.ac_v, eager.ac_v)):
        torch.testing.assert_close(got[:, :live], want[:, :live], rtol=1e-5, atol=1e-6)
    assert live == 2 and lazy.hist_k[:, :live, :, 6].abs().sum() > 0


def test_the_workers_acoustic_kv_wait_for_the_first_draft_and_are_made_together():
    """A new request keeps its window's encoder states and gets its acoustic K/V only when
    `prepare` is called before its first round: requests that never draft never pay, and the
    requests prepared together in one call hold what the drafter makes for each alone."""
    torch.manual_seed(4)
    drafter = WhisperFlashDrafter.from_target(tiny_target()).eval()
    n_hist, d = len(drafter.config.history_layers), drafter.config.d_model
    memories = DrafterMemories(drafter, MAX_POSITIONS, max_backoff=8)
    g = torch.Generator().manual_seed(9)
    encoder = [torch.randn(8, d, generator=g) for _ in range(3)]
    with torch.inference_mode():
        states = [memories.new_state(torch.randn(3, n_hist, d, generator=g), enc) for enc in encoder]
        assert not any(state.ready for state in states)
        assert memories.prepare(states[:2]) == 2  # the third does not draft yet
        assert states[0].ready and states[1].ready and not states[2].ready
        assert states[0].encoder_out is None and states[2].encoder_out is not None
        assert memories.prepare(states) == 1  # only the one still without
        assert memories.prepare(states) == 0
        for state, enc in zip(states, encoder):
            alone = drafter.acoustic_memory(enc[None])  # keys transposed where the CPU kernel reads them
            assert all(type(got) is type(want) for got, want in zip(state.acoustic, alone))
            for (gk, gv), (wk, wv) in zip(state.acoustic, alone):
                torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-6)
        memories.project_pending(states)
        logits = memories.draft_logits([(state, 1, state.length) for state in states])
    assert len(logits) == 3 and all(torch.isfinite(x).all() for x in logits)


@pytest.mark.skipif(not row_kernel.available(), reason="needs the row attention kernel (built on every x86 CPU)")
def test_the_worker_drafts_requests_together_from_their_own_memories_any_window_length():
    """On a CPU the worker passes each request's acoustic memory as it lies (no stacking), also for
    windows of different lengths, in one drafter call: every request's proposals are what it gets
    drafted alone (to float rounding: the batch's history is cut to its longest), and the same
    requests drafted again give the same bits."""
    torch.manual_seed(5)
    drafter = WhisperFlashDrafter.from_target(tiny_target()).eval()
    n_hist, d = len(drafter.config.history_layers), drafter.config.d_model
    memories = DrafterMemories(drafter, MAX_POSITIONS, max_backoff=8)
    g = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        states = [memories.new_state(torch.randn(p, n_hist, d, generator=g), torch.randn(t, d, generator=g))
                  for p, t in ((3, 8), (5, 12), (2, 8))]
        memories.prepare(states)
        memories.project_pending(states)
        assert all(isinstance(m, KeysLastKV) for state in states for m in state.acoustic)
        drafts = [(state, 1 + i, state.length) for i, state in enumerate(states)]
        together = memories.draft_logits(drafts)
        again = memories.draft_logits(drafts)
        alone = [memories.draft_logits([draft])[0] for draft in drafts]
    assert memories._acoustic_batch is None  # nothing stacked
    for got, repeat, want in zip(together, again, alone):
        assert torch.equal(got, repeat)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got))
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)
