"""Which Whisper-Flash drafter a speculative ASR stage uses, decided at start-up.

``--asr.speculative_draft_model_path DIR`` names it; without it the shipped drafter whose
target identity (d_model, vocabulary, decoder layers, token-embedding fingerprint) fits the
served checkpoint is used. A drafter for another target, or no fitting shipped drafter, is a
start-up error that says what to pass. Only the checkpoint's config and its token-embedding
tensor are read (not the whole model), so this costs well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.flash.checkpoint import (
    TargetIdentity,
    find_shipped_drafter,
    read_drafter_config,
)

EMBEDDING_KEY = "model.decoder.embed_tokens.weight"


def _checkpoint_file(model_path: str, name: str) -> str | None:
    from transformers.utils import cached_file

    return cached_file(model_path, name, _raise_exceptions_for_missing_entries=False)


def _token_embedding(model_path: str):
    from safetensors import safe_open

    weights = _checkpoint_file(model_path, "model.safetensors")
    if weights is None:
        index = _checkpoint_file(model_path, "model.safetensors.index.json")
        if index is None:
            raise UserError(f"{model_path} has no model.safetensors: cannot check a drafter against it")
        shard = json.loads(Path(index).read_text())["weight_map"][EMBEDDING_KEY]
        weights = _checkpoint_file(model_path, shard)
    with safe_open(weights, framework="pt") as fh:
        return fh.get_tensor(EMBEDDING_KEY)


def target_view(model_path: str) -> SimpleNamespace:
    """The parts of a transformers Whisper model that the drafter checkpoint checks read."""
    from transformers import WhisperConfig

    config = WhisperConfig.from_pretrained(model_path)
    embed = SimpleNamespace(weight=_token_embedding(model_path))
    return SimpleNamespace(config=config, model=SimpleNamespace(decoder=SimpleNamespace(embed_tokens=embed)))


def resolve_drafter(model_path: str, draft_model_path: str | None, *, shipped_dir: str | Path | None = None) -> Path:
    """The drafter directory to load for ``model_path``; UserError naming the fix otherwise."""
    target = target_view(model_path)
    have = TargetIdentity.of_target(target)
    if draft_model_path is not None:
        config = read_drafter_config(draft_model_path)
        diff = TargetIdentity.of_drafter(config).differences(have)
        if diff:
            raise UserError(
                f"--asr.speculative_draft_model_path {draft_model_path} does not fit {model_path} "
                f"({', '.join(diff)} differ): the drafter was trained for "
                f"{TargetIdentity.of_drafter(config).describe()}, the served model has {have.describe()}"
            )
        return Path(draft_model_path)
    found = find_shipped_drafter(target, search_dir=shipped_dir)
    if found is None:
        raise UserError(
            f"--asr.speculative whisper-flash: no shipped Whisper-Flash drafter fits {model_path} "
            f"({have.describe()}); pass --asr.speculative_draft_model_path DIR with a drafter trained "
            "for this checkpoint (docs/drafter.md), or serve without --asr.speculative"
        )
    return found
