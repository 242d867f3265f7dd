"""The standalone engine's two back ends of a round, over a static preallocated batch.

* `TargetBackend` (a `speculative.VerifyBackend`): the target (`engine.target.WhisperTarget`) over
  a static KV cache and cross K/V, with CUDA graphs per (batch bucket, rows) on a GPU;
* `DrafterProposer` (a `speculative.Proposer`): the Whisper-Flash drafter with its history K/V by
  position and acoustic K/V made once per batch (CUDA graphs per batch bucket on a GPU).

Finished requests are compacted out of every buffer, so the live rows are always 0..n-1.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import record_function

from sglang_omni_flash.engine.kv_cache import compact_rows
from sglang_omni_flash.engine.speculative import Proposal, RoundInputs
from sglang_omni_flash.engine.target import WhisperTarget
from sglang_omni_flash.flash.drafter import KeysLastKV

# cache slots past the decoder window: padded rows of a verify block, and draft-tree nodes (slot
# t + row, see flash.tree) near the end of the window, write there
SLACK = 40


def capture_cuda_graph(fn, pool):
    """Warm `fn` up on a side stream (as torch requires), then capture one replayable call.

    Returns (graph, outputs of the captured call); the outputs are static tensors that each
    replay overwrites.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs


def _bucket(n: int) -> int:
    """CUDA graph batch buckets: 1, 2, 4, 8, 16, ..."""
    b = 1
    while b < n:
        b *= 2
    return b


# ------------------------------------------------------------------------------------ backend


class TargetBackend:
    """`VerifyBackend` over `WhisperTarget` with a static cache; optional CUDA graphs."""

    def __init__(self, target: WhisperTarget, batch: int, enc_len: int, cuda_graphs: bool):
        self.target = target
        self.graphs_on = cuda_graphs and target.device.type == "cuda"
        rows = _bucket(batch) if self.graphs_on else batch
        self.cache = target.new_cache(rows, SLACK)
        self.cross = target.new_cross(rows, enc_len)
        self.vocab_size = target.vocab_size
        self.n = 0
        self._history = None
        if target.history_layers:
            self._history = torch.zeros(
                rows, 64, len(target.history_layers), target.d_model, dtype=target.dtype, device=target.device
            )
        if self.graphs_on:
            self._graphs = _GraphCache(self, rows)

    def start(self, encoder_out: torch.Tensor) -> None:
        self.n = encoder_out.shape[0]
        self.target.fill_cross(encoder_out, self.cross)

    def verify(self, tokens, positions, kv_len, want_history, slots=None, attn_mask=None):
        n, t = tokens.shape
        history = self._history if (want_history and self._history is not None and t <= self._history.shape[1]) else None
        if self.graphs_on and attn_mask is None:
            return self._graphs.run(tokens, positions, want_history)
        masked = not (t == 1 and self.target.device.type == "cpu" and bool((positions == kv_len - 1).all()))
        logits, states = self.target.forward(
            tokens, positions, self.cache, self.cross, kv_len=kv_len, masked=masked, history_out=history,
            slots=slots, attn_mask=attn_mask,
        )
        return logits, (states if want_history else None)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.cache.move(src, dst)

    def commit(self, lengths: list[int]) -> None:
        pass  # lengths live with the decode loop; slots past them are masked by position

    def retire(self, keep: torch.Tensor) -> None:
        self.cache.compact(keep)
        self.cross.compact(keep)
        self.n = keep.numel()


class _GraphCache:
    """CUDA graphs of the target forward, one per (batch bucket, number of new tokens).

    Inputs are copied into static token/position buffers; rows past n (padding up to the bucket)
    get positions in the slack region past the decoder window, so they never touch a live slot.
    Captures share one memory pool; each graph's outputs stay referenced, so replays in any order
    never overwrite another graph's outputs, and every output is consumed before the next replay.
    """

    def __init__(self, backend: TargetBackend, rows: int):
        self.backend = backend
        t = backend.target
        self.tokens = torch.zeros(rows, 64, dtype=torch.long, device=t.device)
        self.positions = torch.zeros(rows, 64, dtype=torch.long, device=t.device)
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.failed = False
        self.slack_pos = t.max_positions  # first slot past the decoder window

    def _park(self, nb: int, t: int, start: int = 0) -> None:
        self.tokens[start:nb, :t] = 0
        self.positions[start:nb, :t] = self.slack_pos + torch.arange(t, device=self.positions.device)

    def run(self, tokens, positions, want_history):
        be, tg = self.backend, self.backend.target
        n, t = tokens.shape
        if self.failed or t > self.tokens.shape[1]:
            history = be._history if t <= self.tokens.shape[1] else None
            return tg.forward(tokens, positions, be.cache, be.cross, history_out=history)
        nb = _bucket(n)
        key = (nb, t)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(nb, t)
            except Exception as exc:  # never let a capture problem break decoding: run eagerly
                print(f"whisper-flash: CUDA graph capture failed ({exc}); running eagerly", file=sys.stderr)
                self.failed = True
                return self.run(tokens, positions, want_history)
        graph, logits, states = self.graphs[key]
        self.tokens[:n, :t].copy_(tokens)
        self.positions[:n, :t].copy_(positions)
        if nb > n:
            self._park(nb, t, start=n)
        graph.replay()
        return logits[:n], (states[:n] if states is not None else None)

    def _capture(self, nb: int, t: int):
        be, tg = self.backend, self.backend.target
        self._park(nb, t)
        tok, pos = self.tokens[:nb, :t], self.positions[:nb, :t]

        def fwd():
            return tg.forward(tok, pos, be.cache, be.cross, kv_len=None, masked=True, history_out=be._history)

        graph, (logits, states) = capture_cuda_graph(fwd, self.pool)
        return graph, logits, states


# ----------------------------------------------------------------------------------- proposer


class DrafterProposer:
    """`Proposer` over a `WhisperFlashDrafter`: static history K/V by position, acoustic K/V once."""

    def __init__(self, drafter, batch: int, max_len: int, enc_len: int, cuda_graphs: bool):
        cfg = drafter.config
        self.drafter = drafter
        self.block_size = cfg.block_size
        self.use_history = cfg.use_history
        self.use_audio = cfg.use_audio
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.graphs_on = cuda_graphs and self.device.type == "cuda"
        rows = _bucket(batch) if self.graphs_on else batch
        layers, heads, hd = cfg.n_layers, cfg.n_heads, cfg.head_dim
        z = dict(dtype=self.dtype, device=self.device)
        self.hist_k = torch.zeros(layers, rows, heads, max_len, hd, **z) if self.use_history else None
        self.hist_v = torch.zeros_like(self.hist_k) if self.use_history else None
        # acoustic keys transposed where the CPU row attention kernel reads them (`KeysLastKV`)
        self.keys_last = self.use_audio and drafter.reads_keys_last(self.device)
        key_shape = (hd, enc_len) if self.keys_last else (enc_len, hd)
        self.ac_k = torch.zeros(layers, rows, heads, *key_shape, **z) if self.use_audio else None
        self.ac_v = torch.zeros(layers, rows, heads, enc_len, hd, **z) if self.use_audio else None
        self._heads = torch.arange(heads, device=self.device)[None, :, None]
        self._rows = torch.arange(rows, device=self.device)[:, None, None]
        self._graphs: dict = {}
        self._graph_failed = False
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (states, positions) not yet projected
        # the last projection: seconds and positions per request (the pacer prices a round without
        # the backlog of plain steps it caught up on: flash.pacing.round_price)
        self.history_s, self.history_positions = 0.0, 0.0
        self._order: torch.Tensor | None = None  # buffer row of each live row while retirements are pending
        self._audio: torch.Tensor | None = None  # this batch's encoder output until its acoustic K/V are made
        if self.graphs_on:
            self._anchor = torch.zeros(rows, dtype=torch.long, device=self.device)
            self._anchor_pos = torch.zeros(rows, dtype=torch.long, device=self.device)
            self._pool = torch.cuda.graph_pool_handle()

    def start(self, encoder_out: torch.Tensor) -> None:
        self._pending.clear()  # what a finished decode left unprojected
        self._order = None
        # the acoustic K/V (~18 ms a request for base on a 2-core CPU) are made at the first proposal,
        # for the requests still live: a batch the pacer decodes in plain steps never pays them
        self._audio = encoder_out if self.use_audio else None

    def _memories(self, n: int, window: int | None):
        hist = acoustic = None
        if self.use_history:
            w = self.hist_k.shape[3] if window is None else max(1, window)
            hist = [(self.hist_k[i, :n, :, :w], self.hist_v[i, :n, :, :w]) for i in range(self.hist_k.shape[0])]
        if self.use_audio:
            layout = KeysLastKV if self.keys_last else lambda k, v: (k, v)
            acoustic = [layout(self.ac_k[i, :n], self.ac_v[i, :n]) for i in range(self.ac_k.shape[0])]
        return hist, acoustic

    def propose(self, inputs: RoundInputs) -> Proposal:
        with record_function("drafter.history"):  # pending history projected, K/V compacted
            self._catch_up()
        n = inputs.anchor.shape[0]
        if self.graphs_on and not self._graph_failed:
            return Proposal(logits=self._propose_graph(inputs.anchor, inputs.anchor_pos))
        hist, acoustic = self._memories(n, inputs.kv_len - 1)
        logits = self.drafter(inputs.anchor, inputs.anchor_pos, hist, inputs.anchor_pos, acoustic)
        return Proposal(logits=logits)

    def _propose_graph(self, anchor, anchor_pos):
        n = anchor.shape[0]
        nb = _bucket(n)
        if nb not in self._graphs:
            try:
                self._graphs[nb] = self._capture(nb)
            except Exception as exc:
                print(f"whisper-flash: drafter CUDA graph capture failed ({exc}); running eagerly", file=sys.stderr)
                self._graph_failed = True
                hist, acoustic = self._memories(n, None)
                return self.drafter(anchor, anchor_pos, hist, anchor_pos, acoustic)
        graph, logits = self._graphs[nb]
        self._anchor[:n].copy_(anchor)
        self._anchor_pos[:n].copy_(anchor_pos)
        self._anchor_pos[n:nb] = 0
        graph.replay()
        return logits[:n]

    def _capture(self, nb: int):
        hist, acoustic = self._memories(nb, None)
        anchor, pos = self._anchor[:nb], self._anchor_pos[:nb]

        def fwd():
            return self.drafter(anchor, pos, hist, pos, acoustic)

        return capture_cuda_graph(fwd, self._pool)

    def observe(self, states, positions) -> None:
        """Keep the target's history states [n, T, n_hist, d] of these positions [n, T]. The
        drafter projects them when it next proposes, every pending position in one call: plain
        steps that the pacer takes instead of rounds then cost no drafter call each."""
        if not self.use_history or states is None:
            return
        self._pending.append((states.clone(), positions))  # a backend may reuse its states buffer

    def _catch_up(self) -> None:
        """Before the drafter runs: compact its K/V after retirements, project the pending history,
        and make the acoustic K/V if this batch has none yet."""
        self.prepare()  # first: it reads the live rows from `_order` before compacting
        self._compact()
        self._project_pending()

    def prepare(self) -> None:
        """The acoustic K/V of the live requests, once per batch."""
        if self._audio is None:
            return
        # until the acoustic K/V exist nothing else compacts, so `_order` is also `_audio`'s live rows
        audio = self._audio if self._order is None else self._audio.index_select(0, self._order)
        self._compact()  # the history rows; the acoustic rows are written below, already in live order
        for i, (k, v) in enumerate(self.drafter.acoustic_memory(audio)):
            self.ac_k[i, : audio.shape[0]].copy_(k)
            self.ac_v[i, : audio.shape[0]].copy_(v)
        self._audio = None

    def _project_pending(self) -> None:
        self.history_s, self.history_positions = 0.0, 0.0
        if not self._pending:
            return
        started = time.perf_counter()
        n = self._pending[0][1].shape[0]
        states = torch.cat([s for s, _ in self._pending], dim=1)
        positions = torch.cat([p for _, p in self._pending], dim=1)
        layers = self.drafter.history_kv(self.drafter.project_history(states), positions)  # (k, v) [n, H, T, hd]
        start = 0
        for _, pos in self._pending:  # in the order observed: a position a round rejected comes again later
            t = pos.shape[1]
            index = (self._rows[:n], self._heads, pos[:, None, :])
            for i, (k, v) in enumerate(layers):
                self.hist_k[i, :n].index_put_(index, k[:, :, start:start + t])
                self.hist_v[i, :n].index_put_(index, v[:, :, start:start + t])
            start += t
        self._pending.clear()
        self.history_s, self.history_positions = time.perf_counter() - started, float(start)

    def retire(self, keep: torch.Tensor) -> None:
        """Only rows `keep` stay. Pending states are cut to those rows; the K/V buffers (~130 MB
        for base at batch 8) are compacted only when the drafter next runs, so a batch the pacer
        finishes on plain steps never copies them."""
        self._pending = [(s[keep], p[keep]) for s, p in self._pending]
        self._order = keep if self._order is None else self._order[keep]

    def _compact(self) -> None:
        """Move the live rows' K/V (buffer rows `_order`) to rows 0..m-1."""
        if self._order is None:
            return
        made = self._audio is None  # acoustic K/V not made yet: nothing of theirs to move
        buffers = (self.hist_k, self.hist_v) + ((self.ac_k, self.ac_v) if made else ())
        compact_rows([b for b in buffers if b is not None], self._order)
        self._order = None
