"""CTranslate2 Whisper variables -> transformers `WhisperForConditionalGeneration` weights.

Every CTranslate2 variable must be accounted for: mapped to a transformers weight, checked as a
known constant, or dropped because it is provably redundant (the all-zero key biases that
CTranslate2 stores inside its fused attention projections; Whisper's k_proj has no bias).
Anything else - an unknown name, a missing name, a wrong shape, a non-zero key bias - is a
`UserError` naming the variable.

CTranslate2 name (d = d_model)                      transformers name
encoder/conv{1,2}/{weight,bias}                     model.encoder.conv{1,2}.*
{en,de}coder/position_encodings/encodings           model.{en,de}coder.embed_positions.weight
*/layer_i/self_attention/linear_0  [3d, d]          self_attn.{q,k,v}_proj (rows 0:d, d:2d, 2d:3d)
*/layer_i/self_attention/linear_1                   self_attn.out_proj
decoder/layer_i/attention/linear_0                  encoder_attn.q_proj
decoder/layer_i/attention/linear_1  [2d, d]         encoder_attn.{k,v}_proj (rows 0:d, d:2d)
decoder/layer_i/attention/linear_2                  encoder_attn.out_proj
*/ffn/linear_{0,1}                                  fc1, fc2
*/{self_attention,attention,ffn}/layer_norm         self_attn_layer_norm, encoder_attn_layer_norm,
                                                    final_layer_norm ({gamma,beta} -> {weight,bias})
decoder/embeddings/weight                           model.decoder.embed_tokens.weight (= proj_out)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.models.ct2 import Ct2Model

WHISPER_SPEC_NAME = "WhisperSpec"
N_AUDIO_CTX = 1500  # encoder positions: 30 s of audio, 3000 mel frames halved by conv2's stride
# CTranslate2 ActivationType.GELU; Whisper uses the exact (erf) GELU.
_CT2_GELU = 3
# Decoder constants of a Whisper export. Each is checked when present; a different value would
# mean a model transformers' Whisper cannot run.
_EXPECTED_CONSTANTS = {
    "decoder/activation": _CT2_GELU,
    "decoder/pre_norm": 1,
    "decoder/alibi": 0,
    "decoder/scale_embeddings": 0,
    "decoder/start_from_zero_embedding": 0,
}
# Which cross-attention CTranslate2 returns for word timing; the real alignment heads are in
# config.json, so these are read past.
_IGNORED_CONSTANTS = ("decoder/alignment_heads", "decoder/alignment_layer")
_TIED_PROJECTION = ("decoder/projection/weight", "decoder/embeddings/weight")


@dataclass(frozen=True)
class WhisperDims:
    """The architecture, read from the shapes and constants of the export."""

    n_mels: int
    n_vocab: int
    d_model: int
    n_text_ctx: int
    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    encoder_ffn: int
    decoder_ffn: int


class _Variables:
    """Hands out CTranslate2 variables by name, checking shapes, and remembers which were used."""

    def __init__(self, model: Ct2Model):
        self._model = model
        self.used: set[str] = set()

    def error(self, name: str, problem: str) -> UserError:
        return UserError(f"{self._model.path}: variable {name!r} {problem}")

    def take(self, name: str, shape: tuple[int | None, ...] | None = None) -> np.ndarray:
        """The variable `name`; `shape` (None entries match any size) is checked when given."""
        if name not in self._model.variables:
            raise self.error(name, "is missing (not a Whisper export this converter knows)")
        array = self._model.variables[name]
        if shape is not None and (
            array.ndim != len(shape)
            or any(want not in (None, got) for want, got in zip(shape, array.shape, strict=True))
        ):
            expected = ", ".join("?" if size is None else str(size) for size in shape)
            raise self.error(name, f"has shape {list(array.shape)}, expected [{expected}]")
        self.used.add(name)
        return array

    def weight(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = self.take(name, shape)
        if array.dtype not in (np.float16, np.float32):
            raise self.error(
                name,
                f"is {array.dtype} (a quantized export?); convert a float16 or float32 export "
                "(ct2-transformers-converter --quantization float16)",
            )
        return array

    def constant(self, name: str) -> int:
        array = self.take(name, ())
        return int(array)

    def unused(self) -> list[str]:
        return sorted(set(self._model.variables) - self.used)


def _layer_count(model: Ct2Model, stack: str) -> int:
    indices = {
        int(m.group(1)) for name in model.variables if (m := re.match(rf"^{stack}/layer_(\d+)/", name))
    }
    if not indices:
        raise UserError(f"{model.path}: no {stack} layers ({stack}/layer_0/... is missing)")
    if indices != set(range(len(indices))):
        gaps = sorted(set(range(max(indices) + 1)) - indices)
        raise UserError(
            f"{model.path}: {stack} layers are not numbered 0..n-1 (missing {stack}/layer_{gaps[0]})"
        )
    return len(indices)


def read_dims(model: Ct2Model, variables: _Variables) -> WhisperDims:
    d_model, n_mels, _ = variables.take("encoder/conv1/weight", (None, None, 3)).shape
    n_vocab, _ = variables.take("decoder/embeddings/weight", (None, d_model)).shape
    n_text_ctx, _ = variables.take("decoder/position_encodings/encodings", (None, d_model)).shape
    dims = WhisperDims(
        n_mels=n_mels,
        n_vocab=n_vocab,
        d_model=d_model,
        n_text_ctx=n_text_ctx,
        encoder_layers=_layer_count(model, "encoder"),
        decoder_layers=_layer_count(model, "decoder"),
        encoder_heads=variables.constant("encoder/num_heads"),
        decoder_heads=variables.constant("decoder/num_heads"),
        encoder_ffn=variables.take("encoder/layer_0/ffn/linear_0/weight", (None, d_model)).shape[0],
        decoder_ffn=variables.take("decoder/layer_0/ffn/linear_0/weight", (None, d_model)).shape[0],
    )
    for stack, heads in (("encoder", dims.encoder_heads), ("decoder", dims.decoder_heads)):
        if heads <= 0 or d_model % heads:
            raise UserError(f"{model.path}: {stack}/num_heads = {heads} does not divide d_model = {d_model}")
    return dims


def whisper_weights(model: Ct2Model) -> tuple[dict[str, np.ndarray], WhisperDims, list[str]]:
    """Map a CTranslate2 Whisper model to transformers' state dict.

    Returns (state dict, dims, names of the dropped all-zero bias slices). The tied output
    projection (`proj_out.weight`) is not in the state dict: transformers ties it to
    `model.decoder.embed_tokens.weight` on load.
    """
    if model.spec_name != WHISPER_SPEC_NAME:
        raise UserError(
            f"{model.path}: spec {model.spec_name!r} is not {WHISPER_SPEC_NAME!r}: not a Whisper model"
        )
    variables = _Variables(model)
    dims = read_dims(model, variables)
    d = dims.d_model
    state: dict[str, np.ndarray] = {}
    dropped: list[str] = []

    for name, expected in _EXPECTED_CONSTANTS.items():
        if name in model.variables and (value := variables.constant(name)) != expected:
            raise UserError(f"{model.path}: variable {name!r} is {value}, expected {expected} for Whisper")
    for name in _IGNORED_CONSTANTS:
        if name in model.variables:
            variables.constant(name)
    _check_tied_projection(model, variables)

    def linear(ct2: str, hf: str, out_features: int, in_features: int) -> None:
        state[f"{hf}.weight"] = variables.weight(f"{ct2}/weight", (out_features, in_features))
        state[f"{hf}.bias"] = variables.weight(f"{ct2}/bias", (out_features,))

    def layer_norm(ct2: str, hf: str) -> None:
        state[f"{hf}.weight"] = variables.weight(f"{ct2}/gamma", (d,))
        state[f"{hf}.bias"] = variables.weight(f"{ct2}/beta", (d,))

    def fused_projection(ct2: str, hf_names: tuple[str, ...], zero_bias: str) -> None:
        """Split CTranslate2's fused [q;k;v] (or [k;v]) linear; its k bias must be zero."""
        parts = len(hf_names)
        weight = variables.weight(f"{ct2}/weight", (parts * d, d))
        bias = variables.weight(f"{ct2}/bias", (parts * d,))
        for index, hf in enumerate(hf_names):
            rows = slice(index * d, (index + 1) * d)
            state[f"{hf}.weight"] = np.ascontiguousarray(weight[rows])
            if hf == zero_bias:
                if np.any(bias[rows] != 0):
                    raise variables.error(
                        f"{ct2}/bias",
                        f"has a non-zero key bias in rows {rows.start}:{rows.stop}; Whisper's k_proj "
                        "has no bias, so dropping it would change the model",
                    )
                dropped.append(f"{ct2}/bias[{rows.start}:{rows.stop}]")
            else:
                state[f"{hf}.bias"] = np.ascontiguousarray(bias[rows])

    def self_attention(ct2: str, hf: str) -> None:
        fused_projection(
            f"{ct2}/linear_0", (f"{hf}.q_proj", f"{hf}.k_proj", f"{hf}.v_proj"), zero_bias=f"{hf}.k_proj"
        )
        linear(f"{ct2}/linear_1", f"{hf}.out_proj", d, d)

    def feed_forward(ct2: str, hf: str, ffn: int) -> None:
        linear(f"{ct2}/linear_0", f"{hf}.fc1", ffn, d)
        linear(f"{ct2}/linear_1", f"{hf}.fc2", d, ffn)
        layer_norm(f"{ct2}/layer_norm", f"{hf}.final_layer_norm")

    # encoder
    state["model.encoder.conv1.weight"] = variables.weight("encoder/conv1/weight", (d, dims.n_mels, 3))
    state["model.encoder.conv1.bias"] = variables.weight("encoder/conv1/bias", (d,))
    state["model.encoder.conv2.weight"] = variables.weight("encoder/conv2/weight", (d, d, 3))
    state["model.encoder.conv2.bias"] = variables.weight("encoder/conv2/bias", (d,))
    # 1500 positions: 30 s windows, 3000 mel frames halved by conv2's stride
    state["model.encoder.embed_positions.weight"] = variables.weight(
        "encoder/position_encodings/encodings", (N_AUDIO_CTX, d)
    )
    for i in range(dims.encoder_layers):
        ct2, hf = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        self_attention(f"{ct2}/self_attention", f"{hf}.self_attn")
        layer_norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        feed_forward(f"{ct2}/ffn", hf, dims.encoder_ffn)
    layer_norm("encoder/layer_norm", "model.encoder.layer_norm")

    # decoder
    state["model.decoder.embed_tokens.weight"] = variables.weight(
        "decoder/embeddings/weight", (dims.n_vocab, d)
    )
    state["model.decoder.embed_positions.weight"] = variables.weight(
        "decoder/position_encodings/encodings", (dims.n_text_ctx, d)
    )
    for i in range(dims.decoder_layers):
        ct2, hf = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        self_attention(f"{ct2}/self_attention", f"{hf}.self_attn")
        layer_norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        # cross-attention: linear_0 = q (from the decoder), linear_1 = fused [k;v] (from the encoder)
        linear(f"{ct2}/attention/linear_0", f"{hf}.encoder_attn.q_proj", d, d)
        fused_projection(
            f"{ct2}/attention/linear_1",
            (f"{hf}.encoder_attn.k_proj", f"{hf}.encoder_attn.v_proj"),
            zero_bias=f"{hf}.encoder_attn.k_proj",
        )
        linear(f"{ct2}/attention/linear_2", f"{hf}.encoder_attn.out_proj", d, d)
        layer_norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
        feed_forward(f"{ct2}/ffn", hf, dims.decoder_ffn)
    layer_norm("decoder/layer_norm", "model.decoder.layer_norm")

    unknown = variables.unused()
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UserError(
            f"{model.path}: unknown variable {unknown[0]!r}{more}: not a Whisper layout this converter knows"
        )

    # one float type on disk: the export's own when uniform, float32 otherwise
    dtypes = {array.dtype for array in state.values()}
    out_dtype = np.float16 if dtypes == {np.dtype(np.float16)} else np.float32
    state = {name: np.ascontiguousarray(array, dtype=out_dtype) for name, array in state.items()}
    return state, dims, dropped


def _check_tied_projection(model: Ct2Model, variables: _Variables) -> None:
    """Whisper's output projection is the token embedding; accept it only in that form."""
    projection, embeddings = _TIED_PROJECTION
    other_aliases = {alias: target for alias, target in model.aliases.items() if alias != projection}
    if other_aliases:
        alias, target = next(iter(other_aliases.items()))
        raise UserError(
            f"{model.path}: unknown alias {alias!r} -> {target!r}: not a Whisper layout this converter knows"
        )
    if projection in model.aliases:
        if model.aliases[projection] != embeddings:
            target = model.aliases[projection]
            raise UserError(f"{model.path}: alias {projection!r} -> {target!r}, expected {embeddings!r}")
    elif projection in model.variables:
        if not np.array_equal(variables.take(projection), model.variables.get(embeddings)):
            raise UserError(
                f"{model.path}: variable {projection!r} differs from {embeddings!r}; Whisper ties them"
            )
