"""The Whisper-Flash drafter and its checkpoints, on small random Whisper models (CPU, FP32)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import WhisperConfig, WhisperForConditionalGeneration

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.flash.checkpoint import (
    embedding_fingerprint,
    find_shipped_drafter,
    load_drafter,
    save_drafter,
)
from sglang_omni_flash.flash.drafter import (
    KeysLastKV,
    WhisperFlashDrafter,
    default_history_layers,
    history_from_hidden_states,
    memory_length,
    memory_rows,
    per_request,
)
from sglang_omni_flash.kernels import attention as row_kernel

D, HEADS, VOCAB, T_AUDIO, K = 64, 4, 100, 12, 8


def tiny_target(seed: int = 0, d_model: int = D, vocab: int = VOCAB, layers: int = 4):
    """A random Whisper with a 4-block decoder; biases and LNs perturbed so copies are checked."""
    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=vocab,
        d_model=d_model,
        encoder_layers=1,
        decoder_layers=layers,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model,
        num_mel_bins=8,
        max_source_positions=T_AUDIO,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.model.decoder.named_parameters():
            if "bias" in name or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    return WhisperFlashDrafter.from_target(target).eval()


def memories(drafter, batch: int = 2, hist_len: int = 10, seed: int = 2):
    """Random history states / audio -> (history_kv over positions 0..hist_len-1, acoustic_kv)."""
    g = torch.Generator().manual_seed(seed)
    n_hist = len(drafter.config.history_layers)
    states = torch.randn(batch, hist_len, n_hist, D, generator=g)
    audio = torch.randn(batch, T_AUDIO, D, generator=g)
    positions = torch.arange(hist_len).expand(batch, hist_len)
    with torch.no_grad():
        history = drafter.project_history(states)
        return drafter.history_kv(history, positions), drafter.acoustic_kv(audio), history


def draft(drafter, anchor, anchor_pos, hkv, hlen, akv):
    with torch.no_grad():
        hlen = None if hlen is None else torch.tensor(hlen)
        return drafter(torch.tensor(anchor), torch.tensor(anchor_pos), hkv, hlen, akv)


# ------------------------------------------------------------------------------------ shapes


def test_history_layer_rule():
    assert default_history_layers(32) == (1, 8, 15, 22, 29)
    assert default_history_layers(24) == (1, 6, 11, 16, 21)
    assert default_history_layers(12) == (1, 3, 5, 7, 9)
    assert default_history_layers(6) == (1, 2, 3, 4)
    assert default_history_layers(4) == (1, 2)


def test_shapes(drafter):
    hkv, akv, history = memories(drafter, batch=3)
    assert history.shape == (3, 10, D)
    assert len(hkv) == len(akv) == 2
    assert hkv[0][0].shape == hkv[0][1].shape == (3, HEADS, 10, D // HEADS)
    assert akv[1][0].shape == (3, HEADS, T_AUDIO, D // HEADS)
    logits = draft(drafter, [5, 6, 7], [10, 4, 7], hkv, [10, 4, 7], akv)
    assert logits.shape == (3, K, VOCAB)
    assert torch.isfinite(logits).all()


def test_drafter_params_exclude_shared_embedding_and_head(drafter, target):
    keys = set(drafter.state_dict())
    assert not any("embed" in k or "proj_out" in k for k in keys)
    assert "mask" in keys and "history_proj.weight" in keys and "layers.1.acoustic_attn.k_proj.weight" in keys
    emb = target.model.decoder.embed_tokens.weight
    assert all(p.data_ptr() != emb.data_ptr() for p in drafter.parameters())


def test_from_target_copies_first_two_blocks_exactly(drafter, target):
    decoder = target.model.decoder
    for i, layer in enumerate(drafter.layers):
        source = decoder.layers[i].state_dict()
        mine = layer.state_dict()
        for name, value in source.items():
            assert torch.equal(mine[name.replace("encoder_attn", "acoustic_attn")], value), name
        assert len(mine) == len(source)
    assert torch.equal(drafter.norm.weight, decoder.layer_norm.weight)
    assert torch.equal(drafter.norm.bias, decoder.layer_norm.bias)
    # copies, not aliases: training the drafter must not touch the target
    assert drafter.layers[0].fc1.weight.data_ptr() != decoder.layers[0].fc1.weight.data_ptr()


def test_matches_a_plain_reference_of_paper_a2(drafter, target):
    """Recompute one block with explicit loops over heads and a hand-written softmax."""
    hkv, akv, history = memories(drafter, batch=1, hist_len=6)
    anchor, t = 17, 5  # history holds positions 0..4; the sixth history entry must be ignored
    logits = draft(drafter, [anchor], [t], hkv, [t], akv)

    cfg, hd = drafter.config, D // HEADS
    audio_kv = akv

    def rope(x, pos):  # x [N, hd], pos [N]
        inv = 1.0 / (cfg.rope_base ** (torch.arange(0, hd, 2).float() / hd))
        ang = pos.float()[:, None] * inv
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    with torch.no_grad():
        emb = target.model.decoder.embed_tokens.weight
        x = torch.cat((emb[anchor][None], drafter.mask[None].expand(K, D)))  # [K+1, d]
        block_pos = torch.arange(t, t + K + 1)
        hist = history[0, :t]
        for li, layer in enumerate(drafter.layers):
            a = layer.self_attn
            h = layer.self_attn_layer_norm(x)
            heads_out = []
            for head in range(HEADS):
                sl = slice(head * hd, (head + 1) * hd)
                q = rope((h @ a.q_proj.weight.T + a.q_proj.bias)[:, sl], block_pos) * hd**-0.5
                keys = torch.cat((rope((hist @ a.k_proj.weight.T)[:, sl], torch.arange(t)),
                                  rope((h @ a.k_proj.weight.T)[:, sl], block_pos)))
                vals = torch.cat(((hist @ a.v_proj.weight.T + a.v_proj.bias)[:, sl],
                                  (h @ a.v_proj.weight.T + a.v_proj.bias)[:, sl]))
                heads_out.append(torch.softmax(q @ keys.T, -1) @ vals)
            x = x + a.out_proj(torch.cat(heads_out, -1))
            c = layer.acoustic_attn
            h = layer.acoustic_attn_layer_norm(x)
            q = (h @ c.q_proj.weight.T + c.q_proj.bias).view(K + 1, HEADS, hd).transpose(0, 1) * hd**-0.5
            ak, av = audio_kv[li][0][0], audio_kv[li][1][0]  # [H, T, hd]
            x = x + c.out_proj((torch.softmax(q @ ak.transpose(1, 2), -1) @ av).transpose(0, 1).reshape(K + 1, D))
            x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
        expected = drafter.norm(x[1:]) @ target.proj_out.weight.T
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- attention mask


def test_history_at_or_beyond_history_len_is_ignored(drafter):
    hkv, akv, _ = memories(drafter, batch=2, hist_len=16)
    lens = [7, 12]
    clean = draft(drafter, [3, 4], lens, hkv, lens, akv)
    garbage = []
    for k, v in hkv:
        k, v = k.clone(), v.clone()
        k[0, :, 7:] = 1e4 * torch.randn_like(k[0, :, 7:])
        v[0, :, 7:] = 1e4  # finite: an engine zero-fills its cache (0 * NaN is NaN even when masked)
        k[1, :, 12:] = -1e4
        v[1, :, 12:] = 1e4
        garbage.append((k, v))
    torch.testing.assert_close(draft(drafter, [3, 4], lens, garbage, lens, akv), clean, atol=1e-5, rtol=1e-5)
    # and history truncated to exactly the valid entries gives the same answer
    short = [(k[:1, :, :7], v[:1, :, :7]) for k, v in hkv]
    akv0 = [(k[:1], v[:1]) for k, v in akv]
    torch.testing.assert_close(draft(drafter, [3], [7], short, [7], akv0), clean[:1], atol=1e-5, rtol=1e-5)


def test_attention_is_bidirectional_inside_the_block(drafter, target):
    """With causal attention the first 4 mask positions would not depend on the 4 after them."""
    hkv, akv, _ = memories(drafter, batch=1)
    full = draft(drafter, [5], [10], hkv, [10], akv)
    short_cfg = dataclasses.replace(drafter.config, block_size=4)
    short = WhisperFlashDrafter(short_cfg)
    short.load_state_dict(drafter.state_dict())
    short.bind_target(target)
    head = draft(short.eval(), [5], [10], hkv, [10], akv)
    assert head.shape == (1, 4, VOCAB)
    assert not torch.allclose(head, full[:, :4], atol=1e-3)


def test_packed_blocks_equal_one_at_a_time(drafter):
    """B packed training blocks of ONE utterance share its history (batch 1, broadcast)."""
    n = 14
    hkv, akv, _ = memories(drafter, batch=1, hist_len=n)
    anchors, positions = [11, 22, 33, 44], [0, 3, 9, 13]
    packed = draft(drafter, anchors, positions, hkv, positions, akv)  # history_len == anchor_pos
    expanded = [(k.expand(4, -1, -1, -1), v.expand(4, -1, -1, -1)) for k, v in hkv]
    torch.testing.assert_close(draft(drafter, anchors, positions, expanded, positions, akv), packed)
    for b, (anchor, t) in enumerate(zip(anchors, positions)):
        alone = draft(drafter, [anchor], [t], [(k[:, :, :t], v[:, :, :t]) for k, v in hkv], [t], akv)
        torch.testing.assert_close(packed[b : b + 1], alone, atol=1e-5, rtol=1e-5)


def test_rope_is_relative_shifting_all_positions_keeps_logits(drafter):
    hkv, akv, history = memories(drafter, batch=2, hist_len=9)
    base = draft(drafter, [5, 6], [9, 6], hkv, [9, 6], akv)
    shift = 37
    with torch.no_grad():
        shifted_kv = drafter.history_kv(history, torch.arange(9).expand(2, 9) + shift)
    # history_len still counts entries, anchor_pos moves with the history
    shifted = draft(drafter, [5, 6], [9 + shift, 6 + shift], shifted_kv, [9, 6], akv)
    torch.testing.assert_close(shifted, base, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not row_kernel.available(), reason="needs the row attention kernel (built on every x86 CPU)")
def test_the_cpu_kernels_acoustic_memory_gives_the_logits_of_sdpa(drafter):
    """At CPU inference the acoustic memory is laid out for the row attention kernel (keys
    transposed) and read by it; the logits are SDPA's to float rounding, for a memory per request
    and for one request's memory shared by a batch."""
    hkv, akv, _ = memories(drafter, batch=3)
    audio = torch.randn(3, T_AUDIO, D, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        akv = drafter.acoustic_kv(audio)
        kernel = drafter.acoustic_memory(audio)
    assert drafter.reads_keys_last(torch.device("cpu"))
    assert all(isinstance(m, KeysLastKV) and m.kt.shape == (3, HEADS, D // HEADS, T_AUDIO) for m in kernel)
    assert all(memory_length(m) == memory_length(plain) == T_AUDIO for m, plain in zip(kernel, akv))
    want = draft(drafter, [5, 6, 7], [10, 9, 4], hkv, [10, 9, 4], akv)
    got = draft(drafter, [5, 6, 7], [10, 9, 4], hkv, [10, 9, 4], kernel)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # one request's memory broadcast over the batch, as SDPA's expand does
    one = [memory_rows(m, 1, 2) for m in kernel]
    shared = draft(drafter, [5, 6, 7], [10, 9, 4], hkv, [10, 9, 4], one)
    want_shared = draft(drafter, [5, 6, 7], [10, 9, 4], hkv, [10, 9, 4], [memory_rows(m, 1, 2) for m in akv])
    torch.testing.assert_close(shared, want_shared, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not row_kernel.available(), reason="needs the row attention kernel (built on every x86 CPU)")
def test_memories_read_where_they_lie_give_the_bits_of_stacked_ones(drafter):
    """`PerRequestKV` (each request's memory its own tensors, as a server keeps them) gives every
    request the bits of the stacked `KeysLastKV`: the kernel computes a row alone either way."""
    hkv, _, _ = memories(drafter, batch=3)
    audio = torch.randn(3, T_AUDIO, D, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        stacked = drafter.acoustic_memory(audio)
        apart = [per_request([memory_rows(m, i, i + 1) for i in range(3)]) for m in stacked]
    want = draft(drafter, [5, 6, 7], [10, 9, 4], hkv, [10, 9, 4], stacked)
    got = draft(drafter, [5, 6, 7], [10, 9, 4], hkv, [10, 9, 4], apart)
    assert torch.equal(got, want)


def test_acoustic_memories_keep_their_layout_when_cut_per_request(drafter):
    """A server keeps each request's memory apart: both layouts come back in the layout they went
    in, and the cuts put back together in order are the whole."""
    audio = torch.randn(3, T_AUDIO, D, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for layers in (drafter.acoustic_kv(audio), drafter.acoustic_memory(audio)):
            per_request = [[memory_rows(m, i, i + 1) for m in layers] for i in range(3)]
            for j, whole in enumerate(layers):
                cuts = [req[j] for req in per_request]
                assert all(type(cut) is type(whole) for cut in cuts)
                assert all(torch.equal(torch.cat(parts), part) for parts, part in zip(zip(*cuts), whole))


def test_float16_keeps_the_plain_acoustic_layout(target):
    """No kernel for float16: its memory stays (k, v), read by SDPA."""
    half = WhisperFlashDrafter.from_target(target).eval().half()
    assert not half.reads_keys_last(torch.device("cpu"))
    with torch.no_grad():
        assert not isinstance(half.acoustic_memory(torch.randn(1, T_AUDIO, D).half())[0], KeysLastKV)


# ------------------------------------------------------------------------------------ ablations


def test_ablations_build_and_run(target):
    no_audio = WhisperFlashDrafter.from_target(target, use_audio=False).eval()
    assert not any("acoustic" in k for k in no_audio.state_dict())
    hkv, akv, _ = memories(no_audio, batch=1)
    assert akv == []
    assert draft(no_audio, [3], [10], hkv, [10], None).shape == (1, K, VOCAB)

    no_history = WhisperFlashDrafter.from_target(target, use_history=False).eval()
    assert not any("history" in k for k in no_history.state_dict())
    with torch.no_grad():
        akv = no_history.acoustic_kv(torch.randn(1, T_AUDIO, D))
    assert draft(no_history, [3], [10], None, None, akv).shape == (1, K, VOCAB)


def test_low_precision_runs(target):
    bf16_target = tiny_target().to(torch.bfloat16)
    d = WhisperFlashDrafter.from_target(bf16_target).eval()
    assert d.mask.dtype == torch.bfloat16
    hkv, akv, _ = memories(d, batch=2)
    logits = draft(d, [3, 4], [10, 5], hkv, [10, 5], akv)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_history_from_hidden_states(target):
    enc = torch.randn(1, T_AUDIO, D)
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 6]])
        out = target.model.decoder(input_ids=ids, encoder_hidden_states=enc, output_hidden_states=True)
    states = history_from_hidden_states(out.hidden_states, (1, 2))
    assert states.shape == (1, 3, 2, D)
    assert torch.equal(states[:, :, 0], out.hidden_states[2])
    with pytest.raises(ValueError, match="last block"):
        history_from_hidden_states(out.hidden_states, (3,))


# ---------------------------------------------------------------------------------- checkpoint


def test_checkpoint_round_trip_gives_identical_logits(drafter, target, tmp_path):
    out = save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "WhisperFlashDrafter"
    assert config["history_layers"] == [1, 2] and config["block_size"] == K
    assert config["embedding_fingerprint"] == embedding_fingerprint(target)
    loaded = load_drafter(out, target)
    assert loaded.config == drafter.config
    assert loaded.num_parameters() == drafter.num_parameters()
    hkv, akv, _ = memories(drafter, batch=2)
    lkv, lakv, _ = memories(loaded, batch=2)
    expected = draft(drafter, [3, 4], [10, 5], hkv, [10, 5], akv)
    assert torch.equal(draft(loaded, [3, 4], [10, 5], lkv, [10, 5], lakv), expected)

    half = load_drafter(save_drafter(drafter, tmp_path / "h"), target)  # fp16 on disk, fp32 here
    assert (tmp_path / "h" / "model.safetensors").stat().st_size < (out / "model.safetensors").stat().st_size
    hkv16, akv16, _ = memories(half, batch=2)
    torch.testing.assert_close(draft(half, [3, 4], [10, 5], hkv16, [10, 5], akv16),
                               draft(drafter, [3, 4], [10, 5], hkv, [10, 5], akv), atol=0.05, rtol=0.01)


def test_loading_against_a_different_target_is_refused(drafter, tmp_path):
    out = save_drafter(drafter, tmp_path / "d")
    with pytest.raises(UserError, match="embedding fingerprint") as info:
        load_drafter(out, tiny_target(seed=5))  # same shapes, different weights
    assert embedding_fingerprint(tiny_target(seed=5)) in str(info.value)
    with pytest.raises(UserError, match=r"d_model.*trained for d_model=64.*target has d_model=32"):
        load_drafter(out, tiny_target(d_model=32))
    with pytest.raises(UserError, match="vocab_size"):
        load_drafter(out, tiny_target(vocab=120))


def test_broken_checkpoints_are_user_errors(drafter, target, tmp_path):
    with pytest.raises(UserError, match="no drafter checkpoint"):
        load_drafter(tmp_path / "nowhere", target)

    out = save_drafter(drafter, tmp_path / "d")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # truncated
    with pytest.raises(UserError, match="unreadable"):
        load_drafter(out, target)
    weights.write_bytes(b"\x00garbage" * 64)
    with pytest.raises(UserError, match="unreadable"):
        load_drafter(out, target)

    (out / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        load_drafter(out, target)

    other = save_drafter(WhisperFlashDrafter.from_target(target, use_audio=False), tmp_path / "o")
    shutil.copy(other / "model.safetensors", out / "model.safetensors")
    shutil.copy(save_drafter(drafter, tmp_path / "e") / "config.json", out / "config.json")
    with pytest.raises(UserError, match="do not match its config"):
        load_drafter(out, target)


def test_fingerprints_differ_for_different_embeddings(target):
    assert embedding_fingerprint(target) == embedding_fingerprint(tiny_target())
    assert embedding_fingerprint(target) != embedding_fingerprint(tiny_target(seed=9))
    assert len(embedding_fingerprint(target)) == 16


def test_find_shipped_drafter_matches_target_identity(drafter, target, tmp_path):
    assert find_shipped_drafter(target, search_dir=tmp_path / "missing") is None
    save_drafter(WhisperFlashDrafter.from_target(tiny_target(seed=5)), tmp_path / "a-other")
    (tmp_path / "b-broken").mkdir()
    (tmp_path / "b-broken" / "config.json").write_text("][")
    assert find_shipped_drafter(target, search_dir=tmp_path) is None
    save_drafter(drafter, tmp_path / "c-mine")
    assert find_shipped_drafter(target, search_dir=tmp_path) == tmp_path / "c-mine"
    assert find_shipped_drafter(target) is None or (find_shipped_drafter(target) / "config.json").exists()


# --------------------------------------------------------------------------- real Whisper base


def _fetched_model_dir(name: str) -> Path | None:
    """The converted model directory if `whisper-flash models fetch NAME` already ran (no download)."""
    try:
        from sglang_omni_flash.models.embedded import is_fetched, model_dir
    except ImportError:
        return None
    return model_dir(name) if is_fetched(name) else None


def test_real_base_drafter_builds_runs_and_fits_in_25_mb(tmp_path):
    name, history_layers, max_mb = "base", (1, 2, 3, 4), 25  # 9,457,664 params -> 18.9 MB fp16
    model_dir = _fetched_model_dir(name)
    if model_dir is None:
        pytest.skip(f"converted Whisper {name} not available (run `whisper-flash models fetch {name}`)")
    target = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    torch.manual_seed(0)
    drafter = WhisperFlashDrafter.from_target(target).eval()
    assert drafter.config.history_layers == history_layers

    out = save_drafter(drafter, tmp_path / name)
    size = (out / "model.safetensors").stat().st_size
    print(f"{name} drafter: {drafter.num_parameters():,} params, {size / 1e6:.1f} MB fp16")
    assert size < max_mb * 1e6
    assert math.isclose(size, 2 * drafter.num_parameters(), rel_tol=0.01)

    # one round on real decoder states: prefix of 4 tokens, anchor at position 4
    d = target.config.d_model
    prefix = torch.tensor([[target.config.decoder_start_token_id, 400, 500, 600]])
    audio = torch.randn(1, 100, d)
    loaded = load_drafter(out, target)
    with torch.no_grad():
        hidden = target.model.decoder(input_ids=prefix, encoder_hidden_states=audio, output_hidden_states=True)
        history = loaded.project_history(history_from_hidden_states(hidden.hidden_states, history_layers))
        hkv, akv = loaded.history_kv(history, torch.arange(4)[None]), loaded.acoustic_kv(audio)
    logits = draft(loaded, [700], [4], hkv, [4], akv)
    assert logits.shape == (1, K, target.config.vocab_size) and torch.isfinite(logits).all()


def test_cpu_int8_changes_proposals_little_and_keeps_history_projection_fp32(target):
    torch.manual_seed(1)
    d = WhisperFlashDrafter.from_target(target).eval()
    hkv, akv, _ = memories(d, batch=2, hist_len=12)
    anchors, positions = [5, 9], [12, 12]
    ref = draft(d, anchors, positions, hkv, positions, akv)
    d.set_cpu_int8(True)
    assert d.int8_inference and d.layers[0].fc1.int8_inference and not d.history_proj.int8_inference
    got = draft(d, anchors, positions, hkv, positions, akv)
    assert got.shape == ref.shape
    probs_ref, probs_got = ref.softmax(-1), got.softmax(-1)
    assert (probs_got - probs_ref).abs().sum(-1).max() < 0.2  # total variation per position
    with torch.enable_grad():  # training is untouched: gradients take the fp32 path
        d.train()
        out = d(torch.tensor(anchors), torch.tensor(positions), hkv, torch.tensor(positions), akv)
        out[torch.isfinite(out)].sum().backward()
        assert d.layers[0].fc1.weight.grad is not None
    d.eval()
    d.set_cpu_int8(False)
    torch.testing.assert_close(draft(d, anchors, positions, hkv, positions, akv), ref)
