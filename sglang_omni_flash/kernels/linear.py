"""Row-invariant CPU linears for the target: a row's bits never depend on what else is in the call.

`RowLinear(weight, bias)` packs the weight once; calling it on x [..., K] gives x W^T + b through
row_linear.cpp, where every output element is one fixed sequence of instructions over its own row
of x in k order (fp32 accumulation), on one kernel path per process chosen from the CPU, never
from the number of rows. A verify pass of 264 rows, a greedy step of 1 and a prefill of 32 give
each row the same bits. BLAS / oneDNN choose kernels by the row count (measured on an AMX Xeon:
bf16 rows changed their last bits past 32 rows of the call), which is what made speculative output
differ from greedy there.

Only the target uses it: the drafter's bits only change proposals, and it keeps its faster packed
oneDNN / int8 copies (`flash.cpu_linear`). Off a CPU, for dtypes other than float32 / bfloat16, for
inputs that need gradients, or where the kernel cannot be built (a warning says so) RowLinear
falls back to `F.linear`.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sglang_omni_flash.kernels.torch_ops import load


def available() -> bool:
    return load("row_linear.cpp", "the target's linears use F.linear, whose last bits depend on the number of "
                "rows (speculative output then equals greedy unless an argmax sits on a rounding tie)")


def path(dtype: torch.dtype) -> str:
    """The kernel path this process runs `dtype` linears on ("amx-bf16 tiles", "avx512 fma", ...)."""
    if not available():
        return "F.linear (no row-invariant kernel)"
    return torch.ops.whisper_flash.row_linear_path(dtype == torch.bfloat16)


class RowLinear:
    """y = x W^T + b over a frozen weight, row-invariant on CPU (float32 / bfloat16)."""

    __slots__ = ("weight", "bias", "packed", "out_features", "gelu")

    def __init__(self, weight: Tensor, bias: Tensor | None = None, gelu: bool = False):
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.gelu = gelu  # GELU(x W^T + b), fused into the kernel (Whisper's fc1)
        self.out_features = self.weight.shape[0]
        self.packed = None
        if self.weight.device.type == "cpu" and self.weight.dtype in (torch.float32, torch.bfloat16) and available():
            self.packed = torch.ops.whisper_flash.pack_linear(self.weight)

    @classmethod
    def of(cls, module: nn.Module, gelu: bool = False) -> "RowLinear":
        """From an nn.Linear, or a tied head such as an nn.Embedding (its weight; no bias)."""
        return cls(module.weight, getattr(module, "bias", None), gelu)

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is None or x.dtype != self.weight.dtype or x.device.type != "cpu" or (
                torch.is_grad_enabled() and x.requires_grad):
            y = F.linear(x, self.weight, self.bias)
            return F.gelu(y) if self.gelu else y
        return torch.ops.whisper_flash.row_linear(x, self.packed, self.bias, self.out_features, self.gelu)


def tensor_state(t: Tensor | None) -> tuple | None:
    """What identifies a tensor's current values: its storage, its in-place version, device, dtype.

    A copy made from a weight is stale once any of these changed (an optimizer step or
    `load_state_dict` writes in place and bumps the version; `.to()` or a replaced parameter moves
    the storage). Inference tensors (weights loaded under `torch.inference_mode`, as a serving engine
    may do) keep no version counter; there the storage alone decides."""
    if t is None:
        return None
    try:
        version = t._version
    except RuntimeError:
        version = None
    return (t.data_ptr(), version, t.device, t.dtype)


def cached_copy(cache: "weakref.WeakKeyDictionary", module: nn.Module, make, *variant):
    """`make()`'s copy of a module's weights, kept in `cache` (weak keys: it lives as long as the
    module) and made again after any write to the weight or bias, or for another `variant`."""
    key = (tensor_state(module.weight), tensor_state(getattr(module, "bias", None)), *variant)
    entry = cache.get(module)
    if entry is None or entry[0] != key:
        entry = (key, make())
        cache[module] = entry
    return entry[1]


_ROW_COPIES: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def row_copy(module: nn.Module, gelu: bool = False) -> RowLinear:
    """The module's `RowLinear` (an nn.Linear, or a tied head's module). The serving decode step,
    prefill and verify pass all go through it, so they share one packed copy per linear."""
    return cached_copy(_ROW_COPIES, module, lambda: RowLinear.of(module, gelu), gelu)
