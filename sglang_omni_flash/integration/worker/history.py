"""The drafter's side of the decode worker: each request's memories, and one drafter call per round.

* ``HistoryTap``       forward hooks on the target's history layers and a tee of the encoder
                       states, armed around prefill and stock steps, so the drafter's memories
                       come from what the stage computes anyway;
* ``DraftState``       one request's history K/V by position (rows kept pending until the request
                       drafts again) and acoustic K/V (made at its first round), its back-off and
                       its acceptance counts;
* ``DrafterMemories``  makes states, makes the acoustic K/V of every request about to draft for the
                       first time in one drafter call, projects every pending row of a batch in one
                       drafter call and drafts every drafting request of a step in one drafter call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from sglang_omni_flash.flash.drafter import (
    AcousticMemory,
    KeysLastKV,
    memory_length,
    memory_rows,
    per_request,
)
from sglang_omni_flash.flash.pacing import Backoff


class HistoryTap:
    """Forward hooks on the target's history layers + a tee of the encoder states (both inert unless armed).

    Armed around prefill (and around stock decode steps) so the drafter's history and acoustic
    memories come from what the stage computes anyway.
    """

    def __init__(self, model, history_layers: tuple[int, ...]):
        self.history_layers = history_layers
        self.armed = False
        self.states: dict[int, Tensor] = {}
        self.encoder: list[Tensor] = []
        layers = model.model.decoder.layers
        for i in history_layers:
            layers[i].register_forward_hook(self._hook(i))
        inner = model.model
        real = inner.cache_encoder_states

        def cache_encoder_states(states, cache_loc):
            if self.armed:
                self.encoder.append(states)
            return real(states, cache_loc)

        inner.cache_encoder_states = cache_encoder_states  # instance attribute: this model only

    def _hook(self, index: int):
        def hook(module, args, output):
            if self.armed:
                self.states[index] = output
        return hook

    def arm(self) -> None:
        self.states, self.encoder, self.armed = {}, [], True

    def disarm(self) -> tuple[Tensor | None, list[Tensor]]:
        """-> (history states [N, n_hist, d] or None if a hook did not fire, encoder chunks)."""
        self.armed = False
        states, encoder = self.states, self.encoder
        self.states, self.encoder = {}, []
        if any(i not in states for i in self.history_layers):
            return None, encoder
        return torch.stack([states[i] for i in self.history_layers], dim=-2), encoder


@dataclass
class SpecStats:
    """Per-request acceptance: candidates proposed / accepted and target forward passes."""

    proposed: int = 0
    accepted: int = 0
    target_calls: int = 0

    def line(self) -> str:
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return (f"proposed={self.proposed} accepted={self.accepted} ({rate:.0%}) "
                f"target_calls={self.target_calls}")


@dataclass
class DraftState:
    """The drafter's memories of one request: history K/V by position, acoustic K/V once."""

    hist: list[tuple[Tensor, Tensor]]  # per drafter layer (k, v) [1, H, max_positions, hd], RoPE on k
    # per drafter layer (k, v) [1, H, T, hd], or `KeysLastKV` where the CPU kernel reads it; None until
    # the request first drafts (`encoder_out` kept till then)
    acoustic: list[AcousticMemory] | None
    encoder_out: Tensor | None = None  # [T, d] the window's encoder states, while `acoustic` is None
    length: int = 0  # history positions 0..length-1 (== committed decoder length), pending ones included
    pending: list[Tensor] = field(default_factory=list)  # target states [n, n_hist, d] of the last
    # pending_rows positions (length - pending_rows .. length - 1), projected when the request drafts
    backoff: Backoff = field(default_factory=Backoff)  # pauses drafting after fruitless rounds
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def ready(self) -> bool:
        """Whether the one-off set-up (the acoustic K/V) is done."""
        return self.acoustic is not None

    @property
    def pending_rows(self) -> int:
        return sum(rows.shape[0] for rows in self.pending)

    def keep(self, rows: Tensor) -> None:
        """Target states [n, n_hist, d] of the next n positions, projected when the request drafts
        again (WhisperFlashModelRunner._project_pending)."""
        self.pending.append(rows)
        self.length += rows.shape[0]


class DrafterMemories:
    """The drafter and the memories it keeps per request (on the drafter's device and dtype)."""

    def __init__(self, drafter, max_positions: int, max_backoff: int):
        self.drafter = drafter
        p = next(drafter.parameters())
        self._device, self._dtype = p.device, p.dtype
        self.max_positions = max_positions
        self.max_backoff = max_backoff
        # the stacked (k, v) of the last batched draft where SDPA reads them, kept while the same requests draft
        self._acoustic_batch: tuple[tuple[DraftState, ...], list[AcousticMemory]] | None = None

    def warm_up(self, encoder_len: int) -> None:
        """One draft of a made-up request at start-up. The drafter's first call pays one-time
        kernel set-up (~0.4 s on a CPU with int8 weights); inside the first round it would also
        set the pacer's price of a round ten times too high, and the pacer would step aside for
        hundreds of steps while the average decays."""
        cfg = self.drafter.config
        with torch.inference_mode():
            state = self.new_state(torch.zeros(4, len(cfg.history_layers), cfg.d_model, device=self._device),
                                   torch.zeros(encoder_len, cfg.d_model, device=self._device))
            self.prepare([state])
            self.project_pending([state])
            self.draft_logits([(state, 0, state.length)])
        self._acoustic_batch = None

    def new_state(self, history: Tensor, encoder_out: Tensor) -> DraftState:
        """history [P, n_hist, d] at positions 0..P-1, encoder_out [T, d]. The acoustic K/V are made
        by `prepare` when the request first drafts: a request that the pacer keeps on plain steps
        (a busy batch where rounds do not pay) never pays for them."""
        cfg = self.drafter.config
        hist = []
        for _ in range(cfg.n_layers):
            z = torch.zeros(1, cfg.n_heads, self.max_positions, cfg.head_dim, device=self._device, dtype=self._dtype)
            hist.append((z, z.clone()))
        state = DraftState(hist=hist, acoustic=None, encoder_out=encoder_out.to(self._device, self._dtype),
                           backoff=Backoff(self.max_backoff))
        state.keep(history)
        return state

    def prepare(self, states: list[DraftState]) -> int:
        """Make the acoustic K/V of the states that have none yet, windows of one length in one
        drafter call; -> how many were made (the pacer prices this set-up per request)."""
        todo = [state for state in states if not state.ready]
        by_length: dict[int, list[DraftState]] = {}
        for state in todo:
            by_length.setdefault(state.encoder_out.shape[0], []).append(state)
        for group in by_length.values():
            layers = self.drafter.acoustic_memory(torch.stack([state.encoder_out for state in group]))
            for i, state in enumerate(group):
                state.acoustic = [memory_rows(layer, i, i + 1) for layer in layers]
                state.encoder_out = None
        return len(todo)

    def project_pending(self, states: list[DraftState]) -> None:
        """Project the history rows left pending (the prompt's at prefill, a round's accepted rows,
        stock steps' rows), for every state given, in one drafter call. A request that the pacer
        or its back-off keeps from drafting never pays for the projection, and a batch pays one
        drafter call for all its requests, inside the price of the round that needs the rows
        (what the pacer weighs)."""
        todo = [state for state in states if state.pending]
        if not todo:
            return
        rows = torch.cat([chunk for state in todo for chunk in state.pending])  # [M, n_hist, d]
        positions = torch.cat([torch.arange(state.length - state.pending_rows, state.length) for state in todo])
        projected = self.drafter.project_history(rows[:, None].to(self._device))  # [M, 1, d]
        layers = self.drafter.history_kv(projected, positions[:, None].to(self._device))  # (k, v) [M, H, 1, hd]
        j = 0
        for state in todo:
            n = state.pending_rows
            start = state.length - n
            for (hk, hv), (k, v) in zip(state.hist, layers):
                hk[:, :, start:start + n] = k[j:j + n].transpose(0, 2)
                hv[:, :, start:start + n] = v[j:j + n].transpose(0, 2)
            state.pending.clear()
            j += n

    def draft_logits(self, drafts: list[tuple[DraftState, int, int]]) -> list[Tensor]:
        """One drafter forward for all drafting requests, given as (state, anchor, anchor position)
        -> logits [K, V] per request.

        On a CPU every per-request call re-reads the drafter's weights and head (memory-bound
        matrix-vector work), so requests are drafted together: histories are cut to the longest
        prefix of the batch (each request's own length masks the rest, `history_len`). On a CPU the
        kernel reads each request's acoustic memory where it lies (`PerRequestKV`); elsewhere
        memories of one length are stacked. Batching changes the drafts by float rounding at most,
        and the target verifies every one."""
        if not drafts:
            return []
        states = [state for state, _, _ in drafts]
        layers = range(len(states[0].acoustic))
        if isinstance(states[0].acoustic[0], KeysLastKV):
            acoustic = [per_request([state.acoustic[i] for state in states]) for i in layers]
        elif len({tuple(memory_length(m) for m in state.acoustic) for state in states}) == 1:
            acoustic = self._stacked_acoustic(states)
        else:  # SDPA over memories of different lengths: one call each
            return [self._draft_alone(state, anchor, position) for state, anchor, position in drafts]
        longest = max(pos for _, _, pos in drafts)
        hist = [tuple(torch.cat([state.hist[i][j][:, :, :longest] for state in states]) for j in (0, 1))
                for i in range(len(states[0].hist))]
        pos = torch.tensor([pos for _, _, pos in drafts], device=self._device)
        anchor = torch.tensor([anchor for _, anchor, _ in drafts], device=self._device)
        return list(self.drafter(anchor, pos, hist, pos, acoustic).unbind(0))

    def _draft_alone(self, state: DraftState, anchor: int, position: int) -> Tensor:
        pos = torch.tensor([position], device=self._device)
        hist = [(k[:, :, :position], v[:, :, :position]) for k, v in state.hist]
        return self.drafter(torch.tensor([anchor], device=self._device), pos, hist, pos, state.acoustic)[0]

    def _stacked_acoustic(self, states: list[DraftState]) -> list[AcousticMemory]:
        """The (k, v) memories of these requests stacked in batch order, for SDPA; reused while the
        drafting set is unchanged (steady decoding), since restacking copies ~1.5 MB per request,
        layer and K/V. Keyed by the state objects themselves (held, so an id is never reused): a
        new request is a new state."""
        key = tuple(states)
        cached = self._acoustic_batch
        if cached is None or len(cached[0]) != len(key) or any(a is not b for a, b in zip(cached[0], key)):
            stacked = [tuple(torch.cat([state.acoustic[i][j] for state in states]) for j in (0, 1))
                       for i in range(len(states[0].acoustic))]
            self._acoustic_batch = (key, stacked)
        return self._acoustic_batch[1]
