"""Whisper's encoder self-attention in bfloat16 on AVX512-BF16 dot products (encoder_attention.cpp).

On a CPU with AVX512-BF16 and no AMX, torch's attention runs bfloat16 at its float32 speed, and that
was half of a bf16 encoder window; the kernel runs both products on VDPBF16PS. Where the CPU has AMX,
torch's bf16 encoder is fast already (a whole base window 0.095 s on this project's AMX Xeon) and
this kernel, not measured there, is not used; in float32 torch's attention is already at the CPU's
fp32 rate. The choice is made from the CPU's flags alone, never from a
timing, so every process on one machine (the engine, a plain server, a Whisper-Flash server) encodes
a window to the same bits.

`WHISPER_FLASH_ENCODER_ATTENTION=torch` keeps torch's attention (to compare the two).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from sglang_omni_flash.kernels.torch_ops import load


def _cpu_chooses_kernel() -> bool:
    from sglang_omni_flash.hardware import cpu_flags

    flags = cpu_flags()
    return "avx512_bf16" in flags and "amx_bf16" not in flags


def available() -> bool:
    """True where bf16 encoder attention goes through the kernel on this machine."""
    if os.environ.get("WHISPER_FLASH_ENCODER_ATTENTION", "") == "torch" or not _cpu_chooses_kernel():
        return False
    if not load("encoder_attention.cpp", "the encoder's attention stays torch's"):
        return False
    return bool(torch.ops.whisper_flash.encoder_attention_built())


def path(dtype: torch.dtype) -> str:
    """How this process computes the encoder's self-attention in `dtype`."""
    return "avx512-bf16 dot products" if dtype == torch.bfloat16 and available() else "torch SDPA"


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q, k, v [B, H, T, hd] (no mask, not causal) -> [B, T, H, hd] contiguous. `scale` None: hd^-0.5.
    bf16 on the CPU through the kernel where `available()`, else torch's SDPA."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and available():
        return torch.ops.whisper_flash.encoder_attention(q, k, v, float(scale))
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).contiguous()
