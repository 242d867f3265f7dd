"""What this machine offers for inference, and the dtype `auto` picks from it.

One rule for every command (engine, teacher extraction, serving): on CUDA float16; on a CPU
bfloat16 when the CPU has bf16 matrix instructions (AMX-BF16 tiles or AVX512-BF16 dot products),
float32 otherwise. Read at run time from /proc/cpuinfo, so the same install picks per machine.

Why: the target's row-invariant kernels (kernels/row_linear.cpp) run bf16 on those instructions
at full speed. Measured, base, 2 threads, audio s/s greedy bf16 / fp32:
- an AMX Xeon: a target pass of 9 rows 11.7 ms bf16 vs 16.2 ms fp32, a 30 s encoder window
  0.095 s vs 0.325 s;
- a 2-core AMD EPYC with AVX512-BF16 and no AMX, 2026-12-07 (docs/engine.md): 24 librispeech-mini
  val windows 25.0 / 16.7 at batch 1 and 32.4 / 23.7 at batch 8; 8 long files through the
  engine's batch 8 42.7 / 29.8, WER 4.6% / 4.3%. (Before the row-invariant kernels bf16 decode steps
  were slower there and greedy came out level, so `auto` had stayed float32.)
Without either, bf16 matmuls are emulated: on an AVX2-only EPYC a bf16 encoder window takes 5.6 s
against 0.75 s in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "float16", "bfloat16")
# CPU flags (as /proc/cpuinfo spells them) that make bf16 the CPU's auto dtype
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# flags worth naming in a command's first line and in benchmark notes
REPORTED_FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags: from `cpuinfo` (the text of /proc/cpuinfo; tests fake it) or the file."""
    return _machine_flags() if cpuinfo is None else _parse_flags(cpuinfo)


@functools.cache
def _machine_flags() -> frozenset[str]:
    """This machine's flags, read once per process (they never change; the encoder asks per layer)."""
    try:
        return _parse_flags(Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace"))
    except OSError:
        return frozenset()


def _parse_flags(cpuinfo: str) -> frozenset[str]:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(flags: frozenset[str]) -> bool:
    """bf16 matrix instructions (AMX tiles or AVX512-BF16 dot products): bf16 is the CPU's auto dtype."""
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def fast_bf16_matmul(flags: frozenset[str]) -> bool:
    """bf16 dot-product instructions at least (AVX512-BF16 or AMX)."""
    return native_bf16(flags) or "avx512_bf16" in flags


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a command runs in, and why (for its first output line)."""

    name: str  # "float32", "float16" or "bfloat16"
    reason: str  # "auto: ...", or "asked for"

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def choose_dtype(requested: str, device_type: str, flags: frozenset[str] | None = None) -> DtypeChoice:
    """`requested` ("auto" or one of DTYPES) on `device_type` ("cpu", "cuda") -> the dtype to run in.

    ValueError for an unknown name (callers turn it into their own one-line error)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"unknown dtype {requested!r} (auto, {', '.join(DTYPES)})")
        return DtypeChoice(requested, "asked for")
    if device_type != "cpu":
        return DtypeChoice("float16", f"auto: {device_type}")
    flags = cpu_flags() if flags is None else flags
    if native_bf16(flags):
        have = "/".join(f for f in NATIVE_BF16_FLAGS if f in flags)
        return DtypeChoice("bfloat16", f"auto: CPU has {have}")
    return DtypeChoice("float32", "auto: no AMX-BF16 or AVX512-BF16 on this CPU")


def choose_device(requested: str) -> str:
    """"auto" -> "cuda" where torch sees a CUDA device, else "cpu"; "cpu" / "cuda" as asked
    (ValueError for CUDA that is not there, or an unknown name). The one device rule of every command."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested not in ("cpu", "cuda") and not requested.startswith("cuda:"):
        raise ValueError(f"unknown device {requested!r} (auto, cpu or cuda)")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {requested} requested, but no CUDA device is available")
    return requested


def cpu_summary(flags: frozenset[str] | None = None) -> str:
    """'cpu flags amx_bf16 avx512f ...' (the reported ones present) or 'cpu flags: none of ...'."""
    flags = cpu_flags() if flags is None else flags
    present = [f for f in REPORTED_FLAGS if f in flags]
    return "CPU " + (" ".join(present) if present else "without " + "/".join(REPORTED_FLAGS))
