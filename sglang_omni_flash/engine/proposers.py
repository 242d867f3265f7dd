"""Proposers with known behaviour, for exactness tests and diagnostics (no drafter network).

* `OracleProposer`      proposes the true continuation (e.g. a previous greedy run): everything
                        is accepted, EOS lands inside a block, the R-1 budget cut bites.
* `AdversarialProposer` the oracle, but wrong at one chosen block position: accepted stops there.
* `RandomProposer`      uniformly random tokens: (almost) nothing is accepted.
* `LogitsProposer`      any of them as drafter logits (a first and an optional second choice per
                        position), so that the draft-tree path (`flash.tree`) sees them too.

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


class LogitsProposer:
    """Drafter-like logits from fixed-token proposers: at every position `first`'s token gets
    probability ~`p_first`, `second`'s (if given, and different) ~`p_second`, and the rest of the
    mass is spread at random over the vocabulary (seeded), so a draft tree has real siblings."""

    def __init__(self, first, vocab_size: int, second=None, p_first: float = 0.7, p_second: float = 0.25,
                 seed: int = 0):
        self.first, self.second = first, second
        self.block_size = first.block_size
        self.vocab_size = vocab_size
        self.p_first, self.p_second = p_first, p_second
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, inputs: RoundInputs) -> Proposal:
        top = self.first.propose(inputs).tokens.cpu()
        n, k = top.shape
        rest = 1.0 - self.p_first - (self.p_second if self.second is not None else 0.0)
        noise = torch.rand(n, k, self.vocab_size, generator=self.generator)
        probs = rest * noise / noise.sum(-1, keepdim=True)
        if self.second is not None:
            probs.scatter_add_(2, self.second.propose(inputs).tokens.cpu()[..., None], torch.full((n, k, 1), self.p_second))
        probs.scatter_add_(2, top[..., None], torch.full((n, k, 1), self.p_first))
        return Proposal(logits=probs.log().to(inputs.anchor.device))

    def observe(self, states, positions) -> None:
        pass

    def retire(self, keep) -> None:
        pass
