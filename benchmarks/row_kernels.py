"""The target's linears per call: the row-invariant kernel against oneDNN's packed copy and F.linear.

    .venv/bin/python benchmarks/row_kernels.py [--rows 1,9,72,136,264] [--repeats 15]

Times base's 36 decoder-block linears (6 blocks: fused q/k/v, out, cross q and out, fc1, fc2) and
its 51,865 x 512 head, one call each per row count, median of `repeats`, on 2 threads, in float32
and bfloat16, with random weights of base's shapes (the kernels' speed does not depend on the
values). Prints a Markdown table and the CPU's flags. Nothing here is asserted in tests.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from round_costs import median_ms  # (benchmarks/ is on the path of its own scripts)

SHAPES = [(1536, 512), (512, 512), (512, 512), (512, 512), (2048, 512), (512, 2048)] * 6 + [(51865, 512)]


def onednn_packed(weight, bias):
    """oneDNN's packed linear, what the project used before its own kernel (fp32; bf16 uses F.linear)."""
    if weight.dtype != torch.float32:
        return lambda x: F.linear(x, weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def main() -> int:
    from sglang_omni_flash.hardware import cpu_summary
    from sglang_omni_flash.kernels import linear as row_linear
    from sglang_omni_flash.kernels.linear import RowLinear

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,9,72,136,264")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{cpu_summary()}, 2 threads; ms per call of base's 36 block linears + head, median of {args.repeats}\n")
    print("| dtype | rows | row-invariant kernel | oneDNN packed | F.linear |")
    print("|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        weights = [((torch.randn(n, k) / k ** 0.5).to(dtype), torch.randn(n).to(dtype)) for n, k in SHAPES]
        kernels = {"row": [RowLinear(w, b) for w, b in weights], "onednn": [onednn_packed(w, b) for w, b in weights],
                   "linear": [lambda x, w=w, b=b: F.linear(x, w, b) for w, b in weights]}
        for m in rows:
            inputs = {k: torch.randn(m, k).to(dtype) for k in (512, 2048)}
            with torch.inference_mode():
                ms = {name: median_ms(lambda ls=ls: [lin(inputs[k]) for lin, (_, k) in zip(ls, SHAPES)], args.repeats)
                      for name, ls in kernels.items()}
            print(f"| {str(dtype).removeprefix('torch.')} | {m} | {ms['row']:.1f} | {ms['onednn']:.1f} | {ms['linear']:.1f} |")
    print(f"\nkernel paths: float32 {row_linear.path(torch.float32)}, bfloat16 {row_linear.path(torch.bfloat16)}")
    return 0


if __name__ == "__main__":
    from sglang_omni_flash.errors import run_command

    sys.exit(run_command(main, "row_kernels.py"))
