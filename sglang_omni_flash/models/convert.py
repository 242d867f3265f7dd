"""Convert a CTranslate2 (faster-whisper) Whisper export into a transformers model directory.

Input: a directory with `model.bin` (CTranslate2 spec v6, `WhisperSpec`), `config.json` (the
generation settings ct2-transformers-converter writes) and `tokenizer.json`.
Output: a directory that `WhisperForConditionalGeneration`, `WhisperProcessor`,
`WhisperTokenizer` and `WhisperFeatureExtractor` load with `from_pretrained`.

Weights are stored in the export's own float type (float16 for the embedded models): widening
float16 to float32 at load time is exact, so nothing is lost and the file is half the size.
`config.json` still says `dtype: float32`, so a plain `from_pretrained(dir)` gives a float32
model (transformers 5 defaults to `dtype="auto"`, which reads that field); pass
`dtype=torch.float16` to keep half precision on a GPU.

What is checked and what is dropped: see `whisper_weights` (every variable accounted for, the
all-zero key biases dropped) and `whisper_tokenizer` (timestamp tokens added, lost BPE merges
restored). Before the directory is published, its weight names and shapes are compared with a
`WhisperForConditionalGeneration` built from its own config.json.

The output is written to a temporary sibling directory and renamed into place once complete,
so an interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.models.ct2 import read_model_bin
from sglang_omni_flash.models.staging import make_staging_dir, publish
from sglang_omni_flash.models.whisper_tokenizer import SpecialTokens, special_tokens, write_tokenizer
from sglang_omni_flash.models.whisper_weights import N_AUDIO_CTX, WhisperDims, whisper_weights

# Written last into a converted directory; its presence means "complete".
MARKER_NAME = "whisper_flash_conversion.json"
FORMAT_VERSION = 1

SAMPLE_RATE = 16000
HOP_LENGTH = 160


def is_converted(directory: Path) -> bool:
    """True for a directory this converter finished writing."""
    return (Path(directory) / MARKER_NAME).is_file()


def convert_ct2_whisper(
    source_dir: str | Path,
    out_dir: str | Path,
    on_bytes: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Convert the CTranslate2 Whisper export in `source_dir` into `out_dir`; return `out_dir`.

    A no-op when `out_dir` already holds a finished conversion. `on_bytes(n)` reports progress
    while model.bin is read (its total is model.bin's size); `log` gets one-line notes.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    if out_dir.exists():
        raise UserError(
            f"{out_dir} exists but is not a finished conversion: remove it or choose another directory"
        )
    _check_export_files(source_dir)

    ct2_config = _read_json(source_dir / "config.json")
    tokenizer_json = _read_json(source_dir / "tokenizer.json")
    model = read_model_bin(source_dir / "model.bin", on_bytes=on_bytes)
    weights, dims, dropped = whisper_weights(model)
    tokens = special_tokens(tokenizer_json, dims.n_vocab)

    if log:
        log(f"writing {out_dir}")
    partial = make_staging_dir(out_dir)
    try:
        _write_weights(partial, weights)
        _write_configs(partial, dims, tokens, ct2_config)
        write_tokenizer(partial, tokenizer_json, tokens)
        _check_loadable(partial, weights)
        marker = {
            "format_version": FORMAT_VERSION,
            "source": str(source_dir.resolve()),
            "source_model_bin_bytes": (source_dir / "model.bin").stat().st_size,
            "weights_dtype": str(next(iter(weights.values())).dtype),
            "dims": asdict(dims),
            "dropped_zero_biases": dropped,
        }
        (partial / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        _apply_umask(partial)
        publish(partial, out_dir, is_converted)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out_dir


def _apply_umask(directory: Path) -> None:
    """Give every file the mode a plainly created file gets (safetensors writes them 0600)."""
    file_mode = directory.stat().st_mode & 0o666  # the directory was made with the umask applied
    for path in directory.iterdir():
        path.chmod(file_mode)


def _check_export_files(source_dir: Path) -> None:
    if not source_dir.is_dir():
        raise UserError(f"{source_dir}: no such directory (expected a CTranslate2 Whisper export)")
    missing = [
        name for name in ("model.bin", "config.json", "tokenizer.json") if not (source_dir / name).is_file()
    ]
    if missing:
        hint = (
            " (export with `ct2-transformers-converter ... --copy_files tokenizer.json`)"
            if "tokenizer.json" in missing
            else ""
        )
        raise UserError(
            f"{source_dir}: missing {', '.join(missing)}; a CTranslate2 Whisper export has "
            f"model.bin, config.json and tokenizer.json{hint}"
        )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not readable JSON ({exc})") from None


# ---------------------------------------------------------------------------------------------
# transformers files


def is_multilingual(n_vocab: int) -> bool:
    # transformers' and openai-whisper's rule: English-only vocabularies have 51864 tokens
    return n_vocab >= 51865


def generation_settings(dims: WhisperDims, tokens: SpecialTokens, ct2_config: dict) -> dict:
    """The generation_config.json fields, from the export's config.json and the tokenizer."""
    for key in ("suppress_ids", "suppress_ids_begin", "alignment_heads"):
        if not isinstance(ct2_config.get(key), list):
            raise UserError(
                f"config.json lacks {key!r}: not a Whisper export from ct2-transformers-converter"
            )
    multilingual = is_multilingual(dims.n_vocab)
    settings = {
        "decoder_start_token_id": tokens.sot,
        "bos_token_id": tokens.eot,
        "eos_token_id": tokens.eot,
        "pad_token_id": tokens.eot,
        "max_length": dims.n_text_ctx,
        "suppress_tokens": [int(t) for t in ct2_config["suppress_ids"]],
        "begin_suppress_tokens": [int(t) for t in ct2_config["suppress_ids_begin"]],
        "alignment_heads": [[int(layer), int(head)] for layer, head in ct2_config["alignment_heads"]],
        "is_multilingual": multilingual,
        "no_timestamps_token_id": tokens.no_timestamps,
        "prev_sot_token_id": tokens.start_of_prev,
        "max_initial_timestamp_index": 50,  # openai-whisper's default: first timestamp within 1 s
        "return_timestamps": False,
        "forced_decoder_ids": None,
    }
    # English-only models get no language or task table: transformers would otherwise run
    # language detection on them (as the official English-only checkpoints, they have none).
    if multilingual:
        if tokens.translate is None or tokens.transcribe is None:
            raise UserError("tokenizer.json of a multilingual model lacks <|translate|> or <|transcribe|>")
        lang_ids = [int(t) for t in ct2_config.get("lang_ids", tokens.languages.values())]
        by_id = {token_id: content for content, token_id in tokens.languages.items()}
        unknown = [t for t in lang_ids if t not in by_id]
        if unknown:
            raise UserError(
                f"config.json: lang_ids has id {unknown[0]}, which is not a language token in tokenizer.json"
            )
        settings["lang_to_id"] = {by_id[t]: t for t in lang_ids}
        settings["task_to_id"] = {"translate": tokens.translate, "transcribe": tokens.transcribe}
    return settings


def _write_configs(directory: Path, dims: WhisperDims, tokens: SpecialTokens, ct2_config: dict) -> None:
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor

    generation = generation_settings(dims, tokens, ct2_config)
    config = WhisperConfig(
        vocab_size=dims.n_vocab,
        num_mel_bins=dims.n_mels,
        d_model=dims.d_model,
        encoder_layers=dims.encoder_layers,
        decoder_layers=dims.decoder_layers,
        encoder_attention_heads=dims.encoder_heads,
        decoder_attention_heads=dims.decoder_heads,
        encoder_ffn_dim=dims.encoder_ffn,
        decoder_ffn_dim=dims.decoder_ffn,
        max_source_positions=N_AUDIO_CTX,
        max_target_positions=dims.n_text_ctx,
        decoder_start_token_id=tokens.sot,
        bos_token_id=tokens.eot,
        eos_token_id=tokens.eot,
        pad_token_id=tokens.eot,
        suppress_tokens=generation["suppress_tokens"],
        begin_suppress_tokens=generation["begin_suppress_tokens"],
        activation_function="gelu",
        scale_embedding=False,
        tie_word_embeddings=True,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    # load as float32 by default whatever the on-disk type (see the module docstring)
    config.dtype = "float32"
    config.save_pretrained(directory)
    GenerationConfig(**generation).save_pretrained(directory)
    WhisperFeatureExtractor(
        feature_size=dims.n_mels,
        sampling_rate=SAMPLE_RATE,
        hop_length=HOP_LENGTH,
        chunk_length=N_AUDIO_CTX * 2 * HOP_LENGTH // SAMPLE_RATE,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=False,
    ).save_pretrained(directory)


def _write_weights(directory: Path, weights: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    # transformers refuses safetensors files without this metadata entry
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _check_loadable(directory: Path, weights: dict[str, np.ndarray]) -> None:
    """Refuse to finish unless transformers' Whisper has exactly these weights (names and shapes)."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    with torch.device("meta"):  # structure only, no memory
        model = WhisperForConditionalGeneration(WhisperConfig.from_pretrained(directory))
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items() if name not in tied}
    produced = {name: tuple(array.shape) for name, array in weights.items()}
    if expected != produced:
        missing = sorted(set(expected) - set(produced))
        extra = sorted(set(produced) - set(expected))
        reshaped = sorted(n for n in set(expected) & set(produced) if expected[n] != produced[n])
        raise UserError(
            "conversion does not match transformers' WhisperForConditionalGeneration: "
            f"missing {missing[:3]}, unexpected {extra[:3]}, wrong shape {reshaped[:3]}"
        )
