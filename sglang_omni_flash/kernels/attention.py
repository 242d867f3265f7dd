"""Row-invariant CPU attention: a row's result never depends on what else is in the call.

`row_attention(q, kt, v, limit, mask)` attends each query row r of request b to the keys j with
j < limit[b, r] (and mask[b, r, j], for draft trees); keys come transposed (kt [n, H, hd, W], the
layout the engine's CPU caches keep), values as usual. Its C++ kernel (row_attention.cpp) computes
every row by the same fixed sequence of operations over its own visible keys in key order, so a
verify pass of 9 rows gives, for each row, exactly the bits a one-row greedy step gives at that
position, at any batch size and for tree nodes whose hidden siblings sit between their ancestors.
That is what makes Whisper-Flash's output equal plain greedy's by construction on a CPU, in float32
and in bfloat16, rather than "unless an argmax sits on a rounding tie" (torch's SDPA blocks its work
by the sizes of the call; docs/engine.md, "Exact by construction").

The kernel is compiled on first use for this machine (`-march=native`, cached in the build
directory). Where it cannot be built or loaded, `row_attention` falls back to torch's SDPA with a
warning, and `available()` says so.
"""

from __future__ import annotations

import sys
from importlib import resources

import torch
import torch.nn.functional as F

_state: dict[str, object] = {}


def _flags() -> tuple[list[str], list[str]]:
    import hashlib
    from pathlib import Path

    from sglang_omni_flash.hardware import cpu_flags

    # torch's own headers and libraries (what torch.utils.cpp_extension would name; importing it
    # prints a CUDA_HOME warning on machines without CUDA)
    root = Path(torch.__file__).resolve().parent
    includes = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]
    lib = root / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -march=native: one build per kind of CPU (hashlib, not hash(): str hashes are salted per process)
    machine = int(hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8], 16)
    flags = [
        "-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DWHISPER_FLASH_CPU={machine}", f"-DWHISPER_FLASH_TORCH={torch.__version__.split('+')[0].replace('.', '_')}",
        *[f"-I{p}" for p in includes],
    ]
    return flags, [f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"]


def load() -> bool:
    """Build (first time) and load the kernel; False (and a warning once) where that fails."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    from sglang_omni_flash.kernels.build import build_library

    try:
        source = resources.files("sglang_omni_flash").joinpath("kernels/row_attention.cpp").read_bytes()
        flags, libs = _flags()
        library = build_library(source, name="row-attention", soname="librow_attention.so", flags=flags, libs=libs,
                                cxx=True)
        torch.ops.load_library(str(library))
        _state["loaded"] = True
    except Exception as exc:  # no compiler, no headers, a torch without these ops: fall back
        print(f"whisper-flash: warning: the row-invariant attention kernel is unavailable ({exc}); using torch SDPA, "
              "whose last bits depend on the batch (speculative output then equals greedy unless an argmax "
              "sits on a rounding tie)", file=sys.stderr)
        _state["loaded"] = False
    return bool(_state["loaded"])


def available() -> bool:
    return load()


def row_attention(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, limit: torch.Tensor,
                  mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """q [n, H, T, hd], kt [n, H, hd, W], v [n, H, W, hd], limit [n, T] (keys j < limit visible),
    mask [n, T, W] or None -> [n, H, T, hd]. CPU float32 / bfloat16 through the kernel; anything
    else through SDPA."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and load():
        return torch.ops.whisper_flash.row_attention(q, kt, v, limit, mask, float(scale))
    k = kt.transpose(-1, -2)
    keys = torch.arange(k.shape[2], device=q.device)
    visible = keys[None, None, :] < limit[:, :, None]
    if mask is not None:
        visible = visible & mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale)
