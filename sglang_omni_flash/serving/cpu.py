"""What SGLang-Omni 0.1.9 needs to serve Whisper on a machine without a GPU.

Every workaround for sglang / sglang-omni on CPU lives here and in configs/cpu.yaml
(docs/cpu-serving.md explains each one):

* ``SGLANG_USE_CPU_ENGINE=1`` selects sglang's CPU engine (torch-native attention).
* That engine imports ``sgl_kernel`` at import time; the PyPI sgl-kernel is a CUDA build
  linked against ``libcuda.so.1``, so a stub driver library built from this package's own
  C source (``csrc/libcuda_stub.c``) is put on ``LD_LIBRARY_PATH``.
* Stage overrides (configs/cpu.yaml): no torch compile (the CPU graph runner needs AMX),
  no async decode (pinned host memory needs CUDA), a bounded KV pool, float32.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from sglang_omni_flash.kernels.build import build_library

STUB_SONAME = "libcuda.so.1"


def _stub_source() -> bytes:
    return resources.files("sglang_omni_flash").joinpath("csrc/libcuda_stub.c").read_bytes()


def ensure_libcuda_stub(out_root: Path | None = None) -> Path:
    """Compile the libcuda stub once (keyed by its source hash) and return its directory."""
    library = build_library(_stub_source(), name="libcuda-stub", soname=STUB_SONAME,
                            flags=["-O2", f"-Wl,-soname,{STUB_SONAME}"], out_root=out_root)
    return library.parent


def cpu_environment(base: dict[str, str] | None = None, *, threads: int | None = None) -> dict[str, str]:
    """The environment a CPU sgl-omni process needs: CPU engine switch and the libcuda stub."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    stub_dir = str(ensure_libcuda_stub())
    current = env.get("LD_LIBRARY_PATH", "")
    if stub_dir not in current.split(os.pathsep):
        env["LD_LIBRARY_PATH"] = stub_dir + (os.pathsep + current if current else "")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env
