"""The greedy pick: `argmax(logits)` is torch.argmax(logits, -1), index for index, at vector speed on
a CPU (row_argmax.cpp: 0.4 ms instead of 3-7 ms for a batch-8 round's 72 rows of 51,865 columns).

Every greedy token of this package goes through it: the engine's plain step, a round's candidates
and its verify rows. The plain server picks with sglang's sampler (torch.argmax), so the kernel
keeps torch's rules exactly: the first maximal column wins a tie, a NaN beats every number (the
first NaN wins). Off a CPU, for other dtypes, or where the kernel cannot be built (a warning says
so) it is torch.argmax itself.
"""

from __future__ import annotations

import torch

from sglang_omni_flash.kernels.torch_ops import load


def available() -> bool:
    return load("row_argmax.cpp", "greedy picks use torch.argmax (the same tokens, slower)")


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and logits.numel() > 0 \
            and available():
        return torch.ops.whisper_flash.row_argmax(logits)
    return logits.argmax(dim=-1)
