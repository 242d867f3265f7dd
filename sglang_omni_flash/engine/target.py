"""A lean Whisper decoder over the transformers `WhisperForConditionalGeneration` weights.

The math is transformers' (pre-LN blocks: self-attention, cross-attention, GELU FFN; learned
positions; query scaled before the product; tied output head), written with torch SDPA over a static
cache and explicit positions, so one call serves prefill (the prompt), a greedy step (1 token) and a
Whisper-Flash verify pass (anchor + K candidates). It also returns the residual stream after the
history layers, which the drafter reads as its history memory.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from sglang_omni_flash.engine.kv_cache import CrossKV, KVCache
from sglang_omni_flash.kernels import encoder_attention as encoder_kernel
from sglang_omni_flash.kernels import linear as row_linear
from sglang_omni_flash.kernels.attention import available as row_kernel, row_attention
from sglang_omni_flash.kernels.linear import RowLinear


class _Layer:
    """One decoder block's weights: every linear a `RowLinear` (q/k/v fused, GELU fused into fc1)."""

    def __init__(self, layer):
        sa, ca = layer.self_attn, layer.encoder_attn
        self.ln1 = (layer.self_attn_layer_norm.weight, layer.self_attn_layer_norm.bias, layer.self_attn_layer_norm.eps)
        k_bias = torch.zeros_like(sa.q_proj.bias)  # Whisper's k_proj has no bias
        self.qkv = RowLinear(
            torch.cat([sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight], 0),
            torch.cat([sa.q_proj.bias, k_bias, sa.v_proj.bias], 0),
        )
        self.o = RowLinear.of(sa.out_proj)
        self.ln2 = (layer.encoder_attn_layer_norm.weight, layer.encoder_attn_layer_norm.bias, layer.encoder_attn_layer_norm.eps)
        self.cq = RowLinear.of(ca.q_proj)
        self.ck = RowLinear.of(ca.k_proj)  # k/v of the encoder output: once per request
        self.cv = RowLinear.of(ca.v_proj)
        self.co = RowLinear.of(ca.out_proj)
        self.ln3 = (layer.final_layer_norm.weight, layer.final_layer_norm.bias, layer.final_layer_norm.eps)
        self.fc1 = RowLinear.of(layer.fc1, gelu=True)
        self.fc2 = RowLinear.of(layer.fc2)


def _ln(x, p):
    return F.layer_norm(x, (x.shape[-1],), p[0], p[1], p[2])


def _attend_through_kernel(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature over `encoder_kernel` (the encoder has no mask)."""
    if attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    return encoder_kernel.encoder_attention(query, key, value, scaling), None


def _encoder_attention_on_kernel(encoder) -> None:
    """The encoder's self-attention through `kernels.encoder_attention` (bf16 on an AVX512-BF16 CPU
    without AMX): its layers get a copy of the config naming that function; the decoder keeps its own."""
    from transformers import AttentionInterface

    AttentionInterface.register("whisper_flash_encoder", _attend_through_kernel)
    config = copy.copy(encoder.config)
    config._attn_implementation = "whisper_flash_encoder"
    for layer in encoder.layers:
        layer.self_attn.config = config


class WhisperTarget:
    """The frozen target: encoder (transformers' own module) + a cache-explicit decoder forward."""

    def __init__(self, model, history_layers: tuple[int, ...] = ()):
        self.model = model
        cfg = model.config
        dec = model.model.decoder
        self.d_model = cfg.d_model
        self.heads = cfg.decoder_attention_heads
        self.head_dim = cfg.d_model // cfg.decoder_attention_heads
        self.scaling = self.head_dim**-0.5
        self.num_layers = cfg.decoder_layers
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_target_positions
        self.embed_scale = (cfg.d_model**0.5) if getattr(cfg, "scale_embedding", False) else 1.0
        self.embed = dec.embed_tokens.weight
        self.pos_embed = dec.embed_positions.weight
        self.final_ln = (dec.layer_norm.weight, dec.layer_norm.bias, dec.layer_norm.eps)
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        # CPU: attention and every linear through the row-invariant kernels (kernels/), so a verify
        # row gives exactly the bits of a one-row step at any batch size: speculative output ==
        # greedy output by construction. Elsewhere SDPA and F.linear (exact unless a float tie).
        self.row_invariant = (self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
                              and row_kernel() and row_linear.available())
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and encoder_kernel.available():
            _encoder_attention_on_kernel(model.model.encoder)
        self.head = RowLinear(model.proj_out.weight)
        self.layers = [_Layer(layer) for layer in dec.layers]
        self.history_layers = tuple(history_layers)
        self._history_slot = {layer: i for i, layer in enumerate(self.history_layers)}

    # --- once per batch -------------------------------------------------------------------
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Log-mel [B, n_mels, 3000] -> encoder output [B, 1500, d], one window per call: every call
        then has the one shape [1, n_mels, 3000], so a window's bits never depend on the batch it
        came in (its encoder output gives no_speech_prob, the cross K/V and the first token)."""
        encoder = self.model.model.encoder
        return torch.cat([encoder(window[None].to(self.dtype)).last_hidden_state for window in features])

    def fill_cross(self, encoder_out: torch.Tensor, cross: CrossKV) -> None:
        """Cross-attention K/V of every layer for rows 0..B-1, computed once."""
        b, t, _ = encoder_out.shape
        for i, lw in enumerate(self.layers):
            k = lw.ck(encoder_out).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            v = lw.cv(encoder_out).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            cross.k[i, :b].copy_(k)
            cross.v[i, :b].copy_(v)

    # --- every step -----------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        cross: CrossKV,
        kv_len: int | None = None,
        masked: bool = True,
        last_only: bool = False,
        history_out: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ):
        """Run rows 0..n-1 over new tokens [n, T] at positions [n, T].

        Each new row attends to its cache up to its own position (causal), and its K/V are written
        into the cache at that position. `kv_len` limits attention to the first kv_len cache slots
        (None: the whole static cache, as CUDA graphs need); `masked=False` is allowed when every
        row's positions are the last kv_len-T..kv_len-1 slots (one token, equal lengths).
        A draft tree (`flash.tree`) passes `slots` [n, T] (where the new K/V go; default: the
        positions) and its own `attn_mask` [n, 1, T, kv_len] instead of the causal one.
        Returns logits [n, T, V] (or [n, 1, V] with last_only) and history [n, T, n_hist, d]
        (written into `history_out[:n, :T]` when given).
        """
        n, t = tokens.shape
        w = cache.max_len if kv_len is None else kv_len
        pos_emb = self.pos_embed[positions.clamp(max=self.max_positions - 1)]
        h = F.embedding(tokens, self.embed)
        if self.embed_scale != 1.0:
            h = h * self.embed_scale
        h = h + pos_emb
        mask = attn_mask
        if slots is None:
            slots = positions
        if self.row_invariant:  # keys j < limit visible (causal by position), or the tree's own mask
            limit = positions + 1 if attn_mask is None else torch.full_like(positions, w)
            tree = None if attn_mask is None else attn_mask[:, 0]
            cross_limit = torch.full_like(positions, cross.v.shape[3])
        elif mask is None and masked:
            key_pos = torch.arange(w, device=tokens.device)
            mask = (key_pos[None, None, None, :] <= positions[:, None, :, None])  # [n, 1, T, w]
        if history_out is None and self.history_layers:
            history_out = torch.empty(n, t, len(self.history_layers), self.d_model, dtype=h.dtype, device=h.device)
        for i, lw in enumerate(self.layers):
            # self-attention over the cache (the new rows included)
            x = _ln(h, lw.ln1)
            qkv = lw.qkv(x).view(n, t, 3, self.heads, self.head_dim)
            q = (qkv[:, :, 0] * self.scaling).transpose(1, 2)
            k_all, v_all = cache.update(i, slots, qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2))
            if self.row_invariant:
                a = row_attention(q, cache.kt[i, :n, :, :, :w], v_all[:, :, :w], limit, tree)
            else:
                a = F.scaled_dot_product_attention(q, k_all[:, :, :w], v_all[:, :, :w], attn_mask=mask, scale=1.0)
            h = h + lw.o(a.transpose(1, 2).reshape(n, t, self.d_model))
            # cross-attention to the encoder output
            x = _ln(h, lw.ln2)
            q = (lw.cq(x) * self.scaling).view(n, t, self.heads, self.head_dim).transpose(1, 2)
            if self.row_invariant:
                a = row_attention(q, cross.kt[i, :n], cross.v[i, :n], cross_limit)
            else:
                a = F.scaled_dot_product_attention(q, cross.k[i, :n], cross.v[i, :n], scale=1.0)
            h = h + lw.co(a.transpose(1, 2).reshape(n, t, self.d_model))
            # feed-forward
            x = _ln(h, lw.ln3)
            h = h + lw.fc2(lw.fc1(x))  # GELU inside fc1
            slot = self._history_slot.get(i)
            if slot is not None:
                history_out[:n, :t, slot] = h
        if last_only:
            h = h[:, -1:]
        with record_function("target.head"):  # a label for benchmarks/round_costs.py --breakdown
            logits = self.head(_ln(h, self.final_ln))
        history = history_out[:n, :t] if self.history_layers else None
        return logits, history

    def new_cache(self, batch: int, slack: int) -> KVCache:
        return KVCache(self.num_layers, batch, self.heads, self.max_positions + slack, self.head_dim, self.dtype,
                       self.device, keys_transposed=self.row_invariant)

    def new_cross(self, batch: int, enc_len: int) -> CrossKV:
        return CrossKV(self.num_layers, batch, self.heads, enc_len, self.head_dim, self.dtype, self.device,
                       keys_transposed=self.row_invariant)
