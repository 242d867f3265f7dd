"""`whisper-flash train --recipe`: data, extraction, training and evaluation from one file, resumable.

A handful of real test clips and tiny.en keep it to about a minute; the shipped recipes
(configs/drafter-*.yaml) run the same code at full size."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.training.recipe import RecipeRun, load_recipe


def _write_recipe(path, test_set_paths, tiny_en_model_dir, **train):
    schedule = dict(steps=4, batch_size=2, anchors=4, eval_every=2, checkpoint_every=2, draft_vocab_top=2000,
                    soft_weight=0.5, seed=0) | train
    path.write_text(f"""
model: {tiny_en_model_dir}
corpora:
  train-clips:
    use: train
    manifest: {test_set_paths.synth}
    select: {{pattern: '-(\\d+)$', from: 0, to: 3}}
    pack: 20
    augment: {{copies: 1, seed: 3}}
  train-clips-timestamps:     # the first packed clip and its augmented copy again, decoded with timestamps
    use: train
    clips_from: train-clips
    select: {{pattern: 'packed-(\\d+)', from: 0, to: 0}}
    timestamps: true
  real-lines:
    use: [validation, evaluate]
    manifest: {test_set_paths.librivox}
    select: {{pattern: 'f0*(\\d+)$', from: 2, to: 4}}
  report-lines:               # validated and logged, never selected on
    use: report
    manifest: {test_set_paths.librivox}
    select: {{pattern: 'f0*(\\d+)$', from: 5, to: 6, split: heldout, voices: [librivox:real]}}
extract: {{shard_size: 2, batch_size: 2}}
train: {json.dumps(schedule)}
evaluate:
  dtype: float32
  modes: [chain, tree, timestamps]
""")
    return path


def test_recipe_runs_end_to_end_and_resumes(test_set_paths, tiny_en_model_dir, tmp_path):
    path = _write_recipe(tmp_path / "tiny.yaml", test_set_paths, tiny_en_model_dir,
                         ablations={"hard-labels": {"soft_weight": 0.0}})
    recipe = load_recipe(path, work=str(tmp_path / "w"))
    work = tmp_path / "w"
    first = RecipeRun(recipe, progress=False).run(until="extract")  # interrupted after extraction
    assert set(first["timings"]) == {"data", "extract"} and "train" not in first
    train_corpus = first["data"]["train-clips"]
    assert train_corpus["clips"] == 2 * len(list((work / "corpora" / "train-clips" / "packed" / "wav").glob("*.wav")))
    assert first["extract"]["train-clips"]["kept"] >= 2 and first["extract"]["real-lines"]["kept"] == 3
    assert first["extract"]["report-lines"]["kept"] == 2
    assert first["data"]["train-clips-timestamps"]["clips"] == 2 == first["extract"]["train-clips-timestamps"]["kept"]
    stamped = json.loads((work / "teacher" / "train-clips-timestamps" / "teacher.json").read_text())
    assert stamped["timestamps"] is True and "timestamps" not in json.loads(
        (work / "teacher" / "train-clips" / "teacher.json").read_text())
    shards = {p: p.stat().st_mtime_ns for p in (work / "teacher").rglob("shard-*.safetensors")}
    assert shards

    done = RecipeRun(recipe, progress=False).run()  # the rest: nothing extracted twice
    assert {p: p.stat().st_mtime_ns for p in shards} == shards
    drafter = work / "drafter"
    assert (drafter / "model.safetensors").is_file() and (drafter / "training-log.csv").is_file()
    assert done["train"]["main"]["step"] == done["train"]["hard-labels"]["step"] == 4
    # the report set is validated beside the selection sets, and only they choose
    main = done["train"]["main"]
    assert set(main["last_val"]["report"]) == {"report-lines"} and set(main["last_val"]["sets"]) == {"real-lines"}
    import csv

    rows = [r for r in csv.DictReader(open(work / "train" / "log.csv")) if r["val_rollout_by_set"]]
    assert rows and all(r["report_rollout_by_set"].startswith("report-lines:") for r in rows)
    assert (work / "ablations" / "hard-labels" / "best" / "model.safetensors").read_bytes() != \
        (drafter / "model.safetensors").read_bytes()  # the arm changed the loss, so other weights
    assert set(done["evaluate"]) == {f"{d} ({m})" for d in ("new", "hard-labels") for m in ("chain", "tree", "timestamps")}
    new = done["evaluate"]["new (chain)"]["real-lines"]
    assert 1.0 <= new["tau"] <= 9.0 and 0.0 <= new["first"] <= 1.0
    assert "| new (tree) | real-lines | 3 |" in (work / "eval.md").read_text()
    assert 1.0 <= done["evaluate"]["new (timestamps)"]["real-lines"]["tau"] <= 9.0
    assert set(done["timings"]) == {"data", "extract", "train", "evaluate"}
    assert done["disk_bytes"]["teacher"] > 0

    before = (drafter / "model.safetensors").read_bytes()
    again = RecipeRun(recipe, progress=False).run()  # finished: every stage is a no-op
    assert (drafter / "model.safetensors").read_bytes() == before
    assert again["evaluate"] == done["evaluate"]


def test_recipe_errors_name_the_problem(test_set_paths, tiny_en_model_dir, tmp_path):
    path = _write_recipe(tmp_path / "bad.yaml", test_set_paths, tiny_en_model_dir, learning_rate=1.0)
    with pytest.raises(UserError, match="unknown train keys.*learning_rate"):
        RecipeRun(load_recipe(path, work=str(tmp_path / "w")), progress=False).train_options()
    (tmp_path / "nouse.yaml").write_text("corpora:\n  a: {manifest: x.jsonl}\n")
    with pytest.raises(UserError, match="corpus a needs `use:`"):
        load_recipe(tmp_path / "nouse.yaml")
    with pytest.raises(UserError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")
    bad = {"clips_from: nowhere": "clips_from names no other corpus",
           "clips_from: a, pack: 20": "clips_from takes the other corpus's clips as they are",
           "manifest: x.jsonl, timestamps: true": "timestamps shape the teacher's decodes",
           "manifest: x.jsonl, select: {speaker: 19}": "select keys are"}
    for spec, message in bad.items():
        use = "evaluate" if "timestamps" in spec else "train"
        (tmp_path / "b.yaml").write_text(f"corpora:\n  a: {{use: train, manifest: x.jsonl}}\n  b: {{use: {use}, {spec}}}\n")
        with pytest.raises(UserError, match=message):
            load_recipe(tmp_path / "b.yaml")
    cli = subprocess.run([sys.executable, "-m", "sglang_omni_flash.cli", "train", "--recipe", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True)
    assert cli.returncode != 0 and "does not exist" in cli.stderr and "Traceback" not in cli.stderr


def test_selection_by_pattern_split_and_voice():
    from sglang_omni_flash.training.recipe import select_clips

    Clip = dataclasses.make_dataclass("Clip", ["id", "voice", "split"])
    clips = [Clip("19-1-0001", "real:librispeech-19", "val"), Clip("669-1-0002", "real:librispeech-669", "val"),
             Clip("1088-1-0003", "real:librispeech-1088", "train")]
    assert select_clips(clips, {"split": "val"}) == clips[:2]
    assert select_clips(clips, {"split": "val", "voices": ["real:librispeech-669"]}) == [clips[1]]
    assert select_clips(clips, {"pattern": r"-(\d+)$", "from": 2, "to": 3}) == clips[1:]
    with pytest.raises(UserError, match="keeps no clip"):
        select_clips(clips, {"split": "train", "voices": ["real:librispeech-19"]})
    with pytest.raises(UserError, match="unknown keys"):
        select_clips(clips, {"speakers": [19]})


def test_shipped_recipes_load_and_name_their_warm_start_commit():
    from pathlib import Path

    configs = Path(__file__).resolve().parents[1] / "configs"
    for name in ("drafter-base.yaml", "drafter-tiny.en.yaml"):
        recipe = load_recipe(configs / name)
        assert recipe.corpora_for("train") and recipe.corpora_for("validation") and recipe.corpora_for("evaluate")
        init = recipe.train["init"]
        assert isinstance(init, dict) and set(init) == {"git", "path"}
        # each picks by the worst validation set and merges with its warm start (a fine-tune forgets)
        train = {k: v for k, v in recipe.train.items() if k != "init"}
        assert train["select"] == "worst_gain" and train["merge"] == [0.25, 0.5, 0.75]
        options = RecipeRun(dataclasses.replace(recipe, train=train), progress=False).train_options()
        # selection on LibriSpeech 19 + 2416, cathy, synthetic text and synthetic timestamps; 5789 + 669
        # reported beside them and evaluated clip by clip, never selected on
        assert options.merge == (0.25, 0.5, 0.75) and len(options.validation) == 4 and len(options.report) == 1
        voices = {c.name: set(c.select.get("voices", ())) for c in recipe.corpora if c.manifest.endswith(
            "librispeech-mini/manifest.jsonl")}
        assert voices["librispeech-select"] == {"real:librispeech-19", "real:librispeech-2416"}
        assert voices["librispeech-report"] == voices["librispeech-report-clips"] == {
            "real:librispeech-5789", "real:librispeech-669"}
        assert recipe.corpus("librispeech-train").select == {"split": "train"}
        assert recipe.corpus("librispeech-train").pack == 28  # ~100-token windows, as served
        # srt / vtt decodes: part of the training clips and a validation set again, with timestamps
        stamped = [c for c in recipe.corpora if c.timestamps]
        assert {c.clips_from for c in stamped} == {"librispeech-train", "synth-train", "arctic-train", "synth-val"}
        assert "timestamps" in recipe.evaluate["modes"]
    for name in ("drafter-large-v3-gpu.yaml", "drafter-large-v3-gpu-stage2.yaml"):  # paper scale: the same command
        recipe = load_recipe(configs / name)
        run = RecipeRun(recipe, progress=False)
        assert run.train_options().steps in (40000, 80000) and not run.train_options().freeze_acoustic_kv
