"""`whisper-flash train` and `whisper-flash eval-drafter` (registered by training/cli.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_omni_flash.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    from sglang_omni_flash.training.train import SELECT, TrainOptions

    d = TrainOptions(teacher=(), out="")
    tr = subparsers.add_parser(
        "train", help="train a Whisper-Flash drafter on teacher extractions (resumable)",
        description="Packed-anchor training (paper eq. 3, AdamW, warm-up + cosine). Resumes from OUT/state. "
        "The best checkpoint by validation acceptance is OUT/best, a drafter directory. With --recipe: data, "
        "teacher extraction, training and evaluation from one file (configs/drafter-*.yaml), resumable.",
    )
    tr.add_argument("--recipe", metavar="FILE", help="run a whole recipe (the other options come from the file)")
    tr.add_argument("--work", metavar="DIR", help="with --recipe: where everything goes (default: the recipe's `work`)")
    tr.add_argument("--until", choices=("data", "extract", "train", "evaluate"), default="evaluate",
                    help="with --recipe: stop after this stage")
    tr.add_argument("--teacher", action="append", default=[], metavar="DIR", help="teacher folder (repeatable)")
    tr.add_argument("--validation", action="append", default=[], metavar="DIR",
                    help="teacher folder of held-out voices/speakers (repeatable)")
    tr.add_argument("--report", action="append", default=[], metavar="DIR",
                    help="teacher folder validated and logged, never used to select (repeatable)")
    tr.add_argument("--out", help="output folder")
    tr.add_argument("--model", default=d.model, help="the target the teacher data came from (default base)")
    tr.add_argument("--steps", type=int, default=d.steps)
    tr.add_argument("--batch-size", type=int, default=d.batch_size, help="utterances per update")
    tr.add_argument("--anchors", type=int, default=d.anchors, help="anchors per utterance (default 16)")
    tr.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default 6e-4)")
    tr.add_argument("--warmup", type=float, default=d.warmup, help="warm-up fraction (default 0.04)")
    tr.add_argument("--seed", type=int, default=d.seed)
    tr.add_argument("--eval-every", type=int, default=d.eval_every)
    tr.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    tr.add_argument("--no-audio", action="store_true", help="ablation: no acoustic memory")
    tr.add_argument("--no-history", action="store_true", help="ablation: no target history")
    tr.add_argument("--train-acoustic-kv", action="store_true",
                    help="also train the acoustic K/V projections (paper; slower on CPU)")
    tr.add_argument("--draft-vocab-top", type=int, default=d.draft_vocab_top,
                    help="draft vocabulary: ids below this + specials + training labels (0 = full vocabulary)")
    tr.add_argument("--onpolicy", type=float, default=d.onpolicy, metavar="SHARE",
                    help="share of anchors drawn from where the current drafter's greedy decoding starts its "
                    "rounds (right after a rejection); the rest evenly (default 0: all evenly)")
    tr.add_argument("--select", choices=SELECT, default=d.select,
                    help="validation figure that picks the best checkpoint: rollout_tau (greedy decoding "
                    "replayed on the held-out teacher tokens, default), tau (evenly spaced anchors) or "
                    "worst_gain (the smallest rollout-tau gain over the --init drafter across --validation "
                    "folders)")
    tr.add_argument("--merge", type=float, nargs="+", default=(), metavar="WEIGHT",
                    help="after training, interpolate the best checkpoint with the --init drafter at these "
                    "weights of the fine-tune and keep the one --select prefers in OUT/merged")
    tr.add_argument("--soft-weight", type=float, default=d.soft_weight, metavar="LAMBDA",
                    help="share of the loss that is cross-entropy against the target's own top-k distribution "
                    "(distillation; values good second choices for draft trees; default 0: hard labels only)")
    tr.add_argument("--init", default="", metavar="DRAFTER",
                    help="warm start from this drafter directory (same target and shape), e.g. the shipped one")
    tr.add_argument("--threads", type=int, default=None)
    tr.add_argument("--device", default="auto")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.set_defaults(func=_train)

    ev = subparsers.add_parser(
        "eval-drafter", help="acceptance of a drafter in real decoding: alpha, tau, first, by position/duration",
    )
    ev.add_argument("--model", default="base")
    ev.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    from sglang_omni_flash.training.cli import _add_sources

    _add_sources(ev)
    ev.add_argument("--batch-size", type=int, default=1)
    ev.add_argument("--threads", type=int, default=None)
    from sglang_omni_flash.engine.cli import add_dtype_arg

    add_dtype_arg(ev)
    ev.add_argument("--timestamps", action="store_true",
                    help="decode with timestamp tokens, as srt / vtt / verbose_json requests do")
    ev.add_argument("--json", metavar="OUT", help="write the full result (per clip too) here")
    ev.add_argument("--quiet", action="store_true")
    ev.set_defaults(func=_eval)


def _train(args) -> int:
    from sglang_omni_flash.training.train import Trainer, TrainOptions

    if args.recipe:
        from sglang_omni_flash.training.recipe import RecipeRun, load_recipe

        result = RecipeRun(load_recipe(args.recipe, args.work), progress=not args.quiet, threads=args.threads).run(args.until)
        print(json.dumps({k: result[k] for k in ("timings", "disk_bytes")} | {"evaluate": result.get("evaluate")}, indent=1))
        return 0
    if not args.teacher or not args.out:
        raise UserError("train needs --teacher and --out (or --recipe FILE)")
    for name in ("steps", "batch_size", "anchors", "eval_every", "checkpoint_every"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.lr <= 0 or not 0 <= args.warmup < 1:
        raise UserError("--lr must be > 0 and --warmup in [0, 1)")
    if not 0.0 <= args.onpolicy <= 1.0:
        raise UserError(f"--onpolicy must be between 0 and 1, got {args.onpolicy}")
    if args.no_audio and args.no_history:
        raise UserError("--no-audio and --no-history together leave the drafter nothing to read")
    for folder in [*args.teacher, *args.validation, *args.report]:
        if not (Path(folder) / "teacher.json").is_file():
            raise UserError(f"{folder} is not a teacher extraction (run `whisper-flash extract --out {folder}`)")
    options = TrainOptions(
        teacher=tuple(args.teacher), validation=tuple(args.validation), report=tuple(args.report), out=args.out,
        model=args.model,
        steps=args.steps, batch_size=args.batch_size, anchors=args.anchors, lr=args.lr, warmup=args.warmup,
        seed=args.seed, eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
        use_audio=not args.no_audio, use_history=not args.no_history,
        freeze_acoustic_kv=not args.train_acoustic_kv, draft_vocab_top=args.draft_vocab_top,
        onpolicy=args.onpolicy, select=args.select, merge=tuple(args.merge), soft_weight=args.soft_weight,
        init=str(Path(args.init).resolve()) if args.init else "", threads=args.threads, device=args.device,
    )
    summary = Trainer(options, progress=not args.quiet).run()
    print(json.dumps(summary, indent=1))
    return 0


def _eval(args) -> int:
    from tqdm import tqdm

    from sglang_omni_flash.engine.cli import engine_line
    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.engine.options import EngineOptions
    from sglang_omni_flash.flash.options import SpecOptions
    from sglang_omni_flash.training.cli import _clips
    from sglang_omni_flash.training.evaluate import evaluate_drafter, format_table

    clips = _clips(args)
    engine = WhisperFlashEngine(  # whole chains, every step a round: this measures the drafter, not the engine's cost controls
        EngineOptions(model=args.model, drafter=args.drafter, speculative=True, batch_size=args.batch_size,
                      threads=args.threads, dtype=args.dtype, timestamps=args.timestamps,
                      spec=SpecOptions(min_draft_prob=0.0, tree_nodes=0, pace=False, max_backoff=0))
    )
    print(f"eval-drafter: {engine_line(engine)}; drafter: {engine.drafter_source}", file=sys.stderr)
    with tqdm(total=len(clips), desc="eval", unit="clip", file=sys.stderr, disable=args.quiet) as bar:
        result = evaluate_drafter(engine, clips, progress=bar.update)
    result["drafter"] = engine.drafter_source
    result["dtype"] = engine.dtype_choice.name
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    name = ",".join(Path(m).parent.name for m in args.manifest) or "clips"
    print(format_table(name, result))
    return 0
