"""`whisper-flash transcribe` and `whisper-flash bench`: the standalone engine from the command line.

stdout carries results (text, JSON, the bench table); progress and notes go to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from sglang_omni_flash.engine.options import EngineOptions
from sglang_omni_flash.errors import UserError
from sglang_omni_flash.flash.options import (
    BF16_CPU_NO_AMX_TREE_NODES, BF16_CPU_TREE_MIN_PROB, BF16_CPU_TREE_NODES, CPU_MIN_DRAFT_PROB, CPU_TREE_MIN_PROB,
    CPU_TREE_NODES, SpecOptions,
)
from sglang_omni_flash.hardware import DTYPES


def register(subparsers: argparse._SubParsersAction) -> None:
    tr = subparsers.add_parser(
        "transcribe",
        help="transcribe audio files with Whisper-Flash (or plain greedy)",
        description="Transcribe audio files (up to 30 s each) with Whisper-Flash speculative decoding; the "
        "greedy output is token-identical to plain greedy decoding.",
    )
    tr.add_argument("audio", nargs="+", metavar="AUDIO", help="audio files (any format soundfile reads)")
    _add_engine_args(tr)
    tr.add_argument("--greedy", action="store_true", help="plain decoding, one token per target call (no drafter)")
    tr.add_argument("--batch-size", type=int, default=1, help="requests decoded together (default 1)")
    tr.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 = sampling")
    tr.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    tr.add_argument("--fallback", action=argparse.BooleanOptionalAction, default=True,
                    help="at temperature 0, decode a window again at 0.2 .. 1.0 while it is too repetitive or too "
                    "unsure, and give silence empty text, as openai-whisper (default on)")
    tr.add_argument("--timestamps", action="store_true", help="emit Whisper timestamp tokens")
    tr.add_argument("--language", default=None, help="language code for multilingual models (default: detect)")
    tr.add_argument("--task", default="transcribe", choices=("transcribe", "translate"))
    tr.add_argument("--max-new-tokens", type=int, default=None, help="token budget per file, EOS included")
    tr.add_argument("--json", action="store_true", help="print one JSON object with tokens and statistics")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.set_defaults(func=_transcribe)

    bench = subparsers.add_parser(
        "bench",
        help="time greedy decoding and Whisper-Flash side by side",
        description="Decode the same audio with plain greedy decoding and with Whisper-Flash in one process "
        "(warm-up, then repeats in alternating order; median time), from log-mel to the last token, per batch size.",
    )
    _add_engine_args(bench)
    src = bench.add_mutually_exclusive_group(required=True)
    src.add_argument("--audio", nargs="+", metavar="FILE", help="audio files")
    src.add_argument("--manifest", metavar="FILE", help="a JSONL manifest (fields id, audio, duration, ...)")
    bench.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated batch sizes (default 1,2,4,8)")
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats per engine (default 3)")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 = sampling")
    bench.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    bench.add_argument("--limit", type=int, default=None, help="use only the first N clips")
    bench.add_argument("--json", required=True, metavar="OUT", help="write the results here")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(func=_bench)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="base", help="base, tiny.en or a transformers Whisper directory (default base)")
    p.add_argument("--drafter", default=None, metavar="DIR", help="drafter checkpoint (default: shipped, else untrained)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: run eagerly")
    p.add_argument("--min-draft-prob", type=float, default=None, metavar="P",
                   help="propose candidates only while the drafter's probability of its token is >= P "
                        f"(at least one per round; cost only, never output). Default: {CPU_MIN_DRAFT_PROB} on an fp32 CPU, "
                        "0 in bf16 and on CUDA")
    p.add_argument("--tree-nodes", type=int, default=None, metavar="N",
                   help="greedy rounds without timestamps verify a draft tree of up to N nodes (the drafter's "
                        "likeliest continuations, sharing prefixes) instead of one chain; same output, more "
                        f"tokens per target call. 0 = the paper's chain. Default: {BF16_CPU_TREE_NODES} on a bf16 CPU "
                        f"with AMX, {BF16_CPU_NO_AMX_TREE_NODES} on other CPUs, 0 on CUDA")
    p.add_argument("--tree-min-prob", type=float, default=None, metavar="P",
                   help="leave out tree nodes whose path probability under the drafter is below P "
                        f"(at least one node). Default: {CPU_TREE_MIN_PROB} on an fp32 CPU, {BF16_CPU_TREE_MIN_PROB} in bf16")
    p.add_argument("--drafter-int8", action=argparse.BooleanOptionalAction, default=None,
                   help="run the drafter on int8 weights (CPU; cost and proposals only, never output). "
                        "Default: on for an fp32 CPU")


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="weights and activations: auto (default) = float16 on CUDA; on a CPU bfloat16 where it "
                        "has AMX-BF16 or AVX512-BF16, else float32")


def engine_line(engine) -> str:
    """What every engine command says first: device, dtype and why, the CPU's features."""
    from sglang_omni_flash.hardware import cpu_summary

    where = f"{engine.device.type} {engine.dtype_choice.describe()}"
    if engine.device.type == "cpu":
        where += f", {cpu_summary()}"
    return where


def _options(args, **extra) -> EngineOptions:
    if getattr(args, "temperature", 0.0) < 0:
        raise UserError(f"temperature must be >= 0, got {args.temperature}")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    try:
        spec = SpecOptions(min_draft_prob=args.min_draft_prob, tree_nodes=args.tree_nodes,
                           tree_min_prob=args.tree_min_prob, drafter_int8=args.drafter_int8)
    except ValueError as exc:  # SpecOptions names its fields: --tree-nodes is tree_nodes
        raise UserError(f"bad speculation option: {exc}") from None
    return EngineOptions(
        spec=spec,
        model=args.model,
        drafter=args.drafter,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        cuda_graphs=not args.no_cuda_graphs,
        temperature=args.temperature,
        seed=args.seed,
        **extra,
    )


def _quiet_transformers() -> None:
    """No weight-loading bars or generation notes from transformers on our stderr."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _progress(total: int, quiet: bool, desc: str):
    if quiet:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="clip", file=sys.stderr, leave=False)


# ---------------------------------------------------------------------------------- transcribe


def _transcribe(args) -> int:
    from sglang_omni_flash.engine.audio import load_audio
    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.flash.fallback import LADDER

    if args.batch_size < 1:
        raise UserError(f"batch size must be at least 1, got {args.batch_size}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    waves = [load_audio(path) for path in args.audio]  # bad files fail before the model loads
    _quiet_transformers()
    options = _options(
        args,
        speculative=not args.greedy,
        batch_size=args.batch_size,
        timestamps=args.timestamps,
        language=args.language,
        task=args.task,
        max_new_tokens=args.max_new_tokens,
        temperature_fallback=LADDER if args.fallback else (),
    )
    engine = WhisperFlashEngine(options)
    mode = "greedy" if args.greedy else "whisper-flash"
    print(f"whisper-flash: {engine_line(engine)}; model {engine.model_dir}; mode {mode}; "
          f"drafter: {engine.drafter_source}", file=sys.stderr)
    for path, wave in zip(args.audio, waves):
        if len(wave) > 30 * 16000:
            print(f"whisper-flash: note: {path} is longer than 30 s; only its first 30 s are transcribed", file=sys.stderr)
    bar = _progress(len(waves), args.quiet, "transcribe")
    results = engine.decode(engine.log_mel(waves), progress=bar.update if bar else None)
    if bar:
        bar.close()

    if args.json:
        out = {
            "model": str(engine.model_dir),
            "mode": mode,
            "drafter": engine.drafter_source,
            "device": str(engine.device),
            "dtype": engine.dtype_choice.name,
            "results": [
                {
                    "audio": str(path),
                    "text": r.text,
                    "language": r.language,
                    "tokens": r.tokens,
                    "prompt": r.prompt,
                    "proposed": r.proposed,
                    "accepted": r.accepted,
                    "target_calls": r.target_calls,
                    "avg_logprob": round(r.avg_logprob, 4),
                    "no_speech_prob": None if r.no_speech_prob is None else round(r.no_speech_prob, 4),
                    "compression_ratio": None if r.compression_ratio is None else round(r.compression_ratio, 3),
                    "temperature": r.temperature,
                }
                for path, r in zip(args.audio, results)
            ],
        }
        print(json.dumps(out, ensure_ascii=False, indent=1))
    else:
        for path, r in zip(args.audio, results):
            print(r.text if len(args.audio) == 1 else f"{path}: {r.text}")
    return 0


# --------------------------------------------------------------------------------------- bench


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise UserError(f"batch sizes must be at least 1, got {text!r}")
    return sizes


def _bench(args) -> int:
    import torch

    from sglang_omni_flash.engine.audio import load_audio
    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.hardware import cpu_summary

    sizes = _batch_sizes(args.batch_sizes)
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    if args.manifest:
        from sglang_omni_flash.corpus.manifest import read_manifest

        clips = [str(u.audio) for u in read_manifest(Path(args.manifest))]
    else:
        clips = list(args.audio)
    if args.limit is not None:
        clips = clips[: max(1, args.limit)]
    if not clips:
        raise UserError("no audio to benchmark")
    waves = [load_audio(c) for c in clips]
    _quiet_transformers()
    audio_s = sum(min(len(w) / 16000.0, 30.0) for w in waves)
    out_path = Path(args.json)

    engine = WhisperFlashEngine(_options(args, speculative=True, batch_size=sizes[0]))
    print(f"whisper-flash bench: {engine_line(engine)}; model {engine.model_dir}; drafter: {engine.drafter_source}; "
          f"min draft prob {engine.spec.min_draft_prob:g}; draft tree {engine.spec.tree_nodes} nodes >= "
          f"{engine.spec.tree_min_prob:g}; "
          f"int8 drafter {bool(engine.drafter is not None and engine.drafter.int8_inference)}", file=sys.stderr)
    features = engine.log_mel(waves)  # not timed: the timed path starts at the log-mel
    report = {
        "model": str(engine.model_dir),
        "drafter": engine.drafter_source,
        "min_draft_prob": engine.spec.min_draft_prob,
        "tree_nodes": engine.spec.tree_nodes,
        "tree_min_prob": engine.spec.tree_min_prob,
        "drafter_int8": bool(engine.drafter is not None and engine.drafter.int8_inference),
        "device": str(engine.device),
        "dtype": engine.dtype_choice.describe(),
        "cpu": cpu_summary(),
        "torch_threads": torch.get_num_threads(),
        "temperature": args.temperature,
        "clips": len(clips),
        "audio_s": round(audio_s, 3),
        "repeats": args.repeats,
        "results": [],
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for b in sizes:
        engine.resize(b)
        row = _bench_batch(engine, features, audio_s, args.repeats, args.quiet)
        report["results"].append(row)
        out_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")  # partial results survive
        print(
            f"batch {b}: speedup {row['speedup']:.2f}, identical {row['identical']}/{row['total']}",
            file=sys.stderr,
        )
    print(format_table(report))
    print(f"wrote {out_path}", file=sys.stderr)
    return 0


def _bench_batch(engine, features, audio_s: float, repeats: int, quiet: bool) -> dict:
    b = engine.options.batch_size
    # warm-up: one batch through each engine
    engine.decode(features[:b], speculative=False)
    engine.decode(features[:b], speculative=True)
    runs = {False: [], True: []}
    outputs = {False: [], True: []}
    bar = _progress(2 * repeats * features.shape[0], quiet, f"bench b={b}")
    for r in range(repeats):
        for spec in ((False, True) if r % 2 == 0 else (True, False)):
            results = engine.decode(features, speculative=spec, progress=bar.update if bar else None)
            runs[spec].append((engine.timing.total_s, engine.timing.encoder_s))
            outputs[spec].append(results)
    if bar:
        bar.close()

    def summary(spec: bool) -> dict:
        total = statistics.median(t for t, _ in runs[spec])
        encoder = statistics.median(e for _, e in runs[spec])
        results = outputs[spec][0]
        tokens = sum(len(x.tokens) for x in results)
        d = {
            "audio_s_per_s": round(audio_s / total, 3),
            "tok_per_s": round(tokens / total, 2),
            "time_s": round(total, 3),
            "encoder_s": round(encoder, 3),
            "encoder_share": round(encoder / total, 4),
            "tokens": tokens,
        }
        if spec:
            proposed = sum(x.proposed for x in results)
            accepted = sum(x.accepted for x in results)
            calls = sum(x.target_calls for x in results)
            rounds = sum(x.rounds for x in results)
            d["alpha"] = round(accepted / proposed, 4) if proposed else 0.0
            d["tau"] = round(tokens / calls, 3) if calls else 0.0
            d["first_accept"] = round(sum(x.first_accepts for x in results) / rounds, 4) if rounds else 0.0
            d["target_calls"] = calls
        return d

    greedy, flash = summary(False), summary(True)
    identical = sum(
        all(f[i].tokens == g[i].tokens for g in outputs[False] for f in outputs[True]) for i in range(features.shape[0])
    )
    return {
        "batch_size": b,
        "greedy": greedy,
        "flash": flash,
        "speedup": round(flash["audio_s_per_s"] / greedy["audio_s_per_s"], 3),
        "identical": identical,
        "total": features.shape[0],
    }


def format_table(report: dict) -> str:
    head = (
        f"model {report['model']} | drafter {report['drafter']} | {report['device']} "
        f"{report.get('dtype', '')}, {report.get('cpu', '')}, "
        f"{report['torch_threads']} threads | {report['clips']} clips, {report['audio_s']:.1f} s audio\n"
    )
    cols = ("batch", "greedy tok/s", "greedy audio s/s", "flash tok/s", "flash audio s/s", "speedup",
            "alpha", "tau", "first", "enc% greedy", "enc% flash", "identical")
    rows = [cols]
    for r in report["results"]:
        g, f = r["greedy"], r["flash"]
        rows.append((
            str(r["batch_size"]), f"{g['tok_per_s']:.1f}", f"{g['audio_s_per_s']:.2f}", f"{f['tok_per_s']:.1f}",
            f"{f['audio_s_per_s']:.2f}", f"{r['speedup']:.2f}", f"{f['alpha']:.3f}", f"{f['tau']:.2f}",
            f"{f['first_accept']:.3f}", f"{100 * g['encoder_share']:.1f}", f"{100 * f['encoder_share']:.1f}",
            f"{r['identical']}/{r['total']}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return head + "\n".join(lines)
