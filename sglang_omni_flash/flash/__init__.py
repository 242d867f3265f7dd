"""Whisper-Flash: the drafter, its checkpoints and the accept rules (engine-independent)."""

from sglang_omni_flash.flash.accept import (
    AcceptResult,
    greedy_accept,
    probs_from_logits,
    residual_distribution,
    sample_tokens,
    speculative_sample,
)
from sglang_omni_flash.flash.checkpoint import (
    embedding_fingerprint,
    find_shipped_drafter,
    load_drafter,
    save_drafter,
)
from sglang_omni_flash.flash.drafter import (
    DrafterConfig,
    WhisperFlashDrafter,
    default_history_layers,
    history_from_hidden_states,
)

__all__ = [
    "AcceptResult",
    "DrafterConfig",
    "WhisperFlashDrafter",
    "default_history_layers",
    "embedding_fingerprint",
    "find_shipped_drafter",
    "greedy_accept",
    "history_from_hidden_states",
    "load_drafter",
    "probs_from_logits",
    "residual_distribution",
    "sample_tokens",
    "save_drafter",
    "speculative_sample",
]
