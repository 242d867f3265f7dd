"""Segments of a timestamped Whisper decode, placed on the timeline of the whole upload.

The ASR stage renders a timestamped decode as ``<|0.00|> text<|2.40|><|2.40|> more<|5.00|>``
(sglang-omni's ``render_timestamped_text``: model timestamps relative to the 30 s window it was
given). A long upload is decoded as consecutive chunks, so a segment's time on the upload is

    the chunk's exact start offset + the model's own timestamp,

clamped to the chunk. Whisper's timestamp rules make a window's timestamps non-decreasing, and
chunks do not overlap, so the segments of a file are monotonic. A window may stop with text after
its last timestamp (the budget ran out, or the model ended mid-segment): that segment is still
open at the chunk's end and closes there, as openai-whisper closes it at the window's end.

Pure functions (no sglang imports): tests build segments from strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sglang_omni_flash.flash.fallback import compression_ratio  # the one the engine judges fallback by

TIMESTAMP_STEP_S = 0.02  # one Whisper timestamp token
_TIMESTAMP = re.compile(r"<\|(\d+(?:\.\d+)?)\|>")


@dataclass(frozen=True)
class ChunkSegment:
    """One segment of one chunk, in seconds relative to the chunk's start."""

    start: float
    end: float
    text: str  # as decoded (Whisper's leading space kept; strip for display)
    closed_by_model: bool  # False: the chunk ended first and the segment was closed there


def parse_chunk_segments(rendered: str, chunk_duration_s: float) -> list[ChunkSegment]:
    """The segments of one chunk's rendered timestamped text (empty texts dropped)."""
    pieces = _TIMESTAMP.split(rendered)  # text, ts, text, ts, ..., text
    limit = max(0.0, float(chunk_duration_s))
    out: list[ChunkSegment] = []
    opened: float | None = None
    previous_end = 0.0

    def emit(start: float, end: float | None, text: str) -> None:
        nonlocal previous_end
        start = min(max(start, previous_end), limit)
        stop = limit if end is None else min(max(end, start), limit)
        out.append(ChunkSegment(start, stop, text, end is not None))
        previous_end = stop

    text = pieces[0]
    if text.strip():  # text before any timestamp (the rules forbid it; keep it, from the start)
        opened = 0.0
    for i in range(1, len(pieces), 2):
        stamp = float(pieces[i])
        if opened is not None and text.strip():
            emit(opened, stamp, text)
            opened = None
        else:  # a segment opens (or an empty one re-opens later)
            opened = stamp
        text = pieces[i + 1]
    if text.strip():
        emit(previous_end if opened is None else opened, None, text)
    return out


def timestamp_token(timestamp_begin: int, seconds: float) -> int:
    return timestamp_begin + int(round(seconds / TIMESTAMP_STEP_S))


def verbose_segments(chunks: list[tuple[float, float, str, dict | None]], *, temperature: float, encode=None,
                     timestamp_begin: int | None = None) -> list[dict]:
    """OpenAI verbose_json segments of consecutive chunks.

    ``chunks``: (start offset s, duration s, rendered timestamped text, the stage's verdict of its
    decode or None) per chunk, in order. The verdict (``window_scores.window_report``) gives each
    segment its window's temperature, avg_logprob, compression_ratio and no_speech_prob, as
    openai-whisper; without one the temperature is the request's and the two log-probability
    fields are left out (unknown).
    ``encode(text) -> token ids`` (the served model's tokenizer) fills ``tokens`` with the
    segment's text tokens between its two timestamp tokens, as openai-whisper lists them; without
    it ``tokens`` is empty. ``seek`` is the chunk's start in mel frames (10 ms), as in openai-whisper.
    Times are rounded to the millisecond the subtitle writers print.
    """
    segments: list[dict] = []
    for offset, duration, rendered, report in chunks:
        if report is None:
            stats = {"temperature": float(temperature),
                     "compression_ratio": round(compression_ratio(_TIMESTAMP.sub("", rendered)), 4)}
        else:
            stats = {"temperature": float(report["temperature"]), "avg_logprob": float(report["avg_logprob"]),
                     "compression_ratio": round(report["compression_ratio"], 4)}
            if report.get("no_speech_prob") is not None:
                stats["no_speech_prob"] = float(report["no_speech_prob"])
        for seg in parse_chunk_segments(rendered, duration):
            tokens: list[int] = []
            if encode is not None:
                tokens = list(encode(seg.text))
                if timestamp_begin is not None:
                    tokens = [timestamp_token(timestamp_begin, seg.start), *tokens,
                              timestamp_token(timestamp_begin, seg.end)]
            segments.append({
                "id": len(segments),
                "seek": int(round(offset * 100)),
                "start": round(offset + seg.start, 3),
                "end": round(offset + seg.end, 3),
                "text": seg.text.strip(),
                "tokens": tokens,
                **stats,
            })
    return segments
