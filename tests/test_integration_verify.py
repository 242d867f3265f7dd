"""The decode step's and the verify pass's attention without a server (integration/worker/cpu_model.py,
verify.py): encoder K/V in one ascending run of pool slots are read as a slice with attention
bit-identical to the gathered rows, and a verify row's attention is the plain step's. The whole
pass is checked against the plain server in test_integration_spec_server.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_omni_flash.integration.worker import cpu_model as cpu_decode
from sglang_omni_flash.integration.worker.cpu_model import EncoderKV, attend_row, attend_rows, cross_keys, slot_run


def test_slot_run_slices_only_one_ascending_run():
    pool = torch.arange(4000.0).view(2000, 1, 2)
    for slots in (torch.arange(300, 1800), torch.tensor([7])):
        view = slot_run(pool, slots)
        assert view.data_ptr() == pool[int(slots[0])].data_ptr() and torch.equal(view, pool[slots])
    for slots in (torch.tensor([5, 6, 8, 9]), torch.tensor([6, 5, 7, 8]), torch.tensor([4, 6, 5, 7])):
        view = slot_run(pool, slots)  # a gap, not ascending, shuffled: gathered
        assert view.data_ptr() != pool.data_ptr() and torch.equal(view, pool[slots])
    assert slot_run(pool, torch.tensor([], dtype=torch.long)).shape == (0, 1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slice_and_gather_give_identical_attention(dtype):
    g = torch.Generator().manual_seed(0)
    pool_k = torch.randn(5000, 8, 64, generator=g).to(dtype)
    pool_v = torch.randn(5000, 8, 64, generator=g).to(dtype)
    q = torch.randn(8, 64, generator=g).to(dtype)
    run = torch.arange(1200, 2700)
    sliced = slot_run(pool_k, run)
    assert sliced.stride() == pool_k[run].stride()
    assert torch.equal(attend_row(q, sliced, slot_run(pool_v, run), 0.125),
                       attend_row(q, pool_k[run], pool_v[run], 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_rows_attention_is_the_decode_steps(dtype):
    """verify_forward attends row by row over the keys a row sees (chain: its predecessors; tree: its
    ancestors), the decode step over the keys up to its position: the same call on the same values."""
    from sglang_omni_flash.integration.worker.verify import VerifyRow

    g = torch.Generator().manual_seed(1)
    pool_k = torch.randn(64, 8, 64, generator=g).to(dtype)
    pool_v = torch.randn(64, 8, 64, generator=g).to(dtype)
    q = torch.randn(8, 64, generator=g).to(dtype)
    tree = VerifyRow(row=0, encoder_len=0, prefix_len=5, tokens=(1, 2, 3, 4), depths=(1, 2, 1), parents=(0, 1, 0))
    slots = torch.arange(10, 19)  # prefix 10..14, tree rows 15..18
    visible = slots[tree.mask("cpu")[2]]  # node 2: prefix, anchor, node 1, itself
    assert visible.tolist() == [10, 11, 12, 13, 14, 15, 16, 17]
    as_verified = attend_row(q, pool_k[visible], pool_v[visible], 0.125)
    as_a_step = attend_row(q, pool_k[10:18].clone(), pool_v[10:18].clone(), 0.125)  # the accepted path, laid out
    assert torch.equal(as_verified, as_a_step)


@pytest.mark.parametrize("kernel", [True, False], ids=["row-kernel", "sdpa-fallback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_rows_gives_each_verify_row_the_bits_of_its_decode_step(dtype, kernel, monkeypatch):
    """What the server's decode step and verify pass both call (attend_rows): a chain's rows (limits)
    and a tree's nodes (mask) over the pool, all rows in one call, equal one-row calls over just the
    keys each row sees, laid out as a plain decode step would have them; a cached transposed key
    block (the encoder keys) gives the same bits as the pool's keys."""
    if not kernel:
        monkeypatch.setattr(cpu_decode.row_kernel, "available", lambda: False)
    from sglang_omni_flash.integration.worker.verify import VerifyRow

    g = torch.Generator().manual_seed(4)
    pool_k = torch.randn(64, 8, 64, generator=g).to(dtype)
    pool_v = torch.randn(64, 8, 64, generator=g).to(dtype)
    q = torch.randn(4, 8, 64, generator=g).to(dtype)
    k, v = pool_k[10:19], pool_v[10:19]  # prefix 10..14, then four new rows
    chain = attend_rows(q, k, v, 0.125, limits=[6, 7, 8, 9])
    for r in range(4):
        step = attend_rows(q[r: r + 1], pool_k[10:16 + r].clone(), pool_v[10:16 + r].clone(), 0.125)
        assert torch.equal(chain[r], step[0]), r

    tree = VerifyRow(row=0, encoder_len=0, prefix_len=5, tokens=(1, 2, 3, 4), depths=(1, 2, 1), parents=(0, 1, 0))
    nodes = attend_rows(q, k, v, 0.125, mask=tree.mask("cpu"))
    prefix_and_anchor = list(range(10, 16))
    for r, below in enumerate(([], [16], [16, 17], [18])):  # the slots of each node's path below the anchor
        seen = prefix_and_anchor + below
        step = attend_rows(q[r: r + 1], pool_k[seen].clone(), pool_v[seen].clone(), 0.125)
        assert torch.equal(nodes[r], step[0]), r

    whole = attend_rows(q, k, v, 0.125)
    cached = attend_rows(q, k, v, 0.125, kt=k.permute(1, 2, 0).contiguous())
    assert torch.equal(whole, cached)


def test_encoder_layouts_are_copied_once_and_forgotten_when_their_slots_are_written():
    kpool, vpool = torch.randn(4000, 8, 64), torch.randn(4000, 8, 64)
    run = torch.arange(100, 1600)
    cache = EncoderKV()
    kt, vh = cache.layouts(layer_id=6, kbuf=kpool, vbuf=vpool, slots=run, first=100)
    assert torch.equal(kt, kpool[100:1600].permute(1, 2, 0)) and kt.is_contiguous()
    assert torch.equal(vh, vpool[100:1600].permute(1, 0, 2)) and vh.is_contiguous()
    assert cache.layouts(6, kpool, vpool, run, 100)[0] is kt  # kept: the next step reuses it
    other = cache.layouts(7, kpool, vpool, run, 100)
    cache.written(6, torch.arange(2000, 3500))  # another request's slots: nothing of layer 6 overlaps
    assert cache.layouts(6, kpool, vpool, run, 100)[1] is vh
    kpool[1599] += 1.0  # a new request's encoder states land on (some of) these slots ...
    cache.written(6, torch.arange(1599, 3099))  # ... and the write is announced
    fresh, _ = cache.layouts(6, kpool, vpool, run, 100)
    assert fresh is not kt and torch.equal(fresh, kpool[100:1600].permute(1, 2, 0))
    assert cache.layouts(7, kpool, vpool, run, 100) == other  # other layers' planes were not written

    small = EncoderKV(max_bytes=4 * kt.numel() * 4)  # room for two layers' pairs: the least recently used goes
    a = small.layouts(6, kpool, vpool, torch.arange(1500), 0)
    small.layouts(7, kpool, vpool, torch.arange(1500), 0)
    small.layouts(6, kpool, vpool, torch.arange(1500), 0)  # a used again
    small.layouts(8, kpool, vpool, torch.arange(1500), 0)
    assert small.layouts(6, kpool, vpool, torch.arange(1500), 0)[0] is a[0] and (7, 0, 1500) not in small.entries
    assert small.bytes == sum(e[0].numel() * 4 + e[1].numel() * 4 for e in small.entries.values())


def test_a_recycled_requests_scattered_encoder_slots_are_gathered_once_and_forgotten_on_any_rewrite():
    kpool, vpool = torch.randn(4000, 8, 64), torch.randn(4000, 8, 64)
    slots = torch.cat([torch.arange(3000, 3700), torch.arange(200, 1000)])  # not one run: a recycled pool
    cache = EncoderKV()
    kt, vh = cache.layouts(3, kpool, vpool, slots)
    assert torch.equal(kt, kpool[slots].permute(1, 2, 0)) and torch.equal(vh, vpool[slots].permute(1, 0, 2))
    assert cache.layouts(3, kpool, vpool, slots)[0] is kt
    cache.written(3, torch.arange(1000, 3000))  # between its pieces: untouched
    assert cache.layouts(3, kpool, vpool, slots)[0] is kt
    cache.written(3, torch.tensor([650]))  # one of its slots
    assert cache.layouts(3, kpool, vpool, slots)[0] is not kt


def test_cross_attention_over_the_head_major_copy_has_the_bits_of_the_pool_slice():
    kpool, vpool = torch.randn(3000, 8, 64), torch.randn(3000, 8, 64)
    q = torch.randn(3, 8, 64)
    cache = EncoderKV()
    k, v, kt = cross_keys(SimpleNamespace(layer_id=2), kpool, vpool, torch.arange(700, 2200), 700, cache)
    assert v.shape == k.shape == (1500, 8, 64) and v.stride() != vpool[700:2200].stride()
    assert torch.equal(attend_rows(q, k, v, 0.125, kt=kt), attend_rows(q, kpool[700:2200], vpool[700:2200], 0.125))


def test_tree_rows_have_depth_positions_and_ancestor_masks():
    """A draft tree's verify row (flash.rounds builds it with flash.tree.build_tree): node r sits at
    L + depth and sees the prefix, the anchor and its own ancestors; the anchor row is row 0."""
    from sglang_omni_flash.integration.worker.verify import VerifyRow

    # nodes: 1 = child of the anchor, 2 = child of 1, 3 = child of the anchor
    tree = VerifyRow(row=0, encoder_len=1500, prefix_len=3, tokens=(50, 7, 8, 9), depths=(1, 2, 1), parents=(0, 1, 0))
    assert tree.positions() == [3, 4, 5, 4]
    assert tree.mask("cpu").int().tolist() == [
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0, 1],
    ]
    chain = VerifyRow(row=0, encoder_len=1500, prefix_len=3, tokens=(50, 7, 8))
    assert chain.positions() == [3, 4, 5]
    assert chain.mask("cpu").int().tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_over_a_batchs_decoder_keys_gives_each_request_its_own_bits(dtype):
    from sglang_omni_flash.kernels import attention as row_kernel

    if not row_kernel.available():
        pytest.skip("the row attention kernel cannot be built here")
    torch.manual_seed(0)
    kpool, vpool = torch.randn(9000, 8, 64).to(dtype), torch.randn(9000, 8, 64).to(dtype)
    table = torch.zeros(6, 4000, dtype=torch.int32)
    lengths, encoder_len = [3, 57, 1, 130], 1500  # one key too
    free = torch.randperm(8999)[:sum(lengths) + 4 * encoder_len] + 1  # scattered slots, none is slot 0
    used = 0
    for row, n in zip((1, 4, 0, 5), lengths):
        table[row, :encoder_len + n] = free[used: used + encoder_len + n].to(torch.int32)
        used += encoder_len + n
    batch = SimpleNamespace(req_pool_indices=torch.tensor([1, 4, 0, 5]), seq_lens=torch.tensor(lengths),
                            encoder_lens=torch.tensor([encoder_len] * 4))
    plan = cpu_decode._StepPlan.of(batch, table)
    assert cpu_decode._StepPlan.of(batch, table) is plan  # worked out once per step, read by every layer
    q = torch.randn(4, 8, 64).to(dtype)
    kt = cpu_decode.dense(kpool[plan.self_slots].permute(0, 2, 3, 1))
    together = row_kernel.row_attention(q[:, :, None, :], kt, vpool[plan.self_slots].permute(0, 2, 1, 3),
                                        plan.limits, None, 0.125).reshape(4, -1)
    for i, (row, n) in enumerate(zip((1, 4, 0, 5), lengths)):
        slots = table[row, encoder_len: encoder_len + n].long()
        alone = attend_rows(q[i: i + 1], kpool[slots], vpool[slots], 0.125)[0]
        assert torch.equal(together[i], alone), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_over_each_requests_own_encoder_states_gives_the_bits_of_a_call_per_request(dtype):
    from sglang_omni_flash.kernels import attention as row_kernel

    if not row_kernel.available():
        pytest.skip("the row attention kernel cannot be built here")
    torch.manual_seed(1)
    widths = [1500, 1500, 700, 1]
    kts = [torch.randn(8, 64, w).to(dtype) for w in widths]
    vs = [torch.randn(w, 8, 64).to(dtype).permute(1, 0, 2) for w in widths]  # strided, as a pool's values
    vs[0] = vs[0].contiguous()  # and a head-major copy, as EncoderKV keeps
    q = torch.randn(4, 8, 3, 64).to(dtype)
    limit = torch.tensor([[1500, 900, 1], [1500, 1500, 1500], [700, 2, 699], [1, 1, 1]])
    together = row_kernel.row_attention_each(q, kts, vs, limit, 0.125)
    for b in range(4):
        alone = row_kernel.row_attention(q[b: b + 1], kts[b][None], vs[b][None], limit[b: b + 1], None, 0.125)
        assert torch.equal(together[b: b + 1], alone), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_cross_attention_in_one_call_gives_each_requests_rows_their_own_bits(dtype):
    from sglang_omni_flash.integration.worker.cpu_model import cross_attention

    torch.manual_seed(2)
    kpool, vpool = torch.randn(5000, 8, 64).to(dtype), torch.randn(5000, 8, 64).to(dtype)
    cache = EncoderKV()
    encoder = [cross_keys(SimpleNamespace(layer_id=3), kpool, vpool, torch.arange(f, f + 1500), f, cache)
               for f in (0, 1500, 3200)]
    counts = [9, 1, 4]
    offsets = [0, 9, 10, 14]
    q = torch.randn(sum(counts), 8, 64).to(dtype)
    together = cross_attention(q, offsets, encoder, 0.125)
    for i, (k, v, kt) in enumerate(encoder):
        for r in range(offsets[i], offsets[i + 1]):  # each row alone, as a plain step computes it
            assert torch.equal(together[r], attend_rows(q[r: r + 1], k, v, 0.125, kt=kt)[0]), (i, r)
