"""Start-up choice of the drafter for `--asr.speculative whisper-flash` (no server needed)."""

from __future__ import annotations

import pytest

from sglang_omni_flash.errors import UserError


@pytest.fixture(scope="module")
def drafters(base_model_dir, tiny_en_model_dir, tmp_path_factory):
    """Untrained drafters saved for base and for tiny.en: real checkpoints, wrong or right target."""
    import torch
    from transformers import WhisperForConditionalGeneration

    from sglang_omni_flash.flash.checkpoint import save_drafter
    from sglang_omni_flash.flash.drafter import WhisperFlashDrafter

    root = tmp_path_factory.mktemp("drafters")
    out = {}
    for name, model_dir in (("base", base_model_dir), ("tiny.en", tiny_en_model_dir)):
        target = WhisperForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.float32)
        out[name] = save_drafter(WhisperFlashDrafter.from_target(target), root / "shipped" / name)
    return out


def test_explicit_drafter_for_this_target_is_used(base_model_dir, drafters):
    from sglang_omni_flash.integration.serve.drafter_source import resolve_drafter

    assert resolve_drafter(str(base_model_dir), str(drafters["base"])) == drafters["base"]


def test_drafter_for_another_target_is_refused_with_what_differs(base_model_dir, drafters):
    from sglang_omni_flash.integration.serve.drafter_source import resolve_drafter

    with pytest.raises(UserError, match=r"does not fit .*d_model.*differ"):
        resolve_drafter(str(base_model_dir), str(drafters["tiny.en"]))


def test_without_a_path_the_fitting_shipped_drafter_is_found(base_model_dir, tiny_en_model_dir, drafters):
    from sglang_omni_flash.integration.serve.drafter_source import resolve_drafter

    shipped = drafters["base"].parent
    assert resolve_drafter(str(base_model_dir), None, shipped_dir=shipped) == drafters["base"]
    assert resolve_drafter(str(tiny_en_model_dir), None, shipped_dir=shipped) == drafters["tiny.en"]


def test_no_fitting_shipped_drafter_says_what_to_pass(base_model_dir, tmp_path):
    from sglang_omni_flash.integration.serve.drafter_source import resolve_drafter

    with pytest.raises(UserError, match="pass --asr.speculative_draft_model_path"):
        resolve_drafter(str(base_model_dir), None, shipped_dir=tmp_path)


def test_stage_factory_refuses_a_wrong_drafter_before_building_anything(base_model_dir, drafters):
    pytest.importorskip("sglang_omni")
    from sglang_omni_flash.integration.serve.stages import create_whisper_flash_asr_executor

    with pytest.raises(UserError, match="does not fit"):
        create_whisper_flash_asr_executor(str(base_model_dir), speculative="whisper-flash",
                                          speculative_draft_model_path=str(drafters["tiny.en"]))
