"""Proposers with known behaviour, for exactness tests and diagnostics (no drafter network).

* `OracleProposer`      proposes the true continuation (e.g. a previous greedy run): everything
                        is accepted, EOS lands inside a block, the R-1 budget cut bites.
* `AdversarialProposer` the oracle, but wrong at one chosen block position: accepted stops there.
* `RandomProposer`      uniformly random tokens: (almost) nothing is accepted.

All of them return fixed tokens (`Proposal.tokens`); with temperature > 0 the loop treats them as
a deterministic draft (q = one-hot), which the rejection rule handles exactly.
"""

from __future__ import annotations

import torch

from sglang_omni_flash.engine.speculative import Proposal, RoundInputs


class OracleProposer:
    """Proposes `continuations[request][len(generated):][:K]`, padded with `pad` after the end."""

    def __init__(self, continuations: list[list[int]], block_size: int = 8, pad: int = 0):
        self.continuations = continuations
        self.block_size = block_size
        self.pad = pad

    def guess(self, rid: int, generated: list[int]) -> list[int]:
        ref = self.continuations[rid]
        out = list(ref[len(generated) : len(generated) + self.block_size])
        return out + [self.pad] * (self.block_size - len(out))

    def propose(self, inputs: RoundInputs) -> Proposal:
        rows = [self.guess(rid, gen) for rid, gen in zip(inputs.request_ids, inputs.generated)]
        return Proposal(tokens=torch.tensor(rows, dtype=torch.long, device=inputs.anchor.device))

    def observe(self, states, positions) -> None:
        pass

    def retire(self, keep) -> None:
        pass


class AdversarialProposer(OracleProposer):
    """The oracle with block position `wrong_at` (0-based) replaced by a different token."""

    def __init__(self, continuations, wrong_at: int, vocab_size: int, block_size: int = 8):
        super().__init__(continuations, block_size)
        self.wrong_at = wrong_at
        self.vocab_size = vocab_size

    def guess(self, rid, generated):
        out = super().guess(rid, generated)
        out[self.wrong_at] = (out[self.wrong_at] + 1) % self.vocab_size
        return out


class RandomProposer:
    """Uniform random tokens from a seeded generator."""

    def __init__(self, vocab_size: int, block_size: int = 8, seed: int = 0):
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, inputs: RoundInputs) -> Proposal:
        n = inputs.anchor.shape[0]
        tokens = torch.randint(0, self.vocab_size, (n, self.block_size), generator=self.generator)
        return Proposal(tokens=tokens.to(inputs.anchor.device))

    def observe(self, states, positions) -> None:
        pass

    def retire(self, keep) -> None:
        pass
