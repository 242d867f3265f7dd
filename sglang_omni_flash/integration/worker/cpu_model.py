"""The Whisper ASR stage's model on a CPU: a cheaper decode step, and the same bits in every pass.

Stock sglang runs a CPU decode step of Whisper with `F.linear` for every decoder linear and the
tied head (MKL/oneDNN, whose kernel and last bits change with the number of rows in the call), and
with torch-native attention that copies each request's 1,500 encoder K/V rows per layer and step
(`k_cache[req_to_token[...]]`) before attending to them.

`install(model)` (the plugin's engine builders call it on a CPU, plain and speculative servers
alike) changes how the model is computed, not what:

* every `nn.Linear` of the decoder (prefill, decode step and the encoder states' cross K/V) and the
  tied head run through their `row_copy` (kernels/linear.py: each output element one fixed
  sequence over k, whatever the row count); GELU is fused into fc1 there;
* decode-mode attention (self and cross) runs through `attend_rows`: the row-invariant kernel of
  kernels/attention.py, whose every row is a fixed sequence of operations over the keys it sees. It
  wants keys transposed (contiguous over keys) and reads values fastest head-major; a request's
  encoder keys and values are copied into those layouts once per cross layer and kept (`EncoderKV`)
  until the pool slots they came from are written again;
* the encoder runs one 30 s window per call, always the one shape [1, n_mels, 3000], so a window's
  encoder states never depend on which other windows the encoder service batched with it; in bf16
  on an AVX512-BF16 CPU without AMX its self-attention runs on `kernels.encoder_attention` (chosen
  from the CPU's flags, so plain and speculative servers encode to the same bits).

Prefill attention stays stock: sglang's torch-native backend attends per request, over that
request's own prompt, so its shapes never depend on the other requests. Layer norms are torch's,
which computes each row by one call over that row alone.

The verify pass of the Whisper-Flash decode worker (verify.py) calls the same `row_copy` linears
and the same `attend_rows`, all rows of a request in one call, each row over the keys it would see
in a plain step, so a verified row reproduces the bits of the plain step at that position:
speculative output equals plain output by construction, in float32 and bfloat16 alike, on any
CPU. Where the attention kernel cannot be built, both paths fall back to torch SDPA one row at a
time (`attend_row`), which keeps that property at the price of one call per row.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sglang_omni_flash.integration.worker.compute_turns import ComputeTurns
from sglang_omni_flash.kernels.linear import row_copy
from sglang_omni_flash.kernels import attention as row_kernel
from sglang_omni_flash.kernels import encoder_attention as encoder_kernel

logger = logging.getLogger("sglang_omni_flash.cpu_model")


def attend_row(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """One query row over every key given: q [H, hd], k / v [S, H, hd] -> [H * hd].

    The one attention call of a decode step and of each verify row: same shapes, same kernel,
    whatever else the pass holds."""
    o = F.scaled_dot_product_attention(q[:, None, :], k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
                                       scale=scale)
    return o.reshape(-1)


def run_start(slots: Tensor) -> int | None:
    """The first slot when `slots` are one ascending run (first, first + 1, ...), else None."""
    n = slots.numel()
    if n:
        first = int(slots[0])
        if int(slots[-1]) - first == n - 1 and (n == 1 or bool((slots.diff() == 1).all())):
            return first
    return None


def slot_run(buf: Tensor, slots: Tensor) -> Tensor:
    """buf[slots], as a slice (no copy) when the slots are one ascending run. Same values, same
    strides: attention over either gives the same bits; the slice skips copying 1,500 encoder rows
    per layer and request, which costs more than attending to them."""
    first = run_start(slots)
    return buf[slots] if first is None else buf[first: first + slots.numel()]


def dense(view: Tensor) -> Tensor:
    """A fresh tensor with `view`'s values in row-major layout. `.contiguous()` keeps a view whose only
    odd strides sit on size-1 dims, and the kernel wants unit stride over keys even for one key."""
    out = torch.empty(view.shape, dtype=view.dtype, device=view.device)
    out.copy_(view)
    return out


def attend_rows(q: Tensor, k: Tensor, v: Tensor, scale: float, limits: list[int] | None = None,
                mask: Tensor | None = None, kt: Tensor | None = None) -> Tensor:
    """Rows of one request: q [n, H, hd] over keys k / v [W, H, hd] (views of the pool are fine) -> [n, H * hd].

    Row r sees the keys j < limits[r] (all W when None) and, with a mask [n, W], only where mask[r, j].
    `kt` [H, hd, W] (k transposed, contiguous over keys) saves the kernel's transposing copy. The
    decode step and the verify pass both attend here, so a row's bits never depend on the others."""
    n, width = q.shape[0], k.shape[0]
    limits = [width] * n if limits is None else limits
    if k.dtype != q.dtype:  # a pool kept in another dtype than the activations
        k, v, kt = k.to(q.dtype), v.to(q.dtype), None
    if row_kernel.available():
        kt = dense(k.permute(1, 2, 0)) if kt is None else kt
        out = row_kernel.row_attention(q.permute(1, 0, 2)[None], kt[None], v.permute(1, 0, 2)[None],
                                       torch.tensor([limits], dtype=torch.long, device=q.device),
                                       None if mask is None else mask[None].to(q.device), scale)[0]  # [H, n, hd]
        return out.permute(1, 0, 2).reshape(n, -1)
    rows = []
    for r in range(n):  # no kernel: torch SDPA one row at a time (its bits depend on the call's shape)
        visible = torch.arange(width, device=k.device) < limits[r]
        if mask is not None:
            visible &= mask[r].to(k.device)
        if bool(visible.all()):
            rows.append(attend_row(q[r], k, v, scale))
        else:
            rows.append(attend_row(q[r], k[visible], v[visible], scale))
    return torch.stack(rows)


class EncoderKV:
    """Each request's encoder keys and values per cross layer, in the row kernel's layouts: keys
    transposed ([H, hd, T], contiguous over keys) and values head-major ([H, T, hd]).

    The pool keeps a position's heads together ([T, H, hd]), so a head's values lie 64 floats apart
    from each other there; read head by head in place, the cross attention of a decode step at
    batch 4 took 12-14 ms against 8 ms over head-major copies (base, fp32, 2 cores). Once the pool
    has recycled its slots, a request's encoder states are no longer one run of slots either, and
    gathering them every step made a decode step of 16 requests take ~285 ms, against ~25 ms for 4
    requests whose slots were still runs (server log, long-form files at C=4). So a copy is made
    once per request and layer, from a slice or a gather, the first time a step reads it.

    Keyed by (layer id, first slot, length) of a request's encoder slots: a live slot belongs to one
    request. `written` (called after every write of encoder states) drops the entries any of whose
    slots were written again, so a copy never outlives the request that filled its slots; least
    recently used entries beyond `max_bytes` are dropped too (copied again when needed: the same
    values)."""

    def __init__(self, max_bytes: int | None = None, layers: int = 1):
        # None: as much as the pool's cross-attention planes of `layers` layers hold (a copy for every
        # request the pool can hold; 1.6 GB for base in fp32 with configs/cpu.yaml's 65,536 slots)
        self.max_bytes, self.layers = max_bytes, layers
        # key -> (kt, vh, the slots copied, their largest)
        self.entries: OrderedDict[tuple[int, int, int], tuple[Tensor, Tensor, Tensor, int]] = OrderedDict()
        self.bytes = 0

    def layouts(self, layer_id: int, kbuf: Tensor, vbuf: Tensor, slots: Tensor,
                first: int | None = None) -> tuple[Tensor, Tensor]:
        """(kt [H, hd, T], vh [H, T, hd]) of the pool's `slots` (`first`: their first slot when they
        are one ascending run, read as a slice)."""
        n = slots.numel()
        key = (layer_id, int(slots[0]) if first is None else first, n)
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return entry[0], entry[1]
        if first is None:
            k, v, top = kbuf[slots], vbuf[slots], int(slots.max())
        else:
            k, v, top = kbuf[first: first + n], vbuf[first: first + n], first + n - 1
        if self.max_bytes is None:
            self.max_bytes = 2 * self.layers * kbuf.numel() * kbuf.element_size()
        kt, vh = dense(k.permute(1, 2, 0)), dense(v.permute(1, 0, 2))
        self.entries[key] = (kt, vh, slots.clone(), top)
        self.bytes += kt.numel() * kt.element_size() + vh.numel() * vh.element_size()
        while self.bytes > self.max_bytes and len(self.entries) > 1:
            self._drop(next(iter(self.entries)))
        return kt, vh

    def written(self, layer_id: int, slots: Tensor) -> None:
        keys = [key for key in self.entries if key[0] == layer_id]
        if not keys or slots.numel() == 0:
            return
        hit = torch.zeros(max(int(slots.max()), *(self.entries[key][3] for key in keys)) + 1, dtype=torch.bool)
        hit[slots.long().cpu()] = True
        for key in keys:
            if bool(hit[self.entries[key][2].cpu()].any()):
                self._drop(key)

    def _drop(self, key) -> None:
        kt, vh, _, _ = self.entries.pop(key)
        self.bytes -= kt.numel() * kt.element_size() + vh.numel() * vh.element_size()


def encoder_run(table_row: Tensor, encoder_len: int) -> tuple[Tensor, int | None]:
    """A request's encoder slots, and their first slot when they are one ascending run (else None)."""
    slots = table_row[:encoder_len].long()
    return slots, run_start(slots)


def cross_keys(attn, kbuf: Tensor, vbuf: Tensor, slots: Tensor, first: int | None, cache: EncoderKV):
    """(k, v, kt) of a request's encoder states for `attend_rows`: with the row kernel, views of the
    cached layouts (k [T, H, hd] of kt, v [T, H, hd] of the head-major copy); else the pool's rows,
    sliced (one run of slots) or gathered."""
    if row_kernel.available():
        kt, vh = cache.layouts(attn.layer_id, kbuf, vbuf, slots, first)
        return kt.permute(2, 0, 1), vh.permute(1, 0, 2), kt
    if first is None:
        return kbuf[slots], vbuf[slots], None
    return kbuf[first: first + slots.numel()], vbuf[first: first + slots.numel()], None


def cross_attention(q: Tensor, offsets: list[int], encoder: list[tuple], scale: float) -> Tensor:
    """Every request's rows (q [sum(n_i), H, hd], request i's at offsets[i]..) over its encoder states
    ((k, v, kt) of `cross_keys`) -> [sum(n_i), H * hd]. With the row kernel and cached layouts, one call
    for all requests: rows padded to the longest request's count (a padded row is computed and
    dropped; no row reads another), each row's bits those of a call of its own."""
    if not all(kt is not None and kt.dtype == q.dtype for _, _, kt in encoder):  # kt: the kernel is there
        return torch.cat([attend_rows(q[offsets[i]: offsets[i + 1]], k, v, scale, kt=kt)
                          for i, (k, v, kt) in enumerate(encoder)])
    counts = [offsets[i + 1] - offsets[i] for i in range(len(encoder))]
    rows = max(counts)
    padded = q.new_zeros(len(encoder), rows, *q.shape[1:])
    for i, n in enumerate(counts):
        padded[i, :n] = q[offsets[i]: offsets[i + 1]]
    limits = torch.tensor([[v.shape[0]] * rows for _, v, _ in encoder], dtype=torch.long)
    out = row_kernel.row_attention_each(padded.permute(0, 2, 1, 3), [kt for _, _, kt in encoder],
                                        [v.permute(1, 0, 2) for _, v, _ in encoder], limits, scale)  # [B, H, rows, hd]
    out = out.permute(0, 2, 1, 3).reshape(len(encoder), rows, -1)
    return torch.cat([out[i, :n] for i, n in enumerate(counts)])


def _linear_forward(module: nn.Linear, gelu: bool = False):
    def forward(x: Tensor) -> Tensor:
        return row_copy(module, gelu)(x)

    return forward


def _lm_head(hidden_states: Tensor, lm_head, embedding_bias: Tensor | None = None) -> Tensor:
    logits = row_copy(lm_head)(hidden_states)
    return logits if embedding_bias is None else logits + embedding_bias


def _one_window_at_a_time(run_encoder, turns: ComputeTurns | None):
    """run_encoder over features [B, n_mels, frames] as B calls of one window each (the same shape
    every call, so the same kernels and bits for a window whatever it was batched with), each call
    in its own encoder turn (`compute_turns`)."""

    def window(features: Tensor) -> Tensor:
        if turns is None:
            return run_encoder(features)
        return turns.call(lambda: run_encoder(features), encoder=True)

    def run(features: Tensor) -> Tensor:
        if features.shape[0] <= 1:
            return window(features)
        return torch.cat([window(features[i: i + 1]) for i in range(features.shape[0])])

    return run


class _StepPlan:
    """What every attention layer of one decode step reads of the batch, worked out once per step:
    each request's encoder run, and its decoder slots as one padded index [B, longest] with the
    lengths as per-row key limits (padding points at slot 0, never visible)."""

    def __init__(self, forward_batch, table: Tensor):
        rows = forward_batch.req_pool_indices.tolist()
        lengths = forward_batch.seq_lens.tolist()
        encoder_lens = (forward_batch.encoder_lens.tolist() if forward_batch.encoder_lens is not None
                        else [0] * len(rows))
        self.encoder_runs = [encoder_run(table[row], enc) for row, enc in zip(rows, encoder_lens)]
        longest = max(lengths)
        self.self_slots = torch.zeros(len(rows), longest, dtype=torch.long, device=table.device)
        for i, (row, length, enc) in enumerate(zip(rows, lengths, encoder_lens)):
            self.self_slots[i, :length] = table[row, enc: enc + length]
        self.limits = torch.tensor(lengths, dtype=torch.long, device=table.device)[:, None]  # [B, 1]

    @staticmethod
    def of(forward_batch, table: Tensor) -> "_StepPlan":
        plan = getattr(forward_batch, "_whisper_flash_step_plan", None)
        if plan is None:
            plan = _StepPlan(forward_batch, table)
            forward_batch._whisper_flash_step_plan = plan
        return plan


class _DecodeAttention:
    """Replaces a RadixAttention's forward: decode batches here, everything else stock."""

    def __init__(self, attn, keys: EncoderKV):
        self.attn, self.stock, self.keys = attn, attn.forward, keys

    def __call__(self, q, k, v, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not forward_batch.forward_mode.is_decode() or kwargs:
            return self.stock(q, k, v, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc
        from sglang.srt.model_executor.forward_context import get_attn_backend

        attn = self.attn
        backend = get_attn_backend()
        pool = backend.token_to_kv_pool
        heads, hd = attn.tp_q_head_num, attn.qk_head_dim
        q = q.reshape(-1, heads, hd)
        if k is not None and save_kv_cache:
            pool.set_kv_buffer(attn, KVWriteLoc(forward_batch.out_cache_loc),
                               k.reshape(-1, attn.tp_k_head_num, hd), v.reshape(-1, attn.tp_v_head_num, attn.v_head_dim))
        kbuf, vbuf = pool.get_key_buffer(attn.layer_id), pool.get_value_buffer(attn.layer_id)
        plan = _StepPlan.of(forward_batch, backend.req_to_token_pool.req_to_token)
        if attn.is_cross_attention:  # one row per request (a verify pass has several)
            encoder = [cross_keys(attn, kbuf, vbuf, slots, first, self.keys) for slots, first in plan.encoder_runs]
            return cross_attention(q, list(range(q.shape[0] + 1)), encoder, attn.scaling)
        if not row_kernel.available() or kbuf.dtype != q.dtype:
            return torch.stack([attend_rows(q[i: i + 1], kbuf[slots[:n]], vbuf[slots[:n]], attn.scaling)[0]
                                for i, (slots, n) in enumerate(zip(plan.self_slots, plan.limits[:, 0].tolist()))])
        # every request's decoder keys in one kernel call: row i sees its own first limits[i] keys,
        # in key order, as it would alone (the padding past its limit is never read)
        kt = dense(kbuf[plan.self_slots].permute(0, 2, 3, 1))  # [B, H, hd, longest]
        vh = vbuf[plan.self_slots].permute(0, 2, 1, 3)  # [B, H, longest, hd]
        out = row_kernel.row_attention(q[:, :, None, :], kt, vh, plan.limits, None, attn.scaling)  # [B, H, 1, hd]
        return out.reshape(q.shape[0], -1)


def _encoder_attention_forward(attention):
    """sglang-omni's `WhisperEncoderAttention.forward` with the attention itself on `encoder_kernel`."""

    def forward(hidden_states: Tensor) -> Tensor:
        b, t, _ = hidden_states.shape
        q, k, v = (x.view(b, t, attention.num_heads, attention.head_dim).transpose(1, 2)
                   for x in attention.qkv_proj(hidden_states).chunk(3, dim=-1))
        return attention.out_proj(encoder_kernel.encoder_attention(q, k, v).reshape(b, t, attention.embed_dim))

    return forward


def _forgetting_old_keys(cross_attention, keys: EncoderKV):
    """cache_encoder_states that drops the cached layouts (`EncoderKV`) of the slots it writes."""
    write = cross_attention.cache_encoder_states

    def cache_encoder_states(states: Tensor, cache_loc: Tensor) -> None:
        write(states, cache_loc)
        keys.written(cross_attention.attn.layer_id, cache_loc)

    return cache_encoder_states


def install(model, *, take_turns: bool = True) -> bool:
    """Route `model`'s decoder (sglang's WhisperForConditionalGeneration) through the functions above;
    False (nothing changed) off a CPU or where the model is not laid out as expected. With `take_turns`
    the encoder service and the scheduler compute one at a time (`compute_turns`)."""
    decoder = getattr(getattr(model, "model", None), "decoder", None)
    processor = getattr(model, "logits_processor", None)
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    if decoder is None or processor is None or weight is None or weight.device.type != "cpu":
        return False
    if getattr(model, "_whisper_flash_cpu_decode", False):
        return True
    attentions = []
    for layer in decoder.layers:
        for name in ("self_attn", "encoder_attn"):
            attn = getattr(getattr(layer, name, None), "attn", None)
            if attn is None or not hasattr(attn, "is_cross_attention"):
                logger.warning("whisper-flash: decoder layer without %s.attn; stock CPU decode kept", name)
                return False
            attentions.append(attn)
    gelu = all(type(layer.activation_fn).__name__ == "GELUActivation" for layer in decoder.layers)
    for module in decoder.modules():
        if isinstance(module, nn.Linear):
            module.forward = _linear_forward(module)
    if gelu:  # GELU inside fc1's kernel: one fixed sequence per element (torch's has scalar tails)
        for layer in decoder.layers:
            layer.fc1.forward = _linear_forward(layer.fc1, gelu=True)
            layer.activation_fn = nn.Identity()
    turns = model._whisper_flash_turns = ComputeTurns() if take_turns else None
    if hasattr(model, "run_encoder"):
        model.run_encoder = _one_window_at_a_time(model.run_encoder, turns)
    encoder = getattr(model.model, "encoder", None)
    if weight.dtype == torch.bfloat16 and encoder is not None and encoder_kernel.available():
        for layer in encoder.layers:
            if hasattr(layer.self_attn, "qkv_proj"):
                layer.self_attn.forward = _encoder_attention_forward(layer.self_attn)
    keys = model._whisper_flash_encoder_keys = EncoderKV(layers=len(decoder.layers))
    for attn in attentions:
        attn.forward = _DecodeAttention(attn, keys)
    for layer in decoder.layers:
        layer.encoder_attn.cache_encoder_states = _forgetting_old_keys(layer.encoder_attn, keys)
    processor._compute_lm_head = _lm_head
    model._whisper_flash_cpu_decode = True
    from sglang_omni_flash.kernels import linear

    logger.info("whisper-flash: CPU model: row-invariant linears (%s) and attention kernel, encoder one window "
                "per call (%s, attention: %s), encoder and steps %s", linear.path(weight.dtype), weight.dtype,
                encoder_kernel.path(weight.dtype),
                "in turns on one thread" if take_turns else "concurrent")
    return True
