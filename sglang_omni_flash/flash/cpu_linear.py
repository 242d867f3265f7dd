"""Linear layers of a frozen model at inference on CPU: pre-packed weights for oneDNN.

A decode step of a small Whisper on a CPU streams every decoder weight and the [V, d] output head
(V = 51,865) from memory for a handful of rows, so the step is as fast as the matmul kernel is for
a tiny M. `F.linear` gives MKL x W^T with that tiny M, and for M >= 2 MKL re-packs all of W on every
call: a verify of anchor + 3 candidates costs twice a single-row step in the linears alone. oneDNN
with the weight packed once (`mkldnn._reorder_linear_weight`, the op PyTorch's own CPU inductor
uses for frozen linears) reads W as it is stored. Measured on this project's 2-core CPU (fp32,
median of 15, nothing else running), base's 36 decoder linears and its head:

    rows                                   1        2        4        9       16
    36 decoder linears, F.linear        11.3 ms  19.5 ms  20.4 ms  19.8 ms  20.4 ms
    36 decoder linears, packed           9.7      9.7     10.9     11.7     14.4
    head 51,865 x 512, F.linear         12.8     25.4     ~35      28.1     37.5
    head, packed                         7.2       -       9.2      9.2       -
    head, x @ W^T with W^T contiguous    6.0       -        -        -        -

So: packed weights for every row count, and for the head a pre-transposed copy for a single row
(a gemv at memory bandwidth), which is what a plain greedy step of one request needs.

Exactness: each kernel sums a logit's products in its own order, so outputs differ from F.linear's
in the last bits (as 1 row and 9 rows of the same kernel already do). Greedy agreement with plain
decoding therefore rests, as it always did, on argmax not sitting on a float tie; the engine and
server suites check it token for token against transformers `generate()` and plain serving.

Memory: the packed copies sit beside the model's own weights (base: ~84 MB of decoder linears,
106 MB packed head + 106 MB transposed head; the drafter's ~40 MB), the price of not editing the
model's modules.

Inputs that need gradients (the drafter's training through the frozen head), any device but the
CPU, and any dtype but float32 use F.linear; on a CPU a single reduced-precision row goes through
F.linear as a pair of rows, so that its bits do not depend on the row count (`_one_row_as_two`).

The drafter may go further (`int8=True`, `WhisperFlashDrafter.set_cpu_int8`): its weights as int8
with one scale per output row, its input quantized per call (fbgemm's dynamic linear), a quarter of
the bytes. Measured alone on the shipped base drafter: a drafter call 19.0 -> 10.8 ms, held-out
tau 1.673 -> 1.666. Never the target's weights: its logits decide every token.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sglang_omni_flash.kernels.linear import tensor_state

PACK_ROWS_HINT = 8  # oneDNN's M hint for the packed layout; 1..72 rows measured alike around it


def _pack(weight: Tensor) -> Tensor | None:
    """oneDNN's packed copy of a [out, in] fp32 weight; None where this torch build has no such op."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
    except RuntimeError:  # a CPU oneDNN does not serve (then F.linear, as before)
        return None


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

    __slots__ = ("weight", "bias", "packed", "transposed", "int8")

    def __init__(self, weight: Tensor, bias: Tensor | None = None, single_row: bool = False, int8: bool = False):
        self.weight = weight.detach()  # frozen: no gradient ever reaches it
        self.bias = None if bias is None else bias.detach()
        on_cpu = self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
        self.int8 = _quantize_int8(self.weight, self.bias) if on_cpu and int8 else None
        self.packed = _pack(self.weight) if on_cpu and self.int8 is None else None
        # one row through a [V, d] head: a gemv over a contiguous W^T beats every packed layout
        self.transposed = self.weight.t().contiguous() if on_cpu and single_row and self.int8 is None else None

    @classmethod
    def of(cls, module: nn.Module, single_row: bool = False, int8: bool = False) -> "FrozenLinear":
        """From an nn.Linear, or a tied head such as an nn.Embedding (its weight; no bias)."""
        return cls(module.weight, getattr(module, "bias", None), single_row, int8)

    def __call__(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, self.weight, self.bias)  # (gradients flow to x only: the weight is frozen)
        if x.dtype != torch.float32:
            return self._one_row_as_two(x) if x.numel() == x.shape[-1] else F.linear(x, self.weight, self.bias)
        if self.int8 is not None:
            out = torch.ops.quantized.linear_dynamic(x.reshape(-1, x.shape[-1]), self.int8, True)
            return out.view(*x.shape[:-1], self.weight.shape[0])
        if self.transposed is not None and x.numel() == x.shape[-1]:
            out = x.reshape(1, -1) @ self.transposed
            if self.bias is not None:
                out = out + self.bias
            return out.view(*x.shape[:-1], self.weight.shape[0])
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _one_row_as_two(self, x: Tensor) -> Tensor:
        """One reduced-precision row, computed as a pair (the row twice), the first kept.

        oneDNN serves a bf16 product of ONE row by another kernel than two or more rows (a gemv,
        blocked differently along K), and its last bits differ: measured on an AVX512-BF16 CPU,
        base's fc2 (K = 2048) gave a row other bits alone than among 4..48 rows, for about one row
        in eight, while among any 2..72 rows a row's bits never depended on the others. A plain
        step is one row and a verify is several, so in bf16 that turned into an argmax flip
        between greedy and Whisper-Flash. Two rows cost what one does (the step is memory-bound)."""
        pair = x.reshape(1, -1).repeat(2, 1)
        return F.linear(pair, self.weight, self.bias)[:1].view(*x.shape[:-1], self.weight.shape[0])


# module -> (tensor states of weight and bias, made with single_row, the copy)
_COPIES: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, bool, FrozenLinear]]" = weakref.WeakKeyDictionary()


def frozen_copy(module: nn.Module, single_row: bool = False, int8: bool = False) -> FrozenLinear:
    """The module's `FrozenLinear`, made on first use and again after any write to its weight or bias.

    The one cache of packed copies: the decode worker's verify and `PackedLinear` both go through it.
    The copy lives as long as the module (weak keys). `single_row` adds the head's transposed copy;
    a copy made with it serves calls without it too."""
    key = (tensor_state(module.weight), tensor_state(getattr(module, "bias", None)), int8)
    entry = _COPIES.get(module)
    if entry is None or entry[0] != key or (single_row and not entry[1]):
        entry = (key, single_row, FrozenLinear.of(module, single_row, int8))
        _COPIES[module] = entry
    return entry[2]


class PackedLinear(nn.Linear):
    """nn.Linear (same parameters, same state dict) for a trainable model such as the drafter.

    Where gradients flow it is nn.Linear; at inference (no grad) on CPU it runs through its
    `frozen_copy`, which is made again whenever the weight or bias was written (optimizer step,
    load_state_dict, .to()). `int8_inference` (set by the drafter) makes that copy int8."""

    int8_inference = False

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu" or self.weight.dtype != torch.float32:
            return super().forward(x)
        return frozen_copy(self, int8=self.int8_inference)(x)
