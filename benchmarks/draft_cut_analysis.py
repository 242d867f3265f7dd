"""Tokens per round vs rows verified when draft blocks are cut by the drafter's confidence.

Teacher-forced, on held-out teacher data (`whisper-flash extract` output): for every sampled
anchor block the drafter's greedy candidates, their probabilities and the teacher's tokens give
the accepted prefix with whole blocks and with the cut of `flash.accept.confident_length`
(at least one candidate, as the engine does). This is how the engine's CPU default
`min_draft_prob` was chosen (docs/engine.md).

    .venv/bin/python benchmarks/draft_cut_analysis.py --drafter sglang_omni_flash/drafters/base \\
        --teacher ~/.cache/sglang-omni-flash/teacher/val-heldout
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from sglang_omni_flash.flash.accept import confident_length
from sglang_omni_flash.flash.checkpoint import load_drafter
from sglang_omni_flash.training import packing
from sglang_omni_flash.training.train import Trainer, TrainOptions, _to


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="drafter directory")
    parser.add_argument("--teacher", required=True, help="held-out teacher folder")
    parser.add_argument("--model", default="base")
    parser.add_argument("--anchors", type=int, default=24, help="anchors per utterance (as validation)")
    parser.add_argument("--thresholds", default="0,0.05,0.1,0.2,0.3,0.4,0.5,0.6,0.7")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as out:
        # the trainer's loading and packing (its own fresh drafter is replaced below)
        trainer = Trainer(TrainOptions(teacher=(args.teacher,), validation=(args.teacher,), out=out,
                                       model=args.model), progress=False)
    # the drafter as it is shipped: its own draft vocabulary (a teacher token outside it is a miss)
    trainer.drafter = load_drafter(args.drafter, trainer.target, device=trainer.device, dtype=torch.float32)
    trainer.index = packing.vocab_index(getattr(trainer.drafter, "draft_vocab", None), trainer.drafter.config.vocab_size)
    g = torch.Generator().manual_seed(12345)  # the anchors of training's validation
    confidence, hits = [], []
    with torch.no_grad():
        for start in range(0, len(trainer.val), 4):
            part = trainer.val[start: start + 4]
            anchors = [packing.sample_anchors(u.prompt_len, u.tokens.numel(), args.anchors, g) for u in part]
            batch = _to(packing.pack(part, anchors, trainer.options.block_size, True), trainer.device)
            _, _, logits, labels = packing.packed_loss(trainer.drafter, batch, trainer._acoustic(part),
                                                       trainer.weights, trainer.index)
            conf, guess = logits.float().softmax(-1).max(-1)
            confidence.append(conf)
            hits.append((guess == labels) & (labels >= 0))
    conf, hit = torch.cat(confidence), torch.cat(hits)
    accepted = hit.long().cumprod(-1).sum(-1)
    print(f"{conf.shape[0]} blocks\n")
    print("| min_draft_prob | tokens per round (tau) | candidates per round | rows verified |")
    print("|---:|---:|---:|---:|")
    for threshold in (float(t) for t in args.thresholds.split(",")):
        k = confident_length(conf, threshold, minimum=1)
        tau = float(torch.minimum(accepted, k).float().mean() + 1)
        print(f"| {threshold:g} | {tau:.3f} | {float(k.float().mean()):.2f} | {float(k.float().mean() + 1):.2f} |")


if __name__ == "__main__":
    from sglang_omni_flash.errors import run_command

    raise SystemExit(run_command(main, "draft_cut_analysis.py"))
