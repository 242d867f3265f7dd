"""Does a trained drafter use the audio, and the target's history? A diagnostic beside the ablations.

The paper's ablation (Table 3, `whisper-flash train --no-audio / --no-history`) trains a drafter
without one input. This probe asks the cheaper, different question of a drafter already trained
with both: how much of its held-out acceptance goes away when one input is made uninformative at
validation time, the other input and every weight unchanged.

    as extracted       the validation of `whisper-flash train` (teacher-forced accepted prefix)
    other audio        each utterance's encoder output replaced by the next utterance's (real
                       speech, other words: the acoustic memory no longer matches the text)
    no history         the target's history states set to zero (the projection sees only its bias)

    python benchmarks/drafter_input_probe.py --drafter sglang_omni_flash/drafters/base \
        --teacher teacher/val-heldout [--json out.json]

Every figure is deterministic (fixed anchors), so load on the machine changes only the wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="drafter directory")
    ap.add_argument("--teacher", required=True, help="held-out teacher folder (`whisper-flash extract`)")
    ap.add_argument("--model", default="base")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the three results here")
    args = ap.parse_args(argv)

    from sglang_omni_flash.flash.checkpoint import load_drafter
    from sglang_omni_flash.training import packing
    from sglang_omni_flash.training.train import Trainer, TrainOptions

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out:
        # the held-out folder doubles as "training data" only so the Trainer can be built; no update runs
        options = TrainOptions(teacher=(args.teacher,), validation=(args.teacher,), out=out, model=args.model,
                               init=args.drafter, steps=0)
        trainer = Trainer(options, progress=False)
        # the drafter exactly as shipped: its own draft vocabulary, not one widened by the held-out labels
        trainer.drafter = load_drafter(args.drafter, trainer.target, dtype=torch.float32)
        trainer.index = packing.vocab_index(trainer.drafter.draft_vocab, trainer.drafter.config.vocab_size)
        val = trainer.val
        if len(val) < 2:
            print("need at least two held-out utterances", file=sys.stderr)
            return 2
        other_audio = [dataclasses.replace(u, encoder=val[(i + 1) % len(val)].encoder) for i, u in enumerate(val)]
        no_history = [dataclasses.replace(u, history=torch.zeros_like(u.history)) for u in val]
        with torch.no_grad():
            results = {name: trainer.validate(utts) for name, utts in
                       (("as extracted", val), ("other audio", other_audio), ("no history", no_history))}

    print(f"{'input':<14} {'tau':>6} {'first':>6} {'loss':>6}")
    for name, r in results.items():
        print(f"{name:<14} {r['tau']:6.3f} {r['first']:6.3f} {r['loss']:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"drafter": args.drafter, "teacher": args.teacher, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    from sglang_omni_flash.errors import run_command

    raise SystemExit(run_command(main, "drafter_input_probe.py"))
