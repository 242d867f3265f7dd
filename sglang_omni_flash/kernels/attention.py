"""Row-invariant CPU attention: a row's result never depends on what else is in the call.

`row_attention(q, kt, v, limit, mask)` attends each query row r of request b to the keys j with
j < limit[b, r] (and mask[b, r, j], for draft trees); keys come transposed (kt [n, H, hd, W], the
layout the engine's CPU caches keep), values as usual. Its C++ kernel (row_attention.cpp) computes
every row by the same fixed sequence of operations over its own visible keys in key order, so a
verify pass of 9 rows gives, for each row, exactly the bits a one-row greedy step gives at that
position, at any batch size and for tree nodes whose hidden siblings sit between their ancestors.
Together with the row-invariant linears (`kernels.linear`) that makes Whisper-Flash's output equal
plain greedy's by construction on a CPU, in float32 and in bfloat16 (torch's SDPA blocks its work
by the sizes of the call; docs/engine.md, "Exact by construction").

Where the kernel cannot be built or loaded, `row_attention` falls back to torch's SDPA with a
warning, and `available()` says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_omni_flash.kernels.torch_ops import load


def available() -> bool:
    return load("row_attention.cpp", "using torch SDPA, whose last bits depend on the batch (speculative output "
                "then equals greedy unless an argmax sits on a rounding tie)")


def path(dtype: torch.dtype) -> str:
    """How this process scores keys for `dtype` ("avx512-bf16 dot products", "avx2 fma", ...)."""
    if not available():
        return "torch SDPA (no row-invariant kernel)"
    return torch.ops.whisper_flash.row_attention_path(dtype == torch.bfloat16)


def row_attention(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, limit: torch.Tensor,
                  mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """q [n, H, T, hd], kt [n, H, hd, W], v [n, H, W, hd], limit [n, T] (keys j < limit visible),
    mask [n, T, W] or None -> [n, H, T, hd]. CPU float32 / bfloat16 through the kernel; anything
    else through SDPA."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and available():
        return torch.ops.whisper_flash.row_attention(q, kt, v, limit, mask, float(scale))
    k = kt.transpose(-1, -2)
    keys = torch.arange(k.shape[2], device=q.device)
    visible = keys[None, None, :] < limit[:, :, None]
    if mask is not None:
        visible = visible & mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale)


def row_attention_each(q: torch.Tensor, kts: list[torch.Tensor], vs: list[torch.Tensor], limit: torch.Tensor,
                       scale: float = 1.0) -> torch.Tensor:
    """`row_attention` with each request's keys and values in tensors of its own: q [n, H, T, hd],
    kts[b] [H, hd, W_b], vs[b] [H, W_b, hd], limit [n, T] -> [n, H, T, hd]. Request b's rows have the
    bits `row_attention` gives them over kts[b][None] and vs[b][None]; one call, no stacking copy."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and available():
        return torch.ops.whisper_flash.row_attention_each(q, list(kts), list(vs), limit, float(scale))
    return torch.cat([row_attention(q[b: b + 1], kt[None], v[None], limit[b: b + 1], None, scale)
                      for b, (kt, v) in enumerate(zip(kts, vs))])
