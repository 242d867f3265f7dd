"""Whisper-Flash output is token-identical to greedy decoding, whatever the proposer does.

For base and tiny.en, on the corpus test-set clips: the engine's greedy equals transformers
`generate()` (same features, same prompt); and Whisper-Flash equals the engine's greedy with an
oracle proposer (everything accepted, EOS inside a block, the R-1 budget cut), an adversarial one
(wrong at a chosen block position), a random one (nothing accepted), the real untrained drafter and the shipped trained one,
at batch sizes 1, 3 and 8, with and without timestamps. Sampling runs end to end with a seed.

Cost control (2 shared CPU cores): every clip is encoded once per model and decoded from its
encoder output; the full set runs at batch 8, subsets at batch 1 and 3.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutput

from conftest import torch_threads
from sglang_omni_flash.engine.engine import WhisperFlashEngine
from sglang_omni_flash.engine.options import EngineOptions
from sglang_omni_flash.flash.options import SpecOptions
from sglang_omni_flash.engine.prompt import build_prompt
from sglang_omni_flash.engine.proposers import AdversarialProposer, LogitsProposer, OracleProposer, RandomProposer
from sglang_omni_flash.flash.drafter import WhisperFlashDrafter

K = 8


two_threads = torch_threads(2)  # the row-invariant kernels split columns over both cores (1 thread: +35% time)


class Case:
    """One model: an engine, every clip's encoder output, and the reference transcripts."""

    def __init__(self, name: str, clips):
        self.name = name
        self.engine = WhisperFlashEngine(EngineOptions(model=name, batch_size=8, speculative=True, dtype="float32", spec=SpecOptions(pace=False)))
        self.features = self.engine.features([c.audio for c in clips])
        self.encoded = self.engine.encode(self.features)
        self.greedy = [r.tokens for r in self.engine.decode(encoder_out=self.encoded, speculative=False)]
        self._engines = {}

    def subset(self, n: int, offset: int = 0) -> list[int]:
        """n clips spread over the shorter two thirds of the transcripts (cheap, yet varied)."""
        by_length = sorted(range(len(self.greedy)), key=lambda i: len(self.greedy[i]))
        pool = by_length[: max(n, 2 * len(by_length) // 3)]
        step = max(1, len(pool) // n)
        return sorted(pool[(offset + j * step) % len(pool)] for j in range(n))

    def refs(self, rows) -> list[list[int]]:
        return [self.greedy[i] for i in rows]

    def engine_with(self, **changes) -> WhisperFlashEngine:
        """An engine sharing this case's model and drafter, with other options."""
        key = tuple(sorted(changes.items()))
        if key not in self._engines:
            base = self.engine
            options = base.options.with_(**changes)
            self._engines[key] = WhisperFlashEngine(options, model=base.model, drafter=base.drafter)
        return self._engines[key]

    def prompt(self, timestamps: bool) -> list[int]:
        special = self.engine.special
        lang = special.language_token("en") if special.multilingual else None
        return build_prompt(special, lang, "transcribe", timestamps)

    def run(self, proposer=None, rows=None, speculative=True, **changes):
        engine = self.engine_with(**changes) if changes else self.engine
        enc = self.encoded if rows is None else self.encoded[rows]
        return engine.decode(encoder_out=enc, speculative=speculative, proposer=proposer)


@pytest.fixture(scope="module", params=["base", "tiny.en"])
def case(request, test_clips):
    request.getfixturevalue("base_model_dir" if request.param == "base" else "tiny_en_model_dir")
    return Case(request.param, test_clips)


def hf_generate(case: Case, rows=None, timestamps=False) -> list[list[int]]:
    """transformers `generate()` greedy on the same encoder output, with the engine's prompt."""
    model, special = case.engine.model, case.engine.special
    enc = case.encoded if rows is None else case.encoded[rows]
    kwargs = {"language": "en", "task": "transcribe"} if special.multilingual else {}
    out = []
    with torch.inference_mode():
        for i in range(0, enc.shape[0], 8):
            res = model.generate(
                encoder_outputs=BaseModelOutput(last_hidden_state=enc[i : i + 8]),
                return_timestamps=timestamps,
                return_dict_in_generate=True,
                **kwargs,
            )
            if timestamps:  # short-form timestamp output keeps the raw ids per segment
                seqs = [segs[0]["result"]["sequences"] for segs in res["segments"]]
            else:
                seqs = list(res["sequences"])
            for s in seqs:
                s = s.tolist()[len(case.prompt(timestamps)) :]
                if special.eos in s:
                    s = s[: s.index(special.eos) + 1]
                out.append(s)
    return out


def tokens(results):
    return [r.tokens for r in results]


# ------------------------------------------------------------------------------ greedy baseline


def test_greedy_matches_transformers_generate_on_every_clip(case):
    assert case.greedy == hf_generate(case)
    assert all(t[-1] == case.engine.special.eos for t in case.greedy)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_identical_at_small_batch(case, batch):
    rows = case.subset(2 * batch)
    assert tokens(case.run(rows=rows, speculative=False, batch_size=batch)) == case.refs(rows)


def test_multilingual_prompt_detects_english(case):
    results = case.run(rows=case.subset(3), speculative=False)
    assert all(r.language == "en" for r in results)
    if case.engine.special.multilingual:
        assert results[0].prompt == case.prompt(False)


# ---------------------------------------------------------------------------------- proposers


def test_oracle_drafter_output_identical_at_batch_8(case):
    """Everything is accepted: K candidates and a bonus per round, EOS inside the last block."""
    results = case.run(OracleProposer(case.greedy, K))
    assert tokens(results) == case.greedy
    for r, ref in zip(results, case.greedy):
        assert r.target_calls == 1 + math.ceil((len(ref) - 1) / (K + 1))
    assert any((len(ref) - 1) % (K + 1) not in (0,) for ref in case.greedy)  # EOS lands inside a block


@pytest.mark.parametrize("batch", [1, 3])
def test_oracle_drafter_output_identical_at_small_batch(case, batch):
    rows = case.subset(2 * batch, offset=1)
    want = case.refs(rows)
    assert tokens(case.run(OracleProposer(want, K), rows=rows, batch_size=batch)) == want


@pytest.mark.parametrize("budget", [12, 19])
def test_budget_cut_proposes_at_most_remaining_minus_one(case, budget):
    rows = list(range(8))
    ref = [case.greedy[i][:budget] for i in rows]
    results = case.run(OracleProposer(case.greedy, K), rows=rows, max_new_tokens=budget)
    assert tokens(results) == ref
    for r in results:
        if len(r.tokens) == budget and case.engine.special.eos not in r.tokens:
            # prefill 1 token; then rounds of min(K, R-1) candidates + 1, never past the budget
            left, proposed = budget - 1, 0
            while left > 0:
                k = min(K, left - 1)
                proposed += k
                left -= k + 1
            assert r.proposed == proposed
    greedy_cut = tokens(case.run(rows=rows, speculative=False, max_new_tokens=budget))
    assert greedy_cut == ref


@pytest.mark.parametrize("wrong_at", [0, 3, 7])
def test_adversarial_drafter_output_identical_at_batch_8(case, wrong_at):
    rows = None if wrong_at == 3 else case.subset(8, offset=wrong_at)
    want = case.greedy if rows is None else case.refs(rows)
    results = case.run(AdversarialProposer(want, wrong_at, case.engine.target.vocab_size, K), rows=rows)
    assert tokens(results) == want
    for r in results:
        assert r.accepted <= wrong_at * r.rounds


@pytest.mark.parametrize("batch", [1, 3])
def test_adversarial_drafter_output_identical_at_small_batch(case, batch):
    rows = case.subset(2 * batch, offset=2)
    want = case.refs(rows)
    proposer = AdversarialProposer(want, 5, case.engine.target.vocab_size, K)
    assert tokens(case.run(proposer, rows=rows, batch_size=batch)) == want


@pytest.mark.parametrize("batch", [3, 8])
def test_random_drafter_output_identical(case, batch):
    rows = case.subset(batch + 1, offset=3)
    results = case.run(RandomProposer(case.engine.target.vocab_size, K, seed=batch), rows=rows, batch_size=batch)
    assert tokens(results) == case.refs(rows)
    assert sum(r.accepted for r in results) <= 0.05 * sum(r.proposed for r in results)


def test_untrained_drafter_output_identical_at_batch_3(case):
    """The real drafter network, untrained (it proposes what Whisper's first two blocks guess):
    history by position, acoustic K/V once, compaction on finish."""
    rows = case.subset(4, offset=4)
    untrained = WhisperFlashDrafter.from_target(case.engine.model)
    engine = WhisperFlashEngine(case.engine.options.with_(batch_size=3), model=case.engine.model, drafter=untrained)
    results = engine.decode(encoder_out=case.encoded[rows], speculative=True)
    assert tokens(results) == case.refs(rows)
    assert all(r.rounds > 0 for r in results)


@pytest.mark.parametrize("batch", [1, 4])
def test_shipped_drafter_is_found_and_output_identical(case, batch):
    """Each embedded model has a trained drafter in the package (drafters/base, drafters/tiny.en):
    the engine finds it with no flag, its output is the engine's greedy, and it is the trained one
    (an untrained or mismatched drafter gets ~1 token per target call; see docs/training.md)."""
    assert case.engine.drafter_source.startswith("shipped: ")
    assert Path(case.engine.drafter_source.split(": ", 1)[1]).name == case.name
    rows = case.subset(3 * batch, offset=2)
    results = case.run(rows=rows, batch_size=batch)
    assert tokens(results) == case.refs(rows)
    emitted = sum(len(r.tokens) for r in results)
    assert emitted / sum(r.target_calls for r in results) > 1.5


@pytest.mark.parametrize("batch", [1, 3])
def test_confidence_cut_changes_the_cost_never_the_output(case, batch):
    """The real drafter with its blocks cut where its own probability drops (`min_draft_prob`):
    fewer candidates per round, same tokens; 0 proposes every candidate the budget allows."""
    rows = case.subset(2 * batch, offset=7)
    full = case.run(rows=rows, batch_size=batch, min_draft_prob=0.0, tree_nodes=0)
    cut = case.run(rows=rows, batch_size=batch, min_draft_prob=0.5, tree_nodes=0)
    assert tokens(full) == tokens(cut) == case.refs(rows)
    per_round = lambda results: sum(r.proposed for r in results) / sum(r.rounds for r in results)  # noqa: E731
    assert per_round(cut) < per_round(full)
    assert all(r.proposed >= r.rounds for r in cut)  # at least one candidate every round
    stamped = case.run(rows=rows[:3], timestamps=True, min_draft_prob=0.5, tree_nodes=0)  # per-position rules
    assert tokens(stamped) == tokens(case.run(rows=rows[:3], speculative=False, timestamps=True))


# --------------------------------------------------------------------------------- draft trees


def second_choice_proposer(case, want, wrong_at=2):
    """First choice wrong at block position `wrong_at` (the adversary), the truth second: a chain
    stops there every round, a draft tree walks on through the sibling."""
    vocab = case.engine.target.vocab_size
    return LogitsProposer(AdversarialProposer(want, wrong_at, vocab, K), vocab, second=OracleProposer(want, K))


@pytest.mark.parametrize("batch", [1, 8])
def test_draft_tree_walks_through_second_choices_output_identical(case, batch):
    """Accepted nodes off the first chain: their K/V and history states are moved to their
    positions, and everything after depends on that being exact. Same tokens as greedy; the tree
    accepts past the wrong position and needs fewer target calls than the chain."""
    rows = list(range(8)) if batch == 8 else case.subset(3, offset=2)
    want = case.refs(rows)
    chain = case.run(second_choice_proposer(case, want), rows=rows, batch_size=batch, tree_nodes=0,
                     min_draft_prob=0.0)
    tree = case.run(second_choice_proposer(case, want), rows=rows, batch_size=batch, tree_nodes=16,
                    tree_min_prob=0.0)
    assert tokens(chain) == tokens(tree) == want
    # (a chain still accepts past the wrong position where the rules suppress the adversary's token)
    assert max(a for r in tree for a in r.accepted_lengths) == K
    per_round = lambda results: sum(r.accepted for r in results) / sum(r.rounds for r in results)  # noqa: E731
    assert per_round(tree) > 2 * per_round(chain)
    assert sum(r.target_calls for r in tree) < sum(r.target_calls for r in chain)


@pytest.mark.parametrize("budget", [1, 2, 5, 19])
def test_draft_tree_budget_and_eos(case, budget):
    """The R-1 rule in a tree (no node deeper than R-1), EOS inside the tree (nothing after it)."""
    rows = list(range(8))
    ref = [case.greedy[i][:budget] for i in rows]
    results = case.run(second_choice_proposer(case, case.greedy, wrong_at=0), rows=rows,
                       max_new_tokens=budget, tree_nodes=12, tree_min_prob=0.0)
    assert tokens(results) == ref
    assert all(len(r.tokens) <= budget for r in results)


@pytest.mark.parametrize("batch", [1, 3])
def test_draft_tree_garbage_and_real_drafter_output_identical(case, batch):
    """Random drafter logits (nothing accepted) and the model's own shipped drafter, both through
    trees with the CPU default threshold and without one."""
    rows = case.subset(2 * batch, offset=5)
    vocab = case.engine.target.vocab_size
    garbage = LogitsProposer(RandomProposer(vocab, K, seed=batch), vocab, p_first=0.3, seed=batch)
    assert tokens(case.run(garbage, rows=rows, batch_size=batch, tree_nodes=12)) == case.refs(rows)
    for min_prob in (0.0, 0.02):
        real = case.run(rows=rows, batch_size=batch, tree_nodes=12, tree_min_prob=min_prob)
        assert tokens(real) == case.refs(rows)
        assert all(r.rounds > 0 for r in real)


def test_draft_tree_falls_back_to_chains_with_timestamps_and_sampling(case):
    """Timestamp rules depend on each node's own prefix, and sampling needs the rejection rule:
    those rounds stay chains whatever tree_nodes says (a 12-node tree of this proposer would propose
    more than K nodes a round)."""
    rows = case.subset(3, offset=3)
    greedy = tokens(case.run(rows=rows, speculative=False, timestamps=True))
    stamped = case.run(second_choice_proposer(case, greedy), rows=rows, timestamps=True, tree_nodes=12)
    assert tokens(stamped) == greedy
    assert all(r.proposed <= K * r.rounds for r in stamped)
    tree = case.run(second_choice_proposer(case, case.refs(rows)), rows=rows, tree_nodes=12)
    assert sum(r.proposed for r in tree) > K * sum(r.rounds for r in tree)  # the same proposer as a tree
    sampled = case.run(second_choice_proposer(case, case.refs(rows)), rows=rows, temperature=0.7, seed=3,
                       tree_nodes=12)
    assert all(r.tokens and r.tokens[-1] == case.engine.special.eos for r in sampled)
    assert all(r.proposed <= K * r.rounds for r in sampled)


# ---------------------------------------------------------------------------------- timestamps


def test_timestamps_greedy_and_flash_identical_to_transformers(case):
    rows = case.subset(6, offset=5)
    greedy = tokens(case.run(rows=rows, speculative=False, timestamps=True))
    assert greedy == hf_generate(case, rows, timestamps=True)
    ts_begin = case.engine.special.timestamp_begin
    assert all(t[0] >= ts_begin for t in greedy)  # the first token is a timestamp
    assert tokens(case.run(OracleProposer(greedy, K), rows=rows, timestamps=True)) == greedy
    adversary = AdversarialProposer(greedy, 2, case.engine.target.vocab_size, K)
    assert tokens(case.run(adversary, rows=rows, timestamps=True, batch_size=3)) == greedy


# ------------------------------------------------------------------------------------ sampling


def test_seeded_sampling_runs_and_yields_valid_transcripts(case):
    rows = case.subset(2, offset=6)
    special = case.engine.special
    budget = 32
    suppressed = set(special.suppress_tokens)

    def sample(speculative):
        return case.run(rows=rows, speculative=speculative, temperature=0.7, seed=11, batch_size=2, max_new_tokens=budget)

    flash = sample(True)
    again = sample(True)
    plain = sample(False)
    assert tokens(flash) == tokens(again)  # same seed, same tokens
    for r in flash + plain:
        assert 1 <= len(r.tokens) <= budget
        assert r.tokens[-1] == special.eos or len(r.tokens) == budget
        assert not suppressed & set(r.tokens)
        assert all(0 <= t < case.engine.target.vocab_size for t in r.tokens)
        assert r.text.strip()
    # the oracle as a deterministic draft: rejection sampling still yields valid transcripts
    oracle = case.run(OracleProposer(case.refs(rows), K), rows=rows, temperature=0.7, seed=11, batch_size=2)
    assert all(r.tokens[-1] == special.eos for r in oracle)
