"""Whisper's logit rules over verify blocks equal transformers' processors applied row by row."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    WhisperTimeStampLogitsProcessor,
)

from sglang_omni_flash.flash.logit_rules import LogitRules, Prefix

# a small vocabulary laid out like Whisper's: text < EOS < specials < notimestamps < timestamps
V, EOS, NO_TS = 120, 50, 69
TS_BEGIN = NO_TS + 1
SUPPRESS = [3, 7, 51, 52, 53]
BEGIN_SUPPRESS = [2, EOS]
MAX_INITIAL = 5
PROMPT = [51, 55, 56]  # sot, lang, task


def hf_processors(timestamps: bool):
    cfg = GenerationConfig(eos_token_id=EOS, no_timestamps_token_id=NO_TS, max_initial_timestamp_index=MAX_INITIAL)
    procs = [SuppressTokensAtBeginLogitsProcessor(BEGIN_SUPPRESS, len(PROMPT)), SuppressTokensLogitsProcessor(SUPPRESS)]
    if timestamps:
        procs.append(WhisperTimeStampLogitsProcessor(cfg, begin_index=len(PROMPT)))
    return procs


def hf_apply(procs, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
    ids = torch.tensor([PROMPT + generated])
    scores = logits[None].clone()
    for p in procs:
        scores = p(ids, scores)
    return scores[0]


def ours(timestamps: bool) -> LogitRules:
    return LogitRules.for_whisper(V, SUPPRESS, BEGIN_SUPPRESS, EOS, NO_TS, timestamps, MAX_INITIAL)


def random_prefix(rng: random.Random, length: int) -> list[int]:
    """Token sequences that follow (or deliberately break) the timestamp pairing."""
    out, t = [], TS_BEGIN
    for _ in range(length):
        kind = rng.random()
        if kind < 0.55:
            out.append(rng.randrange(0, EOS))
        elif kind < 0.9:
            t = min(V - 1, t + rng.randrange(0, 4))
            out.append(t)
        else:
            out.append(rng.randrange(TS_BEGIN, V))  # may go backwards: rules must still match
    return out


@pytest.mark.parametrize("timestamps", [False, True], ids=["no-timestamps", "timestamps"])
def test_rules_match_transformers_row_by_row_over_a_verify_block(timestamps):
    rng = random.Random(0)
    torch.manual_seed(0)
    rules, procs = ours(timestamps), hf_processors(timestamps)
    for trial in range(30):
        n, k = 3, 5
        emitted = [random_prefix(rng, rng.randrange(1, 8)) for _ in range(n)]
        candidates = torch.tensor([random_prefix(rng, k) for _ in range(n)])
        logits = torch.randn(n, k + 1, V) * 3
        # make the timestamp-probability rule fire on some rows
        logits[:, :, TS_BEGIN:] += torch.rand(n, k + 1, 1) * 4
        prefixes = [Prefix.from_tokens(emitted, TS_BEGIN, "cpu")]
        for j in range(k):
            prefixes.append(prefixes[-1].extend(candidates[:, j], TS_BEGIN))
        if not timestamps:
            block = Prefix.lengths_only(min(map(len, emitted)), max(map(len, emitted)) + k)
        else:
            block = Prefix.interleave(prefixes)
        got = rules.apply(logits.clone(), block)
        for b in range(n):
            for i in range(k + 1):
                want = hf_apply(procs, emitted[b] + candidates[b, :i].tolist(), logits[b, i])
                assert torch.equal(got[b, i], want), (trial, b, i)


@pytest.mark.parametrize("timestamps", [False, True], ids=["no-timestamps", "timestamps"])
def test_first_generated_position_gets_begin_suppress_and_initial_timestamp_limit(timestamps):
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    got = ours(timestamps).apply(logits.clone(), Prefix.from_tokens([[]] * 4, TS_BEGIN, "cpu"))
    procs = hf_processors(timestamps)
    for b in range(4):
        assert torch.equal(got[b], hf_apply(procs, [], logits[b]))
    assert torch.isinf(got[:, BEGIN_SUPPRESS]).all()
    if timestamps:
        allowed = torch.isfinite(got[0]).nonzero().flatten().tolist()
        assert allowed and all(TS_BEGIN <= t <= TS_BEGIN + MAX_INITIAL for t in allowed)


def test_mixed_first_and_later_rows_in_one_block():
    torch.manual_seed(2)
    rows = [[], [5, 6], [], [TS_BEGIN, 9]]
    logits = torch.randn(4, V)
    for timestamps in (False, True):
        got = ours(timestamps).apply(logits.clone(), Prefix.from_tokens(rows, TS_BEGIN, "cpu"))
        procs = hf_processors(timestamps)
        for b, row in enumerate(rows):
            assert torch.equal(got[b], hf_apply(procs, row, logits[b]))


def test_suppressed_tokens_are_never_the_argmax():
    logits = torch.zeros(2, 3, V)
    logits[..., SUPPRESS[0]] = 100.0
    out = ours(False).apply(logits, Prefix.lengths_only(1, 4))
    assert (out.argmax(-1) != SUPPRESS[0]).all()


def test_the_worker_rows_equal_sglang_omnis_timestamp_processor_step_by_step():
    """The decode worker applies the engine's rules to each verify row (timestamp_rows.py) where a
    stock step runs sglang-omni's WhisperTimestampLogitProcessor on the request's output_ids: the
    two agree row for row, on prefixes that follow and that break the pairing."""
    from types import SimpleNamespace

    from sglang_omni.models.whisper_asr.timestamp_logit_processor import WhisperTimestampLogitProcessor

    from sglang_omni_flash.integration.worker.timestamp_rows import TimestampRows

    rng = random.Random(3)
    torch.manual_seed(3)
    params = {"segment_timestamps": True, "timestamp_begin_id": TS_BEGIN, "no_timestamps_token_id": NO_TS,
              "eos_token_id": EOS, "max_initial_timestamp_index": MAX_INITIAL}
    req = SimpleNamespace(custom_logit_processor=WhisperTimestampLogitProcessor.to_str(),
                          sampling_params=SimpleNamespace(custom_params=params), output_ids=[])
    rows = TimestampRows("cpu")
    rules = rows.rules_for(req, V)
    assert rules is not None
    stock = WhisperTimestampLogitProcessor()
    for trial in range(40):
        emitted = random_prefix(rng, rng.randrange(1, 8))
        candidates = random_prefix(rng, 5)
        logits = torch.randn(6, V) * 3
        logits[:, TS_BEGIN:] += torch.rand(6, 1) * 4
        got = rows.verify(rules, logits.clone(), emitted, candidates)
        for i in range(6):
            req.output_ids = emitted + candidates[:i]
            want = stock(logits[i: i + 1].clone(), [{**params, "__req__": req}])[0]
            assert torch.equal(got[i], want), (trial, i)


def test_the_draft_hint_proposes_the_repeat_of_a_closing_timestamp_and_nothing_else():
    rules = ours(True).timestamps
    logits = torch.randn(3, V)
    rows = [[5, TS_BEGIN + 3], [TS_BEGIN, 5, TS_BEGIN + 3, TS_BEGIN + 3], [TS_BEGIN, 5, 6]]
    prefix = Prefix.from_tokens(rows, TS_BEGIN, "cpu")
    hinted = rules.favour_pair_repeat(logits.clone(), prefix)
    assert hinted[0].argmax() == TS_BEGIN + 3  # one timestamp after text: the segment just closed
    assert torch.equal(hinted[1:], logits[1:])  # a pair already, or text: untouched


def sequential_drafts(rules: LogitRules, logits: torch.Tensor, rows: list[list[int]]):
    """The definition of a greedy chain under the rules: position by position, each row shaped with
    its prefix plus the candidates before it, the draft hint applied, then its argmax; and each
    candidate's probability over its whole shaped row."""
    prefix = Prefix.from_tokens(rows, TS_BEGIN, "cpu")
    picks, probs = [], []
    for j in range(logits.shape[1]):
        row = rules.apply(logits[:, j].clone(), prefix)
        rules.timestamps.favour_pair_repeat(row, prefix)
        picks.append(row.argmax(-1))
        probs.append(torch.softmax(row, dim=-1).amax(dim=-1))
        prefix = prefix.extend(picks[-1], TS_BEGIN)
    return torch.stack(picks, 1), torch.stack(probs, 1)


@pytest.mark.parametrize("seed", range(4))
def test_timestamped_drafts_shaped_at_once_on_few_columns_equal_the_sequential_chain(seed):
    """LogitRules.draft_chain (engine and decode worker) shapes every position in one call from a
    guess of the earlier candidates, on each row's best text columns, EOS and the timestamps: its
    candidates are the chain drafted position by position over the whole vocabulary, on prefixes
    at the first position, inside and after pairs, and with rules that force timestamps. With the
    decode worker's rules (timestamps only) the probabilities that cut chains are the whole rows'."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for trial in range(50):
        rules = ours(True) if trial % 2 else LogitRules([ours(True).timestamps])
        batch, k = rng.randrange(1, 4), rng.randrange(1, 9)
        rows = [[] if rng.random() < 0.2 else random_prefix(rng, rng.randrange(1, 8)) for _ in range(batch)]
        logits = torch.randn(batch, k, V) * 3
        logits[..., TS_BEGIN:] += torch.rand(batch, k, 1) * 6 - 2  # timestamps sometimes win together
        logits[..., EOS] += torch.rand(batch, k) * 4
        want, probability = sequential_drafts(rules, logits, rows)
        got, confidence = rules.draft_chain(logits.clone(), Prefix.from_tokens(rows, TS_BEGIN, "cpu"))
        assert torch.equal(got, want), (trial, rows)
        assert ((confidence > 0) & (confidence <= 1)).all()
        if len(rules.rules) == 1:
            torch.testing.assert_close(confidence, probability, rtol=1e-4, atol=1e-5)


def test_the_draft_hint_on_gathered_columns_equals_the_hint_on_whole_rows():
    rules = ours(True).timestamps
    logits = torch.randn(3, V)
    rows = [[5, TS_BEGIN + 3], [TS_BEGIN, 5, TS_BEGIN + 3, TS_BEGIN + 3], [TS_BEGIN, 5, 6]]
    prefix = Prefix.from_tokens(rows, TS_BEGIN, "cpu")
    columns = torch.stack([torch.randperm(V)[:40] for _ in rows])
    columns[0, 7] = TS_BEGIN + 3  # the repeat is among row 0's columns
    whole = rules.favour_pair_repeat(logits.clone(), prefix)
    some = rules.favour_pair_repeat(logits.gather(1, columns), prefix, columns)
    assert some[0, 7] == some[0].max() > logits[0].gather(0, columns[0]).max()
    assert torch.equal(some[1:], whole[1:].gather(1, columns[1:]))
