"""The greedy pick (kernels/argmax.py) is torch.argmax, index for index: the plain server picks with
torch's argmax, so a speculative round that picked differently on a tie or a NaN would differ."""

import pytest
import torch

from sglang_omni_flash.kernels import argmax as argmax_kernel
from sglang_omni_flash.kernels.argmax import argmax

DTYPES = [torch.float32, torch.bfloat16]


def _same(x: torch.Tensor) -> None:
    assert torch.equal(argmax(x), x.argmax(dim=-1))


def test_the_kernel_builds_here():
    assert argmax_kernel.available()


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_rows_of_whisper_width(dtype):
    g = torch.Generator().manual_seed(0)
    _same(torch.randn(72, 51865, generator=g).to(dtype))
    _same(torch.randn(3, 9, 51865, generator=g).to(dtype))  # a verify block [n, T, V]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 5, 15, 16, 17, 33, 100])
def test_widths_that_are_not_whole_vectors(dtype, width):
    g = torch.Generator().manual_seed(width)
    _same(torch.randn(7, width, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_first_column(dtype):
    x = torch.randn(6, 51865, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[:, [51864, 7, 100]] = 50.0  # three equal maxima, the last one in the tail
    x[1, 51864] = 60.0
    x[2] = 1.0  # every column ties
    x[3, :] = -0.0
    x[3, 9] = 0.0  # +0 == -0: column 0 is the first maximum
    _same(x)
    assert argmax(x)[0] == 7


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_infinities_as_torch_orders_them(dtype):
    x = torch.full((5, 51865), float("-inf"), dtype=dtype)  # row 0: all -inf -> column 0
    x[1, 300] = float("inf")
    x[1, 200] = float("inf")
    x[2, 500] = float("nan")
    x[2, 400] = float("inf")
    x[2, 700] = float("nan")
    x[3, 51864] = float("nan")  # a NaN in the tail, after a full vector pass
    x[4, 3] = 1.0
    _same(x)


def test_other_dtypes_and_empty_rows_fall_back_to_torch():
    x = torch.randn(4, 33, dtype=torch.float64)
    _same(x)
    assert argmax(torch.zeros(0, 51865)).shape == (0,)


def test_non_contiguous_rows():
    x = torch.randn(4, 10, 51865)
    _same(x[:, :7])
    _same(x.transpose(0, 1))
