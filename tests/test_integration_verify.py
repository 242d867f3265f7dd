"""The verify pass's encoder-slot shortcut (integration/verify.py) without a server: a request
whose encoder K/V sit in one ascending run of pool slots is read as a slice, and attention over
that slice is bit-identical to attention over the gathered rows. The whole pass is checked
against the plain server in test_integration_spec_server.py."""

from __future__ import annotations

import torch

from sglang_omni_flash.integration.verify import _attend, _rows, _run_start


def test_run_start_finds_only_one_ascending_run():
    assert _run_start(torch.arange(300, 1800)) == 300
    assert _run_start(torch.tensor([7])) == 7
    assert _run_start(torch.tensor([], dtype=torch.long)) is None
    assert _run_start(torch.tensor([5, 6, 8, 9])) is None  # a gap
    assert _run_start(torch.tensor([6, 5, 7, 8])) is None  # same span, not ascending
    assert _run_start(torch.tensor([4, 6, 5, 7])) is None  # ends 3 apart over 4 slots, but shuffled


def test_slice_and_gather_give_identical_attention():
    g = torch.Generator().manual_seed(0)
    pool_k = torch.randn(5000, 8, 64, generator=g)
    pool_v = torch.randn(5000, 8, 64, generator=g)
    q = torch.randn(9, 8, 64, generator=g)
    run = torch.arange(1200, 2700)
    start = _run_start(run)
    sliced = _rows(pool_k, run, start)
    assert sliced.data_ptr() == pool_k[1200].data_ptr()  # a view: nothing copied
    assert torch.equal(sliced, pool_k[run]) and sliced.stride() == pool_k[run].stride()
    a = _attend(q, _rows(pool_k, run, start), _rows(pool_v, run, start), None, 0.125)
    b = _attend(q, pool_k[run], pool_v[run], None, 0.125)
    assert torch.equal(a, b)

    scattered = run[torch.randperm(run.numel(), generator=g)]
    assert _run_start(scattered) is None
    assert torch.equal(_rows(pool_k, scattered, None), pool_k[scattered])


def test_tree_rows_have_depth_positions_and_ancestor_masks():
    """A draft tree's verify row (spec_runner builds it from flash.tree.build_tree): node r sits at
    L + depth and sees the prefix, the anchor and its own ancestors; the anchor row is row 0."""
    from sglang_omni_flash.integration.verify import VerifyRow

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
