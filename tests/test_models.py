"""The embedded models: model.bin reader, CTranslate2 -> transformers converter, fetch, CLI.

The equivalence test feeds both engines the same log-mel array: faster-whisper 1.2.1 pads the
log-mel with 0.0 where transformers pads the waveform, so end-to-end transcripts can differ for
reasons that have nothing to do with the weights.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

# fixtures shared with the rest of the suite live in fixtures_models.py (to be merged into conftest)
from fixtures_models import SAMPLE_RATE, embedded_models, speech_clips  # noqa: F401

from sglang_omni_flash.cli import main
from sglang_omni_flash.errors import UserError
from sglang_omni_flash.models.convert import MARKER_NAME, convert_ct2_whisper
from sglang_omni_flash.models.ct2 import Ct2Model, read_model_bin
from sglang_omni_flash.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS, ct2_dir, resolve_model
from sglang_omni_flash.models.whisper_weights import whisper_weights

MODEL_NAMES = sorted(EMBEDDED_MODELS)

# ---------------------------------------------------------------------------------------------
# a tiny model.bin writer, the format's reference in executable form


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def _variable(name: str, array: np.ndarray, dtype_id: int) -> bytes:
    header = (
        _string(name) + struct.pack("<B", array.ndim) + b"".join(struct.pack("<I", n) for n in array.shape)
    )
    data = array.tobytes()
    return header + struct.pack("<B", dtype_id) + struct.pack("<I", len(data)) + data


def _model_bin(
    variables: list[bytes], aliases: dict[str, str], version: int = 6, n_vars: int | None = None
) -> bytes:
    out = struct.pack("<I", version) + _string("WhisperSpec") + struct.pack("<I", 3)
    out += struct.pack("<I", len(variables) if n_vars is None else n_vars) + b"".join(variables)
    out += struct.pack("<I", len(aliases)) + b"".join(_string(a) + _string(t) for a, t in aliases.items())
    return out


_WEIGHT = np.arange(6, dtype=np.float16).reshape(2, 3)
_GOOD_VARIABLES = [
    _variable("decoder/embeddings/weight", _WEIGHT, 4),
    _variable("decoder/num_heads", np.int16(8), 2),
]
_GOOD_ALIASES = {"decoder/projection/weight": "decoder/embeddings/weight"}


def _write(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "model.bin"
    path.write_bytes(content)
    return path


_DTYPE_IDS = {np.dtype(np.float16): 4, np.dtype(np.int8): 1, np.dtype(np.int16): 2}


def _synthetic_whisper(d: int = 8, heads: int = 2, ffn: int = 16, vocab: int = 51864) -> bytes:
    """A one-layer Whisper of width `d` with random float16 weights, laid out as CTranslate2 does.

    Small enough to convert in a moment; tiny.en's vocabulary so its tokenizer.json fits.
    """
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {}

    def weight(name: str, *shape: int) -> None:
        arrays[name] = (rng.standard_normal(shape) * 0.02).astype(np.float16)

    def linear(name: str, out_features: int, in_features: int) -> None:
        weight(f"{name}/weight", out_features, in_features)
        weight(f"{name}/bias", out_features)

    def layer_norm(name: str) -> None:
        weight(f"{name}/gamma", d)
        weight(f"{name}/beta", d)

    def attention(name: str, fused: int, zero_rows: slice) -> None:
        linear(name, fused * d, d)
        arrays[f"{name}/bias"][zero_rows] = 0  # CTranslate2's zero k bias

    weight("encoder/conv1/weight", d, 80, 3)
    weight("encoder/conv1/bias", d)
    weight("encoder/conv2/weight", d, d, 3)
    weight("encoder/conv2/bias", d)
    weight("encoder/position_encodings/encodings", 1500, d)
    arrays["encoder/num_heads"] = np.int16(heads)
    for stack in ("encoder", "decoder"):
        attention(f"{stack}/layer_0/self_attention/linear_0", 3, slice(d, 2 * d))
        linear(f"{stack}/layer_0/self_attention/linear_1", d, d)
        layer_norm(f"{stack}/layer_0/self_attention/layer_norm")
        linear(f"{stack}/layer_0/ffn/linear_0", ffn, d)
        linear(f"{stack}/layer_0/ffn/linear_1", d, ffn)
        layer_norm(f"{stack}/layer_0/ffn/layer_norm")
        layer_norm(f"{stack}/layer_norm")
    linear("decoder/layer_0/attention/linear_0", d, d)
    attention("decoder/layer_0/attention/linear_1", 2, slice(0, d))
    linear("decoder/layer_0/attention/linear_2", d, d)
    layer_norm("decoder/layer_0/attention/layer_norm")
    weight("decoder/embeddings/weight", vocab, d)
    weight("decoder/position_encodings/encodings", 448, d)
    for name, value in {"activation": 3, "alibi": 0, "pre_norm": 1, "scale_embeddings": 0,
                        "start_from_zero_embedding": 0}.items():  # fmt: skip
        arrays[f"decoder/{name}"] = np.int8(value)
    arrays["decoder/num_heads"] = np.int16(heads)
    arrays["decoder/alignment_heads"] = np.int16(1)
    arrays["decoder/alignment_layer"] = np.int16(-1)
    variables = [
        _variable(name, np.asarray(a), _DTYPE_IDS[np.asarray(a).dtype]) for name, a in sorted(arrays.items())
    ]
    return _model_bin(variables, _GOOD_ALIASES)


@pytest.fixture
def synthetic_export(tmp_path, embedded_models) -> Path:
    """A CTranslate2 export directory: the synthetic model.bin with tiny.en's config and tokenizer."""
    return _export_with_model_bin(tmp_path, _synthetic_whisper())


def _export_with_model_bin(tmp_path: Path, content: bytes) -> Path:
    source = tmp_path / "export"
    source.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (source / name).write_bytes((ct2_dir("tiny.en") / name).read_bytes())
    (source / "model.bin").write_bytes(content)
    return source


# ---------------------------------------------------------------------------------------------
# reader


def test_reader_returns_header_arrays_and_aliases(tmp_path):
    model = read_model_bin(_write(tmp_path, _model_bin(_GOOD_VARIABLES, _GOOD_ALIASES)))
    assert (model.spec_name, model.revision) == ("WhisperSpec", 3)
    np.testing.assert_array_equal(model.variables["decoder/embeddings/weight"], _WEIGHT)
    assert model.variables["decoder/embeddings/weight"].dtype == np.float16
    assert int(model.variables["decoder/num_heads"]) == 8
    np.testing.assert_array_equal(model.get("decoder/projection/weight"), _WEIGHT)


def test_reader_widens_bfloat16_exactly(tmp_path):
    values = np.array([1.5, -2.25, 2.0**100], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # these values are exact in bfloat16
    model = read_model_bin(_write(tmp_path, _model_bin([_variable("x", bits, 5)], {})))
    np.testing.assert_array_equal(model.variables["x"], values)


def test_reader_reports_progress_in_bytes_up_to_the_file_size(tmp_path):
    path = _write(tmp_path, _model_bin(_GOOD_VARIABLES, _GOOD_ALIASES))
    seen = []
    read_model_bin(path, on_bytes=seen.append)
    assert sum(seen) == path.stat().st_size


def _unknown_dtype() -> bytes:
    good = _model_bin(_GOOD_VARIABLES, _GOOD_ALIASES)
    dtype_at = 4 + len(_string("WhisperSpec")) + 8 + len(_string("decoder/embeddings/weight")) + 1 + 8
    return good[:dtype_at] + bytes([9]) + good[dtype_at + 1 :]


_DAMAGES = {
    "wrong version": (lambda: _model_bin(_GOOD_VARIABLES, _GOOD_ALIASES, version=5), "format version 5"),
    "truncated in the data": (lambda: _model_bin(_GOOD_VARIABLES, _GOOD_ALIASES)[:60], "truncated"),
    "header counts more variables": (
        lambda: _model_bin(_GOOD_VARIABLES, _GOOD_ALIASES, n_vars=3),
        "variable 3 of 3",
    ),
    "header counts fewer variables": (
        lambda: _model_bin(_GOOD_VARIABLES, _GOOD_ALIASES, n_vars=1),
        "variable count",
    ),
    "unknown dtype": (_unknown_dtype, "unknown dtype id 9"),
    "trailing garbage": (
        lambda: _model_bin(_GOOD_VARIABLES, _GOOD_ALIASES) + b"\0junk",
        "5 unexpected bytes",
    ),
    "byte count disagrees with shape": (
        lambda: _model_bin([_variable("x", _WEIGHT, 0)], {}),  # float16 bytes declared as float32
        "needs 24",
    ),
    "alias to nothing": (lambda: _model_bin(_GOOD_VARIABLES, {"a": "b"}), "unknown variable 'b'"),
    "empty file": (lambda: b"", "truncated"),
}


@pytest.mark.parametrize("damage", sorted(_DAMAGES))
def test_damaged_model_bin_is_a_user_error_saying_what_broke(tmp_path, damage):
    make, message = _DAMAGES[damage]
    with pytest.raises(UserError, match=re.escape(message)) as caught:
        read_model_bin(_write(tmp_path, make()))
    assert "not a valid CTranslate2 model.bin" in str(caught.value)


def test_missing_model_bin_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        read_model_bin(tmp_path / "model.bin")


# ---------------------------------------------------------------------------------------------
# converter: layout checks, on the real tiny.en export


@pytest.fixture(scope="module")
def tiny_en_export(embedded_models) -> Ct2Model:
    return read_model_bin(ct2_dir("tiny.en") / "model.bin")


def _edited(model: Ct2Model, changes: dict[str, np.ndarray | None]) -> Ct2Model:
    """A copy of `model` with variables replaced, added, or (value None) removed."""
    edited = dict(model.variables)
    for name, value in changes.items():
        if value is None:
            del edited[name]
        else:
            edited[name] = value
    return replace(model, variables=edited)


def test_every_variable_is_mapped_and_only_the_zero_key_biases_are_dropped(tiny_en_export):
    weights, dims, dropped = whisper_weights(tiny_en_export)
    # one fused self-attention per layer, one fused cross-attention [k;v] per decoder layer
    d = dims.d_model
    assert sorted(dropped) == sorted(
        [f"encoder/layer_{i}/self_attention/linear_0/bias[{d}:{2 * d}]" for i in range(dims.encoder_layers)]
        + [f"decoder/layer_{i}/self_attention/linear_0/bias[{d}:{2 * d}]" for i in range(dims.decoder_layers)]
        + [f"decoder/layer_{i}/attention/linear_1/bias[0:{d}]" for i in range(dims.decoder_layers)]
    )
    assert "proj_out.weight" not in weights  # tied to the token embedding on load
    assert {a.dtype for a in weights.values()} == {np.dtype(np.float16)}
    # the fused self-attention splits into q, k, v in that order
    fused = tiny_en_export.variables["encoder/layer_0/self_attention/linear_0/weight"]
    np.testing.assert_array_equal(weights["model.encoder.layers.0.self_attn.k_proj.weight"], fused[d : 2 * d])


def test_unknown_variable_is_refused_by_name(tiny_en_export):
    model = _edited(tiny_en_export, {"encoder/layer_0/ffn/gate/weight": np.zeros((4,), np.float16)})
    with pytest.raises(UserError, match="unknown variable 'encoder/layer_0/ffn/gate/weight'"):
        whisper_weights(model)


def test_missing_variable_is_refused_by_name(tiny_en_export):
    model = _edited(tiny_en_export, {"decoder/layer_norm/gamma": None})
    with pytest.raises(UserError, match="'decoder/layer_norm/gamma' is missing"):
        whisper_weights(model)


def test_wrong_shape_is_refused_by_name(tiny_en_export):
    model = _edited(tiny_en_export, {"encoder/layer_1/ffn/linear_1/bias": np.zeros((383,), np.float16)})
    with pytest.raises(
        UserError, match=r"'encoder/layer_1/ffn/linear_1/bias' has shape \[383\], expected \[384\]"
    ):
        whisper_weights(model)


def test_nonzero_key_bias_is_refused_rather_than_dropped(tiny_en_export):
    bias = tiny_en_export.variables["decoder/layer_2/attention/linear_1/bias"].copy()
    bias[5] = 0.125  # inside the k rows [0:384]
    model = _edited(tiny_en_export, {"decoder/layer_2/attention/linear_1/bias": bias})
    with pytest.raises(UserError, match="'decoder/layer_2/attention/linear_1/bias' has a non-zero key bias"):
        whisper_weights(model)


def test_non_whisper_spec_is_refused(tiny_en_export):
    with pytest.raises(UserError, match="'TransformerSpec' is not 'WhisperSpec'"):
        whisper_weights(replace(tiny_en_export, spec_name="TransformerSpec"))


def test_quantized_export_is_refused(tiny_en_export):
    quantized = tiny_en_export.variables["encoder/layer_0/ffn/linear_0/weight"].astype(np.int8)
    model = _edited(tiny_en_export, {"encoder/layer_0/ffn/linear_0/weight": quantized})
    with pytest.raises(UserError, match="is int8"):
        whisper_weights(model)


def test_synthetic_export_converts_and_loads_cleanly(synthetic_export, tmp_path):
    from transformers import WhisperForConditionalGeneration

    out = convert_ct2_whisper(synthetic_export, tmp_path / "converted")
    model, info = WhisperForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    config = model.config
    assert (config.d_model, config.encoder_attention_heads, config.decoder_ffn_dim) == (8, 2, 16)
    source = read_model_bin(synthetic_export / "model.bin")
    fused = source.variables["decoder/layer_0/attention/linear_1/weight"].astype(np.float32)
    np.testing.assert_array_equal(
        model.model.decoder.layers[0].encoder_attn.v_proj.weight.detach().numpy(), fused[8:]
    )


def test_interrupted_conversion_leaves_nothing_behind(tmp_path, monkeypatch, synthetic_export):
    import sglang_omni_flash.models.convert as convert

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "write_tokenizer", interrupted)
    out = tmp_path / "models" / "tiny.en"
    with pytest.raises(KeyboardInterrupt):
        convert_ct2_whisper(synthetic_export, out)
    assert list((tmp_path / "models").iterdir()) == []


# ---------------------------------------------------------------------------------------------
# the converted embedded models


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_converted_model_loads_with_no_missing_or_unexpected_keys(embedded_models, name):
    import torch
    from transformers import WhisperForConditionalGeneration

    model, info = WhisperForConditionalGeneration.from_pretrained(
        embedded_models[name], output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert not info["mismatched_keys"] and not info["error_msgs"]
    assert model.dtype == torch.float32  # stored float16, loaded float32 by default (exact)
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_tokenizer_has_the_timestamp_tokens_right_after_notimestamps(embedded_models, name):
    from transformers import WhisperProcessor, WhisperTokenizer

    directory = embedded_models[name]
    vocab_size = json.loads((directory / "config.json").read_text())["vocab_size"]
    processor = WhisperProcessor.from_pretrained(directory)
    assert processor.feature_extractor.feature_size == 80
    for tokenizer in (processor.tokenizer, WhisperTokenizer.from_pretrained(directory)):
        no_timestamps = tokenizer.convert_tokens_to_ids("<|notimestamps|>")
        assert len(tokenizer) == vocab_size
        assert tokenizer.convert_tokens_to_ids(["<|0.00|>", "<|0.02|>", "<|30.00|>"]) == [
            no_timestamps + 1,
            no_timestamps + 2,
            vocab_size - 1,
        ]
        # transformers finds the first timestamp as "last special token + 1"
        assert tokenizer.all_special_ids[-1] == no_timestamps
        text_ids = tokenizer(" Hello", add_special_tokens=False).input_ids
        sequence = [no_timestamps + 1, *text_ids, no_timestamps + 51]
        assert tokenizer.decode(sequence, decode_with_timestamps=True) == "<|0.00|> Hello<|1.00|>"
        assert tokenizer.decode(sequence, skip_special_tokens=True) == " Hello"


def test_base_tokenizer_has_the_merge_its_tokenizer_json_lost(embedded_models):
    from transformers import WhisperTokenizer

    tokenizer = WhisperTokenizer.from_pretrained(embedded_models["base"])
    # ids of openai-whisper's multilingual tiktoken encoding
    assert tokenizer(" this is the test", add_special_tokens=False).input_ids == [341, 307, 264, 1500]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_generation_config_carries_the_exports_settings(embedded_models, name):
    from transformers import GenerationConfig

    generation = GenerationConfig.from_pretrained(embedded_models[name])
    ct2_config = json.loads((ct2_dir(name) / "config.json").read_text())
    assert generation.suppress_tokens == ct2_config["suppress_ids"]
    assert generation.begin_suppress_tokens == ct2_config["suppress_ids_begin"]
    assert generation.alignment_heads == ct2_config["alignment_heads"]
    assert generation.max_length == 448 and generation.forced_decoder_ids is None
    if name == "base":
        assert generation.is_multilingual and len(generation.lang_to_id) == 99
        assert (generation.decoder_start_token_id, generation.no_timestamps_token_id) == (50258, 50363)
        assert generation.lang_to_id["<|en|>"] == 50259
        assert generation.task_to_id == {"translate": 50358, "transcribe": 50359}
    else:  # English-only: no language table, or transformers would run language detection
        assert not generation.is_multilingual and not hasattr(generation, "lang_to_id")
        assert (generation.decoder_start_token_id, generation.no_timestamps_token_id) == (50257, 50362)


# ---------------------------------------------------------------------------------------------
# same greedy tokens as faster-whisper's engine, on the same log-mel


def _greedy_tokens_both_engines(directory: Path, ct2_directory: Path, clips) -> tuple[list, list]:
    import ctranslate2
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    features = WhisperFeatureExtractor.from_pretrained(directory)(
        [clip.audio for clip in clips], sampling_rate=SAMPLE_RATE, return_tensors="np"
    ).input_features  # [n_clips, 80, 3000], float32: the one array both engines see
    model = WhisperForConditionalGeneration.from_pretrained(directory).eval()
    generation = model.generation_config
    language = {"language": "en", "task": "transcribe"} if generation.is_multilingual else {}
    prompt = [generation.decoder_start_token_id]
    if generation.is_multilingual:
        prompt += [generation.lang_to_id["<|en|>"], generation.task_to_id["transcribe"]]
    prompt += [generation.no_timestamps_token_id]

    with torch.inference_mode():
        generated = model.generate(torch.from_numpy(features), **language).tolist()
    eot = generation.eos_token_id
    transformers_tokens = [row[: row.index(eot)] if eot in row else row for row in generated]

    # suppress_tokens=[-1] and suppress_blank=True apply config.json's suppress_ids and
    # suppress_ids_begin: the lists the converter copied into generation_config.json
    engine = ctranslate2.models.Whisper(
        str(ct2_directory), device="cpu", compute_type="float32", intra_threads=torch.get_num_threads()
    )
    results = engine.generate(
        ctranslate2.StorageView.from_array(np.ascontiguousarray(features)),
        [prompt] * len(clips),
        beam_size=1,
        max_length=generation.max_length,
        suppress_blank=True,
        suppress_tokens=[-1],
    )
    return transformers_tokens, [result.sequences_ids[0] for result in results]


@pytest.fixture(scope="module")
def greedy_tokens(embedded_models, speech_clips) -> dict[str, tuple[list, list]]:
    assert len(speech_clips) >= 6 and all(3 <= clip.seconds <= 12 for clip in speech_clips)
    return {
        name: _greedy_tokens_both_engines(embedded_models[name], ct2_dir(name), speech_clips)
        for name in MODEL_NAMES
    }


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_greedy_tokens_equal_faster_whisper_on_identical_features(greedy_tokens, name):
    transformers_tokens, ctranslate2_tokens = greedy_tokens[name]
    for clip_index, (ours, theirs) in enumerate(zip(transformers_tokens, ctranslate2_tokens, strict=True)):
        assert ours == theirs, f"clip {clip_index}"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_converted_model_transcribes_the_clips(embedded_models, greedy_tokens, speech_clips, name):
    from transformers import WhisperTokenizer

    tokenizer = WhisperTokenizer.from_pretrained(embedded_models[name])
    for tokens, clip in zip(greedy_tokens[name][0], speech_clips, strict=True):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        heard, said = set(_words(text)), _words(clip.text)
        # a sanity check that this is speech recognition: espeak-ng voices are not easy listening
        assert sum(word in heard for word in said) >= 0.5 * len(said), (clip.text, text)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


# ---------------------------------------------------------------------------------------------
# fetch, resolve, CLI


def test_default_model_is_base():
    assert DEFAULT_MODEL == "base" and set(EMBEDDED_MODELS) == {"base", "tiny.en"}


def test_resolve_model_accepts_names_and_transformers_directories(embedded_models):
    assert resolve_model("tiny.en") == embedded_models["tiny.en"]
    assert resolve_model(str(embedded_models["base"])) == embedded_models["base"].resolve()


def test_resolve_model_rejects_an_unknown_name_listing_the_choices():
    with pytest.raises(UserError, match=r"unknown model 'small'.*'base' or 'tiny.en'"):
        resolve_model("small")


def test_resolve_model_sends_a_ctranslate2_export_to_the_converter(embedded_models):
    with pytest.raises(UserError, match="whisper-flash models convert"):
        resolve_model(ct2_dir("tiny.en"))


def test_cli_fetch_prints_only_the_directory_and_leaves_it_alone(embedded_models, capsys):
    directory = embedded_models["tiny.en"]
    before = (directory / MARKER_NAME).stat().st_mtime_ns
    for _ in range(2):
        assert main(["models", "fetch", "tiny.en"]) == 0
        assert capsys.readouterr().out == f"{directory}\n"
    assert (directory / MARKER_NAME).stat().st_mtime_ns == before


def test_cli_convert_writes_once_then_is_a_no_op(synthetic_export, tmp_path, capsys):
    out = tmp_path / "converted"
    assert main(["models", "convert", str(synthetic_export), str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    written = {file.name: file.stat().st_mtime_ns for file in out.iterdir()}
    assert main(["models", "convert", str(synthetic_export), str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    assert {file.name: file.stat().st_mtime_ns for file in out.iterdir()} == written


def test_cli_convert_refuses_to_overwrite_a_foreign_directory(synthetic_export, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    assert main(["models", "convert", str(synthetic_export), str(out)]) == 2
    assert "exists but is not a finished conversion" in capsys.readouterr().err


def test_cli_reports_a_truncated_model_bin_in_one_line(embedded_models, tmp_path):
    whole = (ct2_dir("tiny.en") / "model.bin").read_bytes()
    source = _export_with_model_bin(tmp_path, whole[: len(whole) // 3])
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "sglang_omni_flash.cli", "models", "convert", str(source), str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    # everything but the progress bar (its \r-separated updates and its final newline)
    lines = [line for line in result.stderr.splitlines() if line.strip() and "converting" not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "file is truncated" in lines[0] and "decoder/" in lines[0]
    assert not out.exists() and result.stdout == ""


def test_cli_reports_a_corrupted_model_bin(embedded_models, tmp_path, capsys):
    whole = bytearray(_synthetic_whisper())
    whole[0] = 7  # format version
    source = _export_with_model_bin(tmp_path, bytes(whole))
    assert main(["models", "convert", str(source), str(tmp_path / "out")]) == 2
    assert "format version 7, only version 6 is supported" in capsys.readouterr().err


def test_cli_list_shows_every_embedded_model(embedded_models, capsys):
    assert main(["models", "list"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:3] for row in rows] == [
        [name, "converted", str(embedded_models[name])] for name in EMBEDDED_MODELS
    ]
