"""The Whisper tokenizer of a converted model: special token ids, timestamps, BPE merges.

transformers finds the timestamp tokens as "last special token id + 1", so the tokenizer is
saved with every special token (in id order, ending with <|notimestamps|>) as an additional
special token, followed by the 1501 timestamp tokens <|0.00|> ... <|30.00|>.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sglang_omni_flash.errors import UserError

N_TIMESTAMP_TOKENS = 1501  # <|0.00|> ... <|30.00|> in 0.02 s steps
_LANGUAGE_TOKEN = re.compile(r"^<\|[a-z]{2,3}\|>$")
_TIMESTAMP_TOKEN = re.compile(r"^<\|\d+\.\d\d\|>$")


def timestamp_tokens() -> list[str]:
    return [f"<|{i * 0.02:.2f}|>" for i in range(N_TIMESTAMP_TOKENS)]


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens; the timestamps follow `no_timestamps` directly."""

    eot: int
    sot: int
    no_timestamps: int
    start_of_prev: int | None
    translate: int | None
    transcribe: int | None
    # content ("<|en|>") -> id, in id order
    languages: dict[str, int]
    # every special token, in id order (they become the tokenizer's additional special tokens)
    all_special: list[str]

    @property
    def first_timestamp(self) -> int:
        return self.no_timestamps + 1


def special_tokens(tokenizer_json: dict, n_vocab: int) -> SpecialTokens:
    """Find the special token ids in a Whisper `tokenizer.json` and check the timestamps fit."""
    try:
        added = sorted(
            (int(t["id"]), str(t["content"]))
            for t in tokenizer_json["added_tokens"]
            if t.get("special") and not _TIMESTAMP_TOKEN.match(str(t["content"]))
        )
    except (KeyError, TypeError, ValueError):
        raise UserError("tokenizer.json has no readable 'added_tokens' list") from None
    if not added:
        raise UserError("tokenizer.json has no special tokens (not a Whisper tokenizer)")
    by_content = {content: token_id for token_id, content in added}

    def require(content: str) -> int:
        if content not in by_content:
            raise UserError(f"tokenizer.json lacks the special token {content} (not a Whisper tokenizer)")
        return by_content[content]

    no_timestamps = require("<|notimestamps|>")
    if added[-1][0] != no_timestamps:
        raise UserError(
            f"tokenizer.json: special token {added[-1][1]} (id {added[-1][0]}) comes after <|notimestamps|>"
        )
    if no_timestamps + 1 + N_TIMESTAMP_TOKENS != n_vocab:
        raise UserError(
            f"tokenizer.json: <|notimestamps|> is id {no_timestamps}, so {N_TIMESTAMP_TOKENS} timestamp "
            f"tokens would end at {no_timestamps + N_TIMESTAMP_TOKENS}, but the model has {n_vocab} tokens"
        )
    sot = require("<|startoftranscript|>")
    return SpecialTokens(
        eot=require("<|endoftext|>"),
        sot=sot,
        no_timestamps=no_timestamps,
        start_of_prev=by_content.get("<|startofprev|>"),
        translate=by_content.get("<|translate|>"),
        transcribe=by_content.get("<|transcribe|>"),
        languages={
            content: token_id
            for token_id, content in added
            if _LANGUAGE_TOKEN.match(content) and token_id > sot
        },
        all_special=[content for _, content in added],
    )


def write_tokenizer(directory: Path, tokenizer_json: dict, tokens: SpecialTokens) -> None:
    """Save a `WhisperTokenizer` (tokenizer.json + tokenizer_config.json) with timestamp tokens."""
    from transformers import AddedToken, WhisperTokenizer

    source = json.loads(json.dumps(tokenizer_json))  # private copy: the merges get repaired
    _restore_missing_merges(source)
    with tempfile.TemporaryDirectory() as scratch:
        repaired = Path(scratch) / "tokenizer.json"
        repaired.write_text(json.dumps(source, ensure_ascii=False))
        tokenizer = WhisperTokenizer(
            tokenizer_file=str(repaired),
            additional_special_tokens=tokens.all_special,
            model_max_length=448,
        )
    timestamps = timestamp_tokens()
    if timestamps[0] not in tokenizer.get_vocab():  # newer tokenizer.json files already carry them
        # plain (non-special) added tokens, as in the official checkpoints: `decode` drops them
        # unless `decode_with_timestamps=True`
        tokenizer.add_tokens(
            [AddedToken(t, lstrip=False, rstrip=False, normalized=False, special=False) for t in timestamps]
        )
    ids = tokenizer.convert_tokens_to_ids(timestamps)
    expected = list(range(tokens.first_timestamp, tokens.first_timestamp + N_TIMESTAMP_TOKENS))
    if ids != expected:
        raise UserError(
            f"tokenizer.json: timestamp tokens got ids {ids[0]}..{ids[-1]}, "
            f"expected {expected[0]}..{expected[-1]}"
        )
    if tokenizer.all_special_ids[-1] + 1 != tokens.first_timestamp:
        # transformers locates the timestamps as "last special id + 1"
        raise UserError("tokenizer.json: <|notimestamps|> is not the last special token")
    tokenizer.save_pretrained(directory)


def _restore_missing_merges(tokenizer_json: dict) -> None:
    """Put back BPE merges that a Whisper `tokenizer.json` lost.

    Some multilingual Whisper tokenizer.json files lack the very first merge ("Ġ t", which
    makes token 256 " t"): it was read as the header line of merges.txt. Without it, " the",
    " this", " to" ... are encoded as two tokens where openai-whisper's tiktoken encoder gives
    one (decoding is unaffected). Whisper's BPE comes from tiktoken, where a token's rank is its
    id and every multi-byte token is the merge of two lower-ranked ones, so each missing merge
    is rebuilt by running the byte-pair merges of lower rank on the token's characters.
    """
    model = tokenizer_json.get("model", {})
    vocab: dict[str, int] = model.get("vocab") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not isinstance(merges, list) or not merges:
        return
    as_pairs = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    results = [vocab.get(a + b) for a, b in as_pairs]
    if None in results or results != sorted(results):  # not tiktoken-style: leave it alone
        return
    produced = set(results)
    special = {t["content"] for t in tokenizer_json.get("added_tokens", [])}
    missing = sorted(
        token_id
        for token, token_id in vocab.items()
        if len(token) > 1 and token_id not in produced and token not in special
    )
    if not missing:
        return
    rank = dict(zip(as_pairs, results, strict=True))
    id_to_token = {token_id: token for token, token_id in vocab.items()}
    for token_id in missing:
        pair = _last_merge(id_to_token[token_id], rank, token_id)
        if pair is None:  # not a tiktoken-style vocabulary: leave it as it is
            return
        rank[pair] = token_id
    ordered = sorted(rank.items(), key=lambda item: item[1])
    as_strings = isinstance(merges[0], str)
    model["merges"] = [f"{a} {b}" if as_strings else [a, b] for (a, b), _ in ordered]


def _last_merge(token: str, rank: dict[tuple[str, str], int], below: int) -> tuple[str, str] | None:
    """Merge the characters of `token` with merges ranked below `below` until two parts remain."""
    parts = list(token)
    while len(parts) > 2:
        candidates = [(rank.get((parts[i], parts[i + 1]), below), i) for i in range(len(parts) - 1)]
        best_rank, i = min(candidates)
        if best_rank >= below:
            return None
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None
