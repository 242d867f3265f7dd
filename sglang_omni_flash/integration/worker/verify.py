"""The verify pass: one target forward over [anchor, c_1..c_k] of every running request.

sglang's torch-native attention computes an EXTEND request with ``prefix + new`` query rows
(it pads the queries to the whole sequence and runs a causal SDPA over it), so a verify of
9 new rows after a 100-token transcript pays for 109 rows in every self- and cross-attention
layer. This pass runs the target's own decoder modules (same weights, same K/V pool) and
attends with exactly the new rows:

* self-attention   the new K/V are written to their slots in the paged pool first, then each
                   new row attends to the slots it sees in ``req_to_token[row, enc : enc + L + n]``
                   (the prefix, then its chain predecessors or tree ancestors, then itself);
* cross-attention  each new row attends to the request's cached encoder K/V,
                   ``req_to_token[row, 0 : enc]`` in the cross layer planes (written at prefill).

The rows of a request go through ``cpu_model.attend_rows`` together, each over exactly the keys a
plain decode step at its position attends to, and the linears and head through the same
row-invariant copies as the decode step (``row_copy``): a verified row has the bits of that plain
step (cpu_model.py explains why).

It also returns the residual stream after the drafter's history layers (before the final
layer norm), so no hooks are needed on this path. Pure torch over sglang's pool tensors:
it runs on any device, but on CUDA the stage's own attention kernels would be faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_omni_flash.kernels.linear import row_copy
from sglang_omni_flash.integration.worker.cpu_model import (EncoderKV, attend_rows, cross_attention, cross_keys,
                                                             encoder_run)


@dataclass(frozen=True)
class VerifyRow:
    """One request of a verify pass."""

    row: int  # req_to_token row (req_pool_idx)
    encoder_len: int  # encoder slots at the start of the row (1500 for Whisper)
    prefix_len: int  # L: decoder positions already in the cache (the anchor's position)
    tokens: tuple[int, ...]  # [anchor, c_1..c_k]; their slots are at row positions enc+L .. enc+L+k
    # a draft tree (flash/tree.py): verify row r > 0 holds a node at position L + depths[r-1] whose
    # parent is verify row parents[r-1] (0 = the anchor); it attends to the prefix and its ancestors.
    # None: a chain (row r at position L + r, causal).
    depths: tuple[int, ...] | None = None
    parents: tuple[int, ...] | None = None

    def positions(self) -> list[int]:
        if self.depths is None:
            return [self.prefix_len + j for j in range(len(self.tokens))]
        return [self.prefix_len] + [self.prefix_len + d for d in self.depths]

    def mask(self, device) -> Tensor:
        """[n, L + n] bool: which of the row's prefix + new slots each new row attends to."""
        n, L = len(self.tokens), self.prefix_len
        if self.parents is None:
            return torch.arange(L + n, device=device)[None, :] <= (L + torch.arange(n, device=device))[:, None]
        block = torch.eye(n, dtype=torch.bool)
        for r, parent in enumerate(self.parents, start=1):  # parents come first: their rows are complete
            block[r] |= block[parent]
        return torch.cat([torch.ones(n, L, dtype=torch.bool), block], 1).to(device)


@dataclass
class VerifyOutput:
    logits: Tensor  # [sum(n_i), V] raw target logits, rows in request order
    history: Tensor  # [sum(n_i), n_hist, d] residual stream after the history layers
    offsets: list[int]  # start row of each request in the flat outputs


@torch.inference_mode()
def verify_forward(model, kv_pool, req_to_token: Tensor, rows: list[VerifyRow],
                   history_layers: tuple[int, ...]) -> VerifyOutput:
    """Run the target decoder over every row's tokens at positions L..L+n-1 (K/V written to the pool).

    Every linear and the tied head run through their `row_copy` (kernels/linear.py; GELU fused into
    fc1), as the decode step's do."""

    def lin(module, x: Tensor, gelu: bool = False) -> Tensor:
        return row_copy(module, gelu)(x)

    decoder = model.model.decoder
    device = decoder.embed_tokens.weight.device
    lengths = [len(r.tokens) for r in rows]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    ids = torch.tensor([t for r in rows for t in r.tokens], dtype=torch.long, device=device)
    positions = torch.tensor([p for r in rows for p in r.positions()], dtype=torch.long, device=device)
    # slots of the new positions, the self-attention K/V of the whole sequence, the encoder K/V
    table = [req_to_token[r.row] for r in rows]
    new_slots = torch.cat([
        t[r.encoder_len + r.prefix_len: r.encoder_len + r.prefix_len + n] for t, r, n in zip(table, rows, lengths)
    ]).long()
    self_slots = [t[r.encoder_len: r.encoder_len + r.prefix_len + n].long() for t, r, n in zip(table, rows, lengths)]
    cross_runs = [encoder_run(t, r.encoder_len) for t, r in zip(table, rows)]
    # a chain's row j sees the prefix and rows 0..j; a tree's row its ancestors (mask)
    limits = [[r.prefix_len + j + 1 for j in range(n)] if r.parents is None else None for r, n in zip(rows, lengths)]
    masks = [None if r.parents is None else r.mask(torch.device("cpu")) for r in rows]
    keys = getattr(model, "_whisper_flash_encoder_keys", None) or EncoderKV()

    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    h = decoder.embed_input_ids(ids, positions)
    captured: dict[int, Tensor] = {}
    for index, layer in enumerate(decoder.layers):
        sa = layer.self_attn
        heads, hd = sa.num_heads, sa.head_dim
        x = layer.self_attn_layer_norm(h)
        q, k, v = lin(sa.qkv_proj, x).chunk(3, dim=-1)
        q = q.reshape(-1, heads, hd)
        kv_pool.set_kv_buffer(sa.attn, KVWriteLoc(new_slots), k.reshape(-1, heads, hd), v.reshape(-1, heads, hd))
        kbuf, vbuf = kv_pool.get_key_buffer(sa.attn.layer_id), kv_pool.get_value_buffer(sa.attn.layer_id)
        o = torch.cat([
            attend_rows(q[offsets[i]: offsets[i + 1]], kbuf[slots], vbuf[slots], sa.scaling, limits[i], masks[i])
            for i, slots in enumerate(self_slots)
        ])
        h = h + lin(sa.out_proj, o)

        ca = layer.encoder_attn
        x = layer.encoder_attn_layer_norm(h)
        q = lin(ca.q_proj, x).reshape(-1, ca.num_heads, ca.head_dim)
        kbuf, vbuf = kv_pool.get_key_buffer(ca.attn.layer_id), kv_pool.get_value_buffer(ca.attn.layer_id)
        encoder = [cross_keys(ca.attn, kbuf, vbuf, slots, first, keys) for slots, first in cross_runs]  # (k, v, kt)
        o = cross_attention(q, offsets, encoder, ca.scaling)
        h = h + lin(ca.out_proj, o)

        x = layer.final_layer_norm(h)
        h = h + lin(layer.fc2, lin(layer.fc1, x, gelu=True))
        if index in history_layers:
            captured[index] = h
    hidden = decoder.layer_norm(h)
    logits = lin(model.lm_head, hidden)  # the row-invariant head, as the decode step's (cpu_model)
    history = torch.stack([captured[i] for i in history_layers], dim=-2)  # [N, n_hist, d]
    return VerifyOutput(logits=logits, history=history, offsets=offsets)
