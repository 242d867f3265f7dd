"""Logits through Whisper's output head, with a matmul layout that is fast on CPU.

Whisper's head is the token embedding, [V, d] with V = 51,865: a single decode row reads all of it,
so the head is most of a small model's decode step on a CPU. How the product is handed to the BLAS
matters far more than its size: measured on this project's 2-core CPU (MKL, fp32, base's
51,865 x 512 head, median of 30, nothing else running):

    rows                        1        3        9       24       72
    F.linear(x, W)          12.8 ms  36.0 ms  28.1 ms  34.7 ms  73.5 ms
    (W @ x.T).T             11.2      7.1     15.3     22.8     38.6
    x @ W.T (W.T contiguous) 6.0        -        -        -        -

`F.linear` asks for x W^T with a tiny M and a huge N, which MKL serves with a slow kernel; `W @ x^T`
is the same product as a tall-skinny gemm, which it serves near memory bandwidth, and a single row
is a gemv on a pre-transposed copy. The (W @ x^T)^T result is a transposed view, not contiguous:
every consumer here (argmax, softmax, the logit rules, indexing) takes strided tensors.

Exactness: any of these kernels sums each logit's 512 products in its own order, so logits differ in
the last bits between kernels, and between 1 and M rows of the same kernel. Greedy agreement with
plain decoding therefore rests, as it always did, on argmax not sitting on a float tie; the engine
and server suites check it token for token against transformers `generate()` and plain serving.

Training keeps `F.linear` (autograd, and the numbers the checkpoints were trained with); so does
every device other than the CPU, whose BLAS has no such cliff.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def vocab_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None = None,
                 weight_t: Tensor | None = None) -> Tensor:
    """hidden [..., d] -> logits [..., V] = hidden @ weight^T (+ bias).

    weight_t: optional contiguous weight^T [d, V], used for a single row on CPU."""
    if hidden.device.type != "cpu" or (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return F.linear(hidden, weight, bias)
    lead = hidden.shape[:-1]
    rows = hidden.reshape(-1, hidden.shape[-1])
    if rows.shape[0] == 1 and weight_t is not None:
        out = rows @ weight_t
    else:
        out = (weight @ rows.T).T  # [M, V], a transposed view
    if bias is not None:
        out = out + bias
    return out.view(*lead, weight.shape[0])


def transposed_head(weight: Tensor) -> Tensor | None:
    """The contiguous weight^T that `vocab_logits` uses for one row on CPU (None elsewhere)."""
    if weight.device.type != "cpu":
        return None
    return weight.detach().t().contiguous()
