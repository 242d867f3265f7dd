"""This engine against the Whisper runtimes a CPU user would pick instead, on the same clips, one run.

    .venv/bin/python benchmarks/peers.py [--model base] [--manifest M] [--limit N] [--repeats 3]
                                         [--dtypes float32,bfloat16] [--out docs/peers-cpu]

Rows: transformers `generate()` fp32 (SDPA); faster-whisper fp32 and int8, one clip a call and its
BatchedInferencePipeline (8 clips a call); this engine's greedy and Whisper-Flash in each dtype
(default: float32, plus bfloat16 where the CPU has AMX-BF16 or AVX512-BF16; bf16 elsewhere is emulated and slow).
Every row decodes greedily with the English prompt, no timestamps, no temperature fallback, no VAD,
2 threads. Timed from the 16 kHz waveform to the text (faster-whisper computes its own log-mel,
so the engine rows include theirs); repeats are interleaved (each repeat runs every row, in a
rotated order) and the median is reported. Columns: audio s/s, decode-only tokens/s (engine and
transformers rows, where the encoder is timed apart), encoder share, corpus WER on the synthetic
and the real clips (Whisper's English normaliser + jiwer), and for Whisper-Flash rows the clips
whose tokens equal the same-dtype greedy row's. Writes OUT.json, OUT.md and OUT.png.

Long-form (`--long-form`, a manifest of 60-120 s files such as `whisper-flash corpus long-form
--split val`): the rows are what a user would run on a recording. faster-whisper int8 transcribes
each file sequentially (its 30 s sliding windows) and through its BatchedInferencePipeline (Silero
VAD, batch 8, as asr_server_bench.py runs it); the engine rows cut each file where the server cuts
it (sglang-omni's own RMSSplitter: windows of at most 30 s ending at quiet points) and decode all
windows in batches of 8, joined per file as the server joins them. transformers is left out there
(its long-form generate is another algorithm: sequential, timestamp-conditioned). "identical" then
counts files whose every window's tokens equal greedy's.

faster-whisper reads the CTranslate2 export that `whisper-flash models fetch` keeps (the same
weights the engine converts). Nothing here is asserted in tests; compare ratios within one run.
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


def corpus_wer(refs: list[str], hyps: list[str]) -> float | None:
    import jiwer
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    normalize = EnglishTextNormalizer({})
    pairs = [(normalize(r), normalize(h)) for r, h in zip(refs, hyps) if normalize(r).strip()]
    if not pairs:
        return None
    return jiwer.wer([r for r, _ in pairs], [h for _, h in pairs])


class Row:
    """One runtime: `run(waves)` -> (texts, token ids or None, seconds, encoder seconds or None)."""

    name = ""

    def run(self, waves):
        raise NotImplementedError


class EngineRow(Row):
    def __init__(self, engine, speculative: bool, label: str):
        self.engine, self.speculative, self.name = engine, speculative, label

    def run(self, waves):
        pacer = self.engine.drafter_pacer  # lives as long as the engine: count this call's decisions
        before = (pacer.rounds, pacer.steps)
        start = time.perf_counter()
        results = self.engine.decode(self.engine.log_mel(waves), speculative=self.speculative)
        total = time.perf_counter() - start
        extra = {}
        if self.speculative:
            calls = sum(r.target_calls for r in results)
            extra = {"tau": sum(len(r.tokens) for r in results) / calls, "target_calls": calls}
            if self.engine.pacer is not None:
                extra |= {"paced_rounds": pacer.rounds - before[0], "paced_steps": pacer.steps - before[1]}
        decode = self.engine.timing.decode_s
        return [r.text for r in results], [r.tokens for r in results], total, total - decode, extra


def server_windows(wave: np.ndarray) -> list[np.ndarray]:
    """A long file cut as the server cuts it: sglang-omni's RMSSplitter, windows of at most 30 s
    ending at the quietest point near each boundary (its default 0.5 s floor for a last window)."""
    from sglang_omni.serve.transcription_chunking import RMSSplitter

    return [wave[start:end] for start, end in RMSSplitter().split(wave, 16000, 30 * 16000, min_tail_s=0.5)]


class LongFormEngineRow(EngineRow):
    """The engine on long files: every file's server windows decoded together, in the engine's batches."""

    def run(self, waves):
        from sglang_omni.serve.transcription_chunking import join_transcript_parts

        windows = [server_windows(w) for w in waves]
        texts, tokens, total, encoder, extra = super().run([x for file in windows for x in file])
        file_texts, file_tokens, start = [], [], 0
        for file in windows:
            file_texts.append(join_transcript_parts(texts[start: start + len(file)]))
            file_tokens.append(tokens[start: start + len(file)])
            start += len(file)
        return file_texts, file_tokens, total, encoder, extra | {"windows": start}


class TransformersRow(Row):
    name = "transformers generate() fp32"

    def __init__(self, model_dir: Path):
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        self.processor = WhisperProcessor.from_pretrained(model_dir)
        self.model = WhisperForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
        self.kwargs = {"language": "en", "task": "transcribe"} if self.model.generation_config.is_multilingual else {}

    @torch.inference_mode()
    def run(self, waves):
        from transformers.modeling_outputs import BaseModelOutput

        texts, tokens, encoder = [], [], 0.0
        start = time.perf_counter()
        for wave in waves:
            features = self.processor(wave, sampling_rate=16000, return_tensors="pt").input_features
            t0 = time.perf_counter()
            enc = self.model.model.encoder(features).last_hidden_state
            encoder += time.perf_counter() - t0
            ids = self.model.generate(encoder_outputs=BaseModelOutput(last_hidden_state=enc), max_new_tokens=440,
                                      **self.kwargs)[0]
            tokens.append(ids.tolist())
            texts.append(self.processor.decode(ids, skip_special_tokens=True).strip())
        return texts, None, time.perf_counter() - start, encoder, {}


class FasterWhisperRow(Row):
    def __init__(self, ct2_dir: Path, compute_type: str, batched: int, english_only: bool, long_form: bool = False):
        from faster_whisper import BatchedInferencePipeline, WhisperModel

        self.model = WhisperModel(str(ct2_dir), device="cpu", compute_type=compute_type, cpu_threads=2)
        self.pipeline = BatchedInferencePipeline(self.model) if batched else None
        self.batched = batched
        self.long_form = long_form
        self.language = None if english_only else "en"
        self.name = f"faster-whisper {compute_type}" + (
            f", batched pipeline ({'VAD windows' if long_form else 'clips'}, {batched} a call)" if batched else "")

    def run(self, waves):
        options = dict(language=self.language, beam_size=1, temperature=0.0, without_timestamps=True,
                       condition_on_previous_text=False, vad_filter=False)
        start = time.perf_counter()
        texts = []
        if self.pipeline is not None and self.long_form:  # a file a call, its VAD windows batched
            options.pop("vad_filter")
            for wave in waves:
                segments, _ = self.pipeline.transcribe(wave, batch_size=self.batched, **options)
                texts.append("".join(s.text for s in segments).strip())
        elif self.pipeline is None:
            for wave in waves:
                segments, _ = self.model.transcribe(wave, **options)
                texts.append("".join(s.text for s in segments).strip())
        else:  # the pipeline batches the 30 s windows of one file; clips are short, so batch clips
            for i in range(0, len(waves), self.batched):
                group = waves[i: i + self.batched]
                joined = np.concatenate([np.pad(w, (0, 30 * 16000 - min(len(w), 30 * 16000)))[: 30 * 16000]
                                         for w in group])
                clips = [{"start": 30.0 * j, "end": 30.0 * j + len(w) / 16000} for j, w in enumerate(group)]
                segments, _ = self.pipeline.transcribe(joined, clip_timestamps=clips, batch_size=self.batched,
                                                       **options)
                per_clip = ["" for _ in group]
                for s in segments:
                    per_clip[min(len(group) - 1, int(s.start // 30))] += s.text
                texts += [t.strip() for t in per_clip]
        return texts, None, time.perf_counter() - start, None, {}


def build_rows(args, model_dir: Path, dtypes: list[str]) -> list[Row]:
    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.engine.options import EngineOptions
    from sglang_omni_flash.models.embedded import ct2_dir

    long_form = args.long_form
    rows: list[Row] = [] if long_form else [TransformersRow(model_dir)]
    ct2 = ct2_dir(args.model) if args.model in ("base", "tiny.en") else None
    if ct2 is not None and (ct2 / "model.bin").is_file():
        english_only = args.model.endswith(".en")
        rows += [] if long_form else [FasterWhisperRow(ct2, "float32", 0, english_only)]
        rows += [FasterWhisperRow(ct2, "int8", 0, english_only), FasterWhisperRow(ct2, "int8", 8, english_only, long_form)]
    else:
        print(f"peers: no CTranslate2 export for {args.model}; faster-whisper rows left out", file=sys.stderr)
    for dtype in dtypes:
        engine = WhisperFlashEngine(EngineOptions(model=args.model, dtype=dtype, threads=2,
                                                  batch_size=8 if long_form else 1))
        kind, label = (LongFormEngineRow, f"this engine, {dtype}, batch 8") if long_form else \
            (EngineRow, f"this engine, {dtype}")
        rows += [kind(engine, False, f"{label}, greedy"), kind(engine, True, f"{label}, Whisper-Flash")]
    return rows


def main() -> int:
    from sglang_omni_flash.corpus.manifest import read_manifest
    from sglang_omni_flash.corpus.synth import build_test_set
    from sglang_omni_flash.engine.audio import load_audio
    from sglang_omni_flash.engine.cli import _quiet_transformers
    from sglang_omni_flash.hardware import choose_dtype, cpu_flags, cpu_summary, native_bf16
    from sglang_omni_flash.models.embedded import resolve_model
    from sglang_omni_flash.paths import audio_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="base")
    p.add_argument("--manifest", default=None, help="default: the test set (synthetic voices + real LibriVox lines)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", default=None,
                   help="engine dtypes (default: float32, plus bfloat16 on a CPU with AMX-BF16 or AVX512-BF16)")
    p.add_argument("--long-form", action="store_true",
                   help="the manifest holds long files (60-120 s): server windows for the engine, no transformers row")
    p.add_argument("--out", default="docs/peers-cpu", help="writes OUT.json, OUT.md, OUT.png")
    args = p.parse_args()

    torch.set_num_threads(2)
    _quiet_transformers()
    manifest = Path(args.manifest) if args.manifest else build_test_set(audio_dir(), progress=False).combined
    clips = read_manifest(manifest)[: args.limit]
    waves = [load_audio(c.audio) for c in clips]
    audio_s = sum(len(w) / 16000 if args.long_form else min(len(w) / 16000, 30.0) for w in waves)
    flags = cpu_flags()
    dtypes = args.dtypes.split(",") if args.dtypes else ["float32"] + (["bfloat16"] if native_bf16(flags) else [])
    print(f"peers: {cpu_summary(flags)}; auto dtype {choose_dtype('auto', 'cpu').describe()}; {len(clips)} clips, "
          f"{audio_s:.1f} s audio; rows in {', '.join(dtypes)}", file=sys.stderr)
    rows = build_rows(args, resolve_model(args.model), dtypes)

    for row in rows:  # warm-up: one clip through every row
        row.run(waves[:1])
    times = {row.name: [] for row in rows}
    outputs = {}
    from tqdm import tqdm

    with tqdm(total=args.repeats * len(rows), desc="peers", file=sys.stderr) as bar:
        for r in range(args.repeats):
            shift = r % len(rows)
            for row in rows[shift:] + rows[:shift]:
                texts, tokens, total, encoder, extra = row.run(waves)
                times[row.name].append((total, encoder))
                outputs.setdefault(row.name, (texts, tokens, extra))
                bar.update()

    real = [i for i, c in enumerate(clips) if c.voice.startswith(("librivox", "real:"))]
    synth = [i for i in range(len(clips)) if i not in real]
    table = []
    for row in rows:
        total = statistics.median(t for t, _ in times[row.name])
        encs = [e for _, e in times[row.name] if e is not None]
        encoder = statistics.median(encs) if encs else None
        texts, tokens, extra = outputs[row.name]
        n_tokens = None if tokens is None else sum(  # long-form: a file's tokens are its windows' lists
            sum(len(w) for w in t) if t and isinstance(t[0], list) else len(t) for t in tokens)
        entry = {
            "row": row.name, "audio_s_per_s": round(audio_s / total, 3), "time_s": round(total, 3),
            "encoder_share": None if encoder is None else round(encoder / total, 3),
            "decode_tok_per_s": None if encoder is None or n_tokens is None else round(n_tokens / (total - encoder), 2),
            "wer_synthetic": corpus_wer([clips[i].text for i in synth], [texts[i] for i in synth]),
            "wer_real": corpus_wer([clips[i].text for i in real], [texts[i] for i in real]),
        } | {k: round(v, 3) if isinstance(v, float) else v for k, v in extra.items()}
        if row.name.endswith("Whisper-Flash"):
            greedy = outputs[row.name.replace("Whisper-Flash", "greedy")][1]
            entry["identical"] = f"{sum(a == b for a, b in zip(tokens, greedy))}/{len(tokens)}"
        table.append(entry)
    for entry in table:
        if entry["row"].endswith("Whisper-Flash"):
            greedy = next(e for e in table if e["row"] == entry["row"].replace("Whisper-Flash", "greedy"))
            entry["x_greedy"] = round(entry["audio_s_per_s"] / greedy["audio_s_per_s"], 3)
            if entry["decode_tok_per_s"] and greedy["decode_tok_per_s"]:
                entry["x_greedy_decode"] = round(entry["decode_tok_per_s"] / greedy["decode_tok_per_s"], 3)
    batched = next((e for e in table if "batched" in e["row"]), None)
    if batched:
        for entry in table:
            entry["x_faster_whisper_int8_batched"] = round(entry["audio_s_per_s"] / batched["audio_s_per_s"], 3)

    report = {"cpu": cpu_summary(flags), "torch_threads": 2, "clips": len(clips), "long_form": args.long_form,
              "audio_s": round(audio_s, 2),
              "repeats": args.repeats, "model": args.model, "manifest": str(manifest), "rows": table}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report) + "\n")
    plot(report, out.with_suffix(".png"))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    unit = "long files" if report.get("long_form") else "clips"
    lines = [f"{report['model']}, {report['clips']} {unit} ({report['audio_s']:.0f} s), {report['cpu']}, "
             f"{report['torch_threads']} threads, median of {report['repeats']} interleaved repeats", "",
             "| runtime | audio s/s | x greedy (same dtype) | decode tok/s | encoder share | WER synthetic / real | "
             "identical to greedy |", "|---|---:|---:|---:|---:|---|---|"]
    for e in report["rows"]:
        lines.append(
            f"| {e['row']} | {e['audio_s_per_s']:.2f} | {e.get('x_greedy', '')} | {e['decode_tok_per_s'] or '-'} | "
            f"{pct(e['encoder_share'])} | {pct(e['wer_synthetic'])} / {pct(e['wer_real'])} | {e.get('identical', '')} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    colors = ["#d62728" if "Whisper-Flash" in e["row"] else "#1f77b4" if "this engine" in e["row"] else "#7f7f7f"
              for e in rows]
    ax.barh([e["row"] for e in rows], [e["audio_s_per_s"] for e in rows], color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("audio seconds per second (higher is faster)")
    ax.set_title(f"Whisper {report['model']} on {report['cpu']}, {report['torch_threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    from sglang_omni_flash.errors import run_command

    sys.exit(run_command(main, "peers.py"))
