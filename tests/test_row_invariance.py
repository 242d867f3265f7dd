"""Every target computation gives a row the same bits whatever else is in the call, in float32 and
bfloat16, on any x86 CPU: the reason speculative output equals greedy output by construction.

"Else in the call" is anything from 1 row to the most one verify pass holds (batch 8 x 33 rows =
264), one request or eight, a chain or a tree. Checked on base's real converted weights:

* kernels: every linear of a decoder block (fused q/k/v, out, cross q/k/v/out, fc1 with GELU, fc2)
  at every row count 1..264 and in shuffled orders, the tied head at every count where a blocked
  kernel could switch paths, the attention kernel, layer norm and the softmaxes that score tokens;
* the model: verify logits (chains, and 32-node trees whose path rows sit among siblings) equal, bit
  for bit, the logits of plain steps at the same positions, at batch 1, 3 and 8, on real audio;
* the encoder: a window encoded alone or with others has the same bits.

Fault injection: a linear whose reduction order depends on the row count (what oneDNN's bf16
kernels did on an AMX Xeon past 32 rows) is swapped in, and the same checks must catch it. That is
how a CPU without AMX shows these tests would catch what AMX did.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import torch_threads
from row_bits import MAX_ROWS, SOME_ROWS, RowCountDependentLinear, row_mismatches
from sglang_omni_flash.kernels import linear as row_linear
from sglang_omni_flash.kernels.attention import available as attention_kernel, row_attention
from sglang_omni_flash.kernels.linear import RowLinear

DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.skipif(not (row_linear.available() and attention_kernel()),
                                reason="no C++ compiler for the row-invariant kernels")


two_threads = torch_threads(2)


@pytest.fixture(scope="module")
def base(base_model_dir):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(str(base_model_dir), dtype=torch.float32).eval()


def block_linears(model, dtype) -> dict[str, RowLinear]:
    """The target's linears of decoder block 0 and the head, in dtype, as engine/target.py builds them."""
    import copy

    from sglang_omni_flash.engine.target import _Layer

    layer = _Layer(copy.deepcopy(model.model.decoder.layers[0]).to(dtype))
    head = RowLinear(model.proj_out.weight.detach().to(dtype))
    names = ("qkv", "o", "cq", "ck", "cv", "co", "fc1", "fc2")
    return {**{name: getattr(layer, name) for name in names}, "head": head}


def rows_for(lin: RowLinear, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(MAX_ROWS, lin.weight.shape[1], generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_linear_of_the_target_gives_a_row_the_same_bits_among_1_to_264_rows(base, dtype):
    linears = block_linears(base, dtype)
    assert all(lin.packed is not None for lin in linears.values())  # the kernel, not F.linear
    for name, lin in linears.items():
        counts = SOME_ROWS if name == "head" else range(1, MAX_ROWS + 1)  # the head: 26M weights a row
        x = rows_for(lin, dtype)
        assert row_mismatches(lin, x, counts) == [], (name, dtype)
        # and it computes the linear (fc1 with GELU)
        want = F.linear(x[:9].float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
        want = F.gelu(want) if lin.gelu else want
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(lin(x[:9]).float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_layer_norm_and_the_scoring_softmaxes_are_row_invariant(base, dtype):
    g = torch.Generator().manual_seed(1)
    heads, hd, keys = 8, 64, 1500
    # attention: row r of request b sees its own request's keys j < limit; rows of 1..8 requests
    q = (0.2 * torch.randn(8, heads, 33, hd, generator=g)).to(dtype)
    kt = torch.randn(8, heads, hd, keys, generator=g).to(dtype)
    v = torch.randn(8, heads, keys, hd, generator=g).to(dtype)
    limit = torch.randint(1, keys + 1, (8, 33), generator=g)

    def one_row(b, r):
        return row_attention(q[b: b + 1, :, r: r + 1], kt[b: b + 1], v[b: b + 1], limit[b: b + 1, r: r + 1])

    alone = {(b, r): one_row(b, r) for b in range(8) for r in range(33)}
    for n in (1, 3, 8):
        for rows in (1, 2, 9, 17, 33):
            out = row_attention(q[:n, :, :rows], kt[:n], v[:n], limit[:n, :rows])
            bad = [(b, r) for b in range(n) for r in range(rows) if not torch.equal(out[b:b + 1, :, r:r + 1], alone[b, r])]
            assert bad == [], (n, rows, bad[:5])
    # layer norm (torch's: one row per call of its per-row kernel) over a decoder block's width
    norm = base.model.decoder.layers[0].self_attn_layer_norm
    w, b = norm.weight.detach().to(dtype), norm.bias.detach().to(dtype)
    x = torch.randn(MAX_ROWS, w.shape[0], generator=g).to(dtype)
    assert row_mismatches(lambda t: F.layer_norm(t, (t.shape[-1],), w, b, norm.eps), x, range(1, MAX_ROWS + 1)) == []
    # the softmaxes that score emitted tokens and <|nospeech|> (fp32 over whole vocabulary rows)
    logits = torch.randn(MAX_ROWS, base.config.vocab_size, generator=g).to(dtype)
    assert row_mismatches(lambda t: torch.log_softmax(t.float(), -1), logits, SOME_ROWS) == []
    assert row_mismatches(lambda t: torch.softmax(t.float(), -1), logits, SOME_ROWS) == []


# ------------------------------------------------------------------ the model: verify == plain steps


class Model:
    """A base target in one dtype, real test clips encoded (one window per encoder call)."""

    def __init__(self, dtype, clips):
        from sglang_omni_flash.engine.engine import WhisperFlashEngine
        from sglang_omni_flash.engine.options import EngineOptions

        self.engine = WhisperFlashEngine(EngineOptions(model="base", dtype=str(dtype).removeprefix("torch."),
                                                       speculative=False, batch_size=8))
        self.target = self.engine.target
        chosen = sorted(clips, key=lambda c: c.duration)[-8:]
        self.features = self.engine.features([c.audio for c in chosen])
        with torch.inference_mode():
            self.encoded = self.target.encode(self.features)

    def verify_vs_steps(self, batch: int, tree: bool, positions: int = 32) -> list[tuple[int, int]]:
        """(request, position) of every verify row whose logits differ from the plain step's there.

        Requests 0..batch-1 take the SOT prompt, then `positions` more tokens (fixed text tokens):
        the plain steps feed them one at a time; the verify pass feeds them in ONE block after the
        prompt -- a chain, or a tree where every path node has a sibling beside it (another token at
        the same depth, hidden from the path rows by the tree mask)."""
        from sglang_omni_flash.flash.tree import tree_attention_mask

        from sglang_omni_flash.engine.prompt import build_prompt

        target, special = self.target, self.engine.special
        prompt = build_prompt(special, special.language_token("en") if special.multilingual else None, "transcribe",
                              False)
        g = torch.Generator().manual_seed(batch)
        path = torch.randint(220, 20000, (batch, positions), generator=g)
        p = len(prompt)
        tokens = torch.tensor([prompt] * batch)

        def fresh():
            cache, cross = target.new_cache(batch, 80), target.new_cross(batch, self.encoded.shape[1])
            target.fill_cross(self.encoded[:batch], cross)
            target.forward(tokens, torch.arange(p).expand(batch, p), cache, cross, kv_len=p)
            return cache, cross

        with torch.inference_mode():
            cache, cross = fresh()
            steps = []
            for t in range(positions):
                pos = torch.full((batch, 1), p + t)
                logits, _ = target.forward(path[:, t: t + 1], pos, cache, cross, kv_len=p + t + 1)
                steps.append(logits[:, 0])
            steps = torch.stack(steps, 1)  # [batch, positions, V]: after path[:t+1]

            cache, cross = fresh()
            anchor_pos = torch.full((batch,), p)
            if not tree:
                verify, _ = target.forward(path, p + torch.arange(positions).expand(batch, positions), cache, cross,
                                           kv_len=p + positions)
                rows = list(range(positions))
            else:  # node 2j: path token j at depth j (parent: node 2j-2, row 0 = path[0] as the anchor);
                # node 2j+1: a sibling of it (another token, same parent), never on the path
                depth = positions // 2  # 33 rows with 32 nodes: the anchor and 16 path nodes with 16 siblings
                parents, block, depths = [], [path[:, 0]], [0]
                for j in range(1, depth + 1):
                    parent = 0 if j == 1 else 2 * (j - 1) - 1
                    parents += [parent, parent]
                    block += [path[:, j], (path[:, j] + 7) % 20000]
                    depths += [j, j]
                block = torch.stack(block, 1)
                width = p + block.shape[1]
                parent = torch.tensor(parents).expand(batch, -1)
                verify, _ = target.forward(block, p + torch.tensor(depths).expand(batch, -1), cache, cross,
                                           kv_len=width, slots=p + torch.arange(block.shape[1]).expand(batch, -1),
                                           attn_mask=tree_attention_mask(parent, anchor_pos, width))
                rows = [0] + [2 * j - 1 for j in range(1, depth + 1)]  # the path nodes' block rows
                steps = steps[:, : depth + 1]
        return [(b, t) for b in range(batch) for t, r in enumerate(rows)
                if not torch.equal(verify[b, r], steps[b, t])]


@pytest.fixture(scope="module", params=DTYPES, ids=["float32", "bfloat16"])
def model(request, base_model_dir, test_clips):
    return Model(request.param, test_clips)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_verify_logits_equal_the_plain_steps_bit_for_bit(model, batch, tree):
    assert model.target.row_invariant
    assert model.verify_vs_steps(batch, tree) == []


def test_a_window_encoded_alone_or_among_others_has_the_same_bits(model):
    with torch.inference_mode():
        alone = model.target.encode(model.features[2:3])
    assert torch.equal(model.encoded[2:3], alone)


# ---------------------------------------------------------------------------------- fault injection


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_row_checks_catch_a_linear_whose_sums_depend_on_the_row_count(base, dtype):
    fc2 = block_linears(base, dtype)["fc2"]
    faulty = RowCountDependentLinear(fc2.weight, fc2.bias)
    x = rows_for(fc2, dtype)
    bad = row_mismatches(faulty, x, SOME_ROWS)
    # caught where the fault acts (past 32 rows); plain F.linear may differ below that too (MKL's
    # one-row fp32 gemv sums in another order than its gemm)
    assert any(call.startswith("first") and int(call.split()[-1]) > 32 for call, _ in bad)


def test_the_verify_check_catches_a_linear_whose_sums_depend_on_the_row_count(model, monkeypatch):
    """Every target linear swapped for one that sums differently past 32 rows: a batch-8 verify
    pass (264 tree rows, 256 chain rows) no longer equals the plain steps (8 rows each)."""

    def faulty(self, x):
        return RowCountDependentLinear(self.weight, self.bias, self.gelu)(x)

    monkeypatch.setattr(RowLinear, "__call__", faulty)
    assert model.verify_vs_steps(8, tree=False)
    assert model.verify_vs_steps(8, tree=True)
