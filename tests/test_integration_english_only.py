"""English-only (`.en`) checkpoints through the real `sgl-omni serve`: the plugin fixes the prefix.

Stock sglang-omni 0.1.9 prompts every checkpoint with `<|startoftranscript|><|en|><|transcribe|>
<|notimestamps|>`; tiny.en answers EOS at once and the server returns "". Through
`WhisperFlashASRPipelineConfig` the prompt is `<|startoftranscript|><|notimestamps|>` and the
text equals transformers `generate()`.
"""

from __future__ import annotations

import pytest
import requests

from conftest import free_port, started_server, transformers_transcripts

pytest.importorskip("sglang_omni")

N_CLIPS = 4


def test_english_only_prefix_has_no_language_or_task_token(tiny_en_model_dir, base_model_dir):
    from sglang_omni.models.whisper_asr.request_builders import build_prefix_tokens
    from transformers import GenerationConfig, WhisperTokenizer

    from sglang_omni_flash.integration.serve.english_only import EnglishOnlyPrefix, is_english_only

    assert is_english_only(GenerationConfig.from_pretrained(tiny_en_model_dir))
    assert not is_english_only(GenerationConfig.from_pretrained(base_model_dir))
    tokenizer = WhisperTokenizer.from_pretrained(tiny_en_model_dir)
    ids = tokenizer.convert_tokens_to_ids
    sot, no_ts = ids("<|startoftranscript|>"), ids("<|notimestamps|>")
    assert len(build_prefix_tokens(tokenizer, language="en", task="transcribe")) == 4  # the stock bug
    view = EnglishOnlyPrefix(tokenizer)
    assert build_prefix_tokens(view, language="en", task="transcribe") == [sot, no_ts]
    assert build_prefix_tokens(view, language="en", task="transcribe", predict_timestamps=True) == [sot]
    assert len(view) == len(tokenizer)


@pytest.fixture(scope="module")
def clips(test_clips):
    real = [c for c in test_clips if c.voice.startswith("librivox")]
    synthetic = [c for c in test_clips if not c.voice.startswith("librivox")]
    return synthetic[: N_CLIPS // 2] + real[: N_CLIPS // 2]


@pytest.fixture(scope="module")
def reference_texts(tiny_en_model_dir, clips):
    texts = transformers_transcripts(tiny_en_model_dir, clips)
    assert all(texts.values())
    return texts


@pytest.fixture(scope="module")
def server(tiny_en_plain_server):
    return tiny_en_plain_server


def assert_texts_equal_reference(server, clips, reference_texts) -> None:
    for clip in clips:
        with open(clip.audio, "rb") as fh:
            resp = requests.post(f"{server.url}/v1/audio/transcriptions",
                                 data={"model": "whisper", "response_format": "json"},
                                 files={"file": (clip.audio.name, fh, "audio/wav")}, timeout=300)
        assert resp.status_code == 200, resp.text
        assert resp.json()["text"].strip() == reference_texts[clip.id], clip.id


@pytest.mark.server
def test_tiny_en_server_text_equals_transformers_generate(server, clips, reference_texts):
    assert_texts_equal_reference(server, clips, reference_texts)


@pytest.fixture(scope="module")
def spec_server(tiny_en_model_dir, tmp_path_factory):
    """`--asr.speculative whisper-flash` on tiny.en with a drafter made from tiny.en's own first two
    decoder blocks (untrained: it proposes, the target rejects, so the worker's prefill, verify and
    fall-back paths all run with the English-only prompt). `min_draft_prob 0` keeps its blocks whole
    (the base spec server tests run the default cut), so full 9-row verify passes are tested too."""
    import torch
    from transformers import WhisperForConditionalGeneration

    from sglang_omni_flash.flash.checkpoint import save_drafter
    from sglang_omni_flash.flash.drafter import WhisperFlashDrafter
    from sglang_omni_flash.serving.launch import ServeOptions

    work = tmp_path_factory.mktemp("server-en-spec")
    target = WhisperForConditionalGeneration.from_pretrained(tiny_en_model_dir, torch_dtype=torch.float32)
    drafter_dir = save_drafter(WhisperFlashDrafter.from_target(target), work / "drafter")
    options = ServeOptions(dtype="float32", model=str(tiny_en_model_dir), port=free_port(), log_file=work / "sgl-omni.log",
                           extra_args=("--asr.speculative", "whisper-flash",
                                       "--asr.speculative_draft_model_path", str(drafter_dir),
                                       "--asr.speculative_min_draft_prob", "0"))
    srv = started_server(options)
    yield srv
    srv.stop()


@pytest.mark.server
def test_tiny_en_speculative_server_text_equals_transformers_generate(spec_server, clips, reference_texts):
    assert_texts_equal_reference(spec_server, clips, reference_texts)
    stats = requests.get(f"{spec_server.url}/whisper-flash/stats", timeout=30).json()["totals"]
    assert stats["requests"] == len(clips) and stats["proposed_tokens"] > 0  # the worker decoded them
