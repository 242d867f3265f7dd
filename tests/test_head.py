"""flash/head.py: the CPU layouts of the output head compute the same product as F.linear."""

import pytest
import torch
import torch.nn.functional as F

from sglang_omni_flash.flash.head import transposed_head, vocab_logits


@pytest.fixture(scope="module")
def head():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5003, 64, generator=g) * 0.1


@pytest.mark.parametrize("shape", [(64,), (1, 64), (1, 1, 64), (3, 64), (2, 9, 64), (40, 64)])
@pytest.mark.parametrize("with_transposed", [False, True])
def test_same_logits_as_linear_in_every_shape(head, shape, with_transposed):
    x = torch.randn(*shape)
    bias = torch.randn(head.shape[0])
    with torch.inference_mode():
        for b in (None, bias):
            got = vocab_logits(x, head, b, transposed_head(head) if with_transposed else None)
            want = F.linear(x, head, b)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_training_keeps_linear_and_its_gradients(head):
    w = head.clone().requires_grad_(True)
    x = torch.randn(4, 64, requires_grad=True)
    out = vocab_logits(x, w)
    assert torch.equal(out, F.linear(x, w))
    out.sum().backward()
    assert w.grad is not None and x.grad is not None


def test_transposed_copy_only_on_cpu(head):
    t = transposed_head(head)
    assert t.is_contiguous() and torch.equal(t, head.t())
