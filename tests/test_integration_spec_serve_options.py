"""`whisper-flash serve` / `make serve`: when the launcher turns Whisper-Flash on (no server started)."""

from __future__ import annotations

import pytest

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.serving.launch import ServeOptions, speculative_args


@pytest.fixture(scope="module")
def drafters(base_model_dir, tiny_en_model_dir, tmp_path_factory):
    """Untrained drafters for base and tiny.en (from_target): enough for the start-up checks."""
    import torch
    from transformers import WhisperForConditionalGeneration

    from sglang_omni_flash.flash.checkpoint import save_drafter
    from sglang_omni_flash.flash.drafter import WhisperFlashDrafter

    out = tmp_path_factory.mktemp("drafters")
    made = {}
    for name, model_dir in (("base", base_model_dir), ("tiny.en", tiny_en_model_dir)):
        target = WhisperForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.float32)
        made[name] = save_drafter(WhisperFlashDrafter.from_target(target), out / name)
    return made


def test_off_adds_no_flag(base_model_dir):
    argv, drafter, note = speculative_args(ServeOptions(speculative="off"), base_model_dir)
    assert argv == [] and drafter is None and "plain" in note


def test_an_explicit_drafter_turns_speculation_on(base_model_dir, drafters):
    options = ServeOptions(speculative="auto", draft_model=str(drafters["base"]))
    argv, drafter, _ = speculative_args(options, base_model_dir)
    assert argv == ["--asr.speculative", "whisper-flash", "--asr.speculative_draft_model_path", str(drafters["base"])]
    assert drafter == drafters["base"]


def test_a_wrong_explicit_drafter_is_refused_before_launch(base_model_dir, drafters):
    with pytest.raises(UserError, match="does not fit"):
        speculative_args(ServeOptions(speculative="auto", draft_model=str(drafters["tiny.en"])), base_model_dir)


def test_auto_follows_the_shipped_drafters(base_model_dir):
    from sglang_omni_flash.integration.serve.drafter_source import resolve_drafter

    try:
        shipped = resolve_drafter(str(base_model_dir), None)
    except UserError:
        shipped = None
    argv, drafter, note = speculative_args(ServeOptions(speculative="auto"), base_model_dir)
    assert drafter == shipped
    assert bool(argv) == (shipped is not None)
    if shipped is None:
        assert "plain decoding" in note and "--asr.speculative_draft_model_path" in note
        with pytest.raises(UserError, match="no shipped Whisper-Flash drafter"):
            speculative_args(ServeOptions(speculative="on"), base_model_dir)


def test_flags_given_by_hand_are_left_alone(base_model_dir):
    options = ServeOptions(speculative="on", extra_args=("--asr.speculative", "whisper-flash"))
    argv, drafter, _ = speculative_args(options, base_model_dir)
    assert argv == [] and drafter is None
