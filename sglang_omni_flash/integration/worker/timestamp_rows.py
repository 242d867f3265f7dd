"""Whisper's timestamp rules on the decode worker's draft and verify rows.

A timestamped request (srt, vtt, verbose_json) reaches the stage with sglang-omni's
``WhisperTimestampLogitProcessor``, which sglang's sampler applies to one row per request: the
logits after the request's ``logit_bias``, with the request's ``output_ids`` as the prefix. A
speculative step produces k+1 logits rows per request whose prefixes are ``output_ids`` plus
the first i candidates; it applies the *engine's* rules (``flash.logit_rules``, the same code
the standalone engine speculates with, not a copy) to each row with that row's prefix, after the
same bias. The rules are openai-whisper's / transformers' (tests/test_logit_rules.py checks them
against transformers), and sglang-omni's processor implements the same ones, so row 0 of a
verify pass equals the stock step's sampled distribution and later rows equal what the stock
steps would have seen after accepting those candidates.

Candidates are drafted under the rules too (a chain: row j's prefix ends with candidate j-1), so
the drafter never proposes a token the rules forbid, and with the engine's draft hint
(``favour_pair_repeat``: after a segment's closing timestamp, propose the same timestamp to open
the next one). Greedy drafts use the engine's ``LogitRules.draft_chain``: every position shaped
in one call, on the columns that can win. Draft trees stay text-only: a tree node's rules depend
on its own path.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from sglang_omni_flash.flash.logit_rules import ApplyTimestampRules, LogitRules, Prefix
from sglang_omni_flash.flash.accept import probs_from_logits, sample_tokens


@functools.lru_cache(maxsize=1)
def _processor_id() -> str:
    from sglang_omni.models.whisper_asr.timestamp_logit_processor import WhisperTimestampLogitProcessor

    return WhisperTimestampLogitProcessor.to_str()


def is_timestamped(req) -> bool:
    """Whether the request carries sglang-omni's Whisper timestamp processor, with its parameters."""
    if req.custom_logit_processor != _processor_id():
        return False
    params = req.sampling_params.custom_params or {}
    return bool(params.get("segment_timestamps")) and \
        int(params["timestamp_begin_id"]) == int(params["no_timestamps_token_id"]) + 1


class TimestampRows:
    """The timestamp rules of the requests served, one ``ApplyTimestampRules`` per configuration."""

    def __init__(self, device):
        self.device = device
        self._rules: dict[tuple, LogitRules] = {}

    def rules_for(self, req, vocab_size: int) -> LogitRules | None:
        if not is_timestamped(req):
            return None
        p = req.sampling_params.custom_params
        initial = p.get("max_initial_timestamp_index")
        key = (vocab_size, int(p["eos_token_id"]), int(p["no_timestamps_token_id"]),
               None if initial is None else int(initial))
        if key not in self._rules:
            self._rules[key] = LogitRules([ApplyTimestampRules(*key, device=self.device)])
        return self._rules[key]

    def draft(self, rules: LogitRules, logits: Tensor, generated: list[int]) -> tuple[Tensor, Tensor]:
        """Greedy chain candidates under the rules, the engine's draft (`LogitRules.draft_chain`):
        (candidates [k], the drafter's probability of each [k]) from drafter logits [k, V]."""
        prefix = Prefix.from_tokens([generated], rules.timestamps.timestamp_begin, self.device)
        candidates, confidence = rules.draft_chain(logits[None], prefix)
        return candidates[0], confidence[0]

    def draft_sampled(self, rules: LogitRules, logits: Tensor, generated: list[int],
                      temperature: float) -> tuple[Tensor, Tensor]:
        """Sampled chain candidates under the rules: (candidates [k], shaped logits [k, V]); each
        candidate is drawn from its row shaped with the prefix that ends with the one before
        (a sample cannot be guessed ahead, so row by row). logits are modified in place."""
        ts = rules.timestamps
        prefix = Prefix.from_tokens([generated], ts.timestamp_begin, self.device)
        picks = []
        for j in range(logits.shape[0]):
            row = logits[j: j + 1]
            ts.apply(row, prefix)
            ts.favour_pair_repeat(row, prefix)
            picks.append(sample_tokens(probs_from_logits(row, temperature)))
            prefix = prefix.extend(picks[-1], ts.timestamp_begin)
        return torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long, device=self.device), logits

    def verify(self, rules: LogitRules, logits: Tensor, generated: list[int], candidates: list[int]) -> Tensor:
        """Apply the rules in place to verify rows [k+1, V]: row i's prefix is generated + candidates[:i]."""
        tsb = rules.timestamps.timestamp_begin
        prefixes = [Prefix.from_tokens([generated], tsb, self.device)]
        for token in candidates:
            prefixes.append(prefixes[-1].extend(torch.tensor([token], device=self.device), tsb))
        return rules.apply(logits, Prefix.interleave(prefixes))
