"""The Whisper-Flash drafter: a two-block parallel drafter that reads the audio and the history.

Reads side by side with the paper (Sec. 3.2, Appendix A.2), generalised to any Whisper size:

* anchor    the latest emitted token y_t at text position t; the target has not processed it yet.
* mask      a learned vector m; the block is X_t = [Emb(y_t), m, ..., m] (K + 1 rows, positions t..t+K)
            and mask row j predicts y_{t+j}.
* history   the target's residual stream after a few decoder blocks (before the final layer norm) at
            the accepted positions 0..t-1, concatenated and projected to the drafter width.
* acoustic  the encoder output A = E(x), read by the drafter's OWN cross-attention projections.
* block     every drafter layer: pre-LN self-attention where the block's queries attend to
            [history ; block] in one softmax (history only before the anchor, bidirectional inside
            the block), pre-LN cross-attention to the acoustic memory, pre-LN feed-forward.

RoPE (base 10,000, rotate-half layout, FP32 phases, explicit text positions) is applied to the block's
queries and keys and to the history keys, so history keys computed once keep their meaning across
rounds: an engine caches `history_kv` by position and `acoustic_kv` once per request. The token
embedding and output head are shared with the frozen target by reference; they are not parameters of
this module, not in its state_dict and never saved (`bind_target` re-attaches them).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function
from transformers.activations import ACT2FN

from sglang_omni_flash.flash.cpu_linear import FrozenLinear, PackedLinear
from sglang_omni_flash.kernels import attention as row_kernel
from sglang_omni_flash.kernels.linear import tensor_state

if TYPE_CHECKING:
    from transformers import WhisperForConditionalGeneration

KV = tuple[Tensor, Tensor]  # (k, v), each [B, H, N, hd]


class KeysLastKV(NamedTuple):
    """An acoustic memory laid out for the CPU row attention kernel (`kernels.attention`): keys
    transposed, kt [B, H, hd, T] (contiguous over T), values v [B, H, T, hd] as in `KV`. Made once per
    request by `acoustic_memory`, read every round: the kernel reads a request's 1,500 keys once for
    all K+1 block rows, where torch's SDPA ran bf16 at its fp32 rate (2-core EPYC, 8 requests:
    3.6 -> 1.7 ms a layer in bf16, 4.8 -> 3.0 in fp32)."""

    kt: Tensor
    v: Tensor


class PerRequestKV(NamedTuple):
    """Several requests' `KeysLastKV`, kept apart: kts[b] [H, hd, T_b], vs[b] [H, T_b, hd]. A server's
    requests come and go, so stacking their memories for each draft would copy ~6 MB a request
    whenever the drafting set changes; the kernel reads each request's own tensors in one call
    (`row_attention_each`), and windows of different lengths draft together."""

    kts: list[Tensor]
    vs: list[Tensor]


AcousticMemory = KV | KeysLastKV | PerRequestKV


def memory_rows(memory: KV | KeysLastKV, start: int, stop: int) -> KV | KeysLastKV:
    """Requests start..stop-1 of one layer's acoustic memory, in its layout."""
    parts = [x[start:stop] for x in memory]
    return KeysLastKV(*parts) if isinstance(memory, KeysLastKV) else (parts[0], parts[1])


def memory_length(memory: KV | KeysLastKV) -> int:
    """How many acoustic frames a memory holds (v is [B, H, T, hd] in both layouts)."""
    return memory[1].shape[2]


def per_request(memories: list[KeysLastKV]) -> PerRequestKV:
    """One layer's `KeysLastKV` of single requests ([1, ...] each), as one `PerRequestKV`, no copy."""
    return PerRequestKV([m.kt[0] for m in memories], [m.v[0] for m in memories])


def default_history_layers(n_target_layers: int) -> tuple[int, ...]:
    """Zero-based target decoder blocks whose residual output (before the final LN) is the history.

    Rule: up to five blocks, evenly spaced, starting at block 1 and ending before the last block:
    ``step = max(1, (n - 2) // 4)`` and the blocks ``1, 1 + step, ...`` that are ``<= n - 2``, at most
    five of them. Block 0 is skipped (the drafter starts as a copy of blocks 0-1, so it adds little)
    and the last block is skipped (Hugging Face reports it only after the final layer norm). A decoder
    shallower than 3 blocks uses block 0 only.

    ====== ============================= =========================
    layers blocks                        Whisper models
    ====== ============================= =========================
    4      (1, 2)                        tiny, tiny.en, large-v3-turbo
    6      (1, 2, 3, 4)                  base, base.en
    12     (1, 3, 5, 7, 9)               small, small.en
    24     (1, 6, 11, 16, 21)            medium, medium.en
    32     (1, 8, 15, 22, 29)            large-v1/v2/v3 (the paper's choice)
    ====== ============================= =========================
    """
    if n_target_layers < 1:
        raise ValueError(f"a decoder needs at least one block, got {n_target_layers}")
    if n_target_layers < 3:
        return (0,)
    step = max(1, (n_target_layers - 2) // 4)
    return tuple(range(1, n_target_layers - 1, step))[:5]


def history_from_hidden_states(hidden_states: tuple[Tensor, ...], history_layers: tuple[int, ...]) -> Tensor:
    """Stack the history blocks' outputs from a Hugging Face decoder's ``output_hidden_states``.

    In transformers 5.x ``hidden_states[0]`` is the embedding input and ``hidden_states[i + 1]`` the
    residual output of block ``i`` -- except for the LAST block, whose entry is after the final layer
    norm, so it is refused here. Returns [B, N, n_hist, d] (feed it to `project_history`).
    """
    n_blocks = len(hidden_states) - 1
    if any(not 0 <= i <= n_blocks - 2 for i in history_layers):
        raise ValueError(
            f"history blocks {history_layers} need pre-LN outputs of blocks 0..{n_blocks - 2}; "
            "the last block is only reported after the final layer norm"
        )
    return torch.stack([hidden_states[i + 1] for i in history_layers], dim=-2)


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    """Everything that fixes the drafter's shape and its target; saved as checkpoint config.json."""

    architecture: str = "WhisperFlashDrafter"
    d_model: int  # drafter width == target decoder width
    n_heads: int  # attention heads (the target decoder's)
    ffn_dim: int  # feed-forward width (the target decoder's)
    vocab_size: int  # target vocabulary (shared embedding / head)
    n_target_layers: int  # target decoder depth
    history_layers: tuple[int, ...]  # zero-based target blocks whose residual output (before final LN) is history
    block_size: int = 8  # K mask positions proposed per round
    n_layers: int = 2  # drafter blocks, initialised from the target's first n_layers blocks
    rope_base: float = 10000.0
    max_positions: int = 448  # target's max text positions (information; RoPE itself is unbounded)
    use_audio: bool = True  # ablation switches (paper Table 3): cross-attention to the encoder output
    use_history: bool = True  # ... and attention to the target's history
    embedding_fingerprint: str = ""  # name of the shared target embedding (checkpoint.embedding_fingerprint)
    embedding_probe: tuple[float, ...] = ()  # its identity across dtypes (checkpoint.embedding_probe)
    activation: str = "gelu"  # FFN activation (Whisper's)
    layer_norm_eps: float = 1e-5
    embed_scale: float = 1.0  # sqrt(d_model) if the target scales its embeddings, else 1 (Whisper: 1)
    draft_vocab_size: int = 0  # > 0: the drafter only proposes these many target tokens (buffer `draft_vocab`)
    target_name_or_path: str = ""  # information only

    def __post_init__(self) -> None:
        object.__setattr__(self, "history_layers", tuple(int(i) for i in self.history_layers))
        object.__setattr__(self, "embedding_probe", tuple(float(x) for x in self.embedding_probe))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("RoPE needs an even head dimension")
        if self.block_size < 1 or self.n_layers < 1:
            raise ValueError("block_size and n_layers must be positive")
        if self.use_history and not self.history_layers:
            raise ValueError("use_history needs at least one history layer")
        if any(not 0 <= i < self.n_target_layers for i in self.history_layers):
            raise ValueError(f"history layers {self.history_layers} outside 0..{self.n_target_layers - 1}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["history_layers"] = list(self.history_layers)
        d["embedding_probe"] = list(self.embedding_probe)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        """Build from a config.json dict; keys that are not fields (dtype, format_version) are skipped."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# ----------------------------------------------------------------------------------------- RoPE


def rope_cos_sin(positions: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """positions [B, N] (integer text positions) -> cos, sin [B, 1, N, hd] in FP32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [B, N, hd/2]
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, N, hd]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, N, hd] rotated by its positions' phases; the math runs in FP32, the result in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


# --------------------------------------------------------------------------------------- layers


class Attention(nn.Module):
    """Whisper's attention projections (k_proj has no bias); the attention itself is in `DrafterLayer`."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = PackedLinear(d_model, d_model)
        self.k_proj = PackedLinear(d_model, d_model, bias=False)
        self.v_proj = PackedLinear(d_model, d_model)
        self.out_proj = PackedLinear(d_model, d_model)

    def heads(self, x: Tensor) -> Tensor:
        """[B, N, d] -> [B, H, N, hd]"""
        b, n, d = x.shape
        return x.view(b, n, self.n_heads, d // self.n_heads).transpose(1, 2)

    def kv(self, x: Tensor) -> KV:
        """memory [B, N, d] -> (k, v) [B, H, N, hd] (no positions)"""
        return self.heads(self.k_proj(x)), self.heads(self.v_proj(x))

    def merge(self, o: Tensor) -> Tensor:
        """[B, H, N, hd] -> out_proj([B, N, d])"""
        b, h, n, hd = o.shape
        return self.out_proj(o.transpose(1, 2).reshape(b, n, h * hd))


class DrafterLayer(nn.Module):
    """One drafter block; parameter names follow `WhisperDecoderLayer` (encoder_attn -> acoustic_attn)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        d, eps = config.d_model, config.layer_norm_eps
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=eps)
        self.self_attn = Attention(d, config.n_heads)
        if config.use_audio:
            self.acoustic_attn_layer_norm = nn.LayerNorm(d, eps=eps)
            self.acoustic_attn = Attention(d, config.n_heads)
        self.final_layer_norm = nn.LayerNorm(d, eps=eps)
        self.fc1 = PackedLinear(d, config.ffn_dim)
        self.fc2 = PackedLinear(config.ffn_dim, d)
        self.activation_fn = ACT2FN[config.activation]

    def forward(
        self,
        block: Tensor,  # [B, K+1, d]
        rope: tuple[Tensor, Tensor],  # block cos/sin [B, 1, K+1, hd]
        history: KV | None,  # k/v [B or 1, H, Lmax, hd], RoPE already on k
        attn_mask: Tensor | None,  # [B, 1, 1, Lmax + K+1] True = attend (same for every block row)
        acoustic: AcousticMemory | None,  # k/v [B or 1, H, T, hd], or the kernel's layout
    ) -> Tensor:
        bsz = block.shape[0]

        # self-attention over [history ; block] in one softmax
        h = self.self_attn_layer_norm(block)
        q = apply_rope(self.self_attn.heads(self.self_attn.q_proj(h)), *rope)  # [B, H, K+1, hd]
        k, v = self.self_attn.kv(h)
        k = apply_rope(k, *rope)
        if history is not None:
            hk, hv = history
            k = torch.cat((hk.expand(bsz, -1, -1, -1), k), dim=2)  # [B, H, Lmax + K+1, hd]
            v = torch.cat((hv.expand(bsz, -1, -1, -1), v), dim=2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # scale hd^-0.5, as Whisper
        block = block + self.self_attn.merge(o)

        # cross-attention to the acoustic memory with the drafter's own k/v
        if acoustic is not None:
            h = self.acoustic_attn_layer_norm(block)
            q = self.acoustic_attn.heads(self.acoustic_attn.q_proj(h))
            shape = (bsz, -1, -1, -1)
            scale = q.shape[-1] ** -0.5  # as SDPA's default and Whisper's
            if isinstance(acoustic, KeysLastKV):  # inference on a CPU: every key, every block row
                limit = torch.full((bsz, q.shape[2]), memory_length(acoustic), device=q.device)  # [B, K+1]
                o = row_kernel.row_attention(q, acoustic.kt.expand(shape), acoustic.v.expand(shape), limit,
                                             None, scale)
            elif isinstance(acoustic, PerRequestKV):  # the same, each request's memory its own tensors
                frames = torch.tensor([v.shape[1] for v in acoustic.vs], device=q.device)
                limit = frames[:, None].expand(bsz, q.shape[2])
                o = row_kernel.row_attention_each(q, acoustic.kts, acoustic.vs, limit, scale)
            else:
                ak, av = acoustic
                o = F.scaled_dot_product_attention(q, ak.expand(shape), av.expand(shape))
            block = block + self.acoustic_attn.merge(o)

        # feed-forward
        h = self.final_layer_norm(block)
        return block + self.fc2(self.activation_fn(self.fc1(h)))


@dataclass
class _SharedTarget:
    """The frozen target modules the drafter uses by reference (a plain holder: not registered)."""

    embed_tokens: nn.Embedding
    output_head: nn.Linear


class WhisperFlashDrafter(nn.Module):
    """Proposes K tokens in one forward pass from the anchor, the history and the acoustic memory."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        d = config.d_model
        self.mask = nn.Parameter(torch.zeros(d))  # m, learned
        if config.use_history:
            self.history_proj = PackedLinear(len(config.history_layers) * d, d)
            self.history_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)  # final LN, before the shared head
        if config.draft_vocab_size:
            # A reduced draft vocabulary (as EAGLE-3's d2t map): the shared head's rows for these token
            # ids only. On CPU the head is most of a drafter call and of a training step; a token
            # outside it is simply never proposed (the target still decides every token).
            self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self._shared: _SharedTarget | None = None
        self._draft_head: tuple | None = None  # (key, FrozenLinear) over the draft vocabulary's head rows
        self.int8_inference = False  # see set_cpu_int8

    # ------------------------------------------------------------------------- construction

    @classmethod
    def from_target(
        cls,
        target: "WhisperForConditionalGeneration",
        *,
        block_size: int = 8,
        history_layers: tuple[int, ...] | None = None,
        use_audio: bool = True,
        use_history: bool = True,
        n_layers: int = 2,
        draft_vocab: Tensor | None = None,
    ) -> "WhisperFlashDrafter":
        """A fresh drafter initialised from the target's first `n_layers` decoder blocks.

        Copied: self-attn q/k/v/o, cross-attn q/k/v/o (-> acoustic_attn), the three layer norms, the
        FFN, and the decoder's final layer norm. Fresh: the mask vector m (normal, scaled like the
        token embedding) and the history projection (+ its norm; identity on the first history block). Shared:
        embedding and output head.
        """
        from sglang_omni_flash.flash.checkpoint import embedding_fingerprint, embedding_probe

        tc = target.config
        if history_layers is None:
            history_layers = default_history_layers(tc.decoder_layers)
        if tc.decoder_layers < n_layers:
            raise ValueError(f"target has {tc.decoder_layers} decoder blocks; the drafter copies {n_layers}")
        config = DrafterConfig(
            d_model=tc.d_model,
            n_heads=tc.decoder_attention_heads,
            ffn_dim=tc.decoder_ffn_dim,
            vocab_size=tc.vocab_size,
            n_target_layers=tc.decoder_layers,
            history_layers=tuple(history_layers),
            block_size=block_size,
            n_layers=n_layers,
            max_positions=tc.max_target_positions,
            use_audio=use_audio,
            use_history=use_history,
            embedding_fingerprint=embedding_fingerprint(target),
            embedding_probe=embedding_probe(target.model.decoder.embed_tokens.weight),
            activation=tc.activation_function,
            embed_scale=math.sqrt(tc.d_model) if tc.scale_embedding else 1.0,
            target_name_or_path=str(getattr(tc, "_name_or_path", "") or ""),
            draft_vocab_size=0 if draft_vocab is None else int(torch.unique(draft_vocab).numel()),
        )
        decoder = target.model.decoder
        drafter = cls(config)
        if draft_vocab is not None:
            drafter.set_draft_vocab(draft_vocab)
        with torch.no_grad():
            emb = decoder.embed_tokens.weight
            drafter.mask.copy_(torch.randn(config.d_model) * emb.float().std().cpu())
            for layer, source in zip(drafter.layers, decoder.layers):
                _copy_block(layer, source, use_audio)
            drafter.norm.load_state_dict(decoder.layer_norm.state_dict())
            if use_history:
                # Start the projection as "take the first history block as it is": the target's residual
                # stream is what the copied blocks already read, so attention over the history means
                # something from step 0 (measured: faster early learning than a random projection).
                d = config.d_model
                drafter.history_proj.weight.zero_()
                drafter.history_proj.bias.zero_()
                drafter.history_proj.weight[:, :d].copy_(torch.eye(d))
        drafter.to(device=emb.device, dtype=emb.dtype)
        drafter.bind_target(target)
        return drafter

    def bind_target(self, target: "WhisperForConditionalGeneration") -> None:
        """(Re)attach the target's frozen token embedding and output head (used by reference)."""
        embed, head = target.model.decoder.embed_tokens, target.get_output_embeddings()
        if embed.weight.shape != (self.config.vocab_size, self.config.d_model):
            raise ValueError(f"target embedding {tuple(embed.weight.shape)} does not fit this drafter")
        self._shared = _SharedTarget(embed_tokens=embed, output_head=head)
        self._draft_head = None

    # ---------------------------------------------------------------------------- memories

    def project_history(self, states: Tensor) -> Tensor:
        """states [..., n_hist, d] (stacked history-block outputs) -> history [..., d]: concat, Linear, LN."""
        x = states.to(self.history_proj.weight.dtype).flatten(-2)  # [..., n_hist * d]
        return self.history_norm(self.history_proj(x))

    def history_kv(self, history: Tensor, positions: Tensor) -> list[KV]:
        """history [B, N, d] (projected), positions [B, N] -> per layer (k, v) [B, H, N, hd], RoPE on k.

        Depends only on the history, never on the block: an engine appends these by position.
        """
        history = history.to(self.mask.dtype)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_base)
        out = []
        for layer in self.layers:
            k, v = layer.self_attn.kv(history)
            out.append((apply_rope(k, cos, sin), v))
        return out

    def acoustic_kv(self, encoder_out: Tensor) -> list[KV]:
        """encoder_out [B, T, d] -> per layer (k, v) [B, H, T, hd]; once per request. [] without audio."""
        if not self.config.use_audio:
            return []
        encoder_out = encoder_out.to(self.mask.dtype)
        return [layer.acoustic_attn.kv(encoder_out) for layer in self.layers]

    def reads_keys_last(self, device: torch.device) -> bool:
        """Whether inference here reads the acoustic memory through the CPU row attention kernel
        (`KeysLastKV`): a CPU, float32 or bfloat16, and the kernel built. Not for training: the
        kernel has no gradient."""
        return (torch.device(device).type == "cpu" and self.mask.dtype in (torch.float32, torch.bfloat16)
                and row_kernel.available())

    def acoustic_memory(self, encoder_out: Tensor) -> list[AcousticMemory]:
        """`acoustic_kv` in the layout this device's inference reads (`reads_keys_last`); once per request."""
        layers = self.acoustic_kv(encoder_out)
        if not self.reads_keys_last(encoder_out.device):
            return layers
        return [KeysLastKV(k.transpose(-1, -2).contiguous(), v) for k, v in layers]

    # ----------------------------------------------------------------------------- drafting

    def forward(
        self,
        anchor: Tensor,  # [B] latest emitted token, not yet processed by the target
        anchor_pos: Tensor,  # [B] its text position t
        history_kv: list[KV] | None,  # per layer k/v [B or 1, H, Lmax, hd]; entries >= history_len ignored
        history_len: Tensor | None,  # [B] valid history entries (== t: positions 0..t-1)
        acoustic_kv: list[AcousticMemory] | None,  # per layer k/v [B or 1, H, T, hd], or a kernel layout
    ) -> Tensor:
        """-> logits [B, K, vocab] for the K mask positions (the anchor row's output is dropped)."""
        cfg, shared = self.config, self._require_target()
        bsz, K = anchor.shape[0], cfg.block_size
        dtype = self.mask.dtype

        # block X_t = [Emb(anchor), m, ..., m] at positions t..t+K
        anchor_emb = F.embedding(anchor, shared.embed_tokens.weight.detach()).to(dtype) * cfg.embed_scale
        block = torch.cat((anchor_emb[:, None], self.mask.expand(bsz, K, -1)), dim=1)  # [B, K+1, d]
        block_pos = anchor_pos[:, None] + torch.arange(K + 1, device=anchor.device)  # [B, K+1]
        rope = rope_cos_sin(block_pos, cfg.head_dim, cfg.rope_base)

        # attention mask over [history ; block]: history entries < history_len, the whole block
        attn_mask = None
        if cfg.use_history:
            if history_kv is None or history_len is None:
                raise ValueError("this drafter uses history: pass history_kv and history_len")
            l_max = history_kv[0][0].shape[2]
            seen = torch.arange(l_max, device=anchor.device) < history_len[:, None]  # [B, Lmax]
            in_block = torch.ones(bsz, K + 1, dtype=torch.bool, device=anchor.device)
            attn_mask = torch.cat((seen, in_block), dim=1)[:, None, None, :]  # [B, 1, 1, Lmax + K+1]
        if cfg.use_audio and acoustic_kv is None:
            raise ValueError("this drafter reads the audio: pass acoustic_kv")

        for i, layer in enumerate(self.layers):
            block = layer(
                block,
                rope,
                history_kv[i] if cfg.use_history else None,
                attn_mask,
                acoustic_kv[i] if cfg.use_audio else None,
            )

        h = self.norm(block[:, 1:])  # [B, K, d], anchor row dropped
        return self.logits(h)

    def logits(self, h: Tensor, full: bool = True) -> Tensor:
        """Final-LN states [..., d] -> logits through the shared head.

        With a draft vocabulary: full=True scatters them into [..., vocab] (-inf elsewhere, so no
        other token is ever proposed); full=False returns [..., draft_vocab_size] (training)."""
        head = self._require_target().output_head
        with record_function("drafter.head"):  # a label for benchmarks/round_costs.py --breakdown
            small = self._head_rows(head)(h.to(head.weight.dtype))
        if not full or not self.config.draft_vocab_size:
            return small
        with record_function("drafter.scatter"):
            out = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
            out.index_copy_(-1, self.draft_vocab, small)  # 2.4x faster than out[..., vocab] = small
        return out

    def _head_rows(self, head: nn.Linear) -> FrozenLinear:
        """The frozen head restricted to the draft vocabulary (the whole head without one), cached."""
        w = head.weight
        vocab = self.draft_vocab if self.config.draft_vocab_size else None
        # a derived weight (rows of the head), so not a `frozen_copy` of a module; made again after
        # in-place writes to either (load_state_dict, set_draft_vocab), by the same rule
        int8 = self.int8_inference
        key = (tensor_state(w), tensor_state(getattr(head, "bias", None)), tensor_state(vocab), int8)
        if self._draft_head is None or self._draft_head[0] != key:
            if vocab is None:
                rows = FrozenLinear.of(head, int8=int8)
            else:
                vocab = vocab.to(w.device)
                bias = None if head.bias is None else head.bias.index_select(0, vocab)
                rows = FrozenLinear(w.detach().index_select(0, vocab), bias, int8=int8)
            self._draft_head = (key, rows)
        return self._draft_head[1]

    def set_cpu_int8(self, enabled: bool = True) -> None:
        """At CPU inference, run the drafter's linears and its head rows on int8 copies of their weights.

        A drafter call streams its weights for a few rows, so on a CPU it costs what its bytes cost;
        int8 (one scale per output row, inputs quantized per call) streams a quarter of them. Only the
        proposals change, and the target verifies every one, so the output cannot. Training and
        other devices are unaffected (gradients and non-CPU tensors take the fp32 path)."""
        self.int8_inference = bool(enabled)
        for module in self.modules():
            if isinstance(module, PackedLinear):
                module.int8_inference = self.int8_inference
        if self.config.use_history:
            # Not the history projection: its input is the target's raw residual streams, whose few
            # outlier channels swamp the input's single 7-bit scale (measured on held-out teacher data:
            # tau 1.67 -> 1.14 with it, 1.67 -> 1.66 without it). It runs once per accepted position,
            # not per round, so fp32 there costs little.
            self.history_proj.int8_inference = False

    def set_draft_vocab(self, token_ids: Tensor) -> None:
        """Fix the draft vocabulary (sorted unique ids) of a drafter whose config reserved its size."""
        ids = torch.unique(token_ids.long().cpu())
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"{ids.numel()} draft tokens, config says {self.config.draft_vocab_size}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError("draft vocabulary ids outside the target vocabulary")
        self.draft_vocab.copy_(ids.to(self.draft_vocab.device))
        self._draft_head = None

    def _require_target(self) -> _SharedTarget:
        if self._shared is None:
            raise RuntimeError("drafter has no target embedding/head: call bind_target(target) first")
        return self._shared

    def num_parameters(self) -> int:
        """Drafter-owned parameters (the shared embedding and head are not counted)."""
        return sum(p.numel() for p in self.parameters())


def _copy_block(layer: DrafterLayer, source: nn.Module, use_audio: bool) -> None:
    """Copy a `WhisperDecoderLayer` into a drafter layer (cross-attention -> acoustic_attn)."""
    pairs = [
        ("self_attn", "self_attn"),
        ("self_attn_layer_norm", "self_attn_layer_norm"),
        ("fc1", "fc1"),
        ("fc2", "fc2"),
        ("final_layer_norm", "final_layer_norm"),
    ]
    if use_audio:
        pairs += [("acoustic_attn", "encoder_attn"), ("acoustic_attn_layer_norm", "encoder_attn_layer_norm")]
    for mine, theirs in pairs:
        own = getattr(layer, mine)
        src = {k: v.detach().float().cpu() for k, v in getattr(source, theirs).state_dict().items()}
        own.load_state_dict(src, strict=True)
