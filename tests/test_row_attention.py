"""The row-invariant CPU attention: a row's bits never depend on what else is in the call.

This is what makes a verify row equal a one-row greedy step exactly (engine/target.py). torch's
SDPA is not like this on a CPU (its last bits move with the number of rows and requests); the
kernel must be, in float32 and in bfloat16, and still compute attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_omni_flash.kernels.attention import available, row_attention

H, HD = 8, 64
pytestmark = pytest.mark.skipif(not available(), reason="no C++ compiler for the kernel (then SDPA is used)")


def tensors(dtype, n=4, rows=33, keys=1500, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (0.2 * torch.randn(n, H, rows, HD, generator=g)).to(dtype)
    k = torch.randn(n, H, keys, HD, generator=g).to(dtype)
    v = torch.randn(n, H, keys, HD, generator=g).to(dtype)
    return q, k.transpose(-1, -2).contiguous(), v


def full(n, rows, width):
    return torch.full((n, rows), width, dtype=torch.long)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_attention_in_double_precision(dtype):
    q, kt, v = tensors(dtype, n=2, rows=9)
    ref = F.scaled_dot_product_attention(q.double(), kt.transpose(-1, -2).double(), v.double(), scale=1.0)
    out = row_attention(q, kt, v, full(2, 9, 1500))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    causal = (torch.arange(40)[None, :] <= (30 + torch.arange(9))[:, None])[None].expand(2, 9, 40)
    ref = F.scaled_dot_product_attention(q.double(), kt[..., :40].transpose(-1, -2).double(), v[:, :, :40].double(),
                                         attn_mask=causal[:, None], scale=1.0)
    out = row_attention(q, kt[..., :40], v[:, :, :40], (31 + torch.arange(9))[None].expand(2, 9))
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bit_identical_whatever_else_is_in_the_call(dtype):
    """Cross-attention (every key visible): each row computed alone == that row among 33 rows of 4,
    whatever its place in the groups of rows the kernel computes together."""
    q, kt, v = tensors(dtype)
    alone = torch.cat([torch.cat([row_attention(q[b: b + 1, :, r: r + 1], kt[b: b + 1], v[b: b + 1],
                                                full(1, 1, 1500)) for r in range(33)], dim=2)
                       for b in range(4)])
    for n in (1, 2, 4):
        for rows in (1, 2, 3, 5, 9, 33):
            out = row_attention(q[:n, :, :rows], kt[:n], v[:n], full(n, rows, 1500))
            assert torch.equal(out, alone[:n, :, :rows]), (n, rows)
            later = q[:n, :, 1: rows + 1]  # the same rows one place on in the groups
            shifted = row_attention(later, kt[:n], v[:n], full(n, later.shape[2], 1500))
            assert torch.equal(shifted, alone[:n, :, 1: rows + 1]), (n, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_causal_row_ignores_the_width_and_the_longer_rows(dtype):
    """Self-attention: a one-row step at position p sees keys 0..p; a verify row at p inside a
    wider call (more keys, rows that see further, other requests) gives the same bits."""
    q, kt, v = tensors(dtype, keys=488)
    for p in (0, 3, 40, 100, 447):
        step = row_attention(q[:1, :, :1], kt[:1, ..., : p + 1], v[:1, :, : p + 1], torch.tensor([[p + 1]]))
        for width in (p + 1, min(488, p + 9), 488):
            rows = min(9, width - p)
            limits = (p + 1 + torch.arange(rows))[None].expand(4, rows).clamp(max=width)
            verify = row_attention(q[:, :, :rows], kt[..., :width], v[:, :, :width], limits)
            assert torch.equal(verify[:1, :, :1], step), (p, width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_node_equals_the_same_path_laid_out_as_a_chain(dtype):
    """A draft-tree node sees its ancestors at scattered slots, hidden siblings between them; the
    result equals the chain that holds the same keys contiguously (a hidden key adds nothing)."""
    q, kt, v = tensors(dtype, n=1, keys=200)
    p = 120
    ancestors = [p + 2, p + 5, p + 6]  # slots of the node's ancestors after the committed prefix 0..p
    mask = torch.zeros(1, 1, p + 8, dtype=torch.bool)
    mask[0, 0, : p + 1] = True
    mask[0, 0, ancestors] = True
    tree = row_attention(q[:, :, :1], kt[..., : p + 8], v[:, :, : p + 8], torch.tensor([[p + 8]]), mask)
    order = list(range(p + 1)) + ancestors
    chain = row_attention(q[:, :, :1], kt[..., order].contiguous(), v[:, :, order], torch.tensor([[len(order)]]))
    assert torch.equal(tree, chain)


def test_bad_arguments_are_refused():
    q, kt, v = tensors(torch.float32, n=1, rows=2, keys=16)
    with pytest.raises(RuntimeError, match="limit must be"):
        row_attention(q, kt, v, torch.tensor([[16]]))
    with pytest.raises(RuntimeError, match="dtypes differ"):
        row_attention(q, kt.bfloat16(), v, full(1, 2, 16))
