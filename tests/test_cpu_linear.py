"""flash/cpu_linear.py: the drafter's packed (row-invariant kernel) and int8 CPU linears compute the product
F.linear computes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sglang_omni_flash.flash.cpu_linear import FrozenLinear, frozen_copy
from sglang_omni_flash.kernels.linear import tensor_state
from sglang_omni_flash.kernels import linear as row_linear


@pytest.fixture(scope="module")
def head():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5003, 64, generator=g) * 0.1


SHAPES = [(64,), (1, 64), (1, 1, 64), (3, 64), (2, 9, 64), (40, 64), (3, 64, 5)]


@pytest.mark.parametrize("shape", SHAPES)
def test_same_outputs_as_linear_in_every_shape(head, shape):
    x = torch.randn(*shape)
    if len(shape) == 3 and shape[-1] == 5:
        x = x.transpose(1, 2)  # a strided input: [3, 5, 64]
    bias = torch.randn(head.shape[0])
    with torch.inference_mode():
        for b in (None, bias):
            lin = FrozenLinear(head, b)
            assert lin.packed is not None or not row_linear.available()
            got, want = lin(x), F.linear(x, head, b)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_gradients_reach_the_input_through_linear(head):
    lin = FrozenLinear(head)
    x = torch.randn(4, 64, requires_grad=True)
    out = lin(x)
    assert torch.equal(out, F.linear(x, head))
    out.sum().backward()
    torch.testing.assert_close(x.grad, head.sum(0).expand(4, -1))


def test_other_dtypes_fall_back_to_linear(head):
    lin = FrozenLinear(head.double())
    assert lin.packed is None
    x = torch.randn(3, 64, dtype=torch.double)
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, head.double()))


def test_module_copies_are_made_once_and_follow_every_write():
    m = nn.Linear(16, 8)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        torch.testing.assert_close(frozen_copy(m)(x), m(x))
        first = frozen_copy(m)
        assert frozen_copy(m) is first
    m.weight = nn.Parameter(torch.randn(8, 16))  # a replaced parameter: new storage
    with torch.inference_mode():
        torch.testing.assert_close(frozen_copy(m)(x), m(x))
    with torch.no_grad():
        m.bias.add_(1.0)  # an in-place write: same storage, new version
    with torch.inference_mode():
        torch.testing.assert_close(frozen_copy(m)(x), m(x))


def test_inference_tensor_weights_are_keyed_by_storage():
    with torch.inference_mode():
        m = nn.Linear(16, 8)  # parameters created in inference mode keep no version counter
        x = torch.randn(3, 16)
        assert tensor_state(m.weight)[1] is None
        torch.testing.assert_close(frozen_copy(m)(x), F.linear(x, m.weight, m.bias))
        assert frozen_copy(m) is frozen_copy(m)


def test_packed_linear_is_nn_linear_and_follows_every_write():
    from sglang_omni_flash.flash.cpu_linear import PackedLinear

    torch.manual_seed(0)
    m = PackedLinear(32, 16)
    ref = nn.Linear(32, 16)
    ref.load_state_dict(m.state_dict())
    assert m.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x))
    # a training step writes the weight in place: inference afterwards uses the new weight
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m(x).square().sum().backward()
    opt.step()
    with torch.inference_mode():
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias))
    m.load_state_dict(ref.state_dict())
    with torch.inference_mode():
        torch.testing.assert_close(m(x), ref(x))


def test_a_tied_embedding_head_is_a_linear_without_bias():
    emb = nn.Embedding(300, 16)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        torch.testing.assert_close(frozen_copy(emb)(x), F.linear(x, emb.weight))


def test_int8_copy_is_close_to_fp32_and_only_at_cpu_inference():
    torch.manual_seed(0)
    w, b = torch.randn(300, 64) * 0.05, torch.randn(300) * 0.01
    lin = FrozenLinear(w, b, int8=True)
    assert lin.int8 is not None and lin.packed is None
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        ref, got = F.linear(x, w, b), lin(x)
    assert got.shape == ref.shape
    # int8 weights (one scale per row) and a 7-bit input scale: a few percent of the output's range
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    xg = x.clone().requires_grad_(True)
    assert torch.equal(lin(xg), F.linear(xg, w, b))  # gradients: the exact fp32 path


def test_packed_linear_int8_follows_writes_and_switches_back():
    from sglang_omni_flash.flash.cpu_linear import PackedLinear

    torch.manual_seed(0)
    m = PackedLinear(64, 32)
    x = torch.randn(4, 64)
    m.int8_inference = True
    with torch.inference_mode():
        assert frozen_copy(m, int8=True).int8 is not None
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), atol=0.05, rtol=0.05)
    with torch.no_grad():
        m.weight.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), atol=0.1, rtol=0.05)
    m.int8_inference = False
    with torch.inference_mode():
        assert torch.equal(m(x), frozen_copy(m)(x))
        assert frozen_copy(m).int8 is None


@pytest.mark.parametrize("shape", [(512, 2048), (1536, 512), (51865, 512)])  # base's fc2, fused qkv, head
def test_a_bf16_row_has_the_same_bits_alone_and_among_others(shape):
    """The drafter's bf16 rows on the row-invariant kernel: the same bits alone and among others (oneDNN's
    one-row bf16 kernel gave other bits than two or more rows on an AVX512-BF16 CPU, and its kernel past
    32 rows others again on an AMX Xeon)."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(*shape, generator=g) * 0.05).bfloat16()
    bias = torch.randn(shape[0], generator=g).bfloat16()
    lin = FrozenLinear(weight, bias)
    x = torch.randn(41, shape[1], generator=g).bfloat16()
    with torch.inference_mode():
        alone = torch.cat([lin(x[r: r + 1]) for r in range(41)])
        assert torch.equal(lin(x[3][None, None])[0], alone[3: 4])  # [1, 1, d], as the engine's step
        for rows in (2, 4, 9, 17, 33, 41):
            assert torch.equal(lin(x[:rows]), alone[:rows]), rows
        torch.testing.assert_close(alone.float(), F.linear(x, weight, bias).float(), rtol=2e-2, atol=2e-2)
