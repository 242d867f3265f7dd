"""Segments of rendered timestamped text, placed at each chunk's offset (integration/routes/segments.py)."""

from __future__ import annotations

import zlib

from sglang_omni_flash.integration.routes.segments import (
    compression_ratio, parse_chunk_segments, timestamp_token, verbose_segments,
)


def spans(segments):
    return [(s.start, s.end, s.text.strip(), s.closed_by_model) for s in segments]


def test_pairs_of_timestamps_make_segments():
    text = "<|0.00|> One two.<|2.40|><|2.40|> Three.<|5.00|>"
    assert spans(parse_chunk_segments(text, 10.0)) == [(0.0, 2.4, "One two.", True), (2.4, 5.0, "Three.", True)]


def test_a_segment_open_at_the_chunk_end_closes_there():
    text = "<|0.00|> One.<|1.00|><|1.50|> and then it went on"
    assert spans(parse_chunk_segments(text, 7.25)) == [(0.0, 1.0, "One.", True), (1.5, 7.25, "and then it went on", False)]


def test_empty_segments_are_dropped_and_times_clamped_to_the_chunk():
    text = "<|0.00|><|0.50|> Hi.<|3.00|><|3.00|><|4.00|> Late.<|29.98|>"
    assert spans(parse_chunk_segments(text, 12.0)) == [(0.5, 3.0, "Hi.", True), (4.0, 12.0, "Late.", True)]


def test_text_without_timestamps_is_one_segment_over_the_chunk():
    assert spans(parse_chunk_segments(" just words", 4.0)) == [(0.0, 4.0, "just words", False)]
    assert parse_chunk_segments("", 4.0) == [] and parse_chunk_segments("<|0.00|><|1.00|>", 4.0) == []


def test_verbose_segments_are_offset_by_each_chunk_start_and_numbered_across_chunks():
    chunks = [(0.0, 29.5, "<|0.00|> A.<|3.00|><|3.00|> B<|29.50|>", None), (29.5, 10.0, "", None),
              (39.5, 8.0, "<|0.20|> C.<|6.00|>", None)]
    encoded = []
    segs = verbose_segments(chunks, temperature=0.0, encode=lambda t: encoded.append(t) or [7, 8],
                            timestamp_begin=1000)
    assert [(s["id"], s["seek"], s["start"], s["end"], s["text"]) for s in segs] == [
        (0, 0, 0.0, 3.0, "A."), (1, 0, 3.0, 29.5, "B"), (2, 3950, 39.7, 45.5, "C.")]
    assert segs[2]["tokens"] == [timestamp_token(1000, 0.2), 7, 8, timestamp_token(1000, 6.0)] == [1010, 7, 8, 1300]
    assert encoded == [" A.", " B", " C."]  # the decoded text, leading space included
    assert all(s["temperature"] == 0.0 for s in segs)
    assert segs[0]["compression_ratio"] == segs[1]["compression_ratio"] == round(compression_ratio(" A. B"), 4)
    assert verbose_segments(chunks, temperature=0.4)[0]["tokens"] == []
    assert "avg_logprob" not in segs[0] and "no_speech_prob" not in segs[0]  # unknown without the stage's verdict


def test_verbose_segments_carry_the_verdict_of_their_window():
    report = {"temperature": 0.4, "avg_logprob": -0.31234, "compression_ratio": 1.23456, "no_speech_prob": 0.0123456}
    chunks = [(0.0, 10.0, "<|0.00|> A.<|3.00|><|3.00|> B.<|6.00|>", report), (10.0, 5.0, "<|0.00|> C.<|2.00|>", None)]
    segs = verbose_segments(chunks, temperature=0.0)
    assert [(s["temperature"], s["avg_logprob"], s["compression_ratio"], s["no_speech_prob"]) for s in segs[:2]] == [
        (0.4, -0.31234, 1.2346, 0.0123456)] * 2
    assert segs[2]["temperature"] == 0.0 and "avg_logprob" not in segs[2]


def test_compression_ratio_is_openai_whispers():
    text = "the same words again " * 20
    assert compression_ratio(text) == len(text.encode()) / len(zlib.compress(text.encode())) > 2.4
    assert compression_ratio("") == 0.0
