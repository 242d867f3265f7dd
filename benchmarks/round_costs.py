"""What one Whisper-Flash round costs on this machine, by part, per dtype and batch size.

    .venv/bin/python benchmarks/round_costs.py [--model base] [--dtypes float32,bfloat16] [--batches 1,8]

Per dtype and batch size B (2 threads, median of repeats, nothing else should run):
  verify by rows   one target pass of B requests x R rows (R = 1 is a plain greedy step), K/V written
  drafter          one drafter call for B anchors (int8 weights on and off where the dtype allows)
  history          the drafter's history K/V for B x 9 new positions
  real decoding    the pacer's averages over the first clips of the test set: a round and a plain
                   step as the engine runs them (host work, rules, accept, tree build included)
These are the figures the per-dtype defaults in engine/options.py come from (docs/engine.md).
With --breakdown, where a real round's and a real plain step's time goes instead, from torch.profiler
over a decode of the clips (the loop's record_function labels; rounds forced, the pacer off):
  round  draft (history projection, drafter body, draft-vocabulary head, scatter to the full
         vocabulary), plan (logit rules, chain / tree), verify (row-invariant linears, attention,
         the tied head, the rest), settle (the accept rule), commit (K/V moves, history, bookkeeping),
         and the loop's own Python around them
  step   verify (the same parts), commit, pick (rules, argmax, scores), Python
ms per round / step under the profiler (which adds a few percent), beside the unprofiled wall times.
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


# profiler events counted as one part wherever they run (not looked into further)
PARTS = ("drafter.history", "drafter.head", "drafter.scatter", "target.head", "whisper_flash::row_linear",
         "whisper_flash::row_attention")


def _parts_below(event, out: dict) -> None:
    for child in event.cpu_children:
        if child.name in PARTS:
            out[child.name] = out.get(child.name, 0.0) + child.cpu_time_total
        else:
            _parts_below(child, out)


def _split(label: str, total: float, parts: dict) -> dict:
    """One labelled stage's microseconds, split into named parts and the rest."""
    if label.endswith(".draft"):
        named = {"history": parts.get("drafter.history", 0.0), "head": parts.get("drafter.head", 0.0),
                 "scatter": parts.get("drafter.scatter", 0.0)}
        return {"body": total - sum(named.values()), **named}
    if label.endswith(".verify"):
        named = {"linears": parts.get("whisper_flash::row_linear", 0.0),
                 "attention": parts.get("whisper_flash::row_attention", 0.0), "head": parts.get("target.head", 0.0)}
        return {**named, "other": total - sum(named.values())}
    return {}


def profile_breakdown(engine, features, speculative: bool) -> dict:
    """ms per round (speculative) or per plain step, by stage and part, over one decode of `features`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.decode(features, speculative=speculative)
    top = "round" if speculative else "step"
    count, stages = 0, {}
    for event in prof.events():
        if event.name != top:
            continue
        count += 1
        inside = 0.0
        for child in event.cpu_children:
            if not child.name.startswith(top + "."):
                continue
            stage = stages.setdefault(child.name.split(".", 1)[1], {"ms": 0.0, "parts": {}})
            stage["ms"] += child.cpu_time_total
            inside += child.cpu_time_total
            parts = {}
            _parts_below(child, parts)
            for name, us in _split(child.name, child.cpu_time_total, parts).items():
                stage["parts"][name] = stage["parts"].get(name, 0.0) + us
        python = stages.setdefault("python", {"ms": 0.0, "parts": {}})
        python["ms"] += event.cpu_time_total - inside
    per = max(1, count)
    return {"count": count, "ms": round(sum(s["ms"] for s in stages.values()) / per / 1000, 3),
            "stages": {name: {"ms": round(s["ms"] / per / 1000, 3),
                              **({"parts": {k: round(v / per / 1000, 3) for k, v in s["parts"].items()}}
                                 if s["parts"] else {})}
                       for name, s in stages.items()}}


def measure_breakdown(model: str, dtype: str, batch: int, clips) -> dict:
    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.engine.options import EngineOptions

    engine = WhisperFlashEngine(EngineOptions(model=model, dtype=dtype, batch_size=batch).with_(pace=False))
    features = engine.features([c.audio for c in clips])
    engine.decode(features[:batch], speculative=True)  # one-time kernel and drafter set-up
    out = {"dtype": dtype, "batch": batch, "clips": len(clips)}
    for speculative in (True, False):
        start = time.perf_counter()
        engine.decode(features, speculative=speculative)
        wall = time.perf_counter() - start
        key = "round" if speculative else "step"
        out[key] = profile_breakdown(engine, features, speculative)
        out[key]["decode_wall_s"] = round(wall, 3)
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
    p.add_argument("--breakdown", action="store_true", help="where a round's and a step's time goes (profiler)")
    p.add_argument("--manifest", help="clips to decode for --breakdown (default: the test set's first 16)")
    p.add_argument("--clips", type=int, default=16, help="how many clips of the manifest (default 16)")
    args = p.parse_args()
    torch.set_num_threads(2)
    _quiet_transformers()
    from pathlib import Path

    if args.manifest:
        from sglang_omni_flash.errors import UserError

        if not Path(args.manifest).is_file():
            raise UserError(f"--manifest {args.manifest} does not exist")
        clips = read_manifest(Path(args.manifest))
    else:
        clips = read_manifest(build_test_set(audio_dir(), progress=False).combined)
    report = {"cpu": cpu_summary(), "model": args.model, "threads": 2, "runs": []}
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            print(f"round_costs: {dtype}, batch {batch}", file=sys.stderr)
            run = measure_breakdown if args.breakdown else measure
            report["runs"].append(run(args.model, dtype, batch, clips[: args.clips]))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    from sglang_omni_flash.errors import run_command

    sys.exit(run_command(main, "round_costs.py"))
