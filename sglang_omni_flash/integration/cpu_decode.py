"""The Whisper ASR stage's decoder on a CPU: a cheaper decode step, and the same bits in every pass.

Stock sglang runs a CPU decode step of Whisper with `F.linear` for every decoder linear and the
tied head (MKL; for one row of base's 51,865 x 512 head 12.8 ms, packed oneDNN 7.2 ms:
flash/cpu_linear.py), and with torch-native attention that copies each request's 1,500 encoder
K/V rows per layer and step (`k_cache[req_to_token[...]]`) before attending to them. Measured on
this project's CPU, plain serving at C=1 was 1.5x the standalone engine's greedy for the same clips.

`install(model)` (the plugin's engine builders call it on a CPU, plain and speculative servers
alike) changes how the step is computed, not what:

* every `nn.Linear` of the decoder and the tied head run through their `frozen_copy` (packed once;
  the same kernel at any row count, no single-row special case);
* decode-mode attention (self and cross) runs one query row at a time through `attend_row`, over
  the row's keys gathered by slot (self) or sliced (cross: a request's encoder slots are one run).

The verify pass of the Whisper-Flash decode worker (verify.py) calls the same `frozen_copy` linears
and the same `attend_row` for each of its rows, over the keys that row would see in a plain step, so
a verified row reproduces the bits of the plain step at that position: speculative output equals
plain output by construction, in float32 and bfloat16 alike (torch's attention changes its last bits
with the number of query rows and masked keys; in bfloat16 that flips argmaxes).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sglang_omni_flash.flash.cpu_linear import frozen_copy

logger = logging.getLogger("sglang_omni_flash.cpu_decode")


def attend_row(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """One query row over every key given: q [H, hd], k / v [S, H, hd] -> [H * hd].

    The one attention call of a decode step and of each verify row: same shapes, same kernel,
    whatever else the pass holds."""
    o = F.scaled_dot_product_attention(q[:, None, :], k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
                                       scale=scale)
    return o.reshape(-1)


def slot_run(buf: Tensor, slots: Tensor) -> Tensor:
    """buf[slots], as a slice (no copy) when the slots are one ascending run. Same values, same
    strides: attention over either gives the same bits; the slice skips copying 1,500 encoder rows
    per layer and request, which costs more than attending to them."""
    n = slots.numel()
    if n:
        first = int(slots[0])
        if int(slots[-1]) - first == n - 1 and (n == 1 or bool((slots.diff() == 1).all())):
            return buf[first: first + n]
    return buf[slots]


def _linear_forward(module: nn.Linear):
    def forward(x: Tensor) -> Tensor:
        return frozen_copy(module)(x)

    return forward


def _lm_head(hidden_states: Tensor, lm_head, embedding_bias: Tensor | None = None) -> Tensor:
    logits = frozen_copy(lm_head)(hidden_states)
    return logits if embedding_bias is None else logits + embedding_bias


class _DecodeAttention:
    """Replaces a RadixAttention's forward: decode batches here, everything else stock."""

    def __init__(self, attn):
        self.attn, self.stock = attn, attn.forward

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
        table = backend.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices.tolist()
        seq_lens = forward_batch.seq_lens.tolist()
        encoder_lens = forward_batch.encoder_lens.tolist() if forward_batch.encoder_lens is not None else [0] * len(rows)
        out = []
        for i, (row, length, enc) in enumerate(zip(rows, seq_lens, encoder_lens)):
            if attn.is_cross_attention:
                slots = table[row, :enc].long()
                out.append(attend_row(q[i], slot_run(kbuf, slots), slot_run(vbuf, slots), attn.scaling))
            else:
                slots = table[row, enc: enc + length].long()
                out.append(attend_row(q[i], kbuf[slots], vbuf[slots], attn.scaling))
        return torch.stack(out)


def install(model) -> bool:
    """Route `model`'s decoder (sglang's WhisperForConditionalGeneration) through the functions above;
    False (nothing changed) off a CPU or where the model is not laid out as expected."""
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
    for module in decoder.modules():
        if isinstance(module, nn.Linear):
            module.forward = _linear_forward(module)
    for attn in attentions:
        attn.forward = _DecodeAttention(attn)
    processor._compute_lm_head = _lm_head
    model._whisper_flash_cpu_decode = True
    logger.info("whisper-flash: CPU decode step: packed linears and head, one-row attention (%s)", weight.dtype)
    return True
