"""kernels/encoder_attention.cpp: Whisper's encoder self-attention in bf16 on AVX512-BF16 dot products.

What must hold for it to replace torch's attention in the encoder: it computes attention (against
float64, no worse than torch's own bf16 attention on the same inputs: random heads, and base's real
encoder on real speech), in the layouts both encoders hand it (transformers' contiguous heads,
sglang-omni's strided views of one fused q/k/v projection); its bits do not depend on the thread count;
and which CPUs choose it is decided from the flags alone (AMX keeps torch's attention).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_omni_flash.kernels import encoder_attention as ea
from sglang_omni_flash.kernels.torch_ops import load

BUILT = load("encoder_attention.cpp", "skipped") and bool(torch.ops.whisper_flash.encoder_attention_built())
needs_kernel = pytest.mark.skipif(not BUILT, reason="this CPU (compiler target) has no AVX512-BF16: the kernel "
                                                    "is not built and torch's attention runs")


def reference(q, k, v, scale):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale).transpose(1, 2)


def errors(got, want):
    diff = got.double() - want
    return diff.abs().max().item(), diff.pow(2).mean().sqrt().item()


@needs_kernel
@pytest.mark.parametrize("rows,keys", [(1, 1), (15, 15), (16, 16), (17, 33), (1500, 1500), (40, 1500)])
def test_the_kernel_is_as_accurate_as_torchs_bf16_attention(rows, keys):
    g = torch.Generator().manual_seed(rows * 7 + keys)
    q = (torch.randn(2, 8, rows, 64, generator=g) * 1.5).bfloat16()
    k, v = ((torch.randn(2, 8, keys, 64, generator=g) * 1.5).bfloat16() for _ in range(2))
    want = reference(q, k, v, 0.125)
    got = torch.ops.whisper_flash.encoder_attention(q, k, v, 0.125)
    assert got.shape == (2, rows, 8, 64) and got.dtype == torch.bfloat16 and got.is_contiguous()
    torch_max, torch_rms = errors(F.scaled_dot_product_attention(q, k, v, scale=0.125).transpose(1, 2), want)
    max_err, rms = errors(got, want)
    # one bf16 rounding of the output alone is up to ~0.4% of |out|; the probabilities meet the
    # values in bf16 (as torch's bf16 attention): the same order of error, never much more
    assert rms <= 1.25 * torch_rms + 1e-4, (rms, torch_rms)
    assert max_err <= 2 * torch_max + 1e-3, (max_err, torch_max)


@needs_kernel
def test_strided_views_of_one_fused_projection_give_the_bits_of_contiguous_heads():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(1, 300, 3 * 512, generator=g).bfloat16()  # sglang-omni: qkv_proj(hidden).chunk(3)
    q, k, v = (x.view(1, 300, 8, 64).transpose(1, 2) for x in qkv.chunk(3, dim=-1))
    assert not q.is_contiguous()
    strided = ea.encoder_attention(q, k, v)
    dense = ea.encoder_attention(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(strided, dense)


@needs_kernel
def test_the_thread_count_never_changes_a_bit():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 8, 1500, 64, generator=g).bfloat16() for _ in range(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.whisper_flash.encoder_attention(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = torch.ops.whisper_flash.encoder_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
def test_base_encoder_on_real_speech_through_the_kernel_is_as_close_to_fp32_as_torchs(base_model_dir, test_clips):
    from transformers import WhisperForConditionalGeneration

    from sglang_omni_flash.engine.audio import LogMel, load_audio
    from sglang_omni_flash.engine.target import WhisperTarget

    real = max((c for c in test_clips if c.voice.endswith(":real")), key=lambda c: c.duration, default=None)
    clip = real or max(test_clips, key=lambda c: c.duration)
    fp32 = WhisperForConditionalGeneration.from_pretrained(str(base_model_dir), dtype=torch.float32).eval()
    bf16 = WhisperForConditionalGeneration.from_pretrained(str(base_model_dir), dtype=torch.bfloat16).eval()
    x = LogMel(base_model_dir, fp32.config.num_mel_bins)([load_audio(clip.audio)])
    with torch.inference_mode():
        want = fp32.model.encoder(x).last_hidden_state.double()
        stock = bf16.model.encoder(x.bfloat16()).last_hidden_state  # before the target swaps the attention
        assert ea.available(), "an AVX512-BF16 CPU without AMX chooses the kernel"
        got = WhisperTarget(bf16).encode(x)
    assert not torch.equal(got, stock), "the encoder's attention did not go through the kernel"
    _, stock_rms = errors(stock, want)
    _, rms = errors(got, want)
    assert rms <= 1.2 * stock_rms, (rms, stock_rms)


@pytest.mark.parametrize("flags,chooses", [
    ({"avx512f", "avx512_bf16"}, True),                 # AVX512-BF16, no AMX: torch runs bf16 at fp32 speed
    ({"avx512f", "avx512_bf16", "amx_bf16"}, False),    # AMX: torch's bf16 encoder is fast there
    ({"avx2", "fma"}, False),                            # no bf16 dot products
])
def test_which_cpus_choose_the_kernel_is_decided_by_their_flags(monkeypatch, flags, chooses):
    monkeypatch.setattr("sglang_omni_flash.hardware.cpu_flags", lambda cpuinfo=None: frozenset(flags))
    assert ea._cpu_chooses_kernel() is chooses
    if not chooses:
        assert not ea.available() and ea.path(torch.bfloat16) == "torch SDPA"


def test_float32_and_the_override_keep_torchs_attention(monkeypatch):
    assert ea.path(torch.float32) == "torch SDPA"
    monkeypatch.setenv("WHISPER_FLASH_ENCODER_ATTENTION", "torch")
    assert not ea.available()
    q, k, v = (torch.randn(1, 2, 5, 16).bfloat16() for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert torch.equal(ea.encoder_attention(q, k, v), want)


@needs_kernel
def test_the_servers_encoder_attention_runs_through_the_kernel():
    """The ASR stage's model (sglang-omni's `WhisperEncoderAttention`: one fused q/k/v projection):
    `cpu_model` swaps its forward for one whose attention is the kernel's, as accurate as stock."""
    from sglang_omni.models.whisper_asr.sglang_model import WhisperEncoderAttention
    from transformers import WhisperConfig

    from sglang_omni_flash.integration.worker.cpu_model import _encoder_attention_forward

    torch.manual_seed(3)
    attention = WhisperEncoderAttention(WhisperConfig(d_model=512, encoder_attention_heads=8)).eval()
    hidden = torch.randn(1, 200, 512)
    with torch.inference_mode():
        want = attention(hidden).double()  # fp32, stock
        attention = attention.to(torch.bfloat16)
        stock = attention(hidden.bfloat16())
        swapped = _encoder_attention_forward(attention)(hidden.bfloat16())
        q, k, v = (x.view(1, 200, 8, 64).transpose(1, 2) for x in attention.qkv_proj(hidden.bfloat16()).chunk(3, -1))
        by_hand = attention.out_proj(torch.ops.whisper_flash.encoder_attention(q, k, v, 0.125).reshape(1, 200, 512))
    assert torch.equal(swapped, by_hand)
    _, stock_rms = errors(stock, want)
    _, rms = errors(swapped, want)
    assert rms <= 1.2 * stock_rms, (rms, stock_rms)
