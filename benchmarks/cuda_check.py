"""A short CUDA check of the standalone engine (a few minutes on one GPU).

    python benchmarks/cuda_check.py [--model base|tiny.en|DIR] [--manifest FILE | --audio FILE...]
                                    [--clips 16] [--batch-sizes 1,4,8] [--repeats 3] [--dtype auto|float16|bfloat16]

What it checks, on CUDA in --dtype (auto: float16) with CUDA graphs (prefill, each verify length, drafter):
  1. exactness: Whisper-Flash tokens == greedy tokens (same graph-captured target) with the
     drafter the engine picks (shipped, else untrained), an oracle proposer (everything accepted,
     EOS inside a block) and an adversarial one (wrong at block position 3), at every batch size;
     and a greedy draft tree of --tree-nodes nodes (verified eagerly: no CUDA graph for a tree mask);
  1b. the drafter is the shipped one and is accepted in this dtype (its identity is an embedding
     probe compared with a cast tolerance; an fp16-hash check once made a bf16 engine fall back
     to an untrained drafter silently): alpha >= 0.3 with a shipped drafter, else the run fails;
  2. graphs vs eager: greedy through CUDA graphs vs greedy without them (fp16 ties may differ on a
     few tokens, as the paper's A.5 notes; reported, not failed);
  3. timing: greedy and Whisper-Flash, median of repeats, from log-mel to the last token,
     with the encoder share; printed as one JSON object on stdout.

The model must be on the machine already (the GPU machine has no network): fetch it beforehand
(`whisper-flash models fetch base`) and carry the cache folder, or pass --model DIR.
Exit code 0 when every exactness check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch


def clips_from(args) -> tuple[list, str]:
    from sglang_omni_flash.engine.audio import load_audio

    if args.audio:
        return [load_audio(a) for a in args.audio[: args.clips]], "files"
    manifest = Path(args.manifest) if args.manifest else None
    if manifest is None:
        from sglang_omni_flash.paths import audio_dir

        manifest = audio_dir() / "test-set" / "manifest.jsonl"
    if manifest.is_file():
        from sglang_omni_flash.corpus.manifest import read_manifest

        utts = read_manifest(manifest)[: args.clips]
        return [load_audio(u.audio) for u in utts], str(manifest)
    # no speech on this machine: chirps and noise still give transcripts to compare token by token
    rng = np.random.default_rng(0)
    waves = []
    for i in range(args.clips):
        t = np.arange(int(16000 * (4 + 2 * (i % 5)))) / 16000
        waves.append((0.1 * np.sin(2 * np.pi * (200 + 50 * i) * t * (1 + t)) + 0.02 * rng.standard_normal(t.size)).astype(np.float32))
    print("cuda_check: no test manifest found; using synthetic signals", file=sys.stderr)
    return waves, "synthetic"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="base")
    p.add_argument("--drafter", default=None)
    p.add_argument("--manifest", default=None)
    p.add_argument("--audio", nargs="*", default=None)
    p.add_argument("--clips", type=int, default=16)
    p.add_argument("--batch-sizes", default="1,4,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tree-nodes", type=int, default=16, help="draft-tree engine's nodes (0: skip it)")
    p.add_argument("--dtype", default="auto", help="auto (float16 on CUDA), float16 or bfloat16")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1

    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.engine.options import EngineOptions
    from sglang_omni_flash.flash.options import SpecOptions
    from sglang_omni_flash.engine.proposers import AdversarialProposer, OracleProposer

    started = time.perf_counter()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    waves, source = clips_from(args)
    audio_s = sum(min(len(w) / 16000, 30.0) for w in waves)
    engine = WhisperFlashEngine(EngineOptions(model=args.model, drafter=args.drafter, batch_size=sizes[0], device="cuda",
                                              dtype=args.dtype))
    features = engine.log_mel(waves)
    tree_engine = None
    if args.tree_nodes and engine.drafter is not None:
        tree_engine = WhisperFlashEngine(
            EngineOptions(model=args.model, batch_size=sizes[0], device="cuda", dtype=args.dtype,
                          spec=SpecOptions(tree_nodes=args.tree_nodes, tree_min_prob=0.0)),
            model=engine.model, drafter=engine.drafter,
        )
    eager = WhisperFlashEngine(
        EngineOptions(model=args.model, batch_size=max(sizes), device="cuda", cuda_graphs=False, speculative=False,
                      dtype=args.dtype),
        model=engine.model,
    )
    report = {
        "device": torch.cuda.get_device_name(0),
        "model": str(engine.model_dir),
        "drafter": engine.drafter_source,
        "dtype": str(engine.dtype),
        "dtype_reason": engine.dtype_choice.reason,
        "clips": len(waves),
        "audio_source": source,
        "audio_s": round(audio_s, 2),
        "results": [],
    }
    ok = True
    eager_tokens = [r.tokens for r in eager.decode(features)]
    for b in sizes:
        engine.resize(b)
        greedy = [r.tokens for r in engine.decode(features, speculative=False)]  # also captures the graphs
        flash = engine.decode(features, speculative=True)
        oracle = engine.decode(features, speculative=True, proposer=OracleProposer(greedy, engine.proposer.block_size))
        adversary = AdversarialProposer(greedy, 3, engine.target.vocab_size, engine.proposer.block_size)
        adversarial = engine.decode(features, speculative=True, proposer=adversary)
        tree = None
        if tree_engine is not None:
            tree_engine.resize(b)
            tree = tree_engine.decode(features, speculative=True)
        checks = {
            "flash_identical": sum(f.tokens == g for f, g in zip(flash, greedy)),
            "oracle_identical": sum(f.tokens == g for f, g in zip(oracle, greedy)),
            "adversarial_identical": sum(f.tokens == g for f, g in zip(adversarial, greedy)),
            "graph_vs_eager_greedy_identical": sum(a == g for a, g in zip(eager_tokens, greedy)),
        }
        exact = ["flash_identical", "oracle_identical", "adversarial_identical"]
        if tree is not None:
            checks["tree_identical"] = sum(f.tokens == g for f, g in zip(tree, greedy))
            exact.append("tree_identical")
        ok &= all(checks[k] == len(greedy) for k in exact)
        times = {False: [], True: []}
        for r in range(args.repeats):
            for spec in (False, True) if r % 2 == 0 else (True, False):
                engine.decode(features, speculative=spec)
                times[spec].append((engine.timing.total_s, engine.timing.encoder_s))
            if tree_engine is not None:
                tree_engine.decode(features, speculative=True)
                times.setdefault("tree", []).append((tree_engine.timing.total_s, tree_engine.timing.encoder_s))
        tokens = sum(len(g) for g in greedy)
        row = {"batch_size": b, "total": len(greedy), **checks}
        for name, spec in (("greedy", False), ("flash", True), ("flash_tree", "tree")):
            if spec not in times:
                continue
            total = statistics.median(t for t, _ in times[spec])
            enc = statistics.median(e for _, e in times[spec])
            row[name] = {
                "audio_s_per_s": round(audio_s / total, 2),
                "tok_per_s": round(tokens / total, 1),
                "encoder_share": round(enc / total, 3),
            }
        calls = sum(f.target_calls for f in flash)
        proposed = sum(f.proposed for f in flash)
        row["flash"]["alpha"] = round(sum(f.accepted for f in flash) / proposed, 4) if proposed else 0.0
        row["flash"]["tau"] = round(sum(len(f.tokens) for f in flash) / calls, 3)
        if "shipped" in str(engine.drafter_source):
            row["shipped_drafter_accepted"] = row["flash"]["alpha"] >= 0.3
            ok &= row["shipped_drafter_accepted"]
        row["speedup"] = round(row["flash"]["audio_s_per_s"] / row["greedy"]["audio_s_per_s"], 3)
        if tree is not None:
            row["flash_tree"]["tau"] = round(sum(len(f.tokens) for f in tree) / sum(f.target_calls for f in tree), 3)
            row["tree_speedup"] = round(row["flash_tree"]["audio_s_per_s"] / row["greedy"]["audio_s_per_s"], 3)
        row["oracle_tau"] = round(sum(len(f.tokens) for f in oracle) / sum(f.target_calls for f in oracle), 3)
        report["results"].append(row)
        print(json.dumps(row), file=sys.stderr)
    report["ok"] = ok
    report["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    from sglang_omni_flash.errors import run_command

    sys.exit(run_command(main, "cuda_check.py"))
