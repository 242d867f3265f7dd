"""The drafter's linear layers at inference on a CPU: the row-invariant kernel, or int8 weights.

A drafter call of a small Whisper on a CPU streams every drafter weight and its head for a handful
of rows, so it is as fast as the matmul kernel is for a tiny M. `F.linear` (MKL) re-packs the
whole weight on every call for M >= 2; the project's own kernel (kernels/row_linear.cpp, the one
the target runs on) reads a weight packed once: base's 36 decoder-sized linears and a head, 1 row,
fp32 6.6 ms against 7.4 (F.linear) and 8.2 (oneDNN's packed copy), bf16 3.2 / 6.2 / 8.8 on an
AMX Xeon (docs/engine.md). The drafter's bits only change proposals, never the output; it uses
that kernel because it is fast.

The drafter may go further (`int8=True`, `WhisperFlashDrafter.set_cpu_int8`): its weights as int8
with one scale per output row, its input quantized per call (fbgemm's dynamic linear), a quarter of
the bytes. Measured alone on the shipped base drafter: a drafter call 19.0 -> 10.8 ms, held-out
tau 1.673 -> 1.666. Never the target's weights: its logits decide every token.

Inputs that need gradients (the drafter's training through the frozen head), any device but the
CPU, any dtype but float32 / bfloat16, or a machine where the kernel cannot be built use F.linear.

Memory: the packed copies sit beside the model's own weights (the price of not editing the model's
modules).
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sglang_omni_flash.kernels import linear as row_linear
from sglang_omni_flash.kernels.linear import cached_copy


def _quantize_int8(weight: Tensor, bias: Tensor | None):
    """fbgemm's packed int8 copy of a [out, in] fp32 weight (symmetric, one scale per output row);
    None where this torch build has no quantized CPU engine."""
    try:
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch marks quantized tensors as deprecated; they still run
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
            return torch.ops.quantized.linear_prepack(q, bias)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


class FrozenLinear:
    """y = x W^T + b for inference over a weight that never changes (on CPU: packed once).

    int8=True (only for a drafter, whose proposals the target checks anyway): on CPU the weight is
    kept as int8 with one scale per output row and the input quantized per call (fbgemm's dynamic
    linear), a quarter of the bytes to stream. Never for the target: its logits decide the output."""

    __slots__ = ("weight", "bias", "packed", "int8")

    def __init__(self, weight: Tensor, bias: Tensor | None = None, int8: bool = False):
        self.weight = weight.detach()  # frozen: no gradient ever reaches it
        self.bias = None if bias is None else bias.detach()
        cpu = self.weight.device.type == "cpu"
        fp32 = self.weight.dtype == torch.float32
        self.int8 = _quantize_int8(self.weight, self.bias) if cpu and fp32 and int8 else None
        self.packed = None
        if cpu and self.int8 is None and self.weight.dtype in (torch.float32, torch.bfloat16) and row_linear.available():
            self.packed = torch.ops.whisper_flash.pack_linear(self.weight)

    @classmethod
    def of(cls, module: nn.Module, int8: bool = False) -> "FrozenLinear":
        """From an nn.Linear, or a tied head such as an nn.Embedding (its weight; no bias)."""
        return cls(module.weight, getattr(module, "bias", None), int8)

    def __call__(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, self.weight, self.bias)  # (gradients flow to x only: the weight is frozen)
        if self.int8 is not None and x.dtype == torch.float32:
            out = torch.ops.quantized.linear_dynamic(x.reshape(-1, x.shape[-1]), self.int8, True)
            return out.view(*x.shape[:-1], self.weight.shape[0])
        if self.packed is not None and x.dtype == self.weight.dtype:
            return torch.ops.whisper_flash.row_linear(x, self.packed, self.bias, self.weight.shape[0])
        return F.linear(x, self.weight, self.bias)


_COPIES: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def frozen_copy(module: nn.Module, int8: bool = False) -> FrozenLinear:
    """The module's `FrozenLinear`, made on first use and again after any write to its weight or
    bias (`PackedLinear` goes through it)."""
    return cached_copy(_COPIES, module, lambda: FrozenLinear.of(module, int8), int8)


class PackedLinear(nn.Linear):
    """nn.Linear (same parameters, same state dict) for a trainable model such as the drafter.

    Where gradients flow it is nn.Linear; at inference (no grad) on CPU it runs through its
    `frozen_copy`, which is made again whenever the weight or bias was written (optimizer step,
    load_state_dict, .to()). `int8_inference` (set by the drafter) makes that copy int8."""

    int8_inference = False

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu":
            return super().forward(x)
        return frozen_copy(self, int8=self.int8_inference)(x)
