"""GPU smoke test of drafter training: extract a few clips, train a few hundred steps, report throughput.

Runs on whatever audio it is given (a manifest, a LibriSpeech tree or a datasets folder) with whatever
target it is given (an embedded name such as base, or a transformers Whisper directory), on one CUDA
device (CPU works too, slowly). Nothing is downloaded. Prints one JSON line at the end:

    python benchmarks/train_smoke_gpu.py --model /models/whisper-large-v3 \
        --librispeech /data/LibriSpeech/dev-clean --limit 64 --steps 300 --out /tmp/wf-smoke

Figures: extraction clips/s, training steps/s and utterances/s, final training loss and the validation
acceptance (tau) of the last checkpoint on the held-out tail of the clips (last 10%).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="base")
    p.add_argument("--manifest", action="append", default=[])
    p.add_argument("--librispeech", action="append", default=[])
    p.add_argument("--dataset", action="append", default=[])
    p.add_argument("--limit", type=int, default=64, help="clips to extract (default 64)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("/tmp/whisper-flash-train-smoke"))
    args = p.parse_args(argv)

    import torch

    from sglang_omni_flash.training.extract import ExtractOptions, TeacherExtractor
    from sglang_omni_flash.training.sources import read_sources
    from sglang_omni_flash.training.train import Trainer, TrainOptions

    clips = read_sources(args.manifest, args.librispeech, args.dataset)[: args.limit]
    n_val = max(1, len(clips) // 10)
    train_clips, val_clips = clips[:-n_val], clips[-n_val:]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}, {len(train_clips)} training + {len(val_clips)} validation clips", file=sys.stderr)

    t0 = time.perf_counter()
    extractor = TeacherExtractor(ExtractOptions(model=args.model, batch_size=16 if device == "cuda" else 4))
    extractor.extract(train_clips, args.out / "teacher-train")
    extractor.extract(val_clips, args.out / "teacher-val")
    extract_s = time.perf_counter() - t0
    del extractor
    if device == "cuda":
        torch.cuda.empty_cache()

    options = TrainOptions(
        teacher=(str(args.out / "teacher-train"),), validation=(str(args.out / "teacher-val"),),
        out=str(args.out / "run"), model=args.model, steps=args.steps, batch_size=args.batch_size,
        eval_every=max(1, args.steps // 3), checkpoint_every=max(1, args.steps // 3), device=device,
        draft_vocab_top=0 if device == "cuda" else 16000, freeze_acoustic_kv=device != "cuda",
    )
    trainer = Trainer(options)
    if device == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    summary = trainer.run()
    if device == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t1
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "model": args.model,
        "clips": len(clips),
        "extract_s": round(extract_s, 1),
        "extract_clips_per_s": round(len(clips) / extract_s, 2),
        "train_s": round(train_s, 1),
        "steps_per_s": round(args.steps / train_s, 3),
        "utterances_per_s": round(args.steps * args.batch_size / train_s, 2),
        "best_val": {summary["select"]: summary["best_val"]},
        "last_val": {k: v for k, v in summary["last_val"].items() if k != "accept_by_position"},
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from sglang_omni_flash.errors import run_command

    sys.exit(run_command(main, "train_smoke_gpu.py"))
