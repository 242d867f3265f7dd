"""Every kernel path of row_linear.cpp and row_attention.cpp is row-invariant and computes what it
should (row_argmax.cpp's: torch.argmax), checked on this machine whatever its CPU: the kernel is
built again for each older CPU class this CPU can run (`WHISPER_FLASH_MARCH`), in a subprocess, so an AMX machine also runs the AVX-512, AVX2 and
plain-vector paths that CPUs without AMX get, and an AVX2 machine the plain-vector one.

Why it matters: which path runs is chosen by the CPU at build time, and the product's exactness
rests on each one being row-invariant; a path only exercised on other machines would be a
guarantee by luck. (A plain-vector path built on std::fma once made a 72-row head take seconds on
CPUs without FMA; the timing printed here is for reading, never asserted.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sglang_omni_flash.hardware import cpu_flags
from sglang_omni_flash.kernels import linear as row_linear

pytestmark = pytest.mark.skipif(not row_linear.available(), reason="no C++ compiler for the row-invariant kernels")

FLAGS = cpu_flags()
# (-march, the CPU flags it needs, the fp32 path and the bf16 path it must report)
CLASSES = [
    ("x86-64", (), "4-lane multiply-add", "4-lane multiply-add over widened bf16"),
    ("haswell", ("avx2", "fma"), "avx2 fma", "avx2 fma over widened bf16"),
    ("skylake-avx512", ("avx512f",), "avx512 fma", "avx512 fma over widened bf16"),
    ("cooperlake", ("avx512f", "avx512_bf16"), "avx512 fma", "avx512-bf16 dot products"),
]
# row_attention's paths for the same builds (fp32, bf16): how keys are scored
ATTENTION_PATHS = {
    "x86-64": ("vector multiply-add", "vector multiply-add over widened bf16"),
    "haswell": ("avx2 fma", "avx2 fma over widened bf16"),
    "skylake-avx512": ("avx512 fma", "avx512 fma over widened bf16"),
    "cooperlake": ("avx512 fma", "avx512-bf16 dot products"),
}

CHECK = textwrap.dedent("""
    import json, sys, time
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, "tests")
    from row_bits import MAX_ROWS, SOME_ROWS, row_mismatches
    from sglang_omni_flash.kernels.linear import RowLinear, path

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        shapes = {"fc1+gelu": (2048, 512, True, True), "fc2": (512, 2048, True, False),
                  "head": (51865, 512, False, False)}
        result = {"path": path(dtype)}
        for name, (n, k, bias, gelu) in shapes.items():
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            b = torch.randn(n, generator=g).to(dtype) if bias else None
            lin = RowLinear(w, b, gelu=gelu)
            x = torch.randn(MAX_ROWS, k, generator=g).to(dtype)
            counts = SOME_ROWS if name == "head" else range(1, MAX_ROWS + 1)
            t = time.perf_counter()
            bad = row_mismatches(lin, x, counts, shuffles=2)
            want = F.linear(x[:9].float(), w.float(), None if b is None else b.float())
            want = F.gelu(want) if gelu else want
            err = ((lin(x[:9]).float() - want).abs() / (want.abs() + 1)).max().item()
            result[name] = {"packed": lin.packed is not None, "mismatches": len(bad), "max_rel_err": err,
                            "check_s": round(time.perf_counter() - t, 2)}
        result["attention"] = attention_check(dtype, g)
        report[str(dtype).removeprefix("torch.")] = result
    print(json.dumps(report))
""")

# row_attention.cpp on the same build: every row alone == that row among 9 rows of 3 requests (its
# place in the groups of rows computed together varies), a tree node == its path laid out as a
# chain, and the values against float64 attention
ATTENTION = textwrap.dedent("""
    from sglang_omni_flash.kernels.attention import available, path as attention_path, row_attention

    def attention_check(dtype, g):
        assert available()
        q = (0.2 * torch.randn(3, 8, 9, 64, generator=g)).to(dtype)
        k = torch.randn(3, 8, 300, 64, generator=g).to(dtype)
        v = torch.randn(3, 8, 300, 64, generator=g).to(dtype)
        kt = k.transpose(-1, -2).contiguous()
        limits = (250 + torch.arange(9))[None].expand(3, 9)
        together = row_attention(q, kt, v, limits)
        bad = sum(not torch.equal(together[b, :, r], row_attention(q[b:b + 1, :, r:r + 1], kt[b:b + 1, ..., :250 + r],
                                                                   v[b:b + 1, :, :250 + r],
                                                                   torch.tensor([[250 + r]]))[0, :, 0])
                  for b in range(3) for r in range(9))
        slots = list(range(200)) + [203, 206, 207]  # a node's ancestors after hidden siblings
        mask = torch.zeros(1, 1, 208, dtype=torch.bool)
        mask[0, 0, slots] = True
        tree = row_attention(q[:1, :, :1], kt[:1, ..., :208], v[:1, :, :208], torch.tensor([[208]]), mask)
        chain = row_attention(q[:1, :, :1], kt[:1][..., slots].contiguous(), v[:1, :, slots],
                              torch.tensor([[len(slots)]]))
        bad += 0 if torch.equal(tree, chain) else 1
        causal = torch.arange(300)[None, :] < limits[0][:, None]
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=causal, scale=1.0)
        return {"mismatches": bad, "max_err": (together.double() - want).abs().max().item(),
                "path": attention_path(dtype)}
""")
assert "torch.set_num_threads(2)\n" in CHECK
CHECK = CHECK.replace("torch.set_num_threads(2)\n", "torch.set_num_threads(2)\n" + ATTENTION, 1)


def _run_built_for(march: str, needs: tuple[str, ...], script: str) -> subprocess.CompletedProcess:
    """`script` in a subprocess whose kernels are built for `march` (skipped where this CPU cannot run it)."""
    missing = [f for f in needs if f not in FLAGS]
    if missing:
        pytest.skip(f"this CPU cannot run {march} code (no {', '.join(missing)})")
    env = {**os.environ, "WHISPER_FLASH_MARCH": march}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.parametrize("march,needs,fp32_path,bf16_path", CLASSES, ids=[c[0] for c in CLASSES])
def test_each_cpu_class_path_is_row_invariant_and_computes_the_linear(march, needs, fp32_path, bf16_path):
    run = _run_built_for(march, needs, CHECK)
    report = json.loads(run.stdout.strip().splitlines()[-1])
    print(march, json.dumps(report, indent=1))
    assert report["float32"]["path"] == fp32_path
    assert report["bfloat16"]["path"] == bf16_path
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 3e-2)):
        for name in ("fc1+gelu", "fc2", "head"):
            got = report[dtype][name]
            assert got["packed"], (march, dtype, name)  # the kernel ran, not F.linear
            assert got["mismatches"] == 0, (march, dtype, name, got)
            assert got["max_rel_err"] < tol, (march, dtype, name, got)
        attention = report[dtype]["attention"]
        assert attention["path"] == ATTENTION_PATHS[march][dtype == "bfloat16"], (march, dtype, attention)
        assert attention["mismatches"] == 0, (march, dtype, attention)
        assert attention["max_err"] < (1e-5 if dtype == "float32" else 2e-2), (march, dtype, attention)


ARGMAX_CHECK = textwrap.dedent("""
    import torch
    from sglang_omni_flash.kernels import argmax as kernel
    assert kernel.available()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(72, 51865, generator=g).to(dtype)
        x[1, [51864, 7, 100]] = 50.0  # a tie
        x[2, 500] = float("nan")
        x[2, 400] = float("inf")
        x[3] = float("-inf")
        x[4, 51864] = float("nan")
        for rows in (x, x[:, :33], x[:, :17]):
            assert torch.equal(kernel.argmax(rows), rows.argmax(dim=-1)), dtype
    print("ok")
""")


@pytest.mark.parametrize("march,needs", [c[:2] for c in CLASSES], ids=[c[0] for c in CLASSES])
def test_each_cpu_class_argmax_is_torchs(march, needs):
    """The greedy pick (row_argmax.cpp) equals torch.argmax on every build, ties and NaN included."""
    run = _run_built_for(march, needs, ARGMAX_CHECK)
    assert run.stdout.strip().endswith("ok")


ENCODER_CHECK = textwrap.dedent("""
    import torch
    from sglang_omni_flash.kernels.torch_ops import load
    assert load("encoder_attention.cpp", "-")
    print("built" if torch.ops.whisper_flash.encoder_attention_built() else "not built")
""")


@pytest.mark.parametrize("march,needs", [c[:2] for c in CLASSES], ids=[c[0] for c in CLASSES])
def test_the_encoder_attention_kernel_exists_only_in_builds_with_bf16_dot_products(march, needs):
    """encoder_attention.cpp compiles on every class; its kernel only where VDPBF16PS is there
    (elsewhere `encoder_attention.available()` is false and torch's attention runs)."""
    run = _run_built_for(march, needs, ENCODER_CHECK)
    assert run.stdout.strip().endswith("built" if "avx512_bf16" in needs else "not built")
