"""What one Whisper-Flash round costs on this machine, by part, per dtype and batch size.

    .venv/bin/python benchmarks/round_costs.py [--model base] [--dtypes float32,bfloat16] [--batches 1,8]

Per dtype and batch size B (2 threads, median of repeats, nothing else should run):
  verify by rows   one target pass of B requests x R rows (R = 1 is a plain greedy step), K/V written
  drafter          one drafter call for B anchors (int8 weights on and off where the dtype allows)
  history          the drafter's history K/V for B x 9 new positions
  real decoding    the pacer's averages over the first clips of the test set: a round and a plain
                   step as the engine runs them (host work, rules, accept, tree build included)
These are the figures the per-dtype defaults in engine/options.py come from (docs/engine.md).
Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def median_ms(fn, repeats: int = 15) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 3)


def measure(model: str, dtype: str, batch: int, clips) -> dict:
    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.engine.options import EngineOptions
    from sglang_omni_flash.engine.speculative import RoundInputs

    engine = WhisperFlashEngine(EngineOptions(model=model, dtype=dtype, batch_size=batch))
    features = engine.features([c.audio for c in clips[:batch]])
    out = {"dtype": dtype, "batch": batch, "row_invariant": engine.target.row_invariant, "verify_ms": {}}
    with torch.inference_mode():
        encoded = engine.target.encode(features)
        if encoded.shape[0] < batch:
            encoded = encoded.repeat(batch, 1, 1)[:batch]
        be, proposer = engine.backend, engine.proposer
        be.start(encoded)
        proposer.start(encoded)
        length = 40  # a transcript about a third of the way into a 5 s clip
        for rows in (1, 2, 4, 9, 16, 33):
            tokens = torch.zeros(batch, rows, dtype=torch.long)
            positions = (length + torch.arange(rows))[None].expand(batch, rows)
            out["verify_ms"][rows] = median_ms(lambda: be.verify(tokens, positions, length + rows, want_history=True))
        inputs = RoundInputs(torch.full((batch,), 50), torch.full((batch,), length), length + 1, 8,
                             list(range(batch)), [[1]] * batch)
        for int8 in (False, True):
            engine.drafter.set_cpu_int8(int8)
            out[f"drafter_ms{'_int8' if int8 else ''}"] = median_ms(lambda: proposer.propose(inputs))
        engine.drafter.set_cpu_int8(engine.spec.drafter_int8)
        states = torch.randn(batch, 9, len(engine.drafter.config.history_layers), engine.target.d_model,
                             dtype=engine.dtype)
        out["history_ms"] = median_ms(lambda: (  # keep 9 positions' states, then project them
            proposer.observe(states, (length + torch.arange(9))[None].expand(batch, 9)), proposer._catch_up()))
    engine.decode(features, speculative=True)
    pacer = engine.pacer
    out["real_round_ms"] = {n: round(1000 * s, 3) for n, s in sorted(pacer.round_s.items())}
    out["real_step_ms"] = {n: round(1000 * s, 3) for n, s in sorted(pacer.step_s.items())}
    out["tokens_per_request_per_round"] = round(pacer.gain, 3) if pacer.gain else None
    return out


def main() -> int:
    from sglang_omni_flash.corpus.manifest import read_manifest
    from sglang_omni_flash.corpus.synth import build_test_set
    from sglang_omni_flash.engine.cli import _quiet_transformers
    from sglang_omni_flash.hardware import cpu_summary
    from sglang_omni_flash.paths import audio_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="base")
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--batches", default="1,8")
    args = p.parse_args()
    torch.set_num_threads(2)
    _quiet_transformers()
    clips = read_manifest(build_test_set(audio_dir(), progress=False).combined)
    report = {"cpu": cpu_summary(), "model": args.model, "threads": 2, "runs": []}
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            print(f"round_costs: {dtype}, batch {batch}", file=sys.stderr)
            report["runs"].append(measure(args.model, dtype, batch, clips[:16]))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    from sglang_omni_flash.errors import run_command

    sys.exit(run_command(main, "round_costs.py"))
