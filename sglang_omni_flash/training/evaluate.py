"""`evaluate_drafter(engine, clips)`: acceptance of a drafter measured in real Whisper-Flash decoding.

Every clip is decoded by the engine with the drafter (greedy, the engine's prompt and rules); the
figures come from the rounds that actually ran, not from teacher forcing:

* alpha   accepted candidates / proposed candidates
* tau     emitted tokens / target calls (prefill included), the paper's tokens per target call
* first   rounds whose first candidate was accepted / rounds
* by position j = 1..K: rounds that accepted at least j candidates / rounds
* the same per clip-duration bucket, and per voice / speaker (the manifest's `voice`), where each
  group also gets the target's own WER against the reference text (Whisper's English normaliser
  without its spelling table, jiwer). The drafter learns to predict the target's transcript, so it
  is hardest to predict where the target itself mis-hears: on the held-out synthetic set tau falls
  with the target's WER voice by voice (docs/training.md, "What was tried and measured").
"""

from __future__ import annotations

from dataclasses import dataclass

DURATION_BUCKETS = ((0.0, 5.0), (5.0, 10.0), (10.0, 20.0), (20.0, 30.0), (30.0, float("inf")))


@dataclass
class Tally:
    clips: int = 0
    tokens: int = 0
    target_calls: int = 0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    first: int = 0

    def add(self, res) -> None:
        self.clips += 1
        self.tokens += len(res.tokens)
        self.target_calls += res.target_calls
        self.proposed += res.proposed
        self.accepted += res.accepted
        self.rounds += res.rounds
        self.first += res.first_accepts

    def summary(self) -> dict:
        return {
            "clips": self.clips,
            "tokens": self.tokens,
            "target_calls": self.target_calls,
            "alpha": self.accepted / self.proposed if self.proposed else 0.0,
            "tau": self.tokens / self.target_calls if self.target_calls else 0.0,
            "first": self.first / self.rounds if self.rounds else 0.0,
        }


def target_wer(references: list[str], hypotheses: list[str]) -> float | None:
    """Corpus WER of the target's transcripts; None when no clip has a reference text."""
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    from sglang_omni_flash.errors import require_extra

    jiwer = require_extra("jiwer")

    normalize = EnglishTextNormalizer({})
    pairs = [(normalize(r), normalize(h)) for r, h in zip(references, hypotheses)]
    pairs = [(r, h) for r, h in pairs if r.strip()]  # clips without a reference text do not count
    if not pairs:
        return None
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))


def evaluate_drafter(engine, clips, progress=None) -> dict:
    """clips: objects with .id, .duration, .load() (training.sources.Clip). Returns a JSON-able dict."""
    import numpy as np

    K = engine.proposer.block_size if engine.proposer is not None else engine.options.block_size
    total = Tally()
    buckets = {b: Tally() for b in DURATION_BUCKETS}
    voices: dict[str, Tally] = {}
    texts: dict[str, tuple[list[str], list[str]]] = {}  # voice -> (references, target transcripts)
    at_least = np.zeros(K, dtype=np.int64)
    per_clip = []
    bs = engine.options.batch_size
    for start in range(0, len(clips), bs):
        part = clips[start : start + bs]
        waves = [c.load() for c in part]
        results = engine.decode(engine.log_mel(waves), speculative=True)
        for clip, wave, res in zip(part, waves, results):
            duration = len(wave) / 16000
            total.add(res)
            for lo, hi in DURATION_BUCKETS:
                if lo <= duration < hi:
                    buckets[(lo, hi)].add(res)
            voice = getattr(clip, "speaker", "") or "unknown"
            voices.setdefault(voice, Tally()).add(res)
            refs, hyps = texts.setdefault(voice, ([], []))
            refs.append(getattr(clip, "text", "") or "")
            hyps.append(res.text)
            for a in res.accepted_lengths:
                at_least[:a] += 1
            per_clip.append({"id": clip.id, "voice": voice, "duration": round(duration, 2), "tokens": len(res.tokens),
                             "target_calls": res.target_calls, "text": res.text})
        if progress is not None:
            progress(len(part))
    out = total.summary()
    out["by_position"] = (at_least / max(1, total.rounds)).round(4).tolist()
    out["by_duration"] = {
        f"{lo:g}-{hi:g}s" if hi != float("inf") else f">{lo:g}s": t.summary() for (lo, hi), t in buckets.items() if t.clips
    }
    out["target_wer"] = target_wer([r for refs, _ in texts.values() for r in refs],
                                   [h for _, hyps in texts.values() for h in hyps])
    out["by_voice"] = {v: {**voices[v].summary(), "target_wer": target_wer(*texts[v])} for v in sorted(voices)}
    out["per_clip"] = per_clip
    return out


def format_table(name: str, result: dict) -> str:
    """A small markdown table of the headline figures and the per-position acceptance."""
    lines = [
        "| set | clips | tokens | target calls | alpha | tau | first |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| {name} | {result['clips']} | {result['tokens']} | {result['target_calls']} | "
        f"{result['alpha']:.3f} | {result['tau']:.2f} | {result['first']:.3f} |",
    ]
    for bucket, t in result.get("by_duration", {}).items():
        lines.append(
            f"| {name} {bucket} | {t['clips']} | {t['tokens']} | {t['target_calls']} | {t['alpha']:.3f} | "
            f"{t['tau']:.2f} | {t['first']:.3f} |"
        )
    if len(result.get("by_voice", {})) > 1:
        lines += ["", "| voice | clips | tokens | target calls | alpha | tau | first | target WER |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for voice, t in result["by_voice"].items():
            wer = "-" if t["target_wer"] is None else f"{100 * t['target_wer']:.1f}%"
            lines.append(
                f"| {voice} | {t['clips']} | {t['tokens']} | {t['target_calls']} | {t['alpha']:.3f} | "
                f"{t['tau']:.2f} | {t['first']:.3f} | {wer} |"
            )
    pos = " | ".join(f"{p:.2f}" for p in result["by_position"])
    lines += ["", "accepted >= j, j = 1..K: " + pos]
    if result.get("target_wer") is not None:
        lines.append(f"target WER against the reference texts: {100 * result['target_wer']:.1f}%")
    return "\n".join(lines)
