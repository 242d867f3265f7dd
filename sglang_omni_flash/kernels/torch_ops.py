"""Load this package's C++ torch operators (namespace `torch.ops.whisper_flash`), built on first use.

Each source is compiled for the machine that runs it (`-march=native`: one build per kind of CPU,
cached in the build directory by `build.build_library`; `WHISPER_FLASH_MARCH=haswell` and the like
build for an older CPU class instead, to run its kernel paths here) against the installed torch's headers and
libraries. Where a source cannot be built or loaded, `load` says so once on stderr and returns
False; each kernel module then names its own fallback.
"""

from __future__ import annotations

import hashlib
import os
import sys
from importlib import resources
from pathlib import Path

import torch

_loaded: dict[str, bool] = {}


def _flags() -> tuple[list[str], list[str]]:
    from sglang_omni_flash.hardware import cpu_flags

    # torch's own headers and libraries (what torch.utils.cpp_extension would name; importing it
    # prints a CUDA_HOME warning on machines without CUDA)
    root = Path(torch.__file__).resolve().parent
    includes = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]
    lib = root / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -march=native: one build per kind of CPU (hashlib, not hash(): str hashes are salted per process)
    machine = int(hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8], 16)
    # WHISPER_FLASH_MARCH builds for another CPU class than this one (haswell, x86-64, ...): how the
    # tests and benchmarks run the AVX2 and scalar paths on an AMX machine; a server leaves it unset
    march = os.environ.get("WHISPER_FLASH_MARCH", "native")
    flags = [
        "-O3", f"-march={march}", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp", "-std=c++20",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DWHISPER_FLASH_CPU={machine}",
        f"-DWHISPER_FLASH_TORCH={torch.__version__.split('+')[0].replace('.', '_')}",
        *[f"-I{p}" for p in includes],
    ]
    return flags, [f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"]


def load(source: str, what: str) -> bool:
    """Build (first time) and load kernels/`source` (a .cpp file); False (with one warning naming
    `what` falls back) where that fails."""
    if source in _loaded:
        return _loaded[source]
    from sglang_omni_flash.kernels.build import build_library

    name = source.removesuffix(".cpp").replace("_", "-")
    try:
        code = resources.files("sglang_omni_flash").joinpath(f"kernels/{source}").read_bytes()
        flags, libs = _flags()
        library = build_library(code, name=name, soname=f"lib{source.removesuffix('.cpp')}.so", flags=flags,
                                libs=libs, cxx=True)
        torch.ops.load_library(str(library))
        _loaded[source] = True
    except Exception as exc:  # no compiler, no headers, a torch without these ops: the caller falls back
        print(f"whisper-flash: warning: the {name} kernel is unavailable ({exc}); {what}", file=sys.stderr)
        _loaded[source] = False
    return _loaded[source]
