"""Static, preallocated decoder caches: self-attention K/V with per-request lengths, and the
cross-attention K/V of the encoder output (computed once per request).

Rows 0..n-1 of every buffer are the active requests. Rollback is by length only: positions past a
request's length stay allocated, are masked out of attention and are overwritten later. When
requests finish, `compact(keep)` moves the survivors to the front, so the hot loop only ever works
on narrow views `[:n]` and finished requests cost nothing.
"""

from __future__ import annotations

import torch


def compact_rows(buffers, keep: torch.Tensor) -> None:
    """Move rows `keep` (ascending) of each buffer [layers, B, ...] to rows 0..m-1, in place.

    Row by row on the buffers' storage: rows already in place are not touched, nothing is gathered
    into a temporary, and a transposed-key buffer is copied in its own contiguous layout (an
    `index_select` through the transposed view was a strided copy of every row: ~75 ms when a row of
    base retired at batch 4). Ascending order makes it safe: row j's source is never below j, and
    every later source lies above j."""
    for j, src in enumerate(keep.tolist()):
        if src != j:
            for buf in buffers:
                buf[:, j].copy_(buf[:, src])


def _keys(shape, dtype, device, transposed: bool):
    """(storage, [.., L, hd] view): with `transposed` the storage is [.., hd, L] (what the row-invariant
    CPU attention reads, contiguous over keys) and the view its transpose; else both are one tensor."""
    if not transposed:
        k = torch.zeros(shape, dtype=dtype, device=device)
        return k, k
    kt = torch.zeros((*shape[:-2], shape[-1], shape[-2]), dtype=dtype, device=device)
    return kt, kt.transpose(-1, -2)


class KVCache:
    """Self-attention K/V: k, v [layers, B, H, L, hd]; L = decoder window + slack for padded rows.
    With `keys_transposed` (CPU) the keys are stored as kt [layers, B, H, hd, L] and `k` is a view."""

    def __init__(self, layers: int, batch: int, heads: int, max_len: int, head_dim: int, dtype, device,
                 keys_transposed: bool = False):
        shape = (layers, batch, heads, max_len, head_dim)
        self.kt, self.k = _keys(shape, dtype, device, keys_transposed)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self._heads = torch.arange(heads, device=device)[None, :, None]  # [1, H, 1]
        self._rows = torch.arange(batch, device=device)[:, None, None]  # [B, 1, 1]

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [n, H, T, hd] at positions [n, T] of rows 0..n-1; return the [n, H, L, hd] views."""
        n = k.shape[0]
        index = (self._rows[:n], self._heads, positions[:, None, :])
        k_all, v_all = self.k[layer, :n], self.v[layer, :n]
        k_all.index_put_(index, k)
        v_all.index_put_(index, v)
        return k_all, v_all

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots src [n, m] to slots dst [n, m] of rows 0..n-1, every layer at once
        (a draft tree's accepted nodes to their positions). Only the slots that move are touched,
        each buffer in its own layout (a gather through the transposed key view was a strided copy
        of every row: ~2.5 ms a round); the right-hand side is read before anything is written."""
        keys_last = self.kt is not self.k  # kt [.., hd, L]: slots on the last dim
        for b, (s, d) in enumerate(zip(src.tolist(), dst.tolist())):
            pairs = [(i, j) for i, j in zip(s, d) if i != j]
            if not pairs:
                continue
            si = torch.tensor([i for i, _ in pairs], device=self.v.device)
            di = torch.tensor([j for _, j in pairs], device=self.v.device)
            if keys_last:
                self.kt[:, b, :, :, di] = self.kt[:, b, :, :, si]
            else:
                self.k[:, b, :, di] = self.k[:, b, :, si]
            self.v[:, b, :, di] = self.v[:, b, :, si]

    def compact(self, keep: torch.Tensor) -> None:
        """Move rows `keep` (ascending) to the front."""
        compact_rows((self.kt, self.v), keep)


class CrossKV:
    """Cross-attention K/V of the encoder output: k, v [layers, B, H, T_enc, hd], filled once per batch
    (keys stored transposed as kt with `keys_transposed`, as in `KVCache`)."""

    def __init__(self, layers: int, batch: int, heads: int, enc_len: int, head_dim: int, dtype, device,
                 keys_transposed: bool = False):
        shape = (layers, batch, heads, enc_len, head_dim)
        self.kt, self.k = _keys(shape, dtype, device, keys_transposed)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def compact(self, keep: torch.Tensor) -> None:
        compact_rows((self.kt, self.v), keep)
