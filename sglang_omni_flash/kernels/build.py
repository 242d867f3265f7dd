"""Compile a C/C++ source of this package into a shared library once, on the machine that runs it.

Used for the CPU libcuda stub (serving) and the row-invariant attention kernel. The library lands in
the build cache under a name keyed by the source, the flags and the compiler, so an edit or another
machine builds again and everything else reuses it; it is compiled to a temporary name and renamed
into place, so concurrent builders (the CLI and a server's stage workers) never see half a file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.paths import build_dir


def compiler(cxx: bool) -> str:
    names = (os.environ.get("CXX", "c++"), "g++") if cxx else (os.environ.get("CC", "cc"), "gcc")
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    pkg = "g++" if cxx else "gcc"
    raise UserError(f"no C{'++' if cxx else ''} compiler found; install one (Debian: apt-get install {pkg})")


def build_library(source: bytes, *, name: str, soname: str, flags: list[str], libs: list[str] = (),
                  cxx: bool = False, out_root: Path | None = None) -> Path:
    """Path of `soname` built from `source` with compiler `flags` and link `libs` (given after the
    source, as the linker needs them); built now unless cached."""
    cc = compiler(cxx)
    key = hashlib.sha256(source + "\0".join([cc, *flags, *libs]).encode()).hexdigest()[:12]
    out_dir = (out_root or build_dir()) / f"{name}-{key}"
    library = out_dir / soname
    if library.exists():
        return library
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / (f"{name}.cpp" if cxx else f"{name}.c")
    src.write_bytes(source)
    tmp = out_dir / f".{soname}.{os.getpid()}"
    result = subprocess.run([cc, "-shared", "-fPIC", *flags, "-o", str(tmp), str(src), *libs],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"building {name} failed:\n{result.stderr.strip()[-4000:]}")
    tmp.replace(library)
    return library
