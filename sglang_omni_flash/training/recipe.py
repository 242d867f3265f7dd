"""`whisper-flash train --recipe FILE`: one file -> a trained, evaluated drafter, resumable stage by stage.

A recipe (YAML, see configs/drafter-*.yaml) names the target, the corpora and what each is for, the
warm start, the training schedule and the evaluation sets. Stages, each resumable on its own:

  data     every corpus's manifest: a slice of a manifest (e.g. ARCTIC prompts by number), a synthetic
           corpus (corpus/synth.py) or the LibriVox reading; then packed to longer clips and augmented
           copies added (corpus/augment.py), as the recipe says
  extract  teacher extraction of every train / validation corpus (training/extract.py; the engine's
           dtype rule; encoder outputs recomputed in training rather than stored)
  train    training/train.py on all train corpora, validated on all validation corpora; then each arm
           under `ablations` (the same run with some options changed, e.g. the loss) on the same data
  evaluate real decoding, per evaluation set, for the new drafter, each ablation arm and each drafter
           named under `compare`: `chain` = eval-drafter's whole chains (the drafter alone), `tree` = the
           engine's default draft tree, `timestamps` = whole chains with timestamp tokens; tau,
           first-candidate acceptance, alpha, target WER in one table

A corpus may take another corpus's clips (`clips_from`, optionally `select`ed) and have its teacher
decode them with timestamp tokens (`timestamps: true`), so a drafter also learns srt / vtt decodes.

Everything lands under `work` (default runs/<recipe file stem>): corpora/, teacher/, train/, drafter/
(the result, with its training log), ablations/, eval.json and eval.md, and timings.json (wall seconds per stage,
summed over resumed runs). Paths in the recipe are relative to the recipe file; `{data}` is
$WHISPER_FLASH_DATA, else ../shared/data beside the repository; `{audio}` is the project's audio cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sglang_omni_flash.errors import UserError

STAGES = ("data", "extract", "train", "evaluate")
# evaluation modes -> engine options. chain: whole chains, every step a round, as eval-drafter (the drafter,
# not the engine's cost controls); tree: the engine's default draft tree, still without the pacer;
# timestamps: whole chains under the timestamp rules (srt / vtt / verbose_json requests; trees stay text-only)
EVAL_MODES = {
    "chain": {"min_draft_prob": 0.0, "tree_nodes": 0},
    "tree": {},
    "timestamps": {"min_draft_prob": 0.0, "tree_nodes": 0, "timestamps": True},
}
# validation: picks the checkpoint and the merge; report: validated and logged beside it, never
# selected on (speakers whose figures are reported, so nothing was chosen on them)
USES = ("train", "validation", "report", "evaluate")
TEACHER_USES = {"train", "validation", "report"}  # the corpora the teacher decodes (extraction)


@dataclass(frozen=True)
class Corpus:
    name: str
    use: tuple[str, ...]  # subset of USES
    manifest: str = ""  # a manifest to take clips from ...
    select: dict = field(default_factory=dict)  # ... optionally filtered (select_clips: id pattern, split, voices)
    synth: dict = field(default_factory=dict)  # ... or a synthetic corpus: n, seed, split, text
    librivox: bool = False  # ... or the LibriVox reading
    librispeech: str = ""  # ... or a LibriSpeech tree (GPU recipes; no packing or augmentation)
    dataset: str = ""  # ... or a local `datasets` folder (likewise; its encoder outputs are stored)
    pack: float = 0.0  # join clips of one voice into clips up to this many seconds (0: as they are)
    augment: dict = field(default_factory=dict)  # copies, seed: augmented copies added beside the originals
    clips_from: str = ""  # ... or the final clips of another corpus of the recipe (optionally `select`ed)
    timestamps: bool = False  # the teacher decodes with timestamp tokens (train / validation corpora)


@dataclass(frozen=True)
class Recipe:
    path: Path
    model: str
    work: Path
    corpora: tuple[Corpus, ...]
    train: dict
    evaluate: dict
    extract: dict

    def corpora_for(self, use: str) -> list[Corpus]:
        return [c for c in self.corpora if use in c.use]

    def corpus(self, name: str) -> Corpus:
        return next(c for c in self.corpora if c.name == name)


def _expand(value: str, base: Path) -> str:
    from sglang_omni_flash.paths import audio_dir

    repo = Path(__file__).resolve().parents[2]
    data = os.environ.get("WHISPER_FLASH_DATA") or str(repo.parent / "shared" / "data")
    value = value.replace("{data}", data).replace("{audio}", str(audio_dir()))
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def load_recipe(path: str | Path, work: str | None = None) -> Recipe:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"recipe {path} is not valid YAML: {exc}") from exc
    base = path.resolve().parent
    unknown = set(raw) - {"model", "work", "corpora", "extract", "train", "evaluate"}
    if unknown:
        raise UserError(f"recipe {path}: unknown keys {sorted(unknown)}")
    corpora = []
    for name, spec in (raw.get("corpora") or {}).items():
        spec = dict(spec or {})
        use = spec.pop("use", None)
        use = (use,) if isinstance(use, str) else tuple(use or ())
        if not use or set(use) - set(USES):
            raise UserError(f"recipe {path}: corpus {name} needs `use:` from {USES}, got {use}")
        sources = [k for k in ("manifest", "synth", "librivox", "librispeech", "dataset", "clips_from") if spec.get(k)]
        if len(sources) != 1:
            raise UserError(f"recipe {path}: corpus {name} needs exactly one of manifest / synth / librivox / "
                            "librispeech / dataset / clips_from")
        if sources[0] in ("librispeech", "dataset") and (spec.get("pack") or spec.get("augment") or spec.get("select")):
            raise UserError(f"recipe {path}: corpus {name}: pack, augment and select work on manifests only")
        if sources[0] == "clips_from" and (spec.get("pack") or spec.get("augment")):
            raise UserError(f"recipe {path}: corpus {name}: clips_from takes the other corpus's clips as they are "
                            "(select only)")
        for key in ("manifest", "librispeech", "dataset"):
            if spec.get(key):
                spec[key] = _expand(spec[key], base)
        try:
            check_select(spec.get("select") or {})
        except UserError as exc:
            raise UserError(f"recipe {path}: corpus {name}: {exc}") from None
        try:
            corpora.append(Corpus(name=name, use=use, **spec))
        except TypeError as exc:
            raise UserError(f"recipe {path}: corpus {name}: {exc}") from exc
    by_name = {c.name: c for c in corpora}
    for c in corpora:
        if c.clips_from and (c.clips_from not in by_name or c.clips_from == c.name):
            raise UserError(f"recipe {path}: corpus {c.name}: clips_from names no other corpus ({c.clips_from})")
        if c.clips_from and by_name[c.clips_from].clips_from:
            raise UserError(f"recipe {path}: corpus {c.name}: clips_from must name a corpus with clips of its own")
        if c.timestamps and not TEACHER_USES & set(c.use):
            raise UserError(f"recipe {path}: corpus {c.name}: timestamps shape the teacher's decodes; evaluation "
                            "decodes with timestamps under `evaluate: modes: [timestamps]`")
    if not any("train" in c.use for c in corpora):
        raise UserError(f"recipe {path}: no corpus has use: train")
    train = dict(raw.get("train") or {})
    work_dir = Path(work) if work else Path(_expand(raw["work"], base)) if raw.get("work") else Path("runs") / path.stem
    return Recipe(path=path.resolve(), model=str(raw.get("model", "base")), work=work_dir.resolve(),
                  corpora=tuple(corpora), train=train, evaluate=dict(raw.get("evaluate") or {}),
                  extract=dict(raw.get("extract") or {}))


# ------------------------------------------------------------------------------------ stages


class RecipeRun:
    def __init__(self, recipe: Recipe, progress: bool = True, threads: int | None = None):
        self.recipe = recipe
        self.progress = progress
        self.threads = threads
        self.work = recipe.work
        self.timings_path = self.work / "timings.json"

    @contextmanager
    def _timed(self, stage: str):
        timings = json.loads(self.timings_path.read_text()) if self.timings_path.is_file() else {}
        print(f"[recipe] {stage} ...", file=sys.stderr)
        t0 = time.perf_counter()
        yield
        timings[stage] = round(timings.get(stage, 0.0) + time.perf_counter() - t0, 1)
        self.timings_path.write_text(json.dumps(timings, indent=1) + "\n")

    def run(self, until: str = "evaluate") -> dict:
        self.work.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.recipe.path, self.work / "recipe.yaml")
        result = {}
        for stage in STAGES[: STAGES.index(until) + 1]:
            with self._timed(stage):
                result[stage] = getattr(self, f"stage_{stage}")()
        result["timings"] = json.loads(self.timings_path.read_text())
        result["disk_bytes"] = {p.name: _disk(p) for p in sorted(self.work.iterdir()) if p.is_dir()}
        (self.work / "recipe-result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        return result

    # -- data -------------------------------------------------------------------------------
    def manifest_of(self, corpus: Corpus) -> Path:
        """The corpus's final manifest (made if missing; every step below is resumable)."""
        from sglang_omni_flash.corpus.augment import augment_corpus
        from sglang_omni_flash.corpus.manifest import read_manifests, write_manifest
        from sglang_omni_flash.corpus.pack import pack_corpus

        root = self.work / "corpora" / corpus.name
        if corpus.synth:
            from sglang_omni_flash.corpus.synth import generate_corpus
            from sglang_omni_flash.paths import audio_dir

            s = corpus.synth
            manifest = generate_corpus(root / "clips", int(s["n"]), int(s.get("seed", 0)), split=s.get("split", "train"),
                                       sources_dir=audio_dir() / "sources", progress=self.progress,
                                       text=s.get("text", "botchan"))
        elif corpus.librivox:
            from sglang_omni_flash.corpus.librivox import build_librivox
            from sglang_omni_flash.paths import audio_dir

            manifest = build_librivox(root / "clips", audio_dir() / "sources")
        else:
            manifest = Path(corpus.manifest)
            if not manifest.is_file():
                raise UserError(f"corpus {corpus.name}: {manifest} does not exist (is {{data}} set? "
                                "WHISPER_FLASH_DATA names the data folder)")
            if corpus.select:
                manifest = write_manifest(root / "selected.jsonl", select_clips(read_manifests([manifest]), corpus.select))
        if corpus.pack:
            manifest = pack_corpus([manifest], root / "packed", max_seconds=float(corpus.pack), progress=self.progress)
        if corpus.augment:
            a = corpus.augment
            copies = augment_corpus(manifest, root / "augmented", int(a.get("copies", 1)), int(a.get("seed", 0)),
                                    progress=self.progress)
            manifest = write_manifest(root / "manifest.jsonl", read_manifests([manifest, copies]))
        return manifest

    def clips_of(self, corpus: Corpus):
        from sglang_omni_flash.training import sources

        if corpus.clips_from:  # any source's clips, selected by id like a manifest's
            clips = self.clips_of(self.recipe.corpus(corpus.clips_from))
            return select_clips(clips, corpus.select) if corpus.select else clips
        if corpus.librispeech:
            return sources.from_librispeech(corpus.librispeech)
        if corpus.dataset:
            return sources.from_dataset(corpus.dataset)
        return sources.from_manifest(self.manifest_of(corpus))

    def stage_data(self) -> dict:
        out = {}
        for corpus in self.recipe.corpora:
            clips = self.clips_of(corpus)
            out[corpus.name] = {"clips": len(clips), "hours": round(sum(c.duration for c in clips) / 3600, 3)}
        return out

    # -- extraction ---------------------------------------------------------------------------
    def teacher_dir(self, corpus: Corpus) -> Path:
        return self.work / "teacher" / corpus.name

    def stage_extract(self) -> dict:
        import dataclasses

        from sglang_omni_flash.engine.cli import engine_line
        from sglang_omni_flash.training.extract import ExtractOptions, TeacherExtractor

        e = dict(self.recipe.extract)
        unknown = set(e) - {"shard_size", "batch_size", "dtype", "teacher_top", "language", "lookup_block"}
        if unknown:
            raise UserError(f"recipe {self.recipe.path}: unknown extract keys {sorted(unknown)}")
        options = ExtractOptions(model=self.recipe.model, threads=self.threads, **({"shard_size": 32} | e))
        extractors = {}  # by `timestamps`: the engine's prompt and logit rules are fixed per engine
        out = {}
        for corpus in [c for c in self.recipe.corpora if TEACHER_USES & set(c.use)]:
            if corpus.timestamps not in extractors:
                extractors[corpus.timestamps] = TeacherExtractor(dataclasses.replace(options, timestamps=corpus.timestamps))
                print(f"[recipe] extract: {engine_line(extractors[corpus.timestamps].engine)}"
                      f"{', with timestamps' if corpus.timestamps else ''}", file=sys.stderr)
            extractor = extractors[corpus.timestamps]
            clips = self.clips_of(corpus)
            # clips without an audio file to re-read (a datasets folder) keep their encoder output
            extractor.options = dataclasses.replace(extractor.options, store_encoder=any(not c.path for c in clips))
            index = extractor.extract(clips, self.teacher_dir(corpus), progress=self.progress)
            out[corpus.name] = index["totals"]
        return out

    # -- training -----------------------------------------------------------------------------
    def warm_start(self) -> str:
        init = self.recipe.train.get("init")
        return self.drafter_dir(init) if init else ""

    def drafter_dir(self, init) -> str:
        """A drafter named in the recipe: a folder, a shipped drafter's name, or {git: COMMIT, path: FOLDER}
        (a drafter as it was at that commit, e.g. the one this recipe fine-tunes and then replaces)."""
        if isinstance(init, dict):
            commit, folder = str(init["git"]), str(init["path"]).rstrip("/")
            dest = self.work / "init" / commit
            if not (dest / "model.safetensors").is_file():
                repo = Path(__file__).resolve().parents[2]
                dest.mkdir(parents=True, exist_ok=True)
                for name in ("config.json", "model.safetensors"):
                    done = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{folder}/{name}"],
                                          capture_output=True, check=False)
                    if done.returncode != 0:
                        raise UserError(f"warm start {commit}:{folder}/{name} is not in this git checkout "
                                        f"({done.stderr.decode(errors='replace').strip()})")
                    (dest / name).write_bytes(done.stdout)
            return str(dest)
        from sglang_omni_flash.flash.checkpoint import SHIPPED_DRAFTERS_DIR

        shipped = SHIPPED_DRAFTERS_DIR / str(init)
        return str(shipped if shipped.is_dir() else Path(_expand(str(init), self.recipe.path.parent)))

    def train_options(self):
        from sglang_omni_flash.training.train import TrainOptions

        t = dict(self.recipe.train)
        t.pop("init", None)
        t.pop("ablations", None)
        known = set(TrainOptions.__dataclass_fields__) - {"teacher", "validation", "report", "out", "model", "init",
                                                          "threads"}
        unknown = set(t) - known
        if unknown:
            raise UserError(f"recipe {self.recipe.path}: unknown train keys {sorted(unknown)}")
        if "merge" in t:
            t["merge"] = tuple(float(a) for a in t["merge"])
        return TrainOptions(
            teacher=tuple(str(self.teacher_dir(c)) for c in self.recipe.corpora_for("train")),
            validation=tuple(str(self.teacher_dir(c)) for c in self.recipe.corpora_for("validation")),
            report=tuple(str(self.teacher_dir(c)) for c in self.recipe.corpora_for("report")),
            out=str(self.work / "train"), model=self.recipe.model, init=self.warm_start(), threads=self.threads, **t,
        )

    def ablations(self) -> dict[str, dict]:
        arms = self.recipe.train.get("ablations") or {}
        for name, changes in arms.items():
            if not isinstance(changes, dict) or not changes:
                raise UserError(f"recipe {self.recipe.path}: ablation {name} must list the options it changes")
        return arms

    def stage_train(self) -> dict:
        import dataclasses

        from sglang_omni_flash.training.train import LOG_CSV, Trainer

        options = self.train_options()
        main = Trainer(options, progress=self.progress)
        summary = {"main": main.run()}
        data = (main.train_index, main.train, main.val_sets, main.report_sets, main.unencoded)
        del main  # its acoustic cache; the loaded utterances (and their recomputed encoder outputs) stay
        final = self.work / "drafter"
        if final.exists():
            shutil.rmtree(final)
        shutil.copytree(summary["main"]["result"], final)  # best/, or merged/ when the recipe merges
        shutil.copyfile(self.work / "train" / LOG_CSV, final / "training-log.csv")
        for name, changes in self.ablations().items():
            arm = dataclasses.replace(options, out=str(self.work / "ablations" / name), **changes)
            summary[name] = Trainer(arm, progress=self.progress, data=data).run()
        return summary

    # -- evaluation ---------------------------------------------------------------------------
    def stage_evaluate(self) -> dict:
        from sglang_omni_flash.engine.engine import WhisperFlashEngine
        from sglang_omni_flash.engine.options import EngineOptions
        from sglang_omni_flash.training.evaluate import evaluate_drafter

        from sglang_omni_flash.training.train import BEST

        drafters = {"new": str(self.work / "drafter")}
        drafters |= {name: str(self.work / "ablations" / name / BEST) for name in self.ablations()}
        for name, where in (self.recipe.evaluate.get("compare") or {}).items():
            drafters[name] = self.drafter_dir(where)
        modes = tuple(self.recipe.evaluate.get("modes", ("chain",)))
        if set(modes) - set(EVAL_MODES):
            raise UserError(f"recipe {self.recipe.path}: evaluate modes are {', '.join(EVAL_MODES)}, got {modes}")
        results_path = self.work / "eval.json"
        results = json.loads(results_path.read_text()) if results_path.is_file() else {}
        sets = self.recipe.corpora_for("evaluate")
        for mode in modes:
            for label, drafter in drafters.items():
                key = f"{label} ({mode})"
                todo = [c for c in sets if c.name not in results.get(key, {})]
                if not todo:
                    continue
                engine = WhisperFlashEngine(EngineOptions(
                    model=self.recipe.model, drafter=drafter, speculative=True, threads=self.threads,
                    dtype=str(self.recipe.evaluate.get("dtype", "auto"))).with_(pace=False, max_backoff=0,
                                                                                **EVAL_MODES[mode]))
                for corpus in todo:
                    clips = self.clips_of(corpus)
                    print(f"[recipe] evaluate {key} on {corpus.name} ({len(clips)} clips)", file=sys.stderr)
                    r = evaluate_drafter(engine, clips)
                    r.pop("per_clip")
                    results.setdefault(key, {})[corpus.name] = dict(r, drafter=drafter, dtype=engine.dtype_choice.name)
                    results_path.write_text(json.dumps(results, indent=1) + "\n")
        (self.work / "eval.md").write_text(eval_table(results) + "\n")
        print(eval_table(results), file=sys.stderr)
        return {label: {s: {k: r[k] for k in ("tau", "first", "alpha")} for s, r in per.items()}
                for label, per in results.items()}


SELECT_KEYS = {"pattern", "from", "to", "split", "voices"}


def check_select(select: dict) -> None:
    unknown = set(select) - SELECT_KEYS
    if unknown:
        raise UserError(f"selection {select}: unknown keys {sorted(unknown)}; select keys are {sorted(SELECT_KEYS)}")


def select_clips(clips, select: dict):
    """Clips that pass every filter `select` names: `pattern` with group 1 (an integer, e.g. an ARCTIC
    prompt number) in [`from`, `to`]; the manifest's `split`; `voices` (a list of manifest voices,
    e.g. real:librispeech-19, so validation speakers can be split into selection and report sets)."""
    check_select(select)
    pattern = re.compile(select["pattern"]) if "pattern" in select else None
    lo, hi = int(select.get("from", 0)), int(select.get("to", 10**9))
    voices = set(select.get("voices") or ())
    kept = []
    for clip in clips:
        if pattern is not None:
            m = pattern.search(clip.id)
            if not (m and lo <= int(m.group(1)) <= hi):
                continue
        if "split" in select and getattr(clip, "split", None) != select["split"]:
            continue
        if voices and clip.voice not in voices:
            continue
        kept.append(clip)
    if not kept:
        raise UserError(f"selection {select} keeps no clip")
    return kept


def eval_table(results: dict) -> str:
    lines = ["| drafter | set | clips | tokens | target calls | tau | first | alpha | target WER |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, per in results.items():
        for name, r in per.items():
            wer = "-" if r.get("target_wer") is None else f"{100 * r['target_wer']:.1f}%"
            lines.append(f"| {label} | {name} | {r['clips']} | {r['tokens']} | {r['target_calls']} | "
                         f"{r['tau']:.2f} | {r['first']:.3f} | {r['alpha']:.3f} | {wer} |")
    return "\n".join(lines)


def _disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
