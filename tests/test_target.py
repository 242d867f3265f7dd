"""The lean decoder forward equals transformers' Whisper math (fp32), over a static cache with
per-request lengths, verify blocks and rollback by length."""

from __future__ import annotations

import pytest
import torch
from transformers import WhisperForConditionalGeneration

from sglang_omni_flash.engine.target import WhisperTarget

TOL = 1e-4  # fp32: absolute and relative
SCALE_TOL = 1e-5  # plus this fraction of the tensor's largest magnitude


def close(a, b):
    # Two fp32 GEMMs that sum in another order (oneDNN's packed kernels here, MKL in transformers; the
    # blocking depends on the CPU) differ by rounding that grows with the magnitudes summed: on one
    # 2-core AMD EPYC base's logits (|x| up to 38) differed by 2.1e-4 in 3 of 2.2M entries. Exactness
    # of tokens is tested end to end elsewhere; this is the float math, to 1e-5 of the tensor's scale.
    return torch.allclose(a, b, rtol=TOL, atol=TOL + SCALE_TOL * float(b.abs().max()))


@pytest.fixture(scope="module", params=["tiny.en", "base"])
def hf_model(request):
    model_dir = request.getfixturevalue("tiny_en_model_dir" if request.param == "tiny.en" else "base_model_dir")
    return WhisperForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def encoder_out(hf_model):
    """A stand-in for the encoder output (the decoder math does not care where it came from)."""
    torch.manual_seed(0)
    return torch.randn(3, hf_model.config.max_source_positions, hf_model.config.d_model)


def hf_logits_and_states(model, encoder_out, ids):
    with torch.inference_mode():
        out = model(encoder_outputs=(encoder_out,), decoder_input_ids=ids, output_hidden_states=True)
    return out.logits, out.decoder_hidden_states


def test_logits_and_history_states_match_transformers_over_prefill_then_verify(hf_model, encoder_out):
    layers = hf_model.config.decoder_layers
    history = (0, layers - 2)
    target = WhisperTarget(hf_model, history)
    torch.manual_seed(1)
    ids = torch.randint(0, 50000, (3, 14))
    ref, hidden = hf_logits_and_states(hf_model, encoder_out, ids)
    cache, cross = target.new_cache(3, 16), target.new_cross(3, encoder_out.shape[1])
    with torch.inference_mode():
        target.fill_cross(encoder_out, cross)
        pos = torch.arange(4).expand(3, 4)
        l1, s1 = target.forward(ids[:, :4], pos, cache, cross, kv_len=4)
        s1 = s1.clone()
        pos = torch.arange(4, 14).expand(3, 10)
        l2, s2 = target.forward(ids[:, 4:], pos, cache, cross, kv_len=14)
    logits = torch.cat([l1, l2], 1)
    states = torch.cat([s1, s2], 1)
    assert close(logits, ref)
    for slot, layer in enumerate(history):
        assert close(states[:, :, slot], hidden[layer + 1])


def test_rows_with_different_lengths_and_rollback_by_length(hf_model, encoder_out):
    """Row b holds a different number of positions; garbage written past a row's length (a
    rejected verify tail) is never read: the next pass at that length overwrites it."""
    target = WhisperTarget(hf_model, ())
    torch.manual_seed(2)
    lengths = [3, 7, 5]
    ids = torch.randint(0, 50000, (3, 12))
    cache, cross = target.new_cache(3, 16), target.new_cross(3, encoder_out.shape[1])
    with torch.inference_mode():
        target.fill_cross(encoder_out, cross)
        # all rows hold positions 0..7; row b keeps only lengths[b] of them (rollback by length)
        pos = torch.arange(8).expand(3, 8)
        target.forward(ids[:, :8], pos, cache, cross, kv_len=8)
        junk = torch.randint(0, 50000, (3, 4))
        tail = torch.tensor(lengths)[:, None] + torch.arange(4)
        target.forward(junk, tail, cache, cross, kv_len=12)  # written, then rolled back by length
        # a 3-token verify block at each row's own length
        block_pos = torch.tensor(lengths)[:, None] + torch.arange(3)
        block = ids.gather(1, block_pos)
        got, _ = target.forward(block, block_pos, cache, cross, kv_len=max(lengths) + 3)
    for b, n in enumerate(lengths):
        ref, _ = hf_logits_and_states(hf_model, encoder_out[b : b + 1], ids[b : b + 1, : n + 3])
        assert close(got[b], ref[0, n : n + 3])


def test_single_token_step_without_mask_matches_masked(hf_model, encoder_out):
    target = WhisperTarget(hf_model, ())
    torch.manual_seed(3)
    ids = torch.randint(0, 50000, (3, 6))
    cache, cross = target.new_cache(3, 16), target.new_cross(3, encoder_out.shape[1])
    with torch.inference_mode():
        target.fill_cross(encoder_out, cross)
        target.forward(ids[:, :5], torch.arange(5).expand(3, 5), cache, cross, kv_len=5)
        pos = torch.full((3, 1), 5)
        a, _ = target.forward(ids[:, 5:], pos, cache, cross, kv_len=6, masked=False)
        b, _ = target.forward(ids[:, 5:], pos, cache, cross, kv_len=None)
    assert close(a, b)


@pytest.mark.parametrize("keep", [[0, 2, 3], [1, 3], [3], [0, 1, 2, 3]])
def test_compaction_moves_the_kept_rows_to_the_front(keep):
    """`compact_rows` (caches with transposed keys, and the drafter's K/V) equals the gather it replaces."""
    from sglang_omni_flash.engine.kv_cache import CrossKV, KVCache

    g = torch.Generator().manual_seed(len(keep))
    for transposed in (False, True):
        cache = KVCache(2, 4, 3, 10, 5, torch.float32, "cpu", keys_transposed=transposed)
        cross = CrossKV(2, 4, 3, 7, 5, torch.float32, "cpu", keys_transposed=transposed)
        for buf in (cache.k, cache.v, cross.k, cross.v):
            buf.copy_(torch.randn(buf.shape, generator=g))
        want = [buf.index_select(1, torch.tensor(keep)).clone() for buf in (cache.k, cache.v, cross.k, cross.v)]
        cache.compact(torch.tensor(keep))
        cross.compact(torch.tensor(keep))
        for buf, w in zip((cache.k, cache.v, cross.k, cross.v), want):
            assert torch.equal(buf[:, : len(keep)], w)
