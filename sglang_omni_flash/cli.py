"""`whisper-flash` command line: one sub-command per concern, each registered by its module."""

from __future__ import annotations

import argparse
import importlib
import sys

from sglang_omni_flash.errors import run_command

# module path -> each module exposes `register(subparsers)`; a sub-command's handler is
# stored as `func` and returns a process exit code.
_COMMAND_MODULES = (
    "sglang_omni_flash.models.cli",
    "sglang_omni_flash.corpus.cli",
    "sglang_omni_flash.engine.cli",
    "sglang_omni_flash.serving.cli",
    "sglang_omni_flash.training.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="whisper-flash",
        description="Whisper-Flash speculative decoding for Whisper (standalone and SGLang-Omni).",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a module not written yet must not break the others
            if exc.name and exc.name.startswith("sglang_omni_flash"):
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_command(lambda: args.func(args), f"whisper-flash {args.command}")


if __name__ == "__main__":
    sys.exit(main())
