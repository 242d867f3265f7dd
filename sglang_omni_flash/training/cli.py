"""`whisper-flash extract`, `whisper-flash train`, `whisper-flash eval-drafter`: the drafter's life cycle."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_omni_flash.errors import UserError


def _add_sources(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--manifest", action="append", default=[], metavar="FILE", help="JSONL manifest (repeatable)")
    p.add_argument("--librispeech", action="append", default=[], metavar="DIR", help="LibriSpeech tree (repeatable)")
    p.add_argument("--dataset", action="append", default=[], metavar="DIR",
                   help="local datasets folder from save_to_disk (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N clips")


def _clips(args):
    from sglang_omni_flash.training.sources import read_sources

    clips = read_sources(args.manifest, args.librispeech, args.dataset)
    if args.limit is not None:
        if args.limit < 1:
            raise UserError("--limit must be at least 1")
        clips = clips[: args.limit]
    return clips


def register(subparsers: argparse._SubParsersAction) -> None:
    ex = subparsers.add_parser(
        "extract", help="teacher extraction: the target's greedy transcripts + history states, sharded on disk",
        description="Run the frozen target over audio: its greedy continuation (engine prompt and rules), the "
        "history-layer states along it from one teacher-forced pass, and the encoder output. Resumable.",
    )
    ex.add_argument("--model", default="base", help="base, tiny.en or a transformers Whisper directory")
    _add_sources(ex)
    ex.add_argument("--out", type=Path, required=True, help="output folder (resumes what is there)")
    ex.add_argument("--shard-size", type=int, default=64, help="clips per shard (default 64)")
    ex.add_argument("--batch-size", type=int, default=8, help="clips decoded together (default 8)")
    ex.add_argument("--language", default=None, help="language code (default: detect, as the engine)")
    ex.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    from sglang_omni_flash.engine.cli import add_dtype_arg

    add_dtype_arg(ex)
    ex.add_argument("--store-encoder", action="store_true",
                    help="also store each clip's encoder output (1500 x d fp16; needed only for clips without an "
                    "audio file, such as a datasets folder; otherwise training recomputes it)")
    ex.add_argument("--timestamps", action="store_true",
                    help="decode with Whisper's timestamp tokens (the continuations of srt / vtt / verbose_json requests)")
    ex.add_argument("--quiet", action="store_true", help="no progress bar")
    ex.set_defaults(func=_extract)

    from sglang_omni_flash.training import train_cli

    train_cli.register(subparsers)


def _extract(args) -> int:
    from sglang_omni_flash.training.extract import ExtractOptions, TeacherExtractor

    if args.shard_size < 1 or args.batch_size < 1:
        raise UserError("--shard-size and --batch-size must be at least 1")
    clips = _clips(args)
    extractor = TeacherExtractor(
        ExtractOptions(model=args.model, shard_size=args.shard_size, batch_size=args.batch_size,
                       language=args.language, threads=args.threads, dtype=args.dtype,
                       store_encoder=args.store_encoder, timestamps=args.timestamps)
    )
    from sglang_omni_flash.engine.cli import engine_line

    print(f"extract: {engine_line(extractor.engine)}; model {extractor.engine.model_dir}", file=sys.stderr)
    index = extractor.extract(clips, args.out, progress=not args.quiet)
    print(json.dumps(index["totals"]), file=sys.stderr)
    print(args.out)
    return 0
