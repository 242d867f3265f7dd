"""Row-bit checks shared by the invariance tests: does a computation give a row the same bits
whatever else is in the call? (Imported by tests/test_row_invariance.py; the fault-injection test
runs the same checks over a kernel built to fail them.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 264  # batch 8 x (MAX_TREE_NODES + 1): the most rows one verify pass can hold
# every row count where a blocked kernel could change its path: small counts, the 6-row FMA and
# 16-row AMX blocks and the ~32-row point where oneDNN changed kernels on an AMX Xeon
SOME_ROWS = [*range(1, 18), 31, 32, 33, 34, 47, 48, 49, 63, 64, 65, 100, 128, 136, 200, 263, MAX_ROWS]


def row_mismatches(kernel, x: torch.Tensor, counts, shuffles: int = 3, seed: int = 0) -> list[tuple[str, int]]:
    """kernel maps rows x[:m] ([m, ...]) to outputs [m, ...], row i from row i. Each row is computed
    alone, then among the first m rows for every m in counts, then in `shuffles` random orders of
    all rows: returns (which call, row) for every row whose bits differ from its bits alone."""
    with torch.inference_mode():
        alone = torch.cat([kernel(x[r: r + 1]) for r in range(x.shape[0])])
        bad = []
        for m in counts:
            out = kernel(x[:m])
            bad += [(f"first {m}", r) for r in range(m) if not torch.equal(out[r], alone[r])]
        g = torch.Generator().manual_seed(seed)
        for s in range(shuffles):
            order = torch.randperm(x.shape[0], generator=g)
            out = kernel(x[order])
            bad += [(f"shuffle {s}", int(order[i])) for i in range(x.shape[0]) if not torch.equal(out[i], alone[order[i]])]
    return bad


class RowCountDependentLinear:
    """A linear whose reduction order depends on the number of rows in the call, as oneDNN's bf16
    kernels did on an AMX Xeon: past 32 rows it sums the two halves of k separately. The invariance
    checks must catch it on any CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False):
        self.weight, self.bias, self.gelu = weight, bias, gelu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        if rows <= 32:
            y = F.linear(x, self.weight, self.bias)
        else:
            half = x.shape[-1] // 2
            y = F.linear(x[..., :half], self.weight[:, :half]) + F.linear(x[..., half:], self.weight[:, half:], self.bias)
        return F.gelu(y) if self.gelu else y
